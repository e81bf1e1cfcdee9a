"""Compressed reduce-scatter: the first phase of :mod:`.twophase`, ending with the owner's shard.

The input is ``n`` equal chunks laid end to end (FSDP2's flat gradient: chunk ``j`` holds
rank ``j``'s shard of every parameter); :class:`~.driver.Slot` ``(j, p)`` is parameter ``p``'s
part of chunk ``j``, keyed ``piece_key(name, j)``. Rank ``r`` of ``n``:

1. check each parameter's gradient (all its chunks); a non-finite one is flagged in every
   chunk, so every owner learns it;
2. encode chunk ``j != r`` slot by slot, through error feedback under ``piece_key(name, j)``
   (seed ``derive_seed(slot.seed, PHASE_REDUCE_SCATTER, j, r)``); its own chunk is never encoded:
   it is added exactly, and needs no residual (``(n-1)/n`` of a gradient in residuals, not all);
3. all_to_all of the fixed-size frames (the frame for itself is empty), waited for here;
4. decode the ``n`` contributions to chunk ``r`` and sum them in rank order ``0..n-1`` in the
   accumulation dtype, divide by ``n`` for an average (``ctx.average``), write ``ctx.output``.
   A parameter flagged by any rank becomes NaN in every rank's shard, and each rank restores
   the residuals this step changed for it.

:class:`DenseReduceScatter` (the ``none`` codec) runs torch's own ``reduce_scatter_single``
instead: FSDP bit for bit, with the same accounting.
Bytes: rank ``r`` sends ``sum_{j != r} frame_j`` (a ring reduce-scatter: ``(n-1)/n`` of the input).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs import Codec, NoneCodec
from ..dtypes import accumulate_dtype
from ..errors import CodecError
from ..feedback import ErrorFeedback
from ..rng import derive_seed
from .driver import Algorithm, Entry, Part, StepContext, empty_plan, frame_layout

#: Phase tag mixed into derived seeds.
PHASE_REDUCE_SCATTER = 4


class ReduceScatter(Algorithm):
    """Compressed all_to_all of chunks into this rank's shard (``ctx.output``); any fixed-size codec."""

    name = "reducescatter"
    shards = True

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """``entries``: one chunk's parameters; ``alltoall``: n frames of it, of which ``(n-1)/n`` leave."""
        return {**empty_plan(), "alltoall": n * frame_layout(entries, codec, dtype).nbytes, "decodes": float(n - 1)}

    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """Encode the other ranks' chunks, all_to_all (waited for), decode this rank's shard."""
        n, r, slots = ctx.n, ctx.rank, ctx.slots
        output, params, chunk = _chunks(ctx, self.name)
        enc = ctx.encode_frames([
            [Part(j * params + p, 0, slots[j * params + p].numel, slots[j * params + p].key,
                  derive_seed(slots[j * params + p].seed, PHASE_REDUCE_SCATTER, j, r)) for p in range(params)]
            for j in range(n)
        ], skip=r, precheck=True)
        mine = enc.layouts[r]
        recv_sizes = [0 if j == r else mine.nbytes for j in range(n)]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=ctx.device)
        ctx.count(collectives=1, bytes_sent=enc.send.numel(), bytes_wire=enc.send.numel(), encode_s=ctx.lap(),
                  nonfinite_local=sum(enc.bad))
        work = dist.all_to_all_single(recv, enc.send, output_split_sizes=recv_sizes, input_split_sizes=enc.sizes,
                                      group=ctx.group, async_op=True)
        assert work is not None
        ctx.wait(work)  # one ordered issue path; bounded by the adapter's fault channel
        ctx.count(wait_s=ctx.lap())
        acc = torch.empty(chunk, dtype=accumulate_dtype(ctx.flat.dtype), device=ctx.device)
        offsets = [slots[r * params + p].offset - r * chunk for p in range(params)]

        def own(first: bool) -> None:  # this rank's chunk, added exactly in its place in rank order
            x = ctx.flat[r * chunk : (r + 1) * chunk]
            acc.copy_(x) if first else acc.add_(x.to(acc.dtype))

        def decode() -> list[bool]:
            layouts = [None if j == r else mine for j in range(n)]
            got = ctx.decode_frames(recv, layouts, lambda j, p: acc[offsets[p] : offsets[p] + slots[r * params + p].numel],
                                    own=own) or [False] * params  # (one rank: nothing received)
            bad = [a or b for a, b in zip(enc.bad, got)]
            if ctx.average:
                acc.div_(n)
            for p in range(params):
                if bad[p]:
                    acc[offsets[p] : offsets[p] + slots[r * params + p].numel] = float("nan")
            output.copy_(acc)
            return [bad[i % params] for i in range(n * params)]  # every chunk of a flagged parameter is voided

        return ctx.finish(work, decode, nonfinite=lambda flags: sum(flags[:params]))

    def check(self, codec: Codec) -> None:
        """Any fixed-size codec."""
        if not codec.fixed_size:
            raise CodecError(f"algorithm 'reducescatter' needs fixed-size packets; {codec!r} is variable-size")


class DenseReduceScatter(Algorithm):
    """torch's own ``reduce_scatter_single`` of the buffer (FSDP's ``none``: FSDP bit for bit)."""

    name = "reducescatter-dense"
    shards = True

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """``entries``: one chunk; a ring sends ``(n-1)/n`` of the n chunks, as an all_to_all does."""
        size = torch.empty((), dtype=dtype).element_size()
        return {**empty_plan(), "alltoall": n * size * sum(e.numel for e in entries)}

    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """One reduce-scatter, waited for here (gloo's work has no future), bounded by the fault scope."""
        output, _, _ = _chunks(ctx, self.name)
        nbytes = (ctx.n - 1) * ctx.flat.numel() * ctx.flat.element_size() / ctx.n
        ctx.count(collectives=1, bytes_sent=nbytes, bytes_wire=nbytes)
        op = dist.ReduceOp.AVG if ctx.average else dist.ReduceOp.SUM
        ctx.wait(dist.reduce_scatter_single(output, ctx.flat, group=ctx.group, op=op, async_op=True))
        return ctx.finish(None, lambda: [False] * len(ctx.slots))

    def check(self, codec: Codec) -> None:
        """Only the lossless ``none``."""
        if not isinstance(codec, NoneCodec):
            raise CodecError(f"algorithm 'reducescatter-dense' sends the buffer as it is, not through {codec!r}")


def _chunks(ctx: StepContext, name: str) -> tuple[torch.Tensor, int, int]:
    """``ctx.output``, slots per chunk and elements per chunk; :class:`CodecError` unless they fit."""
    n, output = ctx.n, ctx.output
    params, chunk = len(ctx.slots) // n, ctx.flat.numel() // n
    if output is None or len(ctx.slots) != n * params or ctx.flat.numel() != n * chunk or output.numel() != chunk:
        raise CodecError(f"{name}: {len(ctx.slots)} slots over {ctx.flat.numel()} elements do not make "
                         f"{n} chunks of an output of {None if output is None else output.numel()}")
    return output, params, chunk


__all__ = ["PHASE_REDUCE_SCATTER", "DenseReduceScatter", "ReduceScatter"]
