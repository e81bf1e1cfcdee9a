"""Hierarchical: dense inside the node, compressed only across nodes (:mod:`.topology`).

Rank ``r`` is local rank ``j`` of node ``m``; ``L`` ranks per node, ``N`` nodes. Every slot is
cut into ``L`` pieces (:func:`~.twophase.piece_bounds`, on the codec's block alignment); share
``j`` is piece ``j`` of every slot, laid end to end.

1. **intra-node reduce-scatter**, dense: all_to_all of the shares over the node's group (share
   ``k`` to local rank ``k``), waited for; local rank ``j`` sums the ``L`` copies of share ``j``
   (accumulation dtype) and divides by ``L``: its node's mean of share ``j``;
2. **inter-node compressed all-reduce** of that share among the ``N`` ranks with local rank ``j``
   (one per node), by the codec's own algorithm (``inner``: all-gather for top-k, two-phase or
   all-gather for sign/QSGD, all-reduce for summable codecs and random-k), on slots keyed
   ``share_key(name, j)`` with seeds ``derive_seed(seed, PHASE_SHARE, j)`` (the same on every
   node): error feedback (and the two-phase server side) holds this share only, ``1/L`` of a
   flat run's residual memory. Waited for on this thread (one ordered issue path);
3. **intra-node all-gather**: when the inner algorithm is the all-gather of frames (top-k; sign
   and QSGD at 2 nodes) and the ``N`` frames of a share are smaller than the share itself, the
   frames: every local rank's ``N`` frames (padded to the largest) over the node's group, and
   every rank decodes all ``L x N`` frames into the buffer (:func:`frames_cross_node`; top-k 1%
   at 2 nodes: 0.16 bytes per element instead of 4). Otherwise the dense share (padded to the
   largest) and the future puts the pieces back in place. Either way every rank of the node
   receives the same bytes and every node the same shares, and decodes them the same way, so
   the buffer is bit-identical everywhere (and equal between the two forms: the same frames
   decoded in the same order).

Non-finite: a share piece that any node flagged is NaN on every node after step 2; after step 3
every rank sees the same buffer, so a slot non-finite anywhere is NaN in full on every rank,
and each rank restores its own share's residuals for it (a voided step leaves no trace).

Bytes per rank: ``(L-1)/L`` of the buffer to the node (step 1), the inner algorithm's bytes of
``1/L`` of it across nodes (step 2), ``(L-1)`` padded shares, or ``N`` padded frames, from the
node (step 3).
:class:`~.stats.CommStats` counts the inter-node and intra-node parts apart
(``inter_bytes_sent`` / ``inter_bytes_wire``, ``intra_bytes_sent`` / ``intra_bytes_wire``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..codecs import Codec
from ..codecs.base import all_finite
from ..dtypes import accumulate_dtype
from ..errors import CodecError
from ..feedback import ErrorFeedback
from ..rng import derive_seed
from ..wire.frame import FrameLayout
from .allgather import AllGather
from .driver import Algorithm, Entry, Piece, Slot, StepContext, all_gather_single, frame_layout
from .stats import LevelStats
from .topology import NodeGroups, Topology, node_groups
from .twophase import piece_bounds

#: Phase tag mixed into the seeds of the shares.
PHASE_SHARE = 5


def share_key(key: str, share: int) -> str:
    """Error-feedback key of share ``share`` of ``key`` (the inner algorithm may cut it further)."""
    return f"{key}@{share}"


def frames_cross_node(inner: Algorithm, frame_nbytes: int, nodes: int, share_nbytes: int) -> bool:
    """Whether step 3 gathers the nodes' frames of each share instead of the decoded dense share.

    Only after the all-gather of frames (every rank of a node can decode what its peer received),
    and only when the ``nodes`` frames of the widest share (``frame_nbytes`` each) are fewer bytes
    than that share dense: top-k 1% up to 49 nodes, sign up to 31, QSGD 4-bit up to 7, 8-bit up to 3
    (sign and QSGD all-gather at 2 nodes by default, two-phase from 3).
    """
    return isinstance(inner, AllGather) and nodes * frame_nbytes < share_nbytes


class Hierarchical(Algorithm):
    """Dense reduce-scatter in the node, ``inner`` across nodes on the share, dense all-gather in the node.

    The instance in :data:`commpress.comm.ALGORITHMS` is unbound (it checks codecs and names the
    algorithm); an adapter runs :meth:`bind`'s instance, which knows the node groups.
    """

    name = "hierarchical"

    def __init__(self, topology: Topology | None = None, rank: int = 0, inner: Algorithm | None = None) -> None:
        self.topology, self.rank, self.inner = topology, rank, inner
        #: step 3 may gather the nodes' frames (:func:`frames_cross_node`); False: always the dense share
        #: (the two give the same buffer bit for bit; the switch is for measuring the difference)
        self.gather_frames = True
        self.groups: NodeGroups | None = None  # set by connect(): the layout needs only the numbers
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    @classmethod
    def bind(cls, topology: Topology, rank: int, inner: Algorithm) -> Hierarchical:
        """The algorithm of group rank ``rank`` in ``topology``, running ``inner`` across nodes.

        Its residual layout is known at once; :meth:`connect` adds the node groups before the first step.
        """
        if not topology.hierarchical:
            raise CodecError(f"algorithm 'hierarchical' needs several nodes of several ranks, got {topology}")
        if inner.shards or isinstance(inner, Hierarchical):
            raise CodecError(f"algorithm {inner.name!r} cannot run across nodes inside 'hierarchical'")
        return cls(topology, rank, inner)

    def connect(self, group: Any) -> None:
        """Create (once per process group and layout) the intra-node and inter-node groups over ``group``."""
        topo, _ = self._layout()
        if self.groups is None:
            self.groups = node_groups(topo, group)

    @property
    def local_rank(self) -> int:
        """The position of this rank in its node."""
        return self._layout()[0].local_rank(self.rank)

    @property
    def node(self) -> int:
        """The node of this rank."""
        return self._layout()[0].node_of(self.rank)

    @property
    def server_feedback(self) -> bool:  # type: ignore[override]
        """The inner algorithm's (two-phase keeps server residuals of the share)."""
        return self.inner is not None and self.inner.server_feedback

    def _layout(self) -> tuple[Topology, Algorithm]:
        if self.topology is None or self.inner is None:
            raise CodecError("algorithm 'hierarchical' needs the node layout: register with local_world_size= "
                             "(or launch with torchrun on several nodes); it cannot be run by name alone")
        return self.topology, self.inner

    def _bound(self) -> tuple[Topology, NodeGroups, Algorithm]:
        topo, inner = self._layout()
        if self.groups is None:
            raise CodecError("algorithm 'hierarchical' has no node groups yet: connect(group) creates them")
        return topo, self.groups, inner

    def check(self, codec: Codec) -> None:
        """Any codec its inner algorithm runs (the unbound instance: any fixed-size codec)."""
        if self.inner is not None:
            self.inner.check(codec)
        elif not codec.fixed_size:
            raise CodecError(f"algorithm 'hierarchical' needs fixed-size packets; {codec!r} is variable-size")

    # ----- layout: the share this rank owns -------------------------------------------------------
    def _share(self, numel: int, codec: Codec) -> tuple[int, int]:
        topo, _ = self._layout()
        return piece_bounds(numel, topo.local_world_size, codec.block_alignment())[self.local_rank]

    def residual_layout(self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int) -> list[Piece]:
        """The inner algorithm's residuals of this rank's share of the parameter (``1/L`` of it)."""
        topo, inner = self._layout()
        lo, hi = self._share(math.prod(shape), codec)
        return [Piece(p.key, lo + p.lo, lo + p.hi, p.shape)
                for p in inner.residual_layout(share_key(name, self.local_rank), (hi - lo,), codec, topo.nodes)]

    def server_layout(
        self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int, rank: int
    ) -> list[Piece]:
        """The inner algorithm's server residuals of this rank's share (this node's part of it)."""
        topo, inner = self._layout()
        lo, hi = self._share(math.prod(shape), codec)
        return [Piece(p.key, lo + p.lo, lo + p.hi, p.shape)
                for p in inner.server_layout(share_key(name, self.local_rank), (hi - lo,), codec, topo.nodes,
                                             self.node)]

    def flush_weights(self, world_size: int) -> tuple[float, float]:
        """A worker residual is of the node's mean (``L`` x on the owner), a server one of the global mean."""
        return float(self._layout()[0].local_world_size), float(world_size)

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """The inner algorithm's plan of this rank's share across nodes, plus the dense bytes inside the node.

        The inter-node part keeps the keys the cost model reads; ``intra_alltoall`` /
        ``intra_allgather`` are the bytes handed over inside the node.
        """
        topo, inner = self._layout()
        size = torch.empty((), dtype=dtype).element_size()
        align = codec.block_alignment()
        shares = [Entry(hi - lo, e.compressed) for e in entries for lo, hi in [self._share(e.numel, codec)]]
        plan = inner.wire_plan(shares, codec, topo.nodes, dtype)
        total = sum(e.numel for e in entries)
        cuts = [piece_bounds(e.numel, topo.local_world_size, align) for e in entries]
        widest = max((sum(b[k][1] - b[k][0] for b in cuts) for k in range(topo.local_world_size)), default=0)
        frame = max((frame_layout([Entry(b[k][1] - b[k][0], e.compressed) for e, b in zip(entries, cuts)], codec,
                                  dtype).nbytes for k in range(topo.local_world_size)), default=0)
        gathered = topo.nodes * frame if frames_cross_node(inner, frame, topo.nodes, size * widest) else size * widest
        return {**plan, "intra_alltoall": size * (total - sum(e.numel for e in shares)),
                "intra_allgather": gathered}

    def _reused(self, tag: str, like: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer kept per DDP bucket (its address) and use: fresh large tensors page-fault every step."""
        key = (tag, like.device, like.data_ptr(), like.numel(), numel, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) > 64:
                self._buffers.clear()
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=like.device)
        return buf

    # ----- the step -------------------------------------------------------------------------------
    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """Reduce-scatter in the node (waited for), the inner algorithm across nodes (waited for), all-gather in the node."""
        topo, groups, inner = self._bound()
        if ctx.n != topo.world_size:
            raise CodecError(f"algorithm 'hierarchical' was bound to {topo.world_size} ranks, the group has {ctx.n}")
        L, j, flat = topo.local_world_size, groups.local_rank, ctx.flat
        t0 = time.perf_counter()
        bounds = [piece_bounds(s.numel, L, s.codec.block_alignment()) for s in ctx.slots]
        sizes = [sum(b[k][1] - b[k][0] for b in bounds) for k in range(L)]
        elt = flat.element_size()
        # 1. dense reduce-scatter inside the node
        send = self._reused("send", flat, flat.numel(), flat.dtype)
        if ctx.slots:
            torch.cat([ctx.view(i)[b[k][0] : b[k][1]] for k in range(L) for i, b in enumerate(bounds)], out=send)
        recv = self._reused("recv", flat, L * sizes[j], flat.dtype)
        work = dist.all_to_all_single(recv, send, output_split_sizes=[sizes[j]] * L, input_split_sizes=sizes,
                                      group=groups.intra, async_op=True)
        assert work is not None
        t1 = time.perf_counter()
        ctx.wait(work)
        t2 = time.perf_counter()
        wide = accumulate_dtype(flat.dtype)
        # one pass into a kept buffer (a fresh copy and L-1 adds cost ~2 passes and page faults per step)
        acc = self._reused("share", flat, sizes[j], wide)
        torch.sum(recv.view(L, sizes[j]), dim=0, dtype=wide, out=acc)
        acc.div_(L)
        share = acc if wide == flat.dtype else acc.to(flat.dtype)
        to_node = (flat.numel() - sizes[j]) * elt
        ctx.count(collectives=1, bytes_sent=to_node, bytes_wire=to_node, intra_bytes_sent=to_node,
                  intra_bytes_wire=to_node, encode_s=(t1 - t0) + (time.perf_counter() - t2), wait_s=t2 - t1)
        # 2. the compressed all-reduce of the share across nodes
        offsets = [sum(b[j][1] - b[j][0] for b in bounds[:i]) for i in range(len(bounds))]
        slots = [Slot(share_key(s.key, j), off, (b[j][1] - b[j][0],), s.codec, derive_seed(s.seed, PHASE_SHARE, j),
                      s.feedback) for s, b, off in zip(ctx.slots, bounds, offsets)]
        sub = StepContext(share, slots, groups.inter, LevelStats(ctx.stats, "inter", (*LevelStats.TOTALS, "nonfinite_slots")))
        if self.gather_frames and isinstance(inner, AllGather):  # the layouts only where frames can cross
            layouts = [FrameLayout([(share_key(s.key, k), s.codec, b[k][1] - b[k][0])
                                    for s, b in zip(ctx.slots, bounds)], flat.dtype) for k in range(L)]
            if frames_cross_node(inner, max(lay.nbytes for lay in layouts), topo.nodes, max(sizes) * elt):
                return self._frames_inside(ctx, sub, bounds, layouts)
        inner.launch(sub, server_feedback).wait()  # bounded: the fault channel fails this future
        # 3. dense all-gather inside the node
        width = max(sizes)
        out = self._reused("gather-send", flat, width, flat.dtype)
        out[: sizes[j]].copy_(share)
        out[sizes[j] :].zero_()
        gathered = self._reused("gather-recv", flat, L * width, flat.dtype)
        ctx.count(collectives=1, bytes_sent=width * elt, bytes_wire=(L - 1) * width * elt,
                  intra_bytes_sent=width * elt, intra_bytes_wire=(L - 1) * width * elt)
        work2 = all_gather_single(gathered, out, group=groups.intra, async_op=True)

        def decode() -> list[bool]:
            for k in range(L):
                off = k * width
                for i, b in enumerate(bounds):
                    lo, hi = b[k]
                    ctx.view(i)[lo:hi].copy_(gathered[off : off + hi - lo])
                    off += hi - lo
            bad = [not all_finite(ctx.view(i)) for i in range(len(ctx.slots))]
            for i, flagged in enumerate(bad):
                if flagged:
                    sub.void(i)  # this rank's share residuals of a slot void on every rank
            return bad

        return ctx.finish(work2, decode)

    def _frames_inside(
        self, ctx: StepContext, sub: StepContext, bounds: list[list[tuple[int, int]]], layouts: list[FrameLayout]
    ) -> torch.futures.Future[torch.Tensor]:
        """Steps 2 and 3 when the frames cross the node: the inner all-gather, then its frames gathered in the node.

        Step 2 encodes and all-gathers exactly as :class:`~.allgather.AllGather` (same seeds, same
        frames); step 3 all-gathers those ``N`` frames in the node and every rank decodes every
        share's frames in node order into the buffer, then averages: what the owner of each share
        would have decoded, on every rank alike.
        """
        _, groups, _ = self._bound()
        nodes, L = sub.n, len(layouts)
        enc = AllGather.encode(sub)
        nbytes = enc.layouts[0].nbytes
        width = nodes * max(lay.nbytes for lay in layouts)  # one local rank's frames, padded to the widest
        out = self._reused("frames-send", ctx.flat, width, torch.uint8)
        sub.wait(all_gather_single(out[: nodes * nbytes], enc.send, group=groups.inter, async_op=True))
        out[nodes * nbytes :].zero_()
        gathered = self._reused("frames-recv", ctx.flat, L * width, torch.uint8)
        ctx.count(collectives=1, bytes_sent=width, bytes_wire=(L - 1) * width, intra_bytes_sent=width,
                  intra_bytes_wire=(L - 1) * width)
        work = all_gather_single(gathered, out, group=groups.intra, async_op=True)

        def decode() -> list[bool]:
            flat = ctx.flat
            wide = accumulate_dtype(flat.dtype)
            acc = flat if wide == flat.dtype else self._reused("frames-acc", flat, flat.numel(), wide)
            bad = [False] * len(ctx.slots)

            def piece(k: int) -> Callable[[int, int], torch.Tensor]:
                # frame j (node j) of share k, entry i: piece k of slot i in the accumulator
                return lambda j, i: ctx.view(i, acc)[bounds[i][k][0] : bounds[i][k][1]]

            for k, lay in enumerate(layouts):
                flags = ctx.decode_frames(gathered[k * width : k * width + nodes * lay.nbytes], [lay] * nodes, piece(k))
                bad = [a or b for a, b in zip(bad, flags)]
            acc.div_(nodes)
            if acc is not flat:
                flat.copy_(acc)
            bad = [b or not all_finite(ctx.view(i)) for i, b in enumerate(bad)]
            for i, flagged in enumerate(bad):
                if flagged:
                    sub.void(i)  # this rank's share residuals of a slot void on every rank
            return bad

        return ctx.finish(work, decode)


__all__ = ["PHASE_SHARE", "Hierarchical", "frames_cross_node", "share_key"]
