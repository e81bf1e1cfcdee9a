"""``CompressionState``: what the DDP hook keeps between steps (plans, residuals, the optimizer modes it composes), and its checkpoint form."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from .. import options as opts
from ..codecs import Codec
from ..codecs.base import all_finite
from ..comm import Algorithm, CommStats, Hierarchical, check_algorithm, topology
from ..comm.agreement import check_same_config
from ..comm.faults import FaultChannel
from ..errors import CodecError, ConfigurationError
from ..feedback import ErrorFeedback, residual_dtype
from ..optim import (
    DISCOVER,
    DivergenceGuard,
    FrozenVarianceAdam,
    MomentumCorrection,
    MomentumRule,
    OptimizerDiscovery,
    OptimizerMode,
    SGDHandover,
    Warmup,
    adopt_adam,
    momentum_as_gain,
    optimizer_mode,
)
from ..rng import derive_seed
from ..statslog import LogsStats, StatsLogger
from .auto import AutoInputs, AutoPolicy
from .checkpointing import DDPCheckpoint
from .planning import (
    BucketPlan,
    CompressFilter,
    ParamPlan,
    plan_bucket,
    plan_parameters,
)
from .residuals import ParamResiduals

#: How long registration waits for every rank to register too (gloo), before failing.
VERIFY_TIMEOUT_S = 60
logger = logging.getLogger("commpress")


class CompressionState(DDPCheckpoint, LogsStats):
    """State of the commpress DDP communication hook (one per DDP model and rank).

    Args:
        model: the ``DistributedDataParallel`` model (or its wrapped module) whose gradients
            the hook reduces; parameter names come from ``module.named_parameters()``.
        codec: a codec name (``"topk"``, ``"sign"``, ...) or a :class:`commpress.codecs.Codec`;
            ``"auto"`` chooses per bucket between dense, fp16 and a compressing candidate
            (``auto_codec``: by default top-k 1% or 1-bit sign, whichever sends fewer bytes at
            this world size, when the hook owns the momentum, passed as ``optimizer=`` or
            ``momentum=``; QSGD otherwise; with its codec parameters) from a calibrated cost
            model (:mod:`commpress.ddp.auto`, options ``auto_codec``, ``auto_interval``,
            ``auto_margin``, ``auto_link``, ``auto_device``).
        error_feedback: keep per-parameter residuals of what compression dropped (and, for the
            two-phase algorithm, server-side residuals of the re-encoding). ``None`` (default):
            on for the biased, contractive codecs, off for the unbiased ones
            (:func:`commpress.options.error_feedback_default` says why); never for none/fp16/bf16.
        warmup_steps, warmup_codec: the first ``warmup_steps`` steps are reduced by
            ``warmup_codec`` (default 8-bit QSGD; ``"dense"``: DDP's all-reduce) before
            compression starts; ``None`` (default): 50 where compression needs it (Adam's
            variance must settle; value-blind codecs with error feedback), else 0. See
            :mod:`commpress.optim.warmup` for the defaults and what they were measured against.
        min_numel, dense_1d: parameters with fewer elements, or 1-D ones (biases, norms), stay
            dense; ``compress_filter(name, param) -> bool`` replaces this rule.
        process_group: defaults to the DDP model's process group (else the default group).
        seed: base of every derived seed (per step, parameter, piece, phase); torch's global
            RNG is never used.
        optimizer: the user's optimizer. Where error feedback needs it, an SGD-like optimizer's
            momentum moves into the hook (:mod:`commpress.optim.sgd`) and Adam/AdamW's is
            compressed with its variance frozen after warm-up (:mod:`commpress.optim.adam`);
            otherwise it runs untouched (:func:`commpress.optim.optimizer_mode` says which and
            why). ``"auto"`` (default): the optimizer that steps these parameters is found at the
            first bucket, or else adopted after its first step (:mod:`commpress.optim.discovery`;
            not with ``codec="auto"`` or ``momentum=``); ``None``: the optimizer is left alone.
        momentum: DGC's momentum correction by hand (Lin et al., 2018) for an optimizer *without*
            momentum: a local velocity ``u = momentum * u + g`` per parameter is compressed
            (through error feedback) instead of ``g`` (:mod:`commpress.optim.momentum`). 0: off.
        divergence_guard: watch ``||residuals|| / ||compressed input||`` every few steps and
            send dense for a while (flushing the residuals) when it runs away; ``True``
            (default) uses :class:`~commpress.optim.guard.DivergenceGuard`'s defaults, ``False``
            turns it off, or pass a ``DivergenceGuard(threshold=..., interval=..., dense_steps=...)``.
        momentum_masking: zero the velocity where the residual is exactly zero after a step,
            i.e. where top-k / random-k sent the value (DGC's momentum factor masking). ``None``
            (default): on for sparse codecs with Adam/AdamW passed as ``optimizer=`` (it lowered the
            byte LM's loss), off otherwise (on SGD digits it cost top-k 1% 0.8 accuracy points).
        modes: optimizer modes of your own (:class:`~commpress.optim.OptimizerMode`), run in order
            on each parameter's gradient before it is reduced, checkpointed and reported with the state.
        algorithm: ``"auto"`` (per codec, see :mod:`commpress.comm`), ``"allreduce"``,
            ``"allgather"`` or ``"twophase"``; on several nodes (``local_world_size``) the one that
            runs across nodes on each rank's share (``"hierarchical"``: the same as ``"auto"`` there).
        local_world_size: ranks per node (L). With several nodes of several ranks, gradients are
            reduced dense inside a node, and only each rank's ``1/L`` share is compressed across
            nodes (:mod:`commpress.comm.hierarchical`); the world must be ``nodes x L`` with the
            ranks of a node contiguous, else a :class:`~commpress.errors.ConfigurationError`.
            ``None`` (default): torchrun's ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` when they describe such a
            layout on every rank, else flat (logged; :mod:`commpress.comm.topology`). With
            ``codec="auto"`` its compressed option is the hierarchical path and its cost model
            calibrates the node's link and the cross-node link apart (:mod:`commpress.ddp.auto`).
        verify: at construction, compare a digest of the configuration and model across ranks
            through the process group's store (no collective): ranks configured differently fail
            with a :class:`~commpress.errors.ConfigurationError` naming what differs, and a rank that
            never registers is named after ``verify_timeout`` seconds. ``False``: the same check at
            the first bucket.
        verify_timeout: seconds to wait for every rank to register (see ``verify``).
        **codec_params: codec parameters when ``codec`` is a name (``ratio=0.01``).

    Example::

        state = CompressionState(ddp_model, "topk", ratio=0.01)
        ddp_model.register_comm_hook(state, commpress.ddp.hook)
    """

    file_what = "commpress DDP state"
    __slots__ = (  # with DDPCheckpoint's
        "process_group", "plans_by_id", "warmup", "adam", "auto", "faults", "_bucket_plans", "_verify_pending",
        "_stats_log", "_first_gradients", "keeping_first_gradients", "_find_optimizer", "topology", "inner_algorithm",
        "algorithm_impl", "warmup_impl",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        codec: str | Codec,
        *,
        error_feedback: bool | None = None,
        warmup_steps: int | None = None,
        warmup_codec: str | Codec | None = None,
        min_numel: int = 1024,
        dense_1d: bool = True,
        compress_filter: CompressFilter | None = None,
        process_group: Any = None,
        seed: int = 0,
        optimizer: torch.optim.Optimizer | str | None = DISCOVER,
        momentum: float = 0.0,
        momentum_masking: bool | None = None,
        algorithm: str = "auto",
        verify: bool = True,
        verify_timeout: float = VERIFY_TIMEOUT_S,
        divergence_guard: DivergenceGuard | bool = True,
        modes: Sequence[OptimizerMode] = (),
        local_world_size: int | None = None,
        **codec_params: Any,
    ) -> None:
        discover = isinstance(optimizer, str) and optimizer == DISCOVER
        if isinstance(optimizer, str) and not discover:
            raise CodecError(f"optimizer must be a torch.optim.Optimizer, None or {DISCOVER!r}, got {optimizer!r}")
        if discover:
            optimizer = None
        assert optimizer is None or not isinstance(optimizer, str)
        auto = None
        known: topology.Topology | None = None  # resolved early for auto: its candidate depends on the nodes
        if isinstance(codec, str) and codec == "auto":
            codec_params = dict(codec_params)
            group = process_group if process_group is not None else getattr(model, "process_group", None)
            ranks, several_nodes = 2, False
            if dist.is_available() and dist.is_initialized():
                known = topology.resolve(group, local_world_size, opts.check_timeout(verify_timeout))
                ranks = known.nodes  # the ranks of the compressed hop: every rank, or one per node
                several_nodes = known.hierarchical
            # the candidate codec and the policy
            codec, auto = AutoPolicy.from_options(codec_params, optimizer, momentum, ranks, several_nodes)
        self.codec = comm.resolve_codec(codec, codec_params, "DDP's collectives")
        error_feedback = opts.error_feedback_default(error_feedback, self.codec)
        opts.check_bools(error_feedback=error_feedback, dense_1d=dense_1d, verify=verify)
        assert isinstance(error_feedback, bool)
        self.warmup = Warmup(warmup_steps, warmup_codec, needed=self.codec.value_blind and error_feedback,
                             compressor=self.codec, where="DDP's collectives")
        self.seed = opts.check_seed(seed)
        if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0.0 <= momentum < 1.0:
            raise CodecError(f"momentum must be a float in [0, 1), got {momentum!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise CodecError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.momentum = float(momentum)
        if momentum_masking is not None and not isinstance(momentum_masking, bool):
            raise CodecError(f"momentum_masking must be a bool or None, got {momentum_masking!r}")
        self.correction = MomentumCorrection(masking=bool(momentum_masking))
        self.optimizer = optimizer
        self.adam: FrozenVarianceAdam | None = None
        self.handover: SGDHandover | None = None  # the user's SGD momentum, taken into the hook
        check_algorithm(algorithm, self.codec)  # bad names fail before any process-group check
        opts.warn_unbiased_feedback(error_feedback, self.codec)
        opts.require_process_group()
        module = getattr(model, "module", model)
        if process_group is None:
            process_group = getattr(model, "process_group", None)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # a failure on one rank becomes every rank's error (see FaultChannel): a watcher thread
        # blocked on the store, nothing per step
        self.faults = FaultChannel.of(process_group)
        self._resolve_topology(process_group, local_world_size, algorithm, opts.check_timeout(verify_timeout), known)
        self.error_feedback = error_feedback
        self.step = 0
        self._stats_log: StatsLogger | None = None  # log_to's
        self.plans_by_id, self.plans = plan_parameters(
            module.named_parameters(), self.codec,
            min_numel=min_numel, dense_1d=dense_1d, compress_filter=compress_filter,
        )
        self.residuals = self._new_residuals()
        if isinstance(divergence_guard, bool):
            divergence_guard = DivergenceGuard() if divergence_guard else DivergenceGuard(threshold=0.0)
        if not isinstance(divergence_guard, DivergenceGuard):
            raise CodecError(f"divergence_guard must be a bool or a DivergenceGuard, got {divergence_guard!r}")
        if self.feedback is None:  # nothing to watch without residuals (the caller's object untouched)
            divergence_guard = dataclasses.replace(divergence_guard, threshold=0.0)
        self.guard = divergence_guard
        self.modes = tuple(modes)
        if not all(isinstance(m, OptimizerMode) for m in self.modes) or len({m.name for m in self.modes}) != len(self.modes):
            raise CodecError(f"modes must be OptimizerMode objects with different names, got {modes!r}")
        self._bucket_plans: dict[tuple[int, ...], BucketPlan] = {}
        self._stats = CommStats()
        self._stats_from_step = 0  # the step the counters start at (a reset, or an old checkpoint)
        if self.momentum:
            rule = MomentumRule(self.momentum)
            self.correction.rules = {name: rule for name in self.plans}
        self.discovery: OptimizerDiscovery | None = None
        #: each parameter's local gradient of the step before an optimizer is discovered
        self._first_gradients: dict[str, torch.Tensor] = {}
        #: the hook calls keep_first_gradients only while this is True (off the hot path after adoption)
        self.keeping_first_gradients = False
        #: set while discovery may still find the optimizer before the first bucket (then run once)
        self._find_optimizer: Callable[[], None] | None = None
        if discover and auto is None and self.uses_feedback and not self.momentum:
            # no optimizer= given: adopt the one that steps these parameters, after its first step
            params = [p for n, p in module.named_parameters() if n in self.plans]
            self.discovery = OptimizerDiscovery(params, lambda opt: self._discovered(module, opt, momentum_masking),
                                                "commpress.ddp.register")
            self.keeping_first_gradients = True
            find_timeout = opts.check_timeout(verify_timeout)
            self._find_optimizer = lambda: self._adopt_if_found(module, momentum_masking, find_timeout)
        else:
            self._adopt_optimizer(module, optimizer, momentum_masking)
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self.auto = None if auto is None else auto.bind(self._auto_inputs(), device)
        timeout = opts.check_timeout(verify_timeout)
        # verify=False only moves the check to the first bucket of the first step: ranks that
        # disagree would otherwise crash gloo (frame sizes) or wait forever (algorithms)
        self._verify_pending: float | None = None if verify else timeout
        if verify:
            self._verify_ranks(timeout)
            self._connect()
            if self.auto is not None:  # after the check (verify=False: at the first bucket)
                self.auto.calibrate()

    def _resolve_topology(self, group: Any, local_world_size: int | None, algorithm: str, timeout_s: float,
                          known: topology.Topology | None = None) -> None:
        """Set ``topology``, the algorithm names and ``algorithm_impl`` / ``warmup_impl`` (what the hook runs).

        ``known``: the topology already resolved (``codec="auto"`` resolves it first), else resolved here.
        """
        topo = known if known is not None else topology.resolve(group, local_world_size, timeout_s)
        self.topology = topo
        if not topo.hierarchical:
            if algorithm == "hierarchical":
                raise ConfigurationError(
                    f"algorithm 'hierarchical' needs several nodes of several ranks; this group runs flat "
                    f"({topo.reason or 'no layout given or detected'}): pass local_world_size="
                )
            self.algorithm = check_algorithm(algorithm, self.codec, self.world_size)
            self.inner_algorithm: str | None = None
            self.algorithm_impl: Algorithm = comm.get(self.algorithm)
            warm = self.warmup.codec
            self.warmup_impl: Algorithm | None = None if warm is None else comm.get(comm.default_algorithm(warm, self.world_size))
            return
        self.inner_algorithm = check_algorithm("auto" if algorithm == "hierarchical" else algorithm, self.codec,
                                               topo.nodes)
        self.algorithm = "hierarchical"
        self.algorithm_impl = Hierarchical.bind(topo, self.rank, comm.get(self.inner_algorithm))
        # warm-up through a codec crosses the nodes the same way (its share, no residuals): with AdamW's 50
        # warm-up steps, flat warm-up was most of a 100-step run's cross-node bytes (docs/ddp.md)
        warm = self.warmup.codec
        self.warmup_impl = None if warm is None else Hierarchical.bind(
            topo, self.rank, comm.get(comm.default_algorithm(warm, topo.nodes)))

    def _connect(self) -> None:
        """Create the node groups (after the agreement: a rank that never registers is named, not waited for)."""
        for impl in (self.algorithm_impl, self.warmup_impl):
            if isinstance(impl, Hierarchical):
                impl.connect(self.process_group)

    # ----- configuration --------------------------------------------------------------------
    @property
    def uses_feedback(self) -> bool:
        """True when residuals are kept (error feedback on, and a codec that drops something)."""
        return self.error_feedback and not self.codec.lossless

    @property
    def warmup_steps(self) -> int:
        """Steps reduced dense (or by ``warmup_codec``) before compression starts."""
        return self.warmup.steps

    @property
    def warmup_codec(self) -> Codec | None:
        """How warm-up steps are reduced (None: DDP's all-reduce)."""
        return self.warmup.codec

    @property
    def velocity(self) -> dict[str, torch.Tensor]:
        """Per-parameter local velocities of momentum correction (:class:`~commpress.optim.MomentumCorrection`)."""
        return self.correction.velocity

    @property
    def momentum_rules(self) -> dict[str, MomentumRule]:
        """The momentum rule the hook applies per parameter name (empty: none)."""
        return self.correction.rules

    @property
    def momentum_masking(self) -> bool:
        """DGC's momentum factor masking is on."""
        return self.correction.masking

    @property
    def feedback(self) -> ErrorFeedback | None:
        """The worker residuals of this rank (None without error feedback)."""
        return self.residuals.worker

    @property
    def server_feedback(self) -> ErrorFeedback | None:
        """The two-phase algorithm's server-side residuals of this rank's pieces (None otherwise)."""
        return self.residuals.server

    def _new_residuals(self) -> ParamResiduals:
        plans = list(self.plans.values()) if self.uses_feedback else None
        return ParamResiduals(self.codec, self.algorithm_impl, self.world_size, self.rank, plans)

    def _auto_inputs(self) -> AutoInputs:
        """What ``codec="auto"`` reads of this state (a record, not the state)."""
        return AutoInputs(
            codec=self.codec, algorithm=self.algorithm, world_size=self.world_size, group=self.process_group,
            feedback=self.feedback is not None, masking=self.momentum_masking and self.feedback is not None,
            momentum=bool(self.momentum_rules), counters=self._stats, flush=self.flush_residuals,
            hierarchy=self.algorithm_impl if isinstance(self.algorithm_impl, Hierarchical) else None,
        )

    def config(self) -> dict[str, Any]:
        """Everything all ranks must agree on (plain types)."""
        return {
            "codec": self.codec.config(),
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            **self.warmup.config(),
            "seed": self.seed,
            "momentum": self.momentum,
            "momentum_rules": self.correction.rules_state(),
            "world_size": self.world_size,
            "topology": self.topology.config(),
            "inner_algorithm": self.inner_algorithm,
            "auto": None if self.auto is None else self.auto.config(),
            **({"modes": [m.name for m in self.modes]} if self.modes else {}),
            "params": [
                [p.name, list(p.shape), str(p.dtype), p.compressed] for p in self.plans.values()
            ],
        }

    def _verify_ranks(self, timeout_s: float) -> None:
        """Fail on every rank, never hang or crash, when ranks register differently or not at all.

        :func:`commpress.comm.agreement.check_same_config` goes through the process group's
        store, so a rank that never registers is named after ``timeout_s`` on gloo and NCCL alike.
        """
        config = self.config()
        summary = (f"{self.codec!r}, algorithm={self.algorithm}, {self.topology.nodes} x "
                   f"{self.topology.local_world_size} ranks ({self.topology.source}), error_feedback={self.error_feedback}, "
                   f"warmup_steps={self.warmup.steps}, {len(config['params'])} parameters")
        check_same_config(config, summary=summary, group=self.process_group, timeout_s=timeout_s,
                          what="commpress.ddp.register")

    def keep_first_gradients(self, plan: BucketPlan, buffer: torch.Tensor) -> None:
        """While an optimizer is still to be discovered: keep the bucket's local gradients (one step).

        Passed as ``optimizer=``, the hook's first velocity is each rank's own gradient; the
        discovered optimizer's momentum buffer after that step is the *averaged, compressed* one.
        Starting the velocities from the kept local gradients instead makes a discovered run the
        same run as one with ``optimizer=`` (test: ``tests/optim_workers.py::worker_discovery``).
        Costs one gradient copy for one step.
        """
        if self.discovery is None or not self.discovery.pending or self.correction.rules:
            # adopted, refused (a subset optimizer), or resumed: a checkpoint's rules and velocities
            # already run in the hook this step, and they go on as they were saved
            self._first_gradients.clear()
            self.keeping_first_gradients = False
            return
        for p, off in zip(plan.params, plan.offsets):
            self._first_gradients[p.name] = buffer[off : off + p.numel].to(residual_dtype(buffer.dtype), copy=True)

    def _adopt_if_found(self, module: torch.nn.Module, masking: bool | None, timeout_s: float) -> None:
        """At a fresh run's first bucket: adopt the optimizer already built, as if passed (all ranks agree)."""
        if self.step != 0 or self.correction.rules or self.discovery is None:
            return  # resumed: the checkpoint's rules run, and the step hook adopts after this step
        optimizer = self.discovery.find_agreed(group=self.process_group, timeout_s=timeout_s)
        if optimizer is not None:
            self.keeping_first_gradients = False
            self._adopt_optimizer(module, optimizer, masking)

    def _discovered(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, masking: bool | None) -> None:
        """Adopt the optimizer found after its first step; velocities start from the kept local gradients."""
        self._adopt_optimizer(module, optimizer, masking)
        if self.handover is not None and self.adam is None:
            for name, g in self._first_gradients.items():
                if name in self.correction.rules and all_finite(g):
                    self.correction.velocity[name] = g
        self._first_gradients = {}
        self.keeping_first_gradients = False

    def _adopt_optimizer(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, masking: bool | None
    ) -> None:
        """Take the optimizer's momentum into the hook where error feedback needs it (:func:`optimizer_mode`)."""
        self.optimizer = optimizer
        mode = optimizer_mode(optimizer, self.codec, uses_feedback=self.uses_feedback, by_hand_momentum=self.momentum)
        if mode == "adam":
            assert optimizer is not None
            compressed = {id(p): (n, p.numel()) for n, p in module.named_parameters()
                          if n in self.plans and self.plans[n].compressed}
            self.adam, self.warmup.steps, masking = adopt_adam(optimizer, compressed, self.codec, self.warmup.steps,
                                                               masking)
            self.correction.masking = bool(masking)
        if mode != "sgd":
            return
        assert optimizer is not None
        self.handover = SGDHandover(
            optimizer, {id(p): n for n, p in module.named_parameters() if n in self.plans}, self.correction,
            {n: (p.numel, p.dtype) for n, p in self.plans.items()}, group=self.process_group, faults=self.faults,
            device=lambda: self.auto.tensor_device if self.auto is not None else torch.device("cpu"),
            want_optimizer=lambda: self.auto is not None and self.auto.all_exact(), where=lambda: f"step {self.step}",
        )
        logger.info("commpress: %s momentum moved into the hook for %d parameters",
                    type(optimizer).__name__, len(self.momentum_rules))

    @property
    def momentum_in_optimizer(self) -> bool:
        """True while the optimizer applies its own SGD momentum again (``codec="auto"``, every bucket exact)."""
        return self.handover is not None and self.handover.in_optimizer

    def place_momentum(self) -> None:
        """After ``optimizer.step()``: put SGD momentum where the next step needs it (:meth:`SGDHandover.place`)."""
        if self.handover is not None:
            self.handover.place()

    def before_bucket(self) -> None:
        """Run a deferred ``verify=False`` check and the optimizer search; start Adam's compressed momentum after warm-up."""
        if self._verify_pending is not None:
            timeout_s, self._verify_pending = self._verify_pending, None
            self._verify_ranks(timeout_s)
            self._connect()
        if self._find_optimizer is not None:
            find, self._find_optimizer = self._find_optimizer, None
            find()
        if self.adam is not None and not self.adam.active and self.step >= self.warmup.steps:
            self.adam.start(self.correction)

    # ----- per-bucket planning ---------------------------------------------------------------
    def dense_step(self) -> bool:
        """True while the current step is dense: warm-up, or the divergence guard's dense steps."""
        return self.warmup.active(self.step) or self.guard.dense_now()

    def warmup_codec_now(self) -> Codec | None:
        """The codec of this warm-up step, or None for a dense all-reduce (also after warm-up)."""
        return self.warmup.codec_now(self.step)

    def flush_residuals(self, plan: BucketPlan, buffer: torch.Tensor) -> None:
        """Add this rank's residuals into a dense step's gradients and zero them (:meth:`ParamResiduals.flush`)."""
        self.residuals.flush(plan, buffer)

    def norms_sq(self, plan: BucketPlan, buffer: torch.Tensor | None) -> float:
        """Squared norm of the compressed parameters' input in ``buffer``, or of their residuals."""
        return self.residuals.norms_sq(plan, buffer)

    def bucket_plan(self, params: list[torch.Tensor], buffer_numel: int) -> BucketPlan:
        """The (cached) plan of a bucket holding ``params``; buckets change after step 1."""
        key = tuple(id(p) for p in params)
        plan = self._bucket_plans.get(key)
        if plan is None:
            plan = plan_bucket(params, self.plans_by_id, buffer_numel)
            self._bucket_plans[key] = plan
        return plan

    def apply_momentum(self, plan: BucketPlan, buffer: torch.Tensor, compressing: bool = True) -> None:
        """Momentum correction: replace each gradient in ``buffer`` by its local velocity.

        A parameter whose gradient is not finite keeps its velocity and its NaN gradient (the
        collectives' non-finite policy then voids the step on every rank).

        Compressed parameters of a value-blind codec (random-k:
        :func:`~commpress.optim.momentum_as_gain`) with SGD momentum get the
        momentum's steady-state gain instead on the steps that compress them (``compressing``;
        :meth:`~commpress.optim.MomentumCorrection.apply` says why and what was measured).
        """
        for p, off in zip(plan.params, plan.offsets):
            self.correction.apply(p.name, buffer[off : off + p.numel], as_gain=compressing and self._momentum_as_gain(p))

    def apply_modes(self, plan: BucketPlan, buffer: torch.Tensor, compressing: bool) -> None:
        """Run the user's ``modes`` on each parameter's gradient view, in order (:class:`OptimizerMode`)."""
        for mode in self.modes:
            for p, off in zip(plan.params, plan.offsets):
                mode.apply(p.name, buffer[off : off + p.numel], compressing=compressing)

    def _momentum_as_gain(self, plan: ParamPlan) -> bool:
        """True when ``plan``'s SGD momentum is a gain, not a velocity, on compressing steps (see above)."""
        return plan.compressed and self.adam is None and momentum_as_gain(self.codec)

    def mask_momentum(self, plan: BucketPlan) -> None:
        """DGC's momentum factor masking of the bucket's compressed parameters (:meth:`MomentumCorrection.mask`)."""
        if not self.correction.masking or self.feedback is None:
            return
        algorithm = self.algorithm_impl
        for p in plan.params:
            if p.compressed:
                pieces = algorithm.residual_layout(p.name, p.shape, self.codec, self.world_size)
                self.correction.mask(p.name, self.feedback, pieces, self.codec.sparse)

    def param_seed(self, plan: ParamPlan) -> int:
        """Seed shared by all ranks for ``plan``'s parameter at the current step."""
        return derive_seed(self.seed, self.step, plan.index)

    # ----- statistics ------------------------------------------------------------------------
    @property
    def counters(self) -> CommStats:
        """The raw thread-safe counters the collectives add to."""
        return self._stats

    def stats(self) -> dict[str, float]:
        """Steps, bytes handed to collectives vs dense, compression ratio and time spent.

        ``steps`` is the training step (restored by :meth:`load_state_dict`); the counters cover
        ``counted_steps`` of them (all, unless :meth:`reset_stats` was called or the checkpoint
        predates saved counters), and the per-step figures divide by that.

        ``bytes_sent``: bytes this rank handed to collectives; ``dense_bytes``: what DDP's own
        all-reduce would have been handed; ``compression_ratio`` = dense / sent.
        ``bytes_wire`` / ``dense_wire`` estimate what this rank transmits (ring all-reduce
        ``2(n-1)/n * B``, all_gather ``(n-1) * B``), ``wire_ratio`` their quotient.
        ``encode_s`` / ``decode_s`` / ``wait_s``: seconds encoding (incl. error feedback),
        decoding, and blocked on phase 1 of the two-phase algorithm.
        ``hierarchical`` (1.0 / 0.0), ``nodes``, ``local_world_size``: the topology in use;
        ``inter_bytes_sent`` / ``inter_bytes_wire`` and ``intra_*``: the parts of the bytes handed
        over across nodes and inside the node (0 when flat; ``bytes_sent`` counts both, so its
        ``compression_ratio`` includes the dense intra-node traffic), per step in
        ``inter_bytes_sent_per_step``; ``inter_compression_ratio`` = ``dense_bytes / inter_bytes_sent``.
        """
        s: dict[str, float] = dict(self._stats.as_dict())
        s["steps"] = self.step
        s["counted_steps"] = self.step - self._stats_from_step
        opts.ratio_stats(s, self.step - self._stats_from_step)
        steps = max(self.step - self._stats_from_step, 1)
        s["inter_bytes_sent_per_step"] = s["inter_bytes_sent"] / steps
        s["intra_bytes_sent_per_step"] = s["intra_bytes_sent"] / steps
        s["hierarchical"] = float(self.topology.hierarchical)
        s["nodes"] = float(self.topology.nodes)
        s["local_world_size"] = float(self.topology.local_world_size)
        if self.topology.hierarchical:  # what crosses nodes against what a flat dense all-reduce hands over
            s["inter_compression_ratio"] = s["dense_bytes"] / s["inter_bytes_sent"] if s["inter_bytes_sent"] else 1.0
        s.update(self.guard.stats())
        if self.auto is not None:
            s.update(self.auto.stats())
        if self.handover is not None:
            s.update(self.handover.stats())
        for mode in self.modes:
            s.update({f"{mode.name}_{k}": v for k, v in mode.stats().items()})
        return s

    def end_step(self, device: torch.device | str) -> None:
        """After the step's last bucket: let the guard count or decide, then advance the step."""
        if not self.warmup.active(self.step):
            measured = self.guard.due(self.step)
            self.guard.end_step(measured, self.process_group, device)
        if self.auto is not None:
            self.auto.end_step(self.step, device)
        for mode in self.modes:
            mode.end_step(self.step)
        self.step += 1
        if self._stats_log is not None:
            self._stats_log.after_step(self.step)

    def reset_stats(self) -> None:
        """Zero the counters (the step count is state, it is kept; per-step figures count from here)."""
        self._stats.reset()
        self._stats_from_step = self.step

    def residual(self, name: str) -> torch.Tensor | None:
        """The worker-side residual of parameter ``name`` (None before its first step)."""
        plan = self.plans.get(name)
        return None if plan is None or not plan.compressed else self.residuals.residual(plan)

    def __repr__(self) -> str:
        dense = sum(1 for p in self.plans.values() if not p.compressed)
        return (
            f"CompressionState(codec={self.codec!r}, algorithm={self.algorithm!r}"
            f"{'' if self.inner_algorithm is None else f' ({self.inner_algorithm} across {self.topology.nodes} nodes)'}, "
            f"error_feedback={self.error_feedback}, step={self.step}, rank={self.rank}/{self.world_size}, "
            f"params={len(self.plans)} ({dense} dense))"
        )
