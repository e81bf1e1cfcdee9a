"""``FSDPCompressionState``: the compressed reduce-scatter installed on every FSDP2 module.

Owns the per-module plans, the bfloat16 residual working set, ``residual_dtype`` and the
checkpoint form; option checks shared with DDP come from :mod:`commpress.options`, the
collective and its fault channel from :mod:`commpress.comm`.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters one flat gradient per module:
``n`` chunks, chunk ``j`` holding rank ``j``'s (dim-0 padded) shard of each of the module's
parameters in order. :meth:`FSDPModule.set_custom_reduce_scatter` lets a comm object replace
that collective; this module installs one per FSDP module that runs
the ``reducescatter`` algorithm (:mod:`commpress.comm.reducescatter`) on the driver, inside
the group's fault channel (``none`` runs FSDP's own ``reduce_scatter_single``: FSDP bit for bit).

**Error-feedback memory per rank** (``d`` = parameters, ``n`` ranks). A rank compresses the
``n-1`` chunks it sends, so a biased codec's residuals cover ``(n-1)/n`` of the unsharded
gradient: ``4 (n-1)/n d`` bytes in float32, as much as an unsharded gradient -- what sharding
saved. Measured choices (see ``docs/benchmarks.md``):

- unbiased codecs (``qsgd``, scaled ``randomk``) keep no residuals by default: 0 bytes;
- ``residual_dtype=torch.bfloat16`` halves the residuals (``2 (n-1)/n d`` bytes); the float32
  working copy exists only for one module during its reduce-scatter;
- an owner-side residual cannot replace them: the error is made by the sender's encoder, and
  the owner only ever sees its decode.

The rank's own chunk is never compressed (added exactly), so it needs no residual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import checkpoint, codecs, comm
from .. import options as opts
from ..checks import check_loaded_tensor
from ..codecs import Codec, NoneCodec
from ..comm import CommStats, Slot, piece_key, resolve_codec
from ..comm.agreement import check_same_config
from ..comm.faults import FaultChannel
from ..errors import CodecError, ConfigurationError
from ..feedback import ErrorFeedback, check_state_header
from ..rng import derive_seed
from ..selection import DEFAULT_MIN_NUMEL, CompressFilter, SelectionRule
from .allgather import ParamAllGather, resolve_param_codec

STATE_FORMAT = 1
VERIFY_TIMEOUT_S = 60

#: Residual dtypes on offer: float32 (exact error feedback) or bfloat16 (half the memory).
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class ShardPlan:
    """One parameter of an FSDP module: name, index, global shape, numel per chunk, compressed."""

    name: str
    index: int
    shape: tuple[int, ...]
    chunk_numel: int
    compressed: bool


@dataclass
class ModulePlan:
    """One FSDP module's reduce-scatter: its parameters in FSDP's order and its call count."""

    name: str
    params: list[ShardPlan]
    world_size: int
    calls: int = 0

    @property
    def chunk_numel(self) -> int:
        """Elements of one chunk (one rank's shard of every parameter, padded)."""
        return sum(p.chunk_numel for p in self.params)


class CompressedReduceScatter:
    """The comm object FSDP2 calls instead of its reduce-scatter (one per FSDP module).

    Implements FSDP's ``ReduceScatter`` protocol (``allocate`` and ``__call__(output_tensor,
    input_tensor, group, op, async_op)``) by duck typing; the work is done by its state.
    """

    def __init__(self, state: FSDPCompressionState, plan: ModulePlan) -> None:
        self.state = state
        self.plan = plan

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain tensor (like FSDP's default allocator)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (done when it returns)."""
        return self.state.reduce(self.plan, output_tensor, input_tensor, group, op, async_op)

    def __repr__(self) -> str:
        return f"CompressedReduceScatter({self.plan.name!r}, {self.state.codec!r})"


class FSDPCompressionState(checkpoint.StateFile):
    """State of commpress's reduce-scatter on an FSDP2 model (one per model and rank).

    Args:
        model: the root module after ``fully_shard`` (it, or modules inside it, are
            ``FSDPModule`` s); every FSDP module inside gets a :class:`CompressedReduceScatter`.
        codec: a codec name or a :class:`commpress.codecs.Codec` (fixed-size).
        error_feedback: keep residuals of what compression dropped; ``None`` (default): on for
            the biased codecs (topk, sign, unscaled randomk), off for the unbiased ones (qsgd,
            scaled randomk) and never for none/fp16/bf16.
        residual_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` (half the memory).
        min_numel, dense_1d, compress_filter: which parameters are compressed (the DDP rule:
            ``commpress.selection.SelectionRule`` on the full parameter shape).
        seed: base of every derived seed; torch's global RNG is never used.
        verify: compare a digest of the configuration across ranks at construction (through the
            process group's store, as DDP's ``register`` does) so ranks set up
            differently fail with :class:`ConfigurationError` instead of hanging.
        param_codec: the parameter all-gather (:mod:`commpress.fsdp.allgather`): ``None``
            (default) leaves FSDP's own untouched; ``"int8"`` / ``"int4"`` (block-scaled, any
            ``"int8:block_size=128"`` spec, or a fixed-size non-sparse :class:`Codec`) quantises
            the gathered copy of the parameters the selection rule compresses (the sharded
            parameters stay exact); ``"none"`` is FSDP's own all-gather with its bytes counted;
            ``{"forward": ..., "backward": ...}`` chooses per direction.
        **codec_params: codec parameters when ``codec`` is a name.
    """

    file_what = "commpress FSDP state"
    __slots__ = (
        "codec", "error_feedback", "residual_dtype", "seed", "world_size", "rank", "modules",
        "feedback", "_low", "_stats", "_rule", "_group", "faults", "allgather",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        codec: str | Codec,
        *,
        error_feedback: bool | None = None,
        residual_dtype: torch.dtype = torch.float32,
        min_numel: int = DEFAULT_MIN_NUMEL,
        dense_1d: bool = True,
        compress_filter: CompressFilter | None = None,
        seed: int = 0,
        verify: bool = True,
        verify_timeout: float = VERIFY_TIMEOUT_S,
        param_codec: Any = None,
        **codec_params: Any,
    ) -> None:
        self.codec = resolve_codec(codec, codec_params, "the all_to_all")
        param_codecs = resolve_param_codec(param_codec)
        error_feedback = opts.error_feedback_default(error_feedback, self.codec)
        opts.check_bools(error_feedback=error_feedback, dense_1d=dense_1d, verify=verify)
        assert isinstance(error_feedback, bool)
        if residual_dtype not in RESIDUAL_DTYPES:
            raise CodecError(f"residual_dtype must be torch.float32 or torch.bfloat16, got {residual_dtype!r}")
        self.seed = opts.check_seed(seed)
        if compress_filter is not None and not callable(compress_filter):
            raise CodecError(f"compress_filter must be callable(name, parameter) -> bool, got {compress_filter!r}")
        try:
            rule = SelectionRule(min_numel, dense_1d)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
        self._rule: CompressFilter = compress_filter or (lambda name, p: rule(name, tuple(p.shape), p.numel()))
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module after fully_shard, got {type(model).__name__}")
        opts.require_process_group()
        self.error_feedback = error_feedback
        self.residual_dtype = residual_dtype
        self._stats = CommStats()
        self._group: Any = None
        self.modules = self._plan(model)
        self.world_size = self.modules[0].world_size
        self.rank = dist.get_rank(self._group)
        self.faults = FaultChannel.of(self._group)  # one rank's failure is every rank's error
        opts.warn_unbiased_feedback(error_feedback, self.codec)
        self.feedback = self._new_feedback()
        self._low: dict[str, torch.Tensor] = {}  # bfloat16 residuals between steps
        self.allgather = None if param_codecs is None else ParamAllGather(model, param_codecs, self._rule, self.faults)
        if verify:
            self._verify_ranks(opts.check_timeout(verify_timeout))
        modules = {n or "<root>": m for n, m in model.named_modules() if isinstance(m, FSDPModule)}
        for plan in self.modules:  # a module without parameters of its own has no plan
            modules[plan.name].set_custom_reduce_scatter(CompressedReduceScatter(self, plan))  # type: ignore[arg-type]
        if self.allgather is not None:
            self.allgather.install(model)

    # ----- planning --------------------------------------------------------------------------
    def _plan(self, model: torch.nn.Module) -> list[ModulePlan]:
        """One plan per FSDP module, from FSDP's parameter groups (the flat gradient's layout)."""
        names = {id(p): n for n, p in model.named_parameters()}
        index = {n: i for i, n in enumerate(names.values())}
        module_names = {id(m): n for n, m in model.named_modules()}
        plans = []
        for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
            label = module_names[id(module)] or "<root>"
            groups = module._get_fsdp_state()._fsdp_param_groups
            if len(groups) > 1:
                raise ConfigurationError(f"FSDP module {label!r} has several parameter groups; commpress supports one")
            if not groups:
                continue
            group = groups[0]
            mesh = getattr(group.mesh_info, "shard_process_group", None)
            if mesh is None:
                raise ConfigurationError(f"FSDP module {label!r} does not shard (a replicate-only mesh)")
            if self._group is None:
                self._group = mesh
            elif dist.get_world_size(mesh) != dist.get_world_size(self._group):
                raise ConfigurationError("FSDP modules shard over groups of different sizes")
            params = []
            for fp in group.fsdp_params:
                p = fp.sharded_param
                name = names.get(id(p))
                if name is None:
                    raise ConfigurationError(f"FSDP module {label!r} holds a parameter that the model does not name")
                compressed = not isinstance(self.codec, NoneCodec) and p.numel() > 0 and bool(self._rule(name, p))
                chunk = math.prod(fp.padded_sharded_param_size)
                if compressed:
                    try:
                        self.codec.wire_size(chunk, p.dtype)
                        self.codec.wire_params(chunk)
                    except CodecError as exc:
                        raise CodecError(f"cannot compress {name!r} (shards of {chunk} elements): {exc}") from None
                params.append(ShardPlan(name, index[name], tuple(p.shape), chunk, compressed))
            plans.append(ModulePlan(label, params, dist.get_world_size(mesh)))
        if not plans:
            raise ConfigurationError(
                f"{type(model).__name__} holds no FSDP module: call fully_shard on it before commpress.fsdp.register"
            )
        return plans

    @property
    def uses_feedback(self) -> bool:
        """True when residuals are kept (error feedback on, and a codec that drops something)."""
        return self.error_feedback and not self.codec.lossless

    def residual_shapes(self) -> dict[str, tuple[int]]:
        """Key -> shape of every residual this rank keeps (the chunks it sends, not its own)."""
        if not self.uses_feedback:
            return {}
        return {
            piece_key(p.name, j): (p.chunk_numel,)
            for plan in self.modules for p in plan.params if p.compressed
            for j in range(self.world_size) if j != self.rank
        }

    def _new_feedback(self) -> ErrorFeedback | None:
        return ErrorFeedback(self.codec, self.residual_shapes()) if self.uses_feedback else None

    def config(self) -> dict[str, Any]:
        """Everything all ranks must agree on (plain types)."""
        return {
            "codec": self.codec.config(),
            "error_feedback": self.error_feedback,
            "residual_dtype": str(self.residual_dtype),
            "seed": self.seed,
            "world_size": self.world_size,
            "modules": [[m.name, [[p.name, list(p.shape), p.chunk_numel, p.compressed] for p in m.params]]
                        for m in self.modules],
            **({} if self.allgather is None else {"param_codec": self.allgather.config()}),
        }

    def _verify_ranks(self, timeout_s: float) -> None:
        """Fail on every rank, never hang, when ranks register differently or not at all."""
        summary = f"{self.codec!r}, residual_dtype={self.residual_dtype}, {len(self.modules)} FSDP modules"
        check_same_config(self.config(), summary=summary, group=self._group, timeout_s=timeout_s,
                          what="commpress.fsdp.register")

    # ----- the reduce-scatter ------------------------------------------------------------------
    def reduce(
        self, plan: ModulePlan, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool
    ) -> Any:
        """One module's reduce-scatter (called by FSDP through :class:`CompressedReduceScatter`)."""
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ConfigurationError(
                f"commpress reduce-scatter supports FSDP's AVG and SUM reductions, not {op!r} "
                "(set_gradient_divide_factor makes FSDP pass a pre-multiplied sum)"
            )
        average = op == dist.ReduceOp.AVG
        n = dist.get_world_size(group)
        if n != plan.world_size:
            raise ConfigurationError(f"module {plan.name!r}: reduce-scatter over {n} ranks, planned for {plan.world_size}")
        if isinstance(self.codec, NoneCodec):  # FSDP's own reduce-scatter, through the driver (its accounting)
            chunk = output.numel()
            slots = [Slot(f"{plan.name}#{j}", j * chunk, (chunk,), self.codec) for j in range(n)]
        elif input.numel() != n * plan.chunk_numel:
            raise ConfigurationError(
                f"module {plan.name!r}: FSDP reduce-scatters {input.numel()} elements, its parameters make "
                f"{n * plan.chunk_numel}; a parameter got no gradient this step: call "
                "module.set_reduce_scatter_unused_params(True) so FSDP always sends every parameter"
            )
        else:
            slots = self._slots(plan, n)
        working_set = self.feedback is not None and self.residual_dtype != torch.float32
        # a failure here is every rank's error; a rank waiting on a failed peer raises, never hangs
        with self.faults.guarded(f"module {plan.name!r}, reduce-scatter {plan.calls}"):
            if working_set:
                self._load_working_set(slots)
            algorithm = "reducescatter-dense" if isinstance(self.codec, NoneCodec) else "reducescatter"
            fut = comm.run(algorithm, input.view(-1), slots, group=group, stats=self._stats,
                           output=output.view(-1), average=average)
            fut.wait()
            if working_set:
                self._store_working_set(slots)
        plan.calls += 1
        if async_op:
            return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]
        return None

    def _slots(self, plan: ModulePlan, n: int) -> list[Slot]:
        dense = codecs.get("none")
        slots = []
        off = 0
        for j in range(n):
            for p in plan.params:
                seed = derive_seed(self.seed, plan.calls, p.index)
                fb = self.feedback if p.compressed and j != self.rank else None
                slots.append(Slot(piece_key(p.name, j), off, (p.chunk_numel,), self.codec if p.compressed else dense,
                                  seed, fb))
                off += p.chunk_numel
        return slots

    def _load_working_set(self, slots: Sequence[Slot]) -> None:
        """bfloat16 residuals -> float32 working copies for this module's step only."""
        assert self.feedback is not None
        for s in slots:
            low = self._low.get(s.key) if s.feedback is not None else None
            if low is not None:
                self.feedback.set_residual(s.key, low.float())

    def _store_working_set(self, slots: Sequence[Slot]) -> None:
        """float32 working copies -> bfloat16 residuals (rounded to nearest); the copies are freed."""
        assert self.feedback is not None
        for s in slots:
            if s.feedback is None:
                continue
            e = self.feedback.residual(s.key)
            if e is not None:
                low = self._low.get(s.key)
                if low is None:
                    self._low[s.key] = e.to(self.residual_dtype)
                else:
                    low.copy_(e)
            self.feedback.reset(s.key)

    # ----- memory and statistics --------------------------------------------------------------
    def residuals(self) -> dict[str, torch.Tensor]:
        """Every residual this rank keeps between steps, by key (live tensors; clone to keep)."""
        if self.feedback is None:
            return {}
        if self.residual_dtype != torch.float32:
            return dict(self._low)
        return {k: e for k in self.feedback.keys() if (e := self.feedback.residual(k)) is not None}

    def residual_bytes(self) -> int:
        """Bytes of error-feedback memory this rank keeps between steps."""
        return sum(e.numel() * e.element_size() for e in self.residuals().values())

    @property
    def counters(self) -> CommStats:
        """The raw thread-safe counters."""
        return self._stats

    def stats(self) -> dict[str, float]:
        """Steps, bytes handed to collectives vs FSDP's reduce-scatter, ratios, time, residual bytes.

        ``dense_bytes`` (= ``dense_wire``): what FSDP's own ring reduce-scatter sends per rank,
        ``(n-1)/n`` of its input; ``bytes_sent`` (= ``bytes_wire``): what the all_to_all sends
        to other ranks. ``*_per_step``: divided by the most reduce-scatters of one module.
        With ``param_codec``, the ``allgather_*`` keys of :meth:`ParamAllGather.stats` too.
        """
        s: dict[str, float] = dict(self._stats.as_dict())
        steps = max((m.calls for m in self.modules), default=0)
        s["steps"] = steps
        opts.ratio_stats(s, steps)
        s["residual_bytes"] = self.residual_bytes()
        if self.allgather is not None:  # the parameter all-gather's counters (commpress.fsdp.allgather)
            s.update(self.allgather.stats())
        return s

    def reset_stats(self) -> None:
        """Zero the counters (call counts are state, they are kept)."""
        self._stats.reset()
        if self.allgather is not None:
            self.allgather.reset_stats()

    # ----- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals, per-module call counts, codec and options; this rank's only (plain types).

        Residuals differ per rank: save one file per rank (``torch.save``; loads with
        ``weights_only=True``).
        """
        return {
            "format": STATE_FORMAT,
            "codec": self.codec.config(),
            "error_feedback": self.error_feedback,
            "residual_dtype": str(self.residual_dtype),
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "calls": {m.name: m.calls for m in self.modules},
            "residuals": {k: v.detach().clone() for k, v in self.residuals().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output after validating all of it (all or nothing)."""
        required = {"error_feedback", "residual_dtype", "world_size", "rank", "seed", "calls", "residuals"}
        check_state_header(state, required=required, fmt=STATE_FORMAT, codec=self.codec, what="commpress FSDP state")
        for what, mine in (("world_size", self.world_size), ("rank", self.rank),
                           ("error_feedback", self.error_feedback), ("residual_dtype", str(self.residual_dtype))):
            if state[what] != mine:
                raise ValueError(
                    f"{what} mismatch: checkpoint has {state[what]!r}, this state {mine!r} "
                    "(residuals are per rank: save and load one commpress state per rank)"
                )
        seed = opts.check_saved_seed(state)
        calls = dict(state["calls"])
        if sorted(calls) != sorted(m.name for m in self.modules) or not all(
            isinstance(c, int) and c >= 0 for c in calls.values()
        ):
            raise ValueError(f"calls {calls!r} do not match this model's FSDP modules {[m.name for m in self.modules]}")
        shapes = self.residual_shapes()
        residuals = dict(state["residuals"])
        for key, value in residuals.items():
            if key not in shapes:
                raise ValueError(f"residual {key!r} is not one this rank keeps")
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes[key]:
                raise ValueError(f"residual {key!r} must be a tensor of shape {shapes[key]}")
            check_loaded_tensor(value, f"residual {key!r}", dtypes=(self.residual_dtype,))
        self.feedback = self._new_feedback()
        self._low = {}
        for key, value in residuals.items():
            if self.residual_dtype == torch.float32:
                assert self.feedback is not None
                self.feedback.set_residual(key, value.detach().clone())
            else:
                self._low[key] = value.detach().clone()
        for m in self.modules:
            m.calls = int(calls[m.name])
        self.seed = seed

    def __repr__(self) -> str:
        return (
            f"FSDPCompressionState(codec={self.codec!r}, error_feedback={self.error_feedback}, "
            f"residual_dtype={self.residual_dtype}, rank={self.rank}/{self.world_size}, modules={len(self.modules)})"
        )
