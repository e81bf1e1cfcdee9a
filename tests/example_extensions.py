"""A worked example of extending commpress: one new codec and one new algorithm, one file.

- ``Int8Codec``: one fp32 scale (max |x| / 127) per tensor and int8 values rounded to nearest.
  Contractive (deterministic rounding), re-encodable, fixed size. Its pure-torch encode/decode
  here is its specification (a native kernel would be added under csrc/ and checked against it).
- ``ScatterThenDense``: the first phase of the two-phase algorithm (compressed all_to_all of
  pieces, averaged by their owner), then a *dense* all_gather of the averaged pieces: one
  compression instead of two, for twice the bytes of the second phase. No residual layout of its
  own beyond the pieces, no server residuals.

Registering both is one line each (``codecs.register``, ``comm.register``), in ``install()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from commpress import codecs, comm
from commpress.codecs import Codec
from commpress.comm.driver import Algorithm, Piece, StepContext, all_gather_single, decode_add
from commpress.comm.twophase import piece_bounds, piece_key
from commpress.dtypes import accumulate_dtype
from commpress.errors import WireError
from commpress.rng import derive_seed
from commpress.wire.frame import FrameLayout
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

    def launch(self, ctx: StepContext, server_feedback: Any) -> torch.futures.Future[torch.Tensor]:
        """Phase 1 compressed and waited for; phase 2 dense; the future copies pieces back."""
        n, r, slots = ctx.n, ctx.rank, ctx.slots
        bounds = [piece_bounds(s.numel, n, s.codec.block_alignment()) for s in slots]
        layouts = [FrameLayout([(piece_key(s.key, j), s.codec, b[j][1] - b[j][0]) for s, b in zip(slots, bounds)],
                               ctx.flat.dtype) for j in range(n)]
        frames = [[None] * len(slots) for _ in range(n)]
        for i, (s, b) in enumerate(zip(slots, bounds)):
            for j, (lo, hi) in enumerate(b):
                frames[j][i] = ctx.compress(i, None if s.dense else s.feedback, s.codec, piece_key(s.key, j),
                                            ctx.view(i)[lo:hi], derive_seed(s.seed, 7, j, r))
        send = torch.cat([lay.pack(frames[j], device=ctx.device) for j, lay in enumerate(layouts)])
        recv = torch.empty(n * layouts[r].nbytes, dtype=torch.uint8, device=ctx.device)
        dist.all_to_all_single(recv, send, [layouts[r].nbytes] * n, [lay.nbytes for lay in layouts], group=ctx.group)
        sizes = [b[r][1] - b[r][0] for b in bounds]
        width = max(sum(b[j][1] - b[j][0] for b in bounds) for j in range(n))
        mine = torch.zeros(width, dtype=accumulate_dtype(ctx.flat.dtype), device=ctx.device)
        off = [sum(sizes[:i]) for i in range(len(sizes))]
        for j in range(n):
            for i, p in enumerate(layouts[r].unpack(recv[j * layouts[r].nbytes : (j + 1) * layouts[r].nbytes], j)):
                if p is None:  # some rank's input was not finite: every rank will see NaN here
                    mine[off[i] : off[i] + sizes[i]] = float("nan")
                elif p.numel:
                    decode_add(slots[i].codec, p, mine[off[i] : off[i] + sizes[i]])
        mine.div_(n)
        gathered = torch.empty(n * width, dtype=mine.dtype, device=ctx.device)
        ctx.count(collectives=2, bytes_sent=send.numel() + width * mine.element_size(), encode_s=ctx.lap())
        work = all_gather_single(gathered, mine, group=ctx.group, async_op=True)

        def decode() -> list[bool]:
            bad = [False] * len(slots)
            for j in range(n):
                o = j * width
                for i, s in enumerate(slots):
                    lo, hi = bounds[i][j]
                    piece = gathered[o : o + hi - lo]
                    o += hi - lo
                    bad[i] |= not bool(torch.isfinite(piece).all())
                    ctx.view(i)[lo:hi].copy_(piece)
            return bad

        return ctx.finish(work, decode)


def install() -> None:
    """The two registry lines."""
    if Int8Codec.name not in codecs.available():
        codecs.register(Int8Codec)
    if ScatterThenDense.name not in comm.ALGORITHMS:
        comm.register(ScatterThenDense())
