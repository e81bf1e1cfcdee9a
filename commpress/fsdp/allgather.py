"""The compressed parameter all-gather of FSDP2: ``param_codec=`` of :func:`commpress.fsdp.register`.

FSDP2 all-gathers every module's parameters before its forward and again before its backward
(with ``reshard_after_forward=True``, the default): two of a sharded step's three volumes.
:meth:`FSDPModule.set_custom_all_gather` lets a comm object replace that collective; FSDP calls
it with the rank's flat shard (``input_tensor``: every parameter's padded dim-0 shard in FSDP's
order, in the all-gather dtype) and the buffer for all ranks' shards (``output_tensor``,
``n`` times as long; ``input_tensor`` is its slice ``rank``). :class:`CompressedAllGather` does,
per call:

1. encode each parameter's piece of the shard with the parameter codec (a parameter the
   selection rule keeps dense, e.g. a bias, travels as it is), into one frame of fixed size
   (:class:`commpress.wire.frame.FrameLayout`, the same on every rank);
2. one ``all_gather_single`` (``all_gather_into_tensor``) of those uint8 frames, inside the
   group's fault channel (a rank that cannot encode, e.g. NaN in its shard, fails every rank
   instead of hanging them);
3. decode every rank's frame, its own included, into ``output_tensor``: every rank computes
   with the same bit-identical gathered parameters.

Only the gathered copy used for compute is quantised: the sharded parameters (what the
optimizer updates) are never written, so they stay exact. With the default ``int8`` codec
(block 256) a gathered element is within half a quantisation step of the exact one,
``|w' - w| <= absmax_block / 254`` (:mod:`commpress.spec.blockint`), and the all-gather moves
about a quarter of FSDP's float32 bytes (half of bfloat16's).

**Dtypes.** The all-gather dtype is the parameters' (float32), or ``MixedPrecisionPolicy``'s
``param_dtype`` (e.g. bfloat16: encoded from the bfloat16 shard, decoded to bfloat16). FSDP
all-gathers raw ``uint8`` when a module's all-gather inputs have different dtypes (a tensor
subclass bringing its own ``fsdp_pre_all_gather``, e.g. float8 weights; FSDP itself refuses
plain parameters of mixed dtypes): that is refused with a :class:`~commpress.errors.ConfigurationError`
at the first all-gather, on every rank alike, before any collective.

**Forward and backward.** ``param_codec={"forward": "int8", "backward": "int4"}`` chooses per
direction. FSDP calls the same comm for both; the call tells them apart cheaply and reliably:
the backward all-gather runs inside the autograd engine (a pre-backward hook, or its prefetch),
where ``torch._C._current_graph_task_id()`` is not -1. An activation-checkpointing recompute
runs there too, and rightly gets the backward codec (it is compute for the backward pass).

**Limits.** ``fully_shard(..., reshard_after_forward=<int>)`` (resharding after forward to a
smaller group, so the backward all-gather runs over other ranks with other shard sizes) is
refused at that all-gather with a :class:`~commpress.errors.ConfigurationError`; the encode is
synchronous (no overlap with compute) and runs the vectorised-torch fast path, not a native kernel.

**The default** (:func:`default_param_codec`). ``param_codec=`` not given (:data:`DEFAULT`) follows the
gradient codec: a codec that compresses (every codec but the exact ``none`` and the casts ``fp16`` /
``bf16``, whose :attr:`~commpress.codecs.Codec.lossless` is True) gets :data:`COMPRESSING_DEFAULT`,
int8 forward and ``"backward": "reuse"`` (the recommended setting's all-gather, ``docs/fsdp.md``:
without it a compressed reduce-scatter bounds the step's saving at 1.5x); ``none`` and the casts
keep FSDP's own all-gather, untouched. ``param_codec="none"`` is FSDP's own all-gather (the same
``all_gather_single`` call, bit for bit) with its bytes counted; ``param_codec=None`` installs
nothing: both are gradient-only.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import codecs
from ..codecs import Codec, NoneCodec
from ..comm.faults import FaultChannel, wait
from ..dtypes import FLOAT_DTYPES
from ..errors import CodecError, ConfigurationError, NonFiniteError
from ..wire.frame import FrameLayout

__all__ = [
    "COMPRESSING_DEFAULT", "DEFAULT", "AllGatherPlan", "CompressedAllGather", "ParamAllGather", "default_param_codec",
    "frame_layout", "resolve_param_codec",
]

#: The two directions FSDP all-gathers parameters for.
DIRECTIONS = ("forward", "backward")
#: ``param_codec={"forward": codec, "backward": REUSE}``: the backward decodes the frames the
#: forward gathered (kept between them) instead of gathering again.
REUSE = "reuse"


class _NotGiven:
    """The type of :data:`DEFAULT` (one instance; ``repr`` names it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "commpress.fsdp.allgather.DEFAULT"


#: ``param_codec=`` left out, told apart from an explicit ``None`` and ``"none"``:
#: :func:`default_param_codec` chooses from the gradient codec.
DEFAULT: Any = _NotGiven()
#: The all-gather a compressing gradient codec gets when ``param_codec=`` is not given:
#: block-scaled int8 forward, the backward decoding the forward's kept frames (0 bytes).
COMPRESSING_DEFAULT: Mapping[str, str] = {"forward": "int8", "backward": REUSE}


def default_param_codec(param_codec: Any, grad_codec: Codec, inside_node: bool = False) -> tuple[Any, bool, str]:
    """``(param_codec, defaulted, why)``: the option as given, or :data:`DEFAULT` resolved for ``grad_codec``.

    Not given: :data:`COMPRESSING_DEFAULT` when ``grad_codec`` compresses (it is not
    :attr:`~commpress.codecs.Codec.lossless`: everything but ``none``, ``fp16`` and ``bf16``),
    else None (FSDP's own all-gather, untouched). ``inside_node``: FSDP shards inside a node
    (HSDP), so the all-gather runs on the fast links only: None. ``why`` is the sentence the
    registration logs.
    """
    if param_codec is not DEFAULT:
        return param_codec, False, f"param_codec={param_codec!r} as given"
    if inside_node:
        return None, True, (
            "param_codec defaulted to FSDP's own all-gather because FSDP shards inside a node: parameters never "
            "cross the slow link, only the gradient shards' compressed all-reduce does"
        )
    if grad_codec.lossless:
        return None, True, (
            f"param_codec defaulted to FSDP's own all-gather because codec {grad_codec.name!r} does not compress "
            "(exact or a cast); pass param_codec='int8' (or {'forward': 'int8', 'backward': 'reuse'}) to compress it"
        )
    return dict(COMPRESSING_DEFAULT), True, (
        f"param_codec defaulted to int8/reuse because codec {grad_codec.name!r} compresses; "
        "pass param_codec='none' for gradient-only"
    )


def _one_codec(value: Any, what: str) -> Codec:
    if value is None:
        return codecs.get("none")
    if isinstance(value, str):
        codec = codecs.from_spec(value)
    elif isinstance(value, Codec):
        codec = value
    else:
        raise CodecError(
            f"{what} must be None, a codec name or spec ('int8', 'int4:block_size=128') or a commpress Codec, "
            f"got {type(value).__name__}"
        )
    if not codec.fixed_size:
        raise CodecError(f"{what}: {codec!r} makes packets of data-dependent size; the all-gather needs fixed-size ones")
    if codec.sparse:
        raise CodecError(
            f"{what}: {codec!r} sends a subset of the elements, which would zero most parameters; "
            "use a quantizer or cast (int8, int4, bf16, fp16)"
        )
    return codec


def resolve_param_codec(param_codec: Any) -> tuple[dict[str, Codec], bool] | None:
    """``param_codec`` option -> ``({"forward": codec, "backward": codec}, reuse)``, or None (FSDP's own).

    Accepts None, a codec name or spec string, a :class:`Codec`, or a mapping with the keys
    ``forward`` and ``backward`` (each any of those; None there means ``"none"``, FSDP's own
    all-gather with its bytes counted). ``"backward": "reuse"`` (:data:`REUSE`) keeps the
    forward's gathered frames for the backward (``reuse`` True; the backward codec is then the
    forward's, used only when no kept frame is there). Raises :class:`CodecError` naming the bad value.
    :data:`DEFAULT` must be resolved first (:func:`default_param_codec`: it depends on the gradient codec).
    """
    if param_codec is DEFAULT:
        raise CodecError("param_codec=DEFAULT depends on the gradient codec: resolve it with default_param_codec first")
    if param_codec is None:
        return None
    if isinstance(param_codec, Mapping):
        if set(param_codec) != set(DIRECTIONS):
            raise CodecError(f"param_codec as a mapping needs exactly the keys 'forward' and 'backward', got {sorted(param_codec)}")
        forward = _one_codec(param_codec["forward"], "param_codec['forward']")
        if param_codec["backward"] == REUSE:
            if isinstance(forward, NoneCodec):
                raise CodecError(
                    "param_codec: 'backward': 'reuse' keeps the forward's compressed frames; with an exact forward "
                    "all-gather that is FSDP's reshard_after_forward=False: use that instead"
                )
            return {"forward": forward, "backward": forward}, True
        return {"forward": forward, "backward": _one_codec(param_codec["backward"], "param_codec['backward']")}, False
    if param_codec == REUSE:
        raise CodecError("param_codec: 'reuse' is for the backward only: {'forward': 'int8', 'backward': 'reuse'}")
    codec = _one_codec(param_codec, "param_codec")
    return dict.fromkeys(DIRECTIONS, codec), False


@dataclass
class AllGatherPlan:
    """One FSDP module's all-gather: its parameters' names, padded shard numels, compressed flags.

    ``calls`` counts its all-gathers per direction (``forward``, ``backward``), as errors name them.
    """

    name: str
    names: list[str]
    numels: list[int]
    compressed: list[bool]
    world_size: int
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    layouts: dict[tuple[str, torch.dtype], FrameLayout] = field(default_factory=dict)
    #: FSDP's parameter group (is it resharded after forward?)
    param_group: Any = None
    #: with ``"backward": "reuse"``: the forward's validated packets of every rank (views into
    #: its receive buffer) and their byte count, until the backward decodes them
    kept: tuple[FrameLayout, list[list[Any]], int] | None = None
    #: this module's own codecs and reuse (``codec="auto"`` chooses per module); None: the owner's
    codecs: dict[str, Codec] | None = None
    reuse: bool | None = None

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's flat shard (padded)."""
        return sum(self.numels)


def frame_layout(plan: AllGatherPlan, codec: Codec, dtype: torch.dtype) -> FrameLayout:
    """One rank's all-gather frame: a packet per quantised parameter, then one for the exact ones.

    The exact parameters (biases, norms: many small tensors) travel as one ``none`` packet, so a
    block's frame has a handful of packets instead of one per tensor (each costs a header
    written, parsed and checked per rank). Its ``nbytes`` is what a rank hands the all-gather.
    """
    entries: list[tuple[Any, Codec, int]] = [(n, codec, k) for n, k, c in zip(plan.names, plan.numels, plan.compressed)
                                             if c]
    exact = sum(k for k, c in zip(plan.numels, plan.compressed) if not c)
    if exact:
        entries.append(("exact parameters", codecs.get("none"), exact))
    return FrameLayout(entries, dtype, flags=False, what="all-gather frame", entry="parameter")


class CompressedAllGather:
    """The comm object FSDP2 calls instead of its all-gather (one per FSDP module).

    Implements FSDP's ``AllGather`` protocol (``allocate`` and ``__call__(output_tensor,
    input_tensor, group, async_op)``) by duck typing; the work is done by :class:`ParamAllGather`.
    """

    def __init__(self, owner: ParamAllGather, plan: AllGatherPlan) -> None:
        self.owner = owner
        self.plan = plan

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain tensor (like FSDP's default allocator)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        """Gather every rank's shard into ``output_tensor`` (done when it returns; returns None)."""
        return self.owner.gather(self.plan, output_tensor, input_tensor, group)

    def __repr__(self) -> str:
        return f"CompressedAllGather({self.plan.name!r}, {self.owner.codecs_of(self.plan)[0]!r})"


class ParamAllGather:
    """The parameter all-gather of one FSDP2 model on one rank: codecs, plans, byte counters.

    Built by :class:`~commpress.fsdp.FSDPCompressionState` from its ``param_codec`` option
    (:func:`resolve_param_codec`); :meth:`install` puts a :class:`CompressedAllGather` on every
    FSDP module. ``rule(name, parameter)`` says which parameters are quantised (the state's
    selection rule: small and 1-D ones are gathered exactly).
    """

    STAT_KEYS = (
        "allgather_calls", "allgather_forward_calls", "allgather_backward_calls", "allgather_bytes_sent",
        "allgather_forward_bytes_sent", "allgather_backward_bytes_sent",
        "allgather_bytes_wire", "allgather_dense_bytes", "allgather_dense_wire", "allgather_encode_s",
        "allgather_decode_s", "allgather_wait_s", "allgather_kept_peak_bytes",
    )

    def __init__(self, model: torch.nn.Module, codecs_by_direction: dict[str, Codec],
                 rule: Callable[[str, torch.nn.Parameter], bool], faults: FaultChannel, reuse: bool = False) -> None:
        self.codecs = codecs_by_direction
        self.reuse = reuse
        self.faults = faults
        self._training = True  # set before every forward of the root (a no_grad forward has no backward)
        self._kept_bytes = 0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(self.STAT_KEYS, 0.0)
        self.plans = self._plan(model, rule)

    def _plan(self, model: torch.nn.Module, rule: Callable[[str, torch.nn.Parameter], bool]) -> dict[str, AllGatherPlan]:
        names = {id(p): n for n, p in model.named_parameters()}
        plans: dict[str, AllGatherPlan] = {}
        for label, module in ((n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if not groups:
                continue
            group = groups[0]  # the state refused several groups already
            pnames, numels, compressed = [], [], []
            for fp in group.fsdp_params:
                p = fp.sharded_param
                name = names[id(p)]
                pnames.append(name)
                numels.append(math.prod(fp.padded_sharded_param_size))
                compressed.append(p.numel() > 0 and bool(rule(name, p)))
            size = dist.get_world_size(getattr(group.mesh_info, "shard_process_group"))
            plans[label] = AllGatherPlan(label, pnames, numels, compressed, size, param_group=group)
        return plans

    def install(self, model: torch.nn.Module) -> None:
        """``set_custom_all_gather`` on every FSDP module of ``model`` that has parameters."""
        for label, module in ((n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)):
            if label in self.plans:
                module.set_custom_all_gather(CompressedAllGather(self, self.plans[label]))  # type: ignore[arg-type]
        if self.reuse or any(p.reuse for p in self.plans.values()):
            # before FSDP's own pre-forward (prepend): FSDP all-gathers under no_grad, so whether a
            # backward will follow is only visible at the root's entry
            model.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._training = torch.is_grad_enabled()

    def config(self) -> dict[str, Any]:
        """What all ranks must agree on (plain types)."""
        own = {label: [{d: c.config() for d, c in p.codecs.items()}, bool(p.reuse)]
               for label, p in self.plans.items() if p.codecs is not None}
        return {**{d: c.config() for d, c in self.codecs.items()}, **({"reuse": True} if self.reuse else {}),
                **({"modules": own} if own else {})}

    # ----- the all-gather ---------------------------------------------------------------------
    @staticmethod
    def direction() -> str:
        """``"backward"`` inside the autograd engine (FSDP's pre-backward all-gather), else ``"forward"``."""
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def codecs_of(self, plan: AllGatherPlan) -> tuple[dict[str, Codec], bool]:
        """The codecs by direction and the reuse flag of ``plan``'s module (its own, else the model's)."""
        return (plan.codecs or self.codecs), (self.reuse if plan.reuse is None else plan.reuse)

    def set_module(self, label: str, codecs_by_direction: dict[str, Codec], reuse: bool) -> None:
        """Give the module ``label`` its own codecs (between steps: its cached frames and kept packets go)."""
        plan = self.plans[label]
        if plan.kept is not None:
            self._kept_bytes -= plan.kept[2]
        plan.codecs, plan.reuse, plan.layouts, plan.kept = dict(codecs_by_direction), reuse, {}, None

    def _layout(self, plan: AllGatherPlan, direction: str, dtype: torch.dtype) -> FrameLayout:
        """The frame of ``plan``'s direction (:func:`frame_layout`), cached per direction and dtype."""
        key = (direction, dtype)
        layout = plan.layouts.get(key)
        if layout is None:
            layout = plan.layouts[key] = frame_layout(plan, self.codecs_of(plan)[0][direction], dtype)
        return layout

    @staticmethod
    def _pieces(plan: AllGatherPlan, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``flat`` (one rank's shard) cut into the quantised parameters' pieces and the exact ones'."""
        quantised: list[torch.Tensor] = []
        exact: list[torch.Tensor] = []
        off = 0
        for k, c in zip(plan.numels, plan.compressed):
            (quantised if c else exact).append(flat[off : off + k])
            off += k
        return quantised, exact

    def _check(self, plan: AllGatherPlan, output: torch.Tensor, input: torch.Tensor, n: int) -> None:
        if input.dtype == torch.uint8:
            raise ConfigurationError(
                f"module {plan.name!r}: FSDP all-gathers raw uint8 bytes (its all-gather inputs have different "
                "dtypes: a tensor subclass, e.g. float8 weights, defines fsdp_pre_all_gather); param_codec needs one "
                "floating dtype per module: use param_codec=None for this model"
            )
        if input.dtype not in FLOAT_DTYPES:
            raise ConfigurationError(f"module {plan.name!r}: param_codec cannot all-gather {input.dtype} parameters")
        if n != plan.world_size:
            raise ConfigurationError(
                f"module {plan.name!r}: all-gather over {n} ranks, planned for {plan.world_size} "
                "(fully_shard(reshard_after_forward=<int>) reshards to a smaller group after forward: "
                "param_codec supports reshard_after_forward True or False)"
            )
        if input.numel() != plan.shard_numel or output.numel() != n * plan.shard_numel:
            raise ConfigurationError(
                f"module {plan.name!r}: FSDP all-gathers {input.numel()} elements per rank into {output.numel()}, "
                f"its parameters' padded shards make {plan.shard_numel} (x {n})"
            )
        if not (output.is_contiguous() and input.is_contiguous()):
            raise ConfigurationError(f"module {plan.name!r}: the all-gather buffers must be contiguous")

    def gather(self, plan: AllGatherPlan, output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        """One module's all-gather (called by FSDP through :class:`CompressedAllGather`)."""
        n = dist.get_world_size(group)
        direction = self.direction()
        by_direction, reuse = self.codecs_of(plan)
        codec = by_direction[direction]
        dense_bytes = input.numel() * input.element_size()
        where = f"module {plan.name!r}, {direction} all-gather {plan.calls[direction]}"
        if isinstance(codec, NoneCodec):  # FSDP's own collective, as DefaultAllGather issues it
            t0 = time.perf_counter()
            with self.faults.guarded(where):
                wait(dist.all_gather_single(output, input, group=group, async_op=True), output.device)
            self._count(direction, dense_bytes, dense_bytes, n, wait_s=time.perf_counter() - t0)
            plan.calls[direction] += 1
            return
        self._check(plan, output, input, n)
        kept, plan.kept = plan.kept, None  # a forward replaces it; a backward uses it once
        if kept is not None:
            self._kept_bytes -= kept[2]
        layout = self._layout(plan, "forward" if reuse else direction, input.dtype)  # reuse: one codec
        if direction == "backward" and kept is not None and kept[0] is layout:
            t0 = time.perf_counter()  # the forward's frames, validated when they arrived: no collective
            with self.faults.guarded(where):
                self._decode(layout, plan, kept[1], output)
            self._count(direction, 0, dense_bytes, n, decode_s=time.perf_counter() - t0)
            plan.calls[direction] += 1
            return
        with self.faults.guarded(where):
            t0 = time.perf_counter()
            quantised, exact = self._pieces(plan, input.view(-1))
            packets = []
            for c, piece, name in zip(layout.codecs, quantised, layout.keys):
                try:
                    packets.append(c.encode(piece))  # type: ignore[attr-defined]
                except NonFiniteError:
                    raise NonFiniteError(
                        f"parameter {name!r}: this rank's shard contains NaN or Inf, which {c.name} cannot encode"
                    ) from None
            if exact:
                try:
                    packets.append(layout.codecs[-1].encode(torch.cat(exact)))  # type: ignore[attr-defined]
                except NonFiniteError:
                    names = [n for n, c in zip(plan.names, plan.compressed) if not c]
                    raise NonFiniteError(
                        f"this rank's shard of the exact parameters {names} contains NaN or Inf"
                    ) from None
            send = layout.pack(packets, device=input.device)
            recv = torch.empty(n * layout.nbytes, dtype=torch.uint8, device=input.device)
            t1 = time.perf_counter()
            wait(dist.all_gather_single(recv, send, group=group, async_op=True), input.device)
            t2 = time.perf_counter()
            me = dist.get_rank(group)  # its own packets need no parsing: they are what it sent
            got = [packets if j == me else layout.unpack(recv[j * layout.nbytes : (j + 1) * layout.nbytes], source=j)
                   for j in range(n)]
            self._decode(layout, plan, got, output)
            t3 = time.perf_counter()
        if reuse and direction == "forward" and self._training and plan.param_group._reshard_after_forward:
            plan.kept = (layout, got, recv.numel())
            self._kept_bytes += recv.numel()
            with self._lock:
                self._stats["allgather_kept_peak_bytes"] = max(self._stats["allgather_kept_peak_bytes"],
                                                               self._kept_bytes)
        self._count(direction, layout.nbytes, dense_bytes, n, encode_s=t1 - t0, wait_s=t2 - t1, decode_s=t3 - t2)
        plan.calls[direction] += 1

    def _decode(self, layout: FrameLayout, plan: AllGatherPlan, got: list[list[Any]], output: torch.Tensor) -> None:
        """Every rank's validated packets into ``output`` (rank ``j``'s shard at ``j * shard_numel``)."""
        out = output.view(-1)
        for j, packets in enumerate(got):
            quantised, exact = self._pieces(plan, out[j * plan.shard_numel : (j + 1) * plan.shard_numel])
            for c, piece, p in zip(layout.codecs, quantised, packets):
                c.decode(p, out=piece)  # type: ignore[attr-defined]
            if exact:  # the last packet: the exact parameters, concatenated
                torch.split_with_sizes_copy(packets[-1].sections["values"], [t.numel() for t in exact], out=exact)

    # ----- statistics -------------------------------------------------------------------------
    def _count(self, direction: str, sent: int, dense: int, n: int, *, encode_s: float = 0.0, decode_s: float = 0.0,
               wait_s: float = 0.0) -> None:
        with self._lock:
            s = self._stats
            s["allgather_calls"] += 1
            s[f"allgather_{direction}_calls"] += 1
            s["allgather_bytes_sent"] += sent
            s[f"allgather_{direction}_bytes_sent"] += sent
            s["allgather_bytes_wire"] += (n - 1) * sent
            s["allgather_dense_bytes"] += dense
            s["allgather_dense_wire"] += (n - 1) * dense
            s["allgather_encode_s"] += encode_s
            s["allgather_decode_s"] += decode_s
            s["allgather_wait_s"] += wait_s

    def stats(self) -> dict[str, float]:
        """All-gather counters of this rank, next to what FSDP's own all-gather would move.

        ``allgather_bytes_sent``: bytes this rank handed to the all-gathers (its encoded frames);
        ``allgather_bytes_wire``: what a ring all-gather then sends per rank, ``(n-1)`` times
        that; ``allgather_dense_bytes`` / ``allgather_dense_wire``: the same for FSDP's own
        all-gather of the shard in its dtype; ``allgather_compression_ratio``: dense / sent.
        Forward and backward all-gathers both count (``allgather_calls``, split in
        ``allgather_forward_calls`` / ``allgather_backward_calls``, and the bytes in
        ``allgather_forward_bytes_sent`` / ``allgather_backward_bytes_sent``: zero for a backward
        that reuses the forward's frames). ``allgather_kept_peak_bytes``: the most bytes of
        forward frames kept for the backward at once (``"backward": "reuse"``; since the last reset).
        """
        with self._lock:
            s = dict(self._stats)
        s["allgather_compression_ratio"] = (
            s["allgather_dense_bytes"] / s["allgather_bytes_sent"] if s["allgather_bytes_sent"] else 1.0
        )
        return s

    def reset_stats(self) -> None:
        """Zero the counters (call counts in the plans are kept; the kept-frames peak restarts from now)."""
        with self._lock:
            self._stats = dict.fromkeys(self.STAT_KEYS, 0.0)
            self._stats["allgather_kept_peak_bytes"] = self._kept_bytes
