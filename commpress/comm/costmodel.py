"""A cost model of one gradient buffer's reduction: link (alpha, beta) plus per-element codec costs.

What it predicts is the time from handing a buffer to a collective to having its average in
place, for three options (:data:`OPTIONS`): ``dense`` (DDP's own all-reduce of the buffer),
``fp16`` (a cast all-reduce) and ``compressed`` (a codec with its algorithm). Two parts:

**Link** (:class:`Link`): ``alpha`` seconds per message, ``beta`` seconds per byte a rank sends,
with how the gloo/NCCL collectives this package issues move bytes (the same accounting as
:class:`~.driver.CommStats`' ``bytes_wire``), ``B`` bytes of the per-rank input, ``n`` ranks:

=====================  =========================================  ==============================
collective             time                                       used by
=====================  =========================================  ==============================
ring all-reduce        ``2(n-1) alpha + 2(n-1)/n B beta``         dense, fp16, random-k values
all_gather (ring)      ``(n-1) alpha + (n-1) B beta``             ``allgather`` (B: one frame)
all_to_all             ``(n-1) alpha + (n-1)/n B beta``           ``twophase`` phase 1 (B: all pieces)
=====================  =========================================  ==============================

``twophase`` adds an all_gather of the padded piece frame (about ``B/n``).

**Device** (:class:`DeviceCost`): seconds per element on this device for the codec's encode
(through error feedback when the caller keeps residuals), one decode-and-add, a plain pass
(``copy_``/``div_``), the fp16 cast round trip, DGC's momentum masking, and the hook's velocity
update beyond what the optimizer's own momentum costs (``momentum_s``: a finiteness check and a
copy per element, where the hook owns SGD momentum). The compressed option costs ``encode + k *
decode + passes + momentum`` where ``k`` is the number of packets each element is decoded from
(``n`` for all-gather: every rank decodes every frame; 2 for two-phase: the server piece and the
gathered result; 1 for the shared-seed all-reduce). Dense and fp16 carry no ``momentum``: while
every bucket takes them, the optimizer applies its own momentum again (``codec="auto"`` hands it
back; with ``momentum=`` given by hand it stays in the hook, and the model leans toward them).

:func:`predict` is pure (numbers in, seconds out); :func:`calibrate_link` and
:func:`calibrate_device` measure the inputs on a process group and a device, and take the
maximum over ranks so that every rank predicts, and decides, the same. Where it breaks: it
assumes one collective at a time on an idle link and CPU (no overlap with backward, no
contention between ranks sharing cores), per-element costs measured at one size (caches), and
``beta`` fitted from all-reduces applied to all_gather/all_to_all. The fp16 option's cost beyond
its bytes is timed on the group itself (:func:`calibrate_cast`), and so is the compressed path
(:func:`calibrate_compressed` rescales encode and decode to match it).

**Several nodes** (DDP's ``codec="auto"`` on a hierarchical layout, :mod:`.hierarchical`): three
links (:class:`NodeLinks`: the whole group's, the node's, across nodes), each calibrated on its own
group; :func:`predict_hierarchical` prices dense and fp16 as flat all-reduces over the whole group
and ``compressed`` as the hierarchical path: a dense all_to_all in the node, the codec's algorithm
on ``1/L`` of the buffer among the ``nodes`` ranks of one local rank, a dense all_gather in the node.

**Sharded training** (FSDP's ``codec="auto"``, :mod:`commpress.fsdp.auto`): one module's
gradient reduce-scatter (:func:`predict_reduce_scatter`: torch's ring reduce-scatter, or the
``reducescatter`` all_to_all of a cast or a codec's frames) and its parameter all-gathers of one
step (:func:`predict_all_gather`: one or two ring all-gathers, or one whose frames the backward
decodes again), each among :data:`SHARDED_OPTIONS`, with the device costs of several codecs
measured at once by :func:`calibrate_codecs` (one all-reduce, with a failure flag, so a rank
that cannot measure makes every rank fall back instead of raising alone), and each option's fixed
cost per call, timed on the real paths (:func:`time_over_ranks`, :func:`path_overhead`). :func:`best` takes the
option order to break ties in; :func:`check_link` is the one check of a given link.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..codecs import Codec, NoneCodec
from ..codecs.base import all_finite
from ..errors import CodecError
from ..feedback import ErrorFeedback
from .driver import Entry, Slot

#: The options a buffer can be reduced with, in the order ties are broken (cheapest to run first).
OPTIONS = ("dense", "fp16", "compressed")
#: Buffer sizes (bytes) the link calibration all-reduces; it stops growing once one takes long.
CALIBRATION_BYTES = (4096, 1 << 20, 1 << 23, 1 << 25)
#: A calibration size that took longer than this (seconds) is the last one timed.
CALIBRATION_STOP_S = 0.25
#: Elements the device calibration encodes and decodes (16 MB of float32: past the caches).
CALIBRATION_NUMEL = 1 << 22


@dataclass(frozen=True)
class Link:
    """A link: ``alpha`` seconds per message and ``beta`` seconds per byte sent by one rank."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise CodecError(f"link {name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_gbit(cls, gbit: float, latency_s: float = 50e-6) -> Link:
        """A link of ``gbit`` Gbit/s per rank and ``latency_s`` seconds per message."""
        if not gbit > 0:
            raise CodecError(f"link bandwidth must be > 0 Gbit/s, got {gbit!r}")
        return cls(latency_s, 8.0 / (gbit * 1e9))

    @property
    def gbit(self) -> float:
        """Bandwidth in Gbit/s (inf for beta 0)."""
        return math.inf if self.beta == 0 else 8.0 / self.beta / 1e9

    def allreduce(self, nbytes: float, n: int) -> float:
        """Ring all-reduce of ``nbytes`` per rank."""
        return 0.0 if n < 2 else 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes * self.beta

    def allgather(self, nbytes: float, n: int) -> float:
        """Ring all_gather of ``nbytes`` per rank (each rank receives and forwards ``n-1`` of them)."""
        return 0.0 if n < 2 else (n - 1) * self.alpha + (n - 1) * nbytes * self.beta

    def alltoall(self, nbytes: float, n: int) -> float:
        """all_to_all of ``nbytes`` per rank (``(n-1)/n`` of it leaves the rank)."""
        return 0.0 if n < 2 else (n - 1) * self.alpha + (n - 1) / n * nbytes * self.beta


def check_link(value: Any, what: str = "auto_link") -> Link | None:
    """``value`` if it is a :class:`Link` or None, else a :class:`CodecError` naming ``what``."""
    if value is not None and not isinstance(value, Link):
        raise CodecError(f"{what} must be a commpress.comm.costmodel.Link (e.g. Link.from_gbit(1.0)), got {value!r}")
    return value


def check_calibration_numel(value: Any, what: str = "auto_calibration_numel") -> int:
    """``value`` if it is an int in ``[1, 2**26]`` (elements a codec is timed on), else a :class:`CodecError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 26:
        raise CodecError(f"{what} must be an int in [1, 2**26], got {value!r}")
    return value


@dataclass(frozen=True)
class DeviceCost:
    """Seconds per element on one device (see the module docstring).

    ``mask_s`` is 0 without momentum masking, ``momentum_s`` 0 where the hook applies no momentum.
    """

    encode_s: float
    decode_s: float
    pass_s: float
    cast_s: float
    mask_s: float = 0.0
    momentum_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise CodecError(f"device cost {name} must be a finite number >= 0, got {v!r}")


def compressed_plan(
    entries: Sequence[Entry], codec: Codec, algorithm: str, n: int, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """Bytes each collective of ``algorithm`` hands over per rank, and decodes per element.

    Returns ``{"allreduce": B, "allgather": B, "alltoall": B, "decodes": k}`` (absent
    collectives 0): what the algorithm states of itself (:meth:`~.driver.Algorithm.wire_plan`),
    computed from the same frame layouts it builds.
    """
    from . import ALGORITHMS  # the package imports this module's users, not the other way round

    if algorithm not in ALGORITHMS:
        raise CodecError(f"the cost model prices the registered algorithms ({', '.join(ALGORITHMS)}), not {algorithm!r}")
    return ALGORITHMS[algorithm].wire_plan(entries, codec, n, dtype)


def wire_time(link: Link, plan: dict[str, float], n: int) -> float:
    """Seconds ``link`` takes for the collectives of a :func:`compressed_plan` among ``n`` ranks."""
    return (link.allreduce(plan["allreduce"], n) + link.allgather(plan["allgather"], n)
            + link.alltoall(plan["alltoall"], n))


def exact_options(numel: int, n: int, link: Link, device: DeviceCost, dtype: torch.dtype) -> dict[str, float]:
    """``dense`` (all-reduce plus the division's pass) and ``fp16`` (half the bytes plus the cast; float32/64 only)."""
    size = torch.empty((), dtype=dtype).element_size()
    out = {"dense": link.allreduce(size * numel, n) + device.pass_s * numel}
    if dtype in (torch.float32, torch.float64):
        out["fp16"] = link.allreduce(2 * numel, n) + device.cast_s * numel
    return out


def predict(
    entries: Sequence[Entry],
    n: int,
    link: Link,
    device: DeviceCost,
    codec: Codec,
    algorithm: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Predicted seconds to reduce one buffer of ``entries`` over ``n`` ranks, per option.

    ``dense``: all-reduce of the buffer plus one pass (the division); ``fp16``: all-reduce of
    half the bytes plus the cast round trip (absent for buffers that are not float32/float64);
    ``compressed``: the codec's collectives (:func:`compressed_plan`) plus encode of the
    compressed elements, ``k`` decodes of them, masking, two passes over the buffer
    (accumulator average and copy) and the hook's velocity update of the whole buffer.
    """
    numel = sum(e.numel for e in entries)
    nc = sum(e.numel for e in entries if e.compressed)
    out = exact_options(numel, n, link, device, dtype)
    plan = compressed_plan(entries, codec, algorithm, n, dtype)
    wire = wire_time(link, plan, n)
    work = nc * (device.encode_s + plan["decodes"] * device.decode_s + device.mask_s)
    work += (numel - nc) * device.pass_s * plan["decodes"] + (2 * device.pass_s + device.momentum_s) * numel
    out["compressed"] = wire + work
    return out


@dataclass(frozen=True)
class NodeLinks:
    """The three links of a cluster of nodes.

    ``flat``: all-reduces over every rank (what dense and fp16 run on); ``intra``: the ranks of one
    node; ``inter``: one rank per node, across the slow network.
    """

    flat: Link
    intra: Link
    inter: Link


def share_entries(entries: Sequence[Entry], local_world_size: int, align: int = 1) -> list[Entry]:
    """The widest local rank's share of each entry (its ``1/L`` piece, cut as :mod:`.hierarchical` cuts it)."""
    # twophase imports the driver; keep this module's imports light
    from .twophase import piece_bounds

    widest = 0
    cuts = [piece_bounds(e.numel, local_world_size, align) for e in entries]
    for k in range(local_world_size):
        if sum(c[k][1] - c[k][0] for c in cuts) > sum(c[widest][1] - c[widest][0] for c in cuts):
            widest = k
    return [Entry(c[widest][1] - c[widest][0], e.compressed) for e, c in zip(entries, cuts)]


def predict_hierarchical(
    entries: Sequence[Entry],
    nodes: int,
    local_world_size: int,
    links: NodeLinks,
    device: DeviceCost,
    codec: Codec,
    inner: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """:func:`predict` for a buffer on ``nodes`` nodes of ``local_world_size`` ranks, per option.

    ``dense`` and ``fp16``: flat all-reduces over all ``nodes * L`` ranks on ``links.flat``.
    ``compressed``: the hierarchical path: a dense all_to_all of the buffer on ``links.intra``, the
    ``inner`` algorithm's collectives of this rank's share (:func:`share_entries`) among ``nodes``
    ranks on ``links.inter``, and an all_gather on ``links.intra``: of the nodes' frames of the
    share where :func:`~.hierarchical.frames_cross_node` says so (every rank then decodes the
    whole buffer), else of the dense share (decoded by its owner). Its work: the codec's encode
    of the share and its decodes (of the share, or of the buffer), ``L`` passes over the share
    (summing the node's copies) and, over the whole buffer, three passes (packing, copying back or
    averaging, the finiteness check) and the hook's velocity update.
    """
    from . import ALGORITHMS
    from .hierarchical import frames_cross_node

    L = local_world_size
    numel = sum(e.numel for e in entries)
    size = torch.empty((), dtype=dtype).element_size()
    out = exact_options(numel, nodes * L, links.flat, device, dtype)
    shares = share_entries(entries, L, codec.block_alignment())
    share = sum(e.numel for e in shares)
    nc = sum(e.numel for e in shares if e.compressed)
    plan = compressed_plan(shares, codec, inner, nodes, dtype)
    frames = inner in ALGORITHMS and frames_cross_node(ALGORITHMS[inner], int(plan["allgather"]), nodes, size * share)
    wire = (links.intra.alltoall(size * numel, L) + wire_time(links.inter, plan, nodes)
            + links.intra.allgather(nodes * plan["allgather"] if frames else size * share, L))
    decoded, nc_decoded = (numel, sum(e.numel for e in entries if e.compressed)) if frames else (share, nc)
    work = nc * (device.encode_s + device.mask_s) + nc_decoded * plan["decodes"] * device.decode_s
    work += (decoded - nc_decoded) * device.pass_s * plan["decodes"] + L * device.pass_s * share
    work += (3 * device.pass_s + device.momentum_s) * numel
    out["compressed"] = wire + work
    return out


def best(predicted: dict[str, float], order: Sequence[str] = OPTIONS) -> str:
    """The option with the least time (ties: the earlier in ``order``, by default :data:`OPTIONS`)."""
    return min((o for o in order if o in predicted), key=lambda o: (predicted[o], order.index(o)))


def time_over_ranks(
    fns: Sequence[Any], *, group: Any = None, device: torch.device | str = "cpu", reps: int = 3
) -> tuple[list[float] | None, str]:
    """Median seconds of each of ``fns`` (after one untimed call), MAX over ranks; or None and why.

    ``fns`` may issue collectives on ``group`` (every rank runs them in the same order). A rank on
    which one raises stops timing and marks itself failed; one all-reduce of the times and the flag
    follows on every rank alike, so a failure anywhere returns None everywhere (the reason on the
    rank that failed, "a peer" on the others). A collective of ``group``.
    """
    times: list[float] = []
    why = ""
    try:
        times = [_median_time(fn, reps) for fn in fns]
    except Exception as exc:  # noqa: BLE001 - any failure must reach the all-reduce, not skip it
        why = f"{type(exc).__name__}: {exc}"
    if why or not all(math.isfinite(t) for t in times):
        why = why or "a time was not a finite number"
        times = [0.0] * len(fns)
    reduced = max_over_ranks([*times, 1.0 if why else 0.0], group, device)
    if reduced[-1]:
        return None, why or "timing failed on a peer rank"
    return reduced[:-1], ""


def path_overhead(measured: dict[str, float], predicted: dict[str, float], base: str = "dense") -> dict[str, float]:
    """Per option, the seconds per call its real path took beyond ``base``'s that the model does not predict.

    ``max((measured[o] - measured[base]) - (predicted[o] - predicted[base]), 0)``, ``base`` 0: measured
    at a size where the wire hardly matters, this is the fixed cost of a call (frame headers,
    packing, per-packet Python work) relative to the exact path, which per-element codec costs
    miss (on a 137k-parameter LM over loopback, 2-bit QSGD modules predicted faster than FSDP's
    own reduce-scatter ran 1.4x slower: ``scripts/bench_fsdp_lm.py --quick``). Relative to ``base``
    because latency common to every option cancels, so a given link needs no real one measured.
    """
    out = {base: 0.0}
    for o in measured:
        if o != base:
            out[o] = max((measured[o] - measured[base]) - (predicted[o] - predicted[base]), 0.0)
    return out


# ----- sharded training: one module's reduce-scatter and parameter all-gather ---------------------
#: The options of a sharded module's collective, in the order ties are broken (exact first).
SHARDED_OPTIONS = ("dense", "bf16", "compressed")


def sharded_wire_time(link: Link, plan: dict[str, float], n: int) -> float:
    """:func:`wire_time` of the collectives ``plan`` issues: one with no bytes is not issued, so costs no latency.

    (:func:`wire_time` charges ``alpha`` for every collective, byte-less ones included: DDP's
    predictions keep that, which adds the same latency to every option of one algorithm.)
    """
    return sum(time_of(plan[k], n) for k, time_of in (("allreduce", link.allreduce), ("allgather", link.allgather),
                                                       ("alltoall", link.alltoall)) if plan[k] > 0)


def predict_reduce_scatter(
    entries: Sequence[Entry], n: int, link: Link, costs: dict[str, DeviceCost], codecs: dict[str, Codec],
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Predicted seconds of one sharded reduce-scatter of ``n`` chunks shaped ``entries``, per option.

    ``entries``: one chunk (one rank's shard of each parameter; ``compressed`` as the selection
    rule says). ``dense``: torch's ring reduce-scatter (``reducescatter-dense``: ``(n-1)/n`` of the
    input leaves the rank) plus one pass for the average. Every option in ``codecs`` (``bf16``, a
    cast; ``compressed``, the codec) runs the ``reducescatter`` all_to_all of its frames
    (:func:`compressed_plan`) and costs, with ``costs[option]``: an encode of the compressed
    elements of the ``n-1`` chunks sent, their ``n-1`` decodes, a pass per element sent as it is,
    and two passes over the shard (the accumulator and the copy out).
    """
    chunk = sum(e.numel for e in entries)
    nc = sum(e.numel for e in entries if e.compressed)
    dense_plan = compressed_plan(entries, NoneCodec(), "reducescatter-dense", n, dtype)
    base = costs.get("dense") or next(iter(costs.values()))
    out = {"dense": sharded_wire_time(link, dense_plan, n) + base.pass_s * chunk}
    for option, codec in codecs.items():
        c = costs[option]
        plan = compressed_plan(entries, codec, "reducescatter", n, dtype)
        work = (n - 1) * (nc * (c.encode_s + c.decode_s) + 2 * (chunk - nc) * c.pass_s) + 2 * c.pass_s * chunk
        out[option] = sharded_wire_time(link, plan, n) + work
    return out


def predict_all_gather(
    shard_numel: int, compressed_numel: int, n: int, link: Link, *, dense_bytes: int,
    frames: dict[str, tuple[int, DeviceCost]], gathers: int = 2, reuse: tuple[str, ...] = (),
) -> dict[str, float]:
    """Predicted seconds of one sharded module's parameter all-gathers in one step, per option.

    ``shard_numel`` elements per rank (``compressed_numel`` of them quantised), ``dense_bytes``
    their bytes in the all-gather dtype; ``gathers``: all-gathers per step (2: forward and
    backward, when the module is resharded after forward; 1 otherwise). ``dense``: ``gathers``
    ring all-gathers of the shard. Each option of ``frames`` (``option -> (frame bytes, costs)``)
    costs per gather a ring all-gather of its frame, an encode of the compressed elements, ``n``
    decodes of them (every rank's shard) and ``n + 1`` passes over the exact ones; an option in
    ``reuse`` all-gathers once and its backward only decodes the forward's kept frames.
    """
    out = {"dense": gathers * link.allgather(dense_bytes, n)}
    exact = shard_numel - compressed_numel
    for option, (nbytes, c) in frames.items():
        decode = n * compressed_numel * c.decode_s + (n + 1) * exact * c.pass_s
        one = link.allgather(nbytes, n) + compressed_numel * c.encode_s + decode
        out[option] = one + (gathers - 1) * (decode if option in reuse else one)
    return out


# ----- calibration -------------------------------------------------------------------------------
def _median_time(fn: Any, reps: int) -> float:
    """Median of ``reps`` timed calls of ``fn`` after one untimed call."""
    fn()  # warm-up: first-touch pages, kernel selection
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def max_over_ranks(values: list[float], group: Any = None, device: torch.device | str = "cpu") -> list[float]:
    """Each of ``values``' maximum over the ranks of ``group`` (one MAX all-reduce; a collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.cpu()]


def fit_link(sizes: Sequence[float], times: Sequence[float], n: int) -> Link:
    """``alpha``, ``beta`` of the ring all-reduce line through the smallest and the largest size.

    ``sizes`` bytes per rank took ``times`` seconds. The smallest size fixes the latency and the
    largest the bandwidth, the sizes between are not used: DDP's buckets (25 MB by default) are
    as large as the largest calibration size or larger, and the mid sizes read faster than the
    link really is for them. A token bucket's burst or TCP's slow start is a fixed number of
    bytes that goes free, and 4 ranks on 2 cores add milliseconds of scheduling to the smallest
    size. Measured on a 1 Gbit/s ``tc tbf`` link at 4 ranks, a least-squares line weighted by
    relative error (used until 2026-12-01) read 1.15-1.25 Gbit/s and predicted 67 MB all-reduces
    16-23% short; this line read 0.97-0.99 Gbit/s and was within 2% (``scripts/bench_link_fit.py``).
    Both values are clamped at 0.
    """
    if len(sizes) != len(times) or len(sizes) < 2 or n < 2:
        raise CodecError(f"fit_link needs >= 2 (size, time) points and n >= 2, got {len(sizes)} and n={n}")
    (b0, t0), (b1, t1) = min(zip(sizes, times)), max(zip(sizes, times))
    sent = 2.0 * (n - 1) / n  # bytes each rank sends per byte of input
    beta = max(t1 - t0, 0.0) / (sent * (b1 - b0)) if b1 > b0 else 0.0
    alpha = max(t0 - sent * b0 * beta, 0.0) / (2.0 * (n - 1))
    return Link(alpha, beta)


def calibrate_link(
    group: Any = None, device: torch.device | str = "cpu", sizes: Sequence[int] = CALIBRATION_BYTES, reps: int = 3
) -> Link:
    """Time all-reduces of ``sizes`` bytes on ``group`` (collective: every rank calls it).

    Every rank times every size (it stops early, on every rank alike, once a size took longer
    than :data:`CALIBRATION_STOP_S` on some rank); the medians are all-reduced with MAX before
    the fit, so every rank returns the same :class:`Link`.
    """
    n = dist.get_world_size(group)
    if n < 2:
        return Link(0.0, 0.0)
    buf = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    used: list[float] = []
    times: list[float] = []
    for b in sizes:
        view = buf[: b // 4]

        def once(view: torch.Tensor = view) -> None:
            dist.all_reduce(view, group=group)
            if view.is_cuda:
                torch.cuda.synchronize(view.device)

        t = max_over_ranks([_median_time(once, reps)], group, device)[0]
        used.append(float(b))
        times.append(t)
        if t > CALIBRATION_STOP_S and len(used) >= 2:
            break
    return fit_link(used, times, n)


def calibrate_cast(link: Link, group: Any = None, device: torch.device | str = "cpu",
                   numel: int = CALIBRATION_BYTES[2] // 4, reps: int = 3) -> float:
    """Seconds per element the fp16 cast all-reduce costs beyond ``link``'s time for its bytes.

    Times the cast all-reduce as :func:`~.allreduce.allreduce_mean` runs it for a DDP bucket
    (divide and cast into the reused send buffer, all-reduce in fp16, copy back): gloo sums
    fp16 on the CPU element by element, which a float32-calibrated ``beta`` does not see
    (measured: PyTorch's fp16 hook 0.91x dense unshaped). The dense all-reduce of the same
    buffer is timed alternately with it, and the cost is set so that the model's fp16-minus-dense
    difference at this size is the measured one: ``(t_cast - t_dense + L(4N) - L(2N)) / N``.
    Both options share the link, so its fit's error cancels from the choice between them (on a
    2 x 2 emulated cluster at 10 Gbit/s the fit read 5.4 and 7.0 Gbit/s in two runs, and fp16
    against dense flipped with it). MAX over ranks (a collective).
    """
    n = dist.get_world_size(group)
    buf = torch.zeros(numel, dtype=torch.float32, device=device)
    send = torch.empty(numel, dtype=torch.float16, device=device)

    def sync() -> None:
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)

    def cast() -> None:  # as a persistent bucket's cast runs: the send buffer is reused
        torch.div(buf, n, out=send)
        dist.all_reduce(send, group=group)
        buf.copy_(send)
        sync()

    def dense() -> None:  # as DDP's own all-reduce of the bucket runs (its division is the model's pass)
        dist.all_reduce(buf, group=group)
        sync()

    cast()  # warm-up: first-touch pages, kernel selection
    dense()
    times: dict[Any, list[float]] = {cast: [], dense: []}
    for _ in range(reps):  # alternately, so drift and neighbours' load fall on both alike
        for fn in (dense, cast):
            t = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t)
    t_cast, t_dense = max_over_ranks([statistics.median(times[cast]), statistics.median(times[dense])], group, device)
    return cast_cost(t_cast, t_dense, link, numel, n)


def cast_cost(t_cast: float, t_dense: float, link: Link, numel: int, n: int) -> float:
    """:func:`calibrate_cast`'s seconds per element from the two measured all-reduces of ``numel`` float32.

    Chosen so that :func:`exact_options`' fp16 minus dense at ``numel`` elements is ``t_cast - t_dense``
    less the dense option's division pass, whatever ``link`` is (clamped at 0).
    """
    return max(t_cast - t_dense + link.allreduce(4 * numel, n) - link.allreduce(2 * numel, n), 0.0) / numel


def calibrate_compressed(
    codec: Codec,
    algorithm: str | Any,
    link: Link | NodeLinks,
    cost: DeviceCost,
    *,
    feedback: bool,
    group: Any = None,
    device: torch.device | str = "cpu",
    numel: int = CALIBRATION_NUMEL,
    reps: int = 5,
) -> DeviceCost:
    """``cost`` with encode and decode rescaled so the model matches the real compressed path.

    Runs ``algorithm`` on the group (:func:`commpress.comm.run`: error feedback, encode, frame
    packing, the collectives, fresh receive and accumulation buffers, decode) for one buffer of
    ``numel`` elements, and scales encode and decode by (measured - predicted wire time) /
    predicted CPU work: the parts :func:`calibrate_device` times alone missed 10-30% of the
    compressed steps of the 17M MLP. ``algorithm``: a registered name, or a bound
    :class:`~.hierarchical.Hierarchical` with ``link`` a :class:`NodeLinks` (priced by
    :func:`predict_hierarchical`). MAX over ranks (a collective: every rank calls it).
    """
    from . import get, run  # the package imports this module's users, not the other way round
    from .hierarchical import Hierarchical

    impl = algorithm if not isinstance(algorithm, str) else get(algorithm)
    n = dist.get_world_size(group)
    side = max(1, math.isqrt(numel))
    x = torch.randn(side, side, generator=torch.Generator().manual_seed(1)).to(device)
    buf = torch.empty(x.numel(), dtype=x.dtype, device=device)
    ef = ErrorFeedback(codec) if feedback else None
    server = ErrorFeedback(codec) if feedback and impl.server_feedback else None
    slots = [Slot("calibration", 0, tuple(x.shape), codec, 7, ef)]

    def once() -> None:
        buf.copy_(x.reshape(-1))
        run(impl, buf, slots, group=group, server_feedback=server).wait()

    # one run spans every rank, so a rank descheduled for a moment (4 ranks on 2 cores) stalls
    # them all: the median of 3 once scaled sign's encode 10x (11.3 ns/element against 3.5-3.8
    # in the runs around it) and auto chose fp16 over it; the median of 5 needs 3 such runs,
    # and the least of 5 predicted compressed steps 10-16% short (it also drops real contention)
    t = max_over_ranks([_median_time(once, reps)], group, device)[0]
    entries = [Entry(x.numel(), True)]
    # the timed path has no velocity update: leave the momentum out of the work it is set against
    path_cost = dataclasses.replace(cost, momentum_s=0.0)
    free = dataclasses.replace(path_cost, encode_s=0.0, decode_s=0.0, pass_s=0.0, mask_s=0.0)
    if isinstance(impl, Hierarchical):
        if not isinstance(link, NodeLinks) or impl.topology is None or impl.inner is None:
            raise CodecError("calibrating the hierarchical path needs a bound Hierarchical and NodeLinks")
        topo, inner = impl.topology, impl.inner.name

        def price(c: DeviceCost) -> float:
            assert isinstance(link, NodeLinks)
            return predict_hierarchical(entries, topo.nodes, topo.local_world_size, link, c, codec, inner,
                                        x.dtype)["compressed"]
    else:
        if not isinstance(link, Link):
            raise CodecError(f"calibrating algorithm {impl.name!r} needs one Link, got {link!r}")

        def price(c: DeviceCost) -> float:
            assert isinstance(link, Link)
            return predict(entries, n, link, c, codec, impl.name, x.dtype)["compressed"]
    wire = price(free)
    work = price(path_cost) - wire
    factor = path_factor(t, wire, work)
    return dataclasses.replace(cost, encode_s=cost.encode_s * factor, decode_s=cost.decode_s * factor)


def path_factor(measured: float, wire: float, work: float) -> float:
    """How much more CPU work the whole compressed path did than the codec timed alone: at least 1.

    ``(measured - wire) / work``, never below 1: the codec's own encode and decode are part of
    the path, so they bound its CPU work from below. On a slow link the wire is nearly all of
    ``measured`` and the difference is mostly the link model's error: at 1 Gbit/s and 2 ranks it
    scaled QSGD's encode to 1.8 ms per 16.8M elements, where the hook measured 11.8 ms.
    """
    if not work > 0 or not math.isfinite(measured) or not math.isfinite(wire):
        return 1.0
    factor = (measured - wire) / work
    return factor if math.isfinite(factor) and factor > 1.0 else 1.0


def calibrate_device(
    codec: Codec,
    *,
    feedback: bool,
    masking: bool = False,
    momentum: bool = False,
    device: torch.device | str = "cpu",
    numel: int = CALIBRATION_NUMEL,
    group: Any = None,
    reps: int = 3,
    over_ranks: bool = True,
) -> DeviceCost:
    """Time the codec's encode (through error feedback when ``feedback``) and decode on ``device``.

    With ``momentum`` (the hook owns SGD momentum), also what its velocity update costs beyond
    the optimizer's own (``CompressionState.apply_momentum``: the same ``mul_``/``add_`` plus a
    finiteness check and a copy into the gradient).

    Runs on every rank of ``group`` and takes the maximum over ranks (a collective when the
    process group is initialised), so every rank has the same numbers; ``over_ranks=False``
    returns this rank's own numbers without a collective (:func:`calibrate_codecs` reduces
    several at once). Gaussian input, seed 0.
    """
    side = max(1, math.isqrt(numel))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(side, side, generator=gen).to(device)
    m = x.numel()
    ef = ErrorFeedback(codec, {"x": x.shape}) if feedback else None

    def encode() -> Any:
        return ef.compress("x", x, seed=1) if ef is not None else codec.encode(x, seed=1)

    enc = _median_time(encode, reps)
    packet = encode()
    acc = torch.zeros(m, dtype=x.dtype, device=device)
    dec = _median_time(lambda: codec.decode(packet, out=acc, accumulate=True), reps)
    flat = x.reshape(-1)
    pass_t = _median_time(lambda: acc.copy_(flat), reps)

    def cast() -> None:  # as the cast all-reduce does it: divide, cast, copy back
        acc.copy_(flat.div(2).to(torch.float16))

    cast_t = _median_time(cast, reps)
    mask_t = 0.0
    if masking:  # as the hook masks: the sent entries of a sparse codec, else a residual scan
        u = flat.clone()
        sent = codec.sent_indices(packet) if packet is not None else None
        if sent is not None:
            mask_t = _median_time(lambda: u.index_fill_(0, sent, 0.0), reps)
        else:
            mask_t = _median_time(lambda: u.masked_fill_(acc == 0, 0.0), reps)
    momentum_t = 0.0
    if momentum:
        # between two buffers of its own, as the hook copies the velocity into the gradient (reusing
        # pass_t's copy instead measured 0.33 ns per element against this 0.53: caches)
        velocity, out = flat.clone(), torch.empty_like(flat)
        momentum_t = _median_time(lambda: (all_finite(flat), out.copy_(velocity)), reps)
    values = [enc / m, dec / m, pass_t / m, cast_t / m, mask_t / m, momentum_t / m]
    if over_ranks:
        values = max_over_ranks(values, group, device)
    return DeviceCost(*values)


def calibrate_codecs(
    codecs: dict[str, Codec], *, group: Any = None, device: torch.device | str = "cpu",
    numel: int = CALIBRATION_NUMEL, reps: int = 3, failed: str = "",
) -> tuple[dict[str, DeviceCost] | None, str]:
    """Every codec's :class:`DeviceCost` (no error feedback), the same on every rank, or None and why.

    Each rank times every codec on its own (:func:`calibrate_device` with ``over_ranks=False``);
    a rank whose measurement raises or is not finite marks itself failed instead of raising, and
    one all-reduce (MAX) of every number and the failure flags follows on every rank alike, so a
    calibration that failed anywhere returns None everywhere (with the reason on the rank that
    failed, "a peer" on the others) and the ranks stay in step. ``failed``: a reason this rank
    already knows it cannot go on (an earlier part of the caller's calibration failed). A
    collective of ``group``.
    """
    names = sorted(codecs)
    values: list[float] = []
    why = failed  # a reason the caller already has: measure nothing, raise the flag
    try:
        for name in names if not failed else ():
            values += list(asdict(calibrate_device(codecs[name], feedback=False, device=device, numel=numel,
                                                   reps=reps, over_ranks=False)).values())
    except Exception as exc:  # noqa: BLE001 - any failure must reach the all-reduce, not skip it
        why = f"{type(exc).__name__}: {exc}"
    width = len(dataclasses.fields(DeviceCost))
    if why or len(values) != width * len(names) or not all(math.isfinite(v) and v >= 0 for v in values):
        why = why or "a measurement was not a finite number"
        values = [0.0] * (width * len(names))
    reduced = max_over_ranks([*values, 1.0 if why else 0.0], group, device)
    if reduced[-1]:
        return None, why or "calibration failed on a peer rank"
    return {name: DeviceCost(*reduced[i * width : (i + 1) * width]) for i, name in enumerate(names)}, ""


__all__ = [
    "CALIBRATION_BYTES", "CALIBRATION_NUMEL", "OPTIONS", "SHARDED_OPTIONS", "DeviceCost", "Entry", "Link", "NodeLinks",
    "best", "exact_options", "predict_hierarchical", "share_entries",
    "calibrate_cast", "calibrate_codecs", "cast_cost", "calibrate_compressed", "calibrate_device", "calibrate_link", "check_link",
    "compressed_plan", "fit_link", "max_over_ranks", "path_factor", "predict", "path_overhead", "predict_all_gather",
    "predict_reduce_scatter", "sharded_wire_time", "time_over_ranks", "wire_time",
]
