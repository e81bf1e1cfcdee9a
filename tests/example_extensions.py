"""A worked example of extending commpress: one new codec, one new algorithm and one optimizer mode, one file.

- ``Int8Codec``: one fp32 scale (max |x| / 127) per tensor and int8 values rounded to nearest.
  Contractive (deterministic rounding), re-encodable, fixed size. Its pure-torch encode/decode
  here is its specification (a native kernel would be added under csrc/ and checked against it).
- ``ScatterThenDense``: the first phase of the two-phase algorithm (compressed all_to_all of
  pieces, averaged by their owner), then a *dense* all_gather of the averaged pieces: one
  compression instead of two, for twice the bytes of the second phase. No residual layout of its
  own beyond the pieces, no server residuals.

- ``LocalGradientClip``: DGC's local gradient clipping as an optimizer mode: each rank clips
  each parameter's gradient to ``max_norm`` before it is compressed; its state (how many clips)
  is checkpointed and reported with the hook's. It needs no registry: pass it as
  ``commpress.ddp.register(..., modes=[LocalGradientClip(1.0)])``.

Registering the codec and the algorithm is one line each (``codecs.register``, ``comm.register``),
in ``install()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from commpress import codecs, comm
from commpress.codecs import Codec
from commpress.comm.driver import (
    Algorithm,
    Entry,
    Part,
    Piece,
    StepContext,
    all_gather_single,
    empty_plan,
    frame_layout,
)
from commpress.comm.twophase import piece_bounds, piece_key
from commpress.dtypes import accumulate_dtype
from commpress.errors import WireError
from commpress.optim import OptimizerMode
from commpress.rng import derive_seed
from commpress.wire.packet import Packet, Section


class Int8Codec(Codec):
    """int8 values and one scale per tensor: 4x smaller than fp32."""

    name = "int8-example"
    codec_id = 200
    reencodable = True

    def config(self) -> dict[str, Any]:
        """No parameters."""
        return {"name": self.name}

    def delta(self, numel: int) -> float:
        """Rounding to 255 levels of max |x| keeps at least this much of ||x||^2 (loose bound)."""
        return 1.0 / max(numel, 1)

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``scale`` (1 x fp32) and ``values`` (numel x int8)."""
        return [Section("scale", torch.float32, 1), Section("values", torch.int8, numel)]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """A finite, non-negative scale; int8 values never reach -128."""
        scale = packet.sections["scale"]
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise WireError("section 'scale': must be finite and >= 0")
        if bool((packet.sections["values"] == -128).any()):
            raise WireError("section 'values': -128 is not a level")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        x = flat.float()
        scale = x.abs().max().reshape(1) / 127 if x.numel() else torch.zeros(1)
        q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)).to(torch.int8)
        return {"scale": scale, "values": q}

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        out.add_((packet.sections["values"].float() * packet.sections["scale"]).to(out.dtype))


class ScatterThenDense(Algorithm):
    """Compressed reduce-scatter (all_to_all of pieces), then a dense all_gather."""

    name = "scatter-dense-example"

    def residual_layout(self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int) -> list[Piece]:
        """One residual per piece, like two-phase."""
        numel = int(torch.Size(shape).numel())
        return [Piece(piece_key(name, j), lo, hi, (hi - lo,))
                for j, (lo, hi) in enumerate(piece_bounds(numel, world_size, codec.block_alignment()))]

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """All compressed pieces all_to_all'd, the largest dense piece all-gathered; one decode."""
        bounds = [piece_bounds(e.numel, n, codec.block_alignment()) for e in entries]
        layouts = [frame_layout([Entry(b[j][1] - b[j][0], e.compressed) for e, b in zip(entries, bounds)], codec, dtype)
                   for j in range(n)]
        width = max(sum(b[j][1] - b[j][0] for b in bounds) for j in range(n))
        size = torch.empty((), dtype=accumulate_dtype(dtype)).element_size()
        return {**empty_plan(), "alltoall": sum(lay.nbytes for lay in layouts), "allgather": width * size}

    def launch(self, ctx: StepContext, server_feedback: Any) -> torch.futures.Future[torch.Tensor]:
        """Phase 1 compressed and waited for; phase 2 dense; the future copies pieces back."""
        n, r, slots = ctx.n, ctx.rank, ctx.slots
        bounds = [piece_bounds(s.numel, n, s.codec.block_alignment()) for s in slots]
        enc = ctx.encode_frames([[Part(i, *b[j], piece_key(s.key, j), derive_seed(s.seed, 7, j, r))
                                  for i, (s, b) in enumerate(zip(slots, bounds))] for j in range(n)])
        mine = enc.layouts[r]
        recv = torch.empty(n * mine.nbytes, dtype=torch.uint8, device=ctx.device)
        ctx.wait(dist.all_to_all_single(recv, enc.send, [mine.nbytes] * n, enc.sizes, group=ctx.group, async_op=True))
        sizes = [b[r][1] - b[r][0] for b in bounds]
        width = max(sum(b[j][1] - b[j][0] for b in bounds) for j in range(n))
        acc = torch.zeros(width, dtype=accumulate_dtype(ctx.flat.dtype), device=ctx.device)
        off = [sum(sizes[:i]) for i in range(len(sizes))]
        bad = ctx.decode_frames(recv, [mine] * n, lambda j, i: acc[off[i] : off[i] + sizes[i]])
        for i in range(len(slots)):
            if bad[i]:  # some rank's input was not finite: every rank will see NaN here
                acc[off[i] : off[i] + sizes[i]] = float("nan")
        acc.div_(n)
        gathered = torch.empty(n * width, dtype=acc.dtype, device=ctx.device)
        ctx.count(collectives=2, bytes_sent=enc.send.numel() + width * acc.element_size(), encode_s=ctx.lap())
        work = all_gather_single(gathered, acc, group=ctx.group, async_op=True)

        def decode() -> list[bool]:
            bad = [False] * len(slots)
            for j in range(n):
                o = j * width
                for i in range(len(slots)):
                    lo, hi = bounds[i][j]
                    piece = gathered[o : o + hi - lo]
                    o += hi - lo
                    bad[i] |= not bool(torch.isfinite(piece).all())
                    ctx.view(i)[lo:hi].copy_(piece)
            return bad

        return ctx.finish(work, decode)


class LocalGradientClip(OptimizerMode):
    """Clip each parameter's local gradient to ``max_norm`` (L2) before it is reduced."""

    name = "clip"

    def __init__(self, max_norm: float) -> None:
        self.max_norm = float(max_norm)
        self.clipped = 0

    def apply(self, param: str, grad: torch.Tensor, *, compressing: bool) -> None:
        """Scale ``grad`` down to ``max_norm`` where it is longer (every step, dense ones too)."""
        norm = float(torch.linalg.vector_norm(grad))
        if norm > self.max_norm:
            grad.mul_(self.max_norm / norm)
            self.clipped += 1

    def state_dict(self) -> dict[str, Any]:
        """The clip count."""
        return {"clipped": self.clipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clip count (a non-negative int)."""
        clipped = state.get("clipped")
        if not isinstance(clipped, int) or clipped < 0:
            raise ValueError(f"clip state: clipped must be an int >= 0, got {clipped!r}")
        self.clipped = clipped

    def stats(self) -> dict[str, float]:
        """``clip_clipped`` in the hook's stats."""
        return {"clipped": float(self.clipped)}


def install() -> None:
    """The two registry lines."""
    if Int8Codec.name not in codecs.available():
        codecs.register(Int8Codec)
    if ScatterThenDense.name not in comm.ALGORITHMS:
        comm.register(ScatterThenDense())
