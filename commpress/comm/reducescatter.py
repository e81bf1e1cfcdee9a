"""Compressed reduce-scatter: the first phase of :mod:`.twophase`, ending with the owner's shard.

The input is ``n`` equal chunks laid end to end (FSDP2's flat gradient: chunk ``j`` holds
rank ``j``'s shard of every parameter); :class:`~.driver.Slot` ``(j, p)`` is parameter ``p``'s
part of chunk ``j``, keyed ``piece_key(name, j)``. Rank ``r`` of ``n``:

1. check each parameter's gradient (all its chunks); a non-finite one is flagged in every
   chunk, so every owner learns it;
2. encode chunk ``j != r`` slot by slot, through error feedback under ``piece_key(name, j)``
   (seed ``derive_seed(slot.seed, PHASE_REDUCE_SCATTER, j, r)``); its own chunk is never encoded:
   it is added exactly, and needs no residual (``(n-1)/n`` of a gradient in residuals, not all);
3. all_to_all of the fixed-size frames (the frame for itself is empty: nothing to send);
4. decode the ``n`` contributions to chunk ``r`` and sum them in rank order ``0..n-1`` in the
   accumulation dtype (rank order is the same on every rank: deterministic), divide by ``n``
   for an average, and write the shard into ``output``. A parameter flagged by any rank becomes
   NaN in every rank's shard, and each rank restores the residuals this step changed for it.

Bytes: rank ``r`` sends ``sum_{j != r} frame_j``, about ``(n-1)/n * d * bits/8`` (FSDP's own
ring reduce-scatter: ``(n-1)/n * d * 32/8``). Not in :data:`commpress.comm.ALGORITHMS`: those
are all-reduce algorithms (every rank ends with the whole average), this ends with one chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs.base import all_finite
from ..dtypes import accumulate_dtype
from ..errors import CodecError
from ..rng import derive_seed
from ..wire.frame import FrameLayout
from ..wire.packet import Packet
from .driver import CommStats, StepContext, decode_add

#: Phase tag mixed into derived seeds.
PHASE_REDUCE_SCATTER = 4


def reduce_scatter(
    ctx: StepContext,
    output: torch.Tensor,
    params: int,
    *,
    average: bool = True,
    stats: CommStats | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatter ``ctx.flat`` (``n`` chunks of ``params`` slots each) into ``output``.

    ``ctx`` must have been built without statistics (its accounting is an all-reduce's);
    ``stats`` receives this collective's: ``bytes_sent`` = ``bytes_wire`` = the bytes bound for
    other ranks, ``dense_bytes`` = ``dense_wire`` = what a ring reduce-scatter of the input
    sends per rank (``(n-1)/n`` of it), so their ratio compares like with like.
    Phase 1 is waited for on this thread; the returned future has decoded into ``output``
    (the slot's residual updates are undone where some rank flagged it non-finite).
    """
    n, r, slots = ctx.n, ctx.rank, ctx.slots
    if len(slots) != n * params:
        raise CodecError(f"reduce_scatter: {len(slots)} slots are not {n} chunks of {params} parameters")
    chunk = ctx.flat.numel() // n
    if ctx.flat.numel() != n * chunk or output.numel() != chunk or output.dim() != 1:
        raise CodecError(
            f"reduce_scatter: input of {ctx.flat.numel()} elements and output of {output.numel()} "
            f"do not make {n} chunks of the output's size"
        )
    t0 = time.perf_counter()
    cut: list[Sequence[int]] = [range(j * params, (j + 1) * params) for j in range(n)]
    # Step 1: a parameter whose gradient is not finite anywhere on this rank is flagged everywhere.
    bad_local = [not all(all_finite(ctx.view(i)) for i in (cut[j][p] for j in range(n))) for p in range(params)]
    # Step 2: encode every other rank's chunk.
    frames: list[list[Packet | None]] = []
    layouts: list[FrameLayout] = []
    for j in range(n):
        slots_j = [slots[i] for i in cut[j]]
        layouts.append(FrameLayout([(s.key, s.codec, s.numel) for s in slots_j], ctx.flat.dtype))
        if j == r:
            frames.append([])
            continue
        frames.append([
            None if bad_local[p] else ctx.compress(
                i, None if s.dense else s.feedback, s.codec, s.key, ctx.view(i),
                derive_seed(s.seed, PHASE_REDUCE_SCATTER, j, r),
            )
            for p, (i, s) in enumerate(zip(cut[j], slots_j))
        ])
    for p in range(params):  # an encoder overflow in one chunk flags the parameter in all
        if not bad_local[p] and any(frames[j][p] is None for j in range(n) if j != r):
            bad_local[p] = True
    for j in range(n):
        if j != r:
            frames[j] = [None if bad_local[p] else pk for p, pk in enumerate(frames[j])]
    sizes = [0 if j == r else lay.nbytes for j, lay in enumerate(layouts)]
    send = torch.empty(sum(sizes), dtype=torch.uint8, device=ctx.device)
    off = 0
    for j, lay in enumerate(layouts):
        if j != r:
            lay.pack(frames[j], out=send[off : off + lay.nbytes])
            off += lay.nbytes
    mine = layouts[r]
    recv_sizes = [0 if j == r else mine.nbytes for j in range(n)]
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=ctx.device)
    t1 = time.perf_counter()
    # Step 3: the all_to_all, waited for here (one ordered issue path).
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=recv_sizes, input_split_sizes=sizes, group=ctx.group, async_op=True
    )
    assert work is not None
    work.wait()
    t2 = time.perf_counter()
    # Step 4: decode and sum in rank order; the own chunk is added exactly.
    acc = torch.empty(chunk, dtype=accumulate_dtype(ctx.flat.dtype), device=ctx.device)
    bad = list(bad_local)
    offsets = [slots[i].offset - r * chunk for i in cut[r]]
    off = 0
    for j in range(n):
        if j == r:
            own = ctx.flat[r * chunk : (r + 1) * chunk]
            if j == 0:
                acc.copy_(own)
            else:
                acc.add_(own.to(acc.dtype))
            continue
        frame = mine.unpack(recv[off : off + mine.nbytes], source=j)
        off += mine.nbytes
        for p, pk in enumerate(frame):
            s = slots[cut[r][p]]
            if pk is None:
                bad[p] = True
            elif pk.numel:
                decode_add(s.codec, pk, acc[offsets[p] : offsets[p] + s.numel], first=j == 0)
    if average:
        acc.div_(n)
    for p in range(params):
        if bad[p]:
            s = slots[cut[r][p]]
            acc[offsets[p] : offsets[p] + s.numel] = float("nan")
    output.copy_(acc)
    t3 = time.perf_counter()
    if stats is not None:
        dense = (n - 1) * ctx.flat.numel() * ctx.flat.element_size() / n  # what a ring sends per rank
        stats.add(
            buffers=1, collectives=1, bytes_sent=send.numel(), bytes_wire=send.numel(), dense_bytes=dense,
            dense_wire=dense, encode_s=t1 - t0, wait_s=t2 - t1, decode_s=t3 - t2,
            nonfinite_local=sum(bad_local), nonfinite_slots=sum(bad),
        )
    # Every chunk of a flagged parameter is voided (its residuals restored) on every rank.
    return ctx.finish(work, lambda: [bad[i % params] for i in range(n * params)])


__all__ = ["PHASE_REDUCE_SCATTER", "reduce_scatter"]
