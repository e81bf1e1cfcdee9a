"""All-reduce: the buffer (or a cast of it), or only the values of shared-seed random indices.

Codecs whose values add up (:attr:`Codec.summable`) need no gather: ``none`` / ``fp16`` /
``bf16`` all-reduce the (cast) buffer, exactly as DDP or PyTorch's fp16 hook do; random-k draws
the same indices on every rank from the shared seed, so only its k values per slot are
all-reduced (dense slots travel whole). One all-reduce per buffer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..codecs import Codec
from ..codecs.base import all_finite
from ..errors import CodecError
from ..feedback import ErrorFeedback
from .driver import Algorithm, Entry, StepContext, empty_plan
from .faults import then
from .stats import CommStats, dense_accounting


def allreduce_mean(
    buffer: torch.Tensor,
    *,
    group: Any = None,
    wire_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
    persistent: bool = False,
) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` over the group in place with one all-reduce; ``wire_dtype`` casts.

    Without a cast this is exactly what DDP does without a hook (divide, then sum).
    ``persistent``: ``buffer`` lives across steps at one address (a DDP bucket), so the cast's
    send buffer is kept for it and reused instead of allocated per call.
    """
    dense_accounting(stats, buffer, dist.get_world_size(group))
    return _cast_reduce(buffer, group, wire_dtype, stats, persistent)


#: Send buffers of the cast all-reduce, by (device, address, elements, wire dtype) of the buffer
#: they serve: a DDP bucket keeps its buffer for the whole run, so each bucket reuses one.
_WIRE_BUFFERS: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
_WIRE_BUFFERS_KEPT = 64


def _wire_buffer(buffer: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """The reused ``wire_dtype`` send buffer for ``buffer`` (the least recently used beyond 64 go).

    Safe to share by address: two live buffers never have the same address, and a buffer is not
    reduced again before its previous reduction's future completed (DDP waits for every bucket).
    """
    key = (buffer.device, buffer.data_ptr(), buffer.numel(), wire_dtype)
    send = _WIRE_BUFFERS.get(key)
    if send is None:
        send = _WIRE_BUFFERS[key] = torch.empty(buffer.numel(), dtype=wire_dtype, device=buffer.device)
        while len(_WIRE_BUFFERS) > _WIRE_BUFFERS_KEPT:
            _WIRE_BUFFERS.popitem(last=False)
    else:
        _WIRE_BUFFERS.move_to_end(key)
    return send.view(buffer.shape)


def _cast_reduce(
    buffer: torch.Tensor, group: Any, wire_dtype: torch.dtype | None, stats: CommStats | None,
    persistent: bool = False,
) -> torch.futures.Future[torch.Tensor]:
    n = dist.get_world_size(group)
    if wire_dtype is None or wire_dtype == buffer.dtype:
        buffer.div_(n)
        send = buffer
    else:
        # Divide in full precision first (casting first could overflow fp16), writing the cast
        # straight into the send buffer; a persistent buffer's is reused across steps (a fresh
        # float32 quotient and its cast fault in 1.5x the bucket's bytes per step)
        send = (_wire_buffer(buffer, wire_dtype) if persistent
                else torch.empty(buffer.shape, dtype=wire_dtype, device=buffer.device))
        torch.div(buffer, n, out=send)
    nbytes = send.numel() * send.element_size()
    if stats is not None:
        stats.add(collectives=1, bytes_sent=nbytes, bytes_wire=2 * (n - 1) * nbytes / n)
    work = dist.all_reduce(send, group=group, async_op=True)
    assert work is not None

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raise a failed collective
        if send is not buffer:
            buffer.copy_(send)
        return buffer

    return then(work.get_future(), finish, buffer.device)


class AllReduce(Algorithm):
    """Sum values directly: a cast all-reduce, or shared-seed random-k values."""

    name = "allreduce"

    def check(self, codec: Codec) -> None:
        """Only codecs whose values add up."""
        if not codec.summable:
            raise CodecError(
                f"algorithm 'allreduce' sums values directly and needs a codec whose values add up "
                f"(none, fp16, bf16, randomk with a shared seed); {codec.name!r} cannot"
            )

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """One all-reduce: of the compressed entries' summable values and the dense ones whole.

        A cast codec (bf16, fp16) all-reduces the whole buffer in its cast dtype (:func:`_cast_reduce`).
        """
        if codec.cast_dtype is not None and any(e.compressed for e in entries):
            cast = torch.empty((), dtype=codec.cast_dtype).element_size()
            return {**empty_plan(), "allreduce": cast * sum(e.numel for e in entries)}
        size = torch.empty((), dtype=dtype).element_size()
        return {**empty_plan(), "allreduce": size * sum(
            codec.wire_params(e.numel)[0] if e.compressed else e.numel for e in entries
        )}

    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """Dispatch to the cast form or the shared-seed form (the codecs are the same per buffer)."""
        compressed = {type(s.codec) for s in ctx.slots if not s.dense}
        if not compressed:
            return _cast_reduce(ctx.flat, ctx.group, None, ctx.stats)  # the context counted the buffer
        if len(compressed) != 1:
            raise CodecError(f"algorithm 'allreduce' cannot mix codecs {sorted(c.name for c in compressed)}")
        codec = next(s.codec for s in ctx.slots if not s.dense)
        if codec.cast_dtype is not None:
            return _cast_reduce(ctx.flat, ctx.group, codec.cast_dtype, ctx.stats)
        return _shared_seed_allreduce(ctx)


def _shared_seed_allreduce(ctx: StepContext) -> torch.futures.Future[torch.Tensor]:
    """Every rank encodes slot ``s`` with the same seed ``s.seed``: the indices agree."""
    dtype = ctx.flat.dtype
    local_bad = 0
    parts: list[torch.Tensor] = []
    for i, s in enumerate(ctx.slots):
        x = ctx.view(i)
        if s.dense:
            parts.append(x)
            continue
        p = ctx.compress(i, s.feedback, s.codec, s.key, x.view(s.shape), s.seed)
        if p is None:
            k = s.codec.wire_params(s.numel)[0]
            parts.append(torch.full((k,), float("nan"), dtype=dtype, device=ctx.device))
            local_bad += 1
        else:
            parts.append(s.codec.summable_values(p))
    send = torch.cat(parts).div_(ctx.n) if parts else ctx.flat.new_empty(0)
    nbytes = send.numel() * send.element_size()
    ctx.count(collectives=1, bytes_sent=nbytes, bytes_wire=2 * (ctx.n - 1) * nbytes / ctx.n,
              encode_s=ctx.lap(), nonfinite_local=local_bad)
    work = dist.all_reduce(send, group=ctx.group, async_op=True)

    def decode() -> list[bool]:
        off = 0
        bad = [False] * len(ctx.slots)
        for i, s in enumerate(ctx.slots):
            out = ctx.view(i)
            if s.dense:
                out.copy_(send[off : off + s.numel])
                off += s.numel
                continue
            k = s.codec.wire_params(s.numel)[0]
            values = send[off : off + k]
            off += k
            if k and not all_finite(values):  # the same reduced values on every rank
                bad[i] = True
                continue
            s.codec.decode(s.codec.packet_from_values(values, s.numel, dtype, s.seed), out=out)
        return bad

    return ctx.finish(work, decode)
