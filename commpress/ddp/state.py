"""``CompressionState``: everything the DDP hook keeps between steps, and its checkpoint form."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import checkpoint, codecs, comm
from ..codecs import Bf16Codec, Codec, Fp16Codec, NoneCodec
from ..codecs.base import all_finite
from ..comm import CommStats, check_algorithm
from ..comm.agreement import check_same_config
from ..comm.faults import FaultChannel, wait
from ..errors import CodecError
from ..feedback import MAX_PLAUSIBLE_ABS, ErrorFeedback, check_state_header, residual_dtype
from ..rng import derive_seed
from .auto import AutoPolicy
from .guard import DivergenceGuard
from .optim import (
    DEFAULT_WARMUP_CODEC,
    DEFAULT_WARMUP_STEPS,
    FrozenVarianceAdam,
    MomentumRule,
    adam_unsupported,
    check_rule,
    give_back_momentum,
    has_momentum,
    is_adam_like,
    is_sgd_like,
    take_over_momentum,
)
from .planning import (
    BucketPlan,
    CompressFilter,
    ParamPlan,
    feedback_shapes,
    plan_bucket,
    plan_parameters,
)

STATE_FORMAT = 1
#: How long registration waits for every rank to register too (gloo), before failing.
VERIFY_TIMEOUT_S = 60
logger = logging.getLogger("commpress")


def _norm_sq(x: torch.Tensor) -> float:
    """``||x||^2`` in one read of ``x`` (``x.square().sum()`` wrote a temporary: ~30 ms at 67 MB)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float32 if x.dtype != torch.float64 else None)) ** 2


def _as_velocity(buf: torch.Tensor) -> torch.Tensor:
    """An optimizer's momentum buffer as the hook keeps a velocity: a flat copy in the residual dtype."""
    return buf.detach().reshape(-1).to(residual_dtype(buf.dtype), copy=True)


class CompressionState(checkpoint.StateFile):
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
            on for the biased, contractive codecs (topk, sign, unscaled randomk) and off for
            the unbiased ones (qsgd, scaled randomk): error feedback needs a contraction, and
            their variance exceeds ``||x||^2`` (QSGD at 4 bits: ~2x on Gaussian input), so the
            residual grows geometrically; measured, qsgd(bits=4) + error feedback diverged.
            Never applied to none/fp16/bf16 (rounding only).
        warmup_steps: the first ``warmup_steps`` communication steps are plain dense
            all-reduces (as DGC and 1-bit Adam do), or use ``warmup_codec``. ``None`` (default):
            :data:`~commpress.ddp.optim.DEFAULT_WARMUP_STEPS` (50) where compression needs it,
            else 0: before Adam's variance freezes (Adam/AdamW passed as ``optimizer``; 0 there
            is raised to 50 too), and for value-blind codecs with error feedback (random-k),
            whose residual sends each element ~1/ratio steps late, too late for the first
            steps' fast-changing gradients (digits MLP, ``SGD(lr=0.1, momentum=0.9)``, random-k
            1%, seeds 0-3: 89.4 / 96.2 / 92.2 / 94.5% without, 97.2 / 96.7 / 97.0 / 97.5% with
            50 dense steps; dense 97.7%).
        warmup_codec: how the warm-up steps are reduced: ``None`` (default): 8-bit QSGD
            (:data:`~commpress.ddp.optim.DEFAULT_WARMUP_CODEC`, unbiased, no residuals, 4x fewer
            bytes than the all-reduce); ``"dense"``: DDP's all-reduce; or another codec without
            error feedback (``"qsgd"`` for 4 bits, ``"fp16"``, a :class:`Codec`). Measured
            (``docs/benchmarks.md``): with AdamW on the 10.8M-parameter byte LM, 8-bit QSGD
            instead of dense warm-up steps took top-k 1% from +1.71% to +0.94% of dense's
            held-out loss and sign from +1.08% to +0.61%; on the digits MLP, AdamW: sign 94.0%
            vs 94.5%, top-k 95.0% vs 95.2% (dense 96.0%); SGD momentum, random-k 1% seeds 0-3:
            97.0 / 97.0 / 97.0 / 97.5% vs 97.2 / 96.7 / 97.0 / 97.5% (dense 97.7%). 4-bit QSGD
            helped the LM more (top-k -0.24%, sign -0.85%) but cost sign 4.6 points on digits.
        min_numel, dense_1d: parameters with fewer elements, or 1-D ones (biases, norms), stay
            dense; ``compress_filter(name, param) -> bool`` replaces this rule.
        process_group: defaults to the DDP model's process group (else the default group).
        seed: base of every derived seed (per step, parameter, piece, phase); torch's global
            RNG is never used.
        optimizer: the user's optimizer (recommended). With an SGD-like optimizer that uses
            momentum and a codec with error feedback, its momentum moves into the hook (DGC
            momentum correction, dampening and Nesterov as ``torch.optim.SGD`` defines them;
            see :mod:`commpress.ddp.optim`): the group's ``momentum`` becomes 0 and the settings
            live in ``group["commpress_momentum"]``, so optimizer checkpoints stay consistent.
            Unbiased codecs without error feedback leave the optimizer untouched. Random-k with
            Adam/AdamW runs but logs a warning: none of the update rules measured made it track
            dense on the byte LM (``docs/benchmarks.md``, "Random-k with AdamW").
        momentum: DGC's momentum correction by hand (Lin et al., 2018): the hook keeps a local
            velocity ``u = momentum * u + g`` per parameter and compresses ``u`` (through error
            feedback) instead of ``g``; use it with an optimizer *without* momentum, or pass
            ``optimizer=`` instead. For dense parameters this is exactly SGD momentum on the
            averaged gradient; for compressed ones it stops error feedback from replaying stale
            momentum. 0 disables it.
        divergence_guard: watch ``||residuals|| / ||compressed input||`` every few steps and
            send dense for a while (flushing the residuals) when it runs away; ``True``
            (default) uses :class:`~commpress.ddp.guard.DivergenceGuard`'s defaults, ``False``
            turns it off, or pass a ``DivergenceGuard(threshold=..., interval=..., dense_steps=...)``.
        momentum_masking: zero the velocity where the residual is exactly zero after a step,
            i.e. where top-k / random-k sent the value (DGC's momentum factor masking). ``None``
            (default): on for sparse codecs with Adam/AdamW passed as ``optimizer=`` (it lowered the
            byte LM's loss), off otherwise (on SGD digits it cost top-k 1% 0.8 accuracy points).
        algorithm: ``"auto"`` (per codec, see :mod:`commpress.comm`), ``"allreduce"``,
            ``"allgather"`` or ``"twophase"``.
        verify: at construction, compare a digest of the configuration and model across ranks
            (through the process group's store, no collective) so that ranks configured
            differently fail with a :class:`~commpress.errors.ConfigurationError` naming what
            differs, and a rank that never registers is named on every rank that did after
            ``verify_timeout`` seconds (default 60), on gloo and NCCL alike. ``False`` defers the
            same check to the first step's first bucket (mismatched ranks would otherwise crash
            gloo or wait until the process group's timeout).
        verify_timeout: seconds to wait for every rank to register (see ``verify``).
        **codec_params: codec parameters when ``codec`` is a name (``ratio=0.01``).

    Example::

        state = CompressionState(ddp_model, "topk", ratio=0.01)
        ddp_model.register_comm_hook(state, commpress.ddp.hook)
    """

    file_what = "commpress DDP state"
    __slots__ = (
        "process_group", "world_size", "rank", "codec", "algorithm", "error_feedback",
        "warmup_steps", "warmup_codec", "seed", "step", "plans", "plans_by_id", "feedback", "server_feedback",
        "momentum", "momentum_masking", "velocity", "_bucket_plans", "_stats", "momentum_rules",
        "optimizer", "guard", "adam", "_verify_pending", "_stats_from_step", "auto",
        "faults", "_param_names", "_momentum_in_optimizer", "_handovers",
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
        optimizer: torch.optim.Optimizer | None = None,
        momentum: float = 0.0,
        momentum_masking: bool | None = None,
        algorithm: str = "auto",
        verify: bool = True,
        verify_timeout: float = VERIFY_TIMEOUT_S,
        divergence_guard: DivergenceGuard | bool = True,
        **codec_params: Any,
    ) -> None:
        auto = None
        if isinstance(codec, str) and codec == "auto":
            codec_params = dict(codec_params)
            group = process_group if process_group is not None else getattr(model, "process_group", None)
            ranks = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 2
            codec, auto = AutoPolicy.from_options(codec_params, optimizer, momentum, ranks)  # the candidate codec and the policy
        self.codec = comm.resolve_codec(codec, codec_params, "DDP's collectives")
        self.warmup_codec = self._warmup_codec(warmup_codec)
        if error_feedback is None:
            error_feedback = not self.codec.unbiased
        for name, value in (
            ("error_feedback", error_feedback), ("dense_1d", dense_1d), ("verify", verify),
        ):
            if not isinstance(value, bool):
                raise CodecError(f"{name} must be a bool, got {value!r}")
        if warmup_steps is None:
            warmup_steps = DEFAULT_WARMUP_STEPS if self.codec.value_blind and error_feedback else 0
            if warmup_steps:
                logger.info("commpress: %d dense warm-up steps before %r compresses (warmup_steps=0 turns them off)",
                            warmup_steps, self.codec)
        elif not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise CodecError(f"warmup_steps must be an int >= 0 or None, got {warmup_steps!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
            raise CodecError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0.0 <= momentum < 1.0:
            raise CodecError(f"momentum must be a float in [0, 1), got {momentum!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise CodecError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.momentum = float(momentum)
        if momentum_masking is not None and not isinstance(momentum_masking, bool):
            raise CodecError(f"momentum_masking must be a bool or None, got {momentum_masking!r}")
        self.momentum_masking = bool(momentum_masking)
        self.velocity: dict[str, torch.Tensor] = {}
        self.momentum_rules: dict[str, MomentumRule] = {}
        self.optimizer = optimizer
        self.adam: FrozenVarianceAdam | None = None
        self._param_names: dict[int, str] | None = None  # id(parameter) -> name, once SGD momentum is taken
        self._momentum_in_optimizer = False  # auto, every bucket exact: the optimizer applies it (place_momentum)
        self._handovers = 0
        check_algorithm(algorithm, self.codec)  # bad names fail before any process-group check
        if error_feedback and self.codec.unbiased and not isinstance(self.codec, NoneCodec):
            logger.warning(
                "commpress: error feedback with the unbiased codec %r: it needs a contraction "
                "and may diverge when the codec's variance exceeds the signal", self.codec,
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        module = getattr(model, "module", model)
        if process_group is None:
            process_group = getattr(model, "process_group", None)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # a failure on one rank becomes every rank's error (see FaultChannel): a watcher thread
        # blocked on the store, nothing per step
        self.faults = FaultChannel.of(process_group)
        self.algorithm = check_algorithm(algorithm, self.codec, self.world_size)
        self.error_feedback = error_feedback
        self.warmup_steps = warmup_steps
        self.seed = seed
        self.step = 0
        self.plans_by_id, self.plans = plan_parameters(
            module.named_parameters(), self.codec,
            min_numel=min_numel, dense_1d=dense_1d, compress_filter=compress_filter,
        )
        self.feedback, self.server_feedback = self._new_feedback()
        if isinstance(divergence_guard, bool):
            divergence_guard = DivergenceGuard() if divergence_guard else DivergenceGuard(threshold=0.0)
        if not isinstance(divergence_guard, DivergenceGuard):
            raise CodecError(f"divergence_guard must be a bool or a DivergenceGuard, got {divergence_guard!r}")
        if self.feedback is None:  # nothing to watch without residuals (the caller's object untouched)
            divergence_guard = dataclasses.replace(divergence_guard, threshold=0.0)
        self.guard = divergence_guard
        self._bucket_plans: dict[tuple[int, ...], BucketPlan] = {}
        self._stats = CommStats()
        self._stats_from_step = 0  # the step the counters start at (a reset, or an old checkpoint)
        if self.momentum:
            rule = MomentumRule(self.momentum)
            self.momentum_rules = {name: rule for name in self.plans}
        self._adopt_optimizer(module, optimizer, momentum_masking)
        first = next(module.parameters(), None)
        self.auto = None if auto is None else auto.bind(self, first.device if first is not None else torch.device("cpu"))
        if not isinstance(verify_timeout, (int, float)) or isinstance(verify_timeout, bool) or verify_timeout <= 0:
            raise CodecError(f"verify_timeout must be a number of seconds > 0, got {verify_timeout!r}")
        # verify=False only moves the check to the first bucket of the first step: ranks that
        # disagree would otherwise crash gloo (frame sizes) or wait forever (algorithms)
        self._verify_pending: float | None = None if verify else float(verify_timeout)
        if verify:
            self._verify_ranks(float(verify_timeout))
            if self.auto is not None:  # after the check (verify=False: at the first bucket)
                self.auto.calibrate()

    # ----- configuration --------------------------------------------------------------------
    @property
    def uses_feedback(self) -> bool:
        """True when residuals are kept (error feedback on, and a codec that drops something)."""
        return self.error_feedback and not isinstance(self.codec, (NoneCodec, Fp16Codec, Bf16Codec))

    def _new_feedback(self) -> tuple[ErrorFeedback | None, ErrorFeedback | None]:
        if not self.uses_feedback:
            return None, None
        plans = list(self.plans.values())
        algorithm = comm.get(self.algorithm)
        worker = ErrorFeedback(self.codec, feedback_shapes(plans, algorithm, self.codec, self.world_size))
        server = None
        if algorithm.server_feedback:
            server = ErrorFeedback(
                self.codec, feedback_shapes(plans, algorithm, self.codec, self.world_size, self.rank)
            )
        return worker, server

    def config(self) -> dict[str, Any]:
        """Everything all ranks must agree on (plain types)."""
        return {
            "codec": self.codec.config(),
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            "warmup_steps": self.warmup_steps,
            "warmup_codec": None if self.warmup_codec is None else self.warmup_codec.config(),
            "seed": self.seed,
            "momentum": self.momentum,
            "momentum_rules": {k: r.as_list() for k, r in sorted(self.momentum_rules.items())},
            "world_size": self.world_size,
            "auto": None if self.auto is None else self.auto.config(),
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
        summary = (f"{self.codec!r}, algorithm={self.algorithm}, error_feedback={self.error_feedback}, "
                   f"warmup_steps={self.warmup_steps}, {len(config['params'])} parameters")
        check_same_config(config, summary=summary, group=self.process_group, timeout_s=timeout_s,
                          what="commpress.ddp.register")

    @staticmethod
    def _warmup_codec(choice: str | Codec | None) -> Codec | None:
        """Resolve and check a ``warmup_codec`` (None: the default; ``"dense"``: the all-reduce, None here)."""
        if choice is None:
            choice = DEFAULT_WARMUP_CODEC
        if choice == "dense":
            return None
        if isinstance(choice, str) and ":" in choice:  # "qsgd:bits=8"
            choice = codecs.from_spec(choice)
        codec = comm.resolve_codec(choice, {}, "DDP's collectives")
        if not (codec.unbiased or codec.cast_dtype is not None):
            raise CodecError(f"warmup_codec must be unbiased or a cast (the warm-up keeps no residuals), got {codec!r}")
        return codec

    def _adopt_optimizer(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, masking: bool | None
    ) -> None:
        """Take the optimizer's momentum into the hook where error feedback needs it; log why."""
        if not self.uses_feedback:
            if optimizer is not None:
                logger.info("commpress: %r has no error feedback; the optimizer runs unchanged", self.codec)
            return
        if optimizer is None:
            if not self.momentum:
                logger.warning(
                    "commpress: %r uses error feedback; pass optimizer=<your optimizer> to register() "
                    "so that its momentum moves into the hook (DGC momentum correction). Error feedback "
                    "feeding an optimizer's momentum converges worse (digits MLP, SGD momentum 0.9: "
                    "sign 21.7%% accuracy, 97.5%% with optimizer=)", self.codec,
                )
            return
        if is_adam_like(optimizer):
            self._adopt_adam(module, optimizer, masking)
            return
        if not is_sgd_like(optimizer) or not has_momentum(optimizer):
            logger.info("commpress: optimizer %s has no SGD momentum to take over; it runs unchanged",
                        type(optimizer).__name__)
            return
        if self.momentum:
            raise CodecError("pass either optimizer= (its momentum moves into the hook) or momentum=, not both")
        self._param_names = {id(p): n for n, p in module.named_parameters() if n in self.plans}
        # buffers found become velocities: e.g. resuming from a dense run's checkpoint (a gain
        # parameter folds it in when it compresses)
        self._take_momentum()

        def resync(*_: Any) -> None:  # before every step (schedulers)
            if not self._momentum_in_optimizer:  # handed back, a scheduler's change is the optimizer's
                self._take_momentum()

        # after load_state_dict the loaded groups and buffers decide, wherever the momentum was: the hook takes them
        optimizer.register_load_state_dict_post_hook(lambda *_: self._take_momentum())
        optimizer.register_step_pre_hook(resync)
        optimizer.register_step_post_hook(lambda *_: self.place_momentum())
        logger.info("commpress: %s momentum moved into the hook for %d parameters",
                    type(optimizer).__name__, len(self.momentum_rules))

    # ----- where SGD momentum is applied: the hook, or the optimizer while auto is exact ---------
    @property
    def momentum_in_optimizer(self) -> bool:
        """True while the optimizer applies its own SGD momentum again (``codec="auto"``, every bucket exact)."""
        return self._momentum_in_optimizer

    def place_momentum(self) -> None:
        """After ``optimizer.step()``: put SGD momentum where the next step needs it (all ranks alike).

        Momentum correction is needed only where a bucket compresses. While ``codec="auto"``
        reduces every bucket dense or fp16 and no residual is left (:meth:`AutoPolicy.all_exact`),
        the velocities, averaged over ranks once, go back to the optimizer as its
        ``momentum_buffer`` and it applies its momentum itself: the same update (averaging is
        linear), with SGD's own fused passes where the hook's cost 6-7% of a step
        (``scripts/bench_hook_overhead.py``). When a bucket is to compress again the hook takes
        the buffers back as every rank's velocity. Weight decay then goes through the momentum,
        as ``torch.optim.SGD`` defines it, instead of being applied once per step.
        """
        if self._param_names is None or not self.momentum_rules:  # no SGD momentum taken from optimizer=
            return
        want = self.auto is not None and self.auto.all_exact()
        if want == self._momentum_in_optimizer:
            return
        if want:
            with self.faults.guarded(f"step {self.step}, momentum hand-back"):  # never waits for a failed rank
                self._give_momentum()
        else:
            self._take_momentum()
        self._handovers += 1
        logger.info("commpress: step %d: SGD momentum now applied by the %s", self.step,
                    "optimizer (every bucket exact)" if want else "hook (a bucket compresses)")

    def _take_momentum(self, keep_velocity: bool = False) -> None:
        """The hook applies the momentum: groups' momentum to 0, buffers (unless ``keep_velocity``) to velocities."""
        assert self.optimizer is not None and self._param_names is not None
        self._momentum_in_optimizer = False
        self.momentum_rules, found = take_over_momentum(self.optimizer, self._param_names)
        if not keep_velocity:
            for name, buf in found.items():
                self.velocity[name] = _as_velocity(buf)

    def _give_momentum(self) -> None:
        """The optimizer applies the momentum: the velocities averaged over ranks become its buffers."""
        assert self.optimizer is not None and self._param_names is not None
        names = sorted(self.momentum_rules)  # the same on every rank (checked at registration)
        averaged: dict[str, torch.Tensor] = {}
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in names:
            by_dtype.setdefault(residual_dtype(self.plans[name].dtype), []).append(name)
        device = self.auto.tensor_device if self.auto is not None else torch.device("cpu")
        for dtype, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            # each velocity, or zeros where this rank has none, then one count per parameter
            parts = [self.velocity[n].reshape(-1).to(dtype) if n in self.velocity
                     else torch.zeros(self.plans[n].numel, dtype=dtype, device=device) for n in group]
            parts.append(torch.tensor([float(n in self.velocity) for n in group], dtype=dtype, device=device))
            flat = torch.cat(parts)
            if self.world_size > 1:  # bounded by the fault channel, as the hook's collectives are
                wait(dist.all_reduce(flat, group=self.process_group, async_op=True), flat.device)
            counts = flat[-len(group):].tolist()
            offset = 0
            for n, count in zip(group, counts):
                numel = self.plans[n].numel
                if count > 0:
                    averaged[n] = flat[offset : offset + numel].div_(count)
                offset += numel
        self.velocity = {}
        give_back_momentum(self.optimizer, self._param_names, averaged)
        self._momentum_in_optimizer = True

    def _velocities(self) -> dict[str, torch.Tensor]:
        """The velocities to checkpoint: the hook's, or the optimizer's buffers while it has them."""
        if not self._momentum_in_optimizer or self.optimizer is None or self._param_names is None:
            return {k: v.detach().clone() for k, v in self.velocity.items()}
        out = {}
        for p, name in ((p, self._param_names.get(id(p))) for g in self.optimizer.param_groups for p in g["params"]):
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if name is not None and isinstance(buf, torch.Tensor):
                out[name] = _as_velocity(buf)
        return out

    def _adopt_adam(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, masking: bool | None) -> None:
        """Adam/AdamW: compressed momentum with the variance frozen after the dense warm-up."""
        reason = adam_unsupported(optimizer)
        if reason is not None:
            logger.warning("commpress: %s: the optimizer runs unchanged on compressed gradients", reason)
            return
        if self.momentum:
            raise CodecError("pass either optimizer= (Adam's momentum moves into the hook) or momentum=, not both")
        if self.warmup_steps == 0:
            self.warmup_steps = DEFAULT_WARMUP_STEPS
            logger.info("commpress: %d dense warm-up steps before Adam's variance freezes", DEFAULT_WARMUP_STEPS)
        compressed = {id(p): n for n, p in module.named_parameters() if n in self.plans and self.plans[n].compressed}
        windows = {}  # top-k's sends hold ~1/ratio steps of momentum: widen Adam's bound as much
        if self.codec.sparse and not self.codec.value_blind:
            for p in module.parameters():
                delta = self.codec.delta(p.numel()) if id(p) in compressed else None
                if delta:
                    windows[id(p)] = 1.0 / delta
        self.adam = FrozenVarianceAdam(optimizer, compressed, self.warmup_steps, windows)
        if self.codec.value_blind:
            logger.warning(
                "commpress: %r with %s: each element's momentum reaches the optimizer about once "
                "per 1/ratio steps, and no update rule measured made that track dense (byte LM, "
                "AdamW, 200 steps: +3.4%% held-out loss at ratio 0.01, +2.8%% at 0.1; top-k 1%% "
                "+1.3%%); prefer \"topk\" with Adam (docs/benchmarks.md)", self.codec, type(optimizer).__name__,
            )
        if masking is None and self.codec.sparse:
            # measured on the 10.8M-parameter byte LM (AdamW, 2 ranks, 200 steps): top-k 1%
            # held-out loss 2.5615 -> 2.5355 (dense 2.4855); on SGD digits it cost top-k 0.8 points
            self.momentum_masking = True
        logger.info("commpress: %s momentum compressed for %d parameters after step %d (1-bit Adam's recipe)",
                    type(optimizer).__name__, len(compressed), self.warmup_steps)

    def before_bucket(self) -> None:
        """Run a deferred ``verify=False`` check; start Adam's compressed momentum after warm-up."""
        if self._verify_pending is not None:
            timeout_s, self._verify_pending = self._verify_pending, None
            self._verify_ranks(timeout_s)
        if self.adam is not None and not self.adam.active and self.step >= self.warmup_steps:
            self.momentum_rules = self.adam.rules()
            for name, m in self.adam.momenta().items():  # a resumed run keeps its checkpointed velocity
                self.velocity.setdefault(name, _as_velocity(m))
            self.adam.active = True

    # ----- per-bucket planning ---------------------------------------------------------------
    def dense_step(self) -> bool:
        """True while the current step is dense: warm-up, or the divergence guard's dense steps."""
        return self.step < self.warmup_steps or self.guard.dense_now()

    def warmup_codec_now(self) -> Codec | None:
        """The codec of this warm-up step, or None for a dense all-reduce (also after warm-up)."""
        return self.warmup_codec if self.step < self.warmup_steps else None

    def flush_residuals(self, plan: BucketPlan, buffer: torch.Tensor) -> None:
        """Add this rank's residuals into a dense step's gradients and zero them (nothing lost).

        Worker residuals are this rank's own; a two-phase server residual is an average already,
        so it is added ``world_size`` times before the dense all-reduce divides by it.
        """
        if self.feedback is None:
            return
        for p, off in zip(plan.params, plan.offsets):
            if not p.compressed:
                continue
            for lo, hi, e in self._residual_pieces(p):
                buffer[off + lo : off + hi].add_(e.reshape(-1).to(buffer.dtype))
                e.zero_()
            if self.server_feedback is not None:
                for piece in comm.get(self.algorithm).server_layout(
                    p.name, p.shape, self.codec, self.world_size, self.rank
                ):
                    server_e = self.server_feedback.residual(piece.key)
                    if server_e is not None:
                        buffer[off + piece.lo : off + piece.hi].add_(
                            server_e.reshape(-1).to(buffer.dtype), alpha=self.world_size
                        )
                        server_e.zero_()

    def norms_sq(self, plan: BucketPlan, buffer: torch.Tensor | None) -> float:
        """Squared norm of the compressed parameters' input in ``buffer``, or of their residuals."""
        total = 0.0
        for p, off in zip(plan.params, plan.offsets):
            if not p.compressed:
                continue
            if buffer is not None:
                total += _norm_sq(buffer[off : off + p.numel])
            else:
                total += sum(_norm_sq(e) for _, _, e in self._residual_pieces(p))
        return total

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

        Compressed parameters of a value-blind codec (random-k) with SGD momentum get the
        momentum's steady-state gain (:attr:`MomentumRule.gain`) instead, on the steps that
        compress them (``compressing``): their residual holds each element ~1/ratio steps (100
        at ratio 0.01), far longer than momentum 0.9 remembers, and a velocity carried across
        those sends only adds inertia. Measured on the digits MLP (``SGD(lr=0.1,
        momentum=0.9)``, random-k 1%, 2 ranks): with a velocity 31.5% without the divergence
        guard and 94.2% with it (100 of 240 steps dense); with the gain 96.5% and the guard
        never fires (dense 97.7%). Dense steps (warm-up, the guard's) keep a true velocity: a
        gain on a dense gradient is plain SGD at 1/(1-m) times the rate, without momentum's
        smoothing, and diverged there. At the first compressing step after dense ones, what
        the velocity would still have moved the parameter (:attr:`MomentumRule.pending`) joins
        the gradient, so error feedback sends it later instead of dropping it.
        """
        for p, off in zip(plan.params, plan.offsets):
            rule = self.momentum_rules.get(p.name)
            g = buffer[off : off + p.numel]
            if rule is None or not all_finite(g):
                continue
            if compressing and self._momentum_as_gain(p):
                g.mul_(rule.gain)
                u = self.velocity.pop(p.name, None)
                if u is not None:  # leaving a dense phase: nothing the velocity owes is lost
                    g.add_(u.to(g.dtype), alpha=rule.pending)
                continue
            u = self.velocity.get(p.name)
            if u is None:  # like torch.optim.SGD: the first velocity is the gradient itself
                u = g.to(residual_dtype(g.dtype), copy=True)
                self.velocity[p.name] = u
            else:
                u.mul_(rule.momentum).add_(g, alpha=1.0 - rule.dampening)
            if rule.nesterov:
                g.add_(u, alpha=rule.momentum)
            else:
                g.copy_(u)

    def _momentum_as_gain(self, plan: ParamPlan) -> bool:
        """True when ``plan``'s SGD momentum is a gain, not a velocity, on compressing steps (see above)."""
        return plan.compressed and self.codec.value_blind and self.adam is None

    def mask_momentum(self, plan: BucketPlan) -> None:
        """DGC's momentum factor masking: zero the velocity of the entries just sent.

        Sparse codecs name them (top-k's indices, random-k's seed): k entries touched. Others
        mask where the residual is exactly 0 (a full scan of the residual).
        """
        if not self.momentum_masking or self.feedback is None:
            return
        for p in plan.params:
            u = self.velocity.get(p.name)
            if u is None or not p.compressed:
                continue
            for piece in comm.get(self.algorithm).residual_layout(p.name, p.shape, self.codec, self.world_size):
                if self.codec.sparse:
                    sent = self.feedback.take_sent(piece.key)
                    if sent is not None:
                        u[piece.lo : piece.hi].index_fill_(0, sent, 0.0)
                    continue
                e = self.feedback.residual(piece.key)
                if e is not None:  # a codec without indices: where the residual was emptied
                    u[piece.lo : piece.hi].masked_fill_(e.reshape(-1) == 0, 0.0)

    def _residual_pieces(self, plan: ParamPlan) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, stop, residual)`` of each piece of a parameter's flat residual."""
        if self.feedback is None:
            return []
        pieces = comm.get(self.algorithm).residual_layout(plan.name, plan.shape, self.codec, self.world_size)
        found = [(piece.lo, piece.hi, self.feedback.residual(piece.key)) for piece in pieces]
        return [(lo, hi, e) for lo, hi, e in found if e is not None]

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
        """
        s: dict[str, float] = dict(self._stats.as_dict())
        s["steps"] = self.step
        s["counted_steps"] = self.step - self._stats_from_step
        s["compression_ratio"] = s["dense_bytes"] / s["bytes_sent"] if s["bytes_sent"] else 1.0
        s["wire_ratio"] = s["dense_wire"] / s["bytes_wire"] if s["bytes_wire"] else 1.0
        steps = max(self.step - self._stats_from_step, 1)
        s["bytes_sent_per_step"] = s["bytes_sent"] / steps
        s["dense_bytes_per_step"] = s["dense_bytes"] / steps
        s.update(self.guard.stats())
        if self.auto is not None:
            s.update(self.auto.stats())
        if self._param_names is not None:
            s["momentum_in_optimizer"] = float(self._momentum_in_optimizer)
            s["momentum_handovers"] = float(self._handovers)
        return s

    def end_step(self, device: torch.device | str) -> None:
        """After the step's last bucket: let the guard count or decide, then advance the step."""
        if self.step >= self.warmup_steps:
            measured = self.guard.due(self.step)
            self.guard.end_step(measured, self.process_group, device)
        if self.auto is not None:
            self.auto.end_step(self.step, device)
        self.step += 1

    def reset_stats(self) -> None:
        """Zero the counters (the step count is state, it is kept; per-step figures count from here)."""
        self._stats.reset()
        self._stats_from_step = self.step

    def residual(self, name: str) -> torch.Tensor | None:
        """The worker-side residual of parameter ``name`` (None before its first step)."""
        plan = self.plans.get(name)
        if plan is None or not plan.compressed:
            return None
        pieces = self._residual_pieces(plan)
        if len(pieces) != len(comm.get(self.algorithm).residual_layout(plan.name, plan.shape, self.codec, self.world_size)):
            return None  # before its first step
        if len(pieces) == 1:
            return pieces[0][2].view(plan.shape)
        return torch.cat([e.reshape(-1) for _, _, e in pieces]).view(plan.shape)

    # ----- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals (keyed by parameter name), codec config, step and seed; this rank's only.

        Error-feedback residuals differ per rank: save one file per rank. Only tensors and
        plain types, so ``torch.load(..., weights_only=True)`` reads it back.
        """
        return {
            "format": STATE_FORMAT,
            "codec": self.codec.config(),
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "step": self.step,
            "shapes": {p.name: list(p.shape) for p in self.plans.values() if p.compressed},
            "momentum": self.momentum,
            "momentum_rules": {k: r.as_list() for k, r in self.momentum_rules.items()},
            "velocity": self._velocities(),
            "guard": self.guard.state(),
            "stats": self._stats.as_dict(),
            "stats_from_step": self._stats_from_step,
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
            "server_feedback": None if self.server_feedback is None else self.server_feedback.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output after validating all of it (all or nothing).

        Raises ValueError (:class:`CodecError` for a codec mismatch) when the checkpoint was
        written with another codec, algorithm, world size or rank, or for other shapes, and for
        entries of the wrong type (a malformed or hostile checkpoint).
        """
        try:
            self._load_state_dict(state)
        except (TypeError, OverflowError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"commpress DDP state: malformed entry ({type(exc).__name__}: {str(exc)[:200]})") from None

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        required = {
            "algorithm", "error_feedback", "world_size", "rank", "seed", "step",
            "shapes", "feedback", "server_feedback", "momentum", "velocity",
        }
        check_state_header(state, required=required, fmt=STATE_FORMAT, codec=self.codec, what="commpress DDP state")
        if state["algorithm"] != self.algorithm:
            raise ValueError(f"algorithm mismatch: checkpoint has {state['algorithm']!r}, this state {self.algorithm!r}")
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"world size mismatch: checkpoint was written by {state['world_size']} ranks, this process "
                f"group has {self.world_size} (residuals are per rank and cannot be redistributed)"
            )
        if state["rank"] != self.rank:
            raise ValueError(
                f"rank mismatch: this is rank {self.rank}'s state slot but the checkpoint is rank "
                f"{state['rank']}'s; save and load one commpress state per rank"
            )
        if bool(state["error_feedback"]) != self.error_feedback:
            raise ValueError(
                f"error_feedback mismatch: checkpoint {state['error_feedback']!r}, this state {self.error_feedback!r}"
            )
        step, seed = state["step"], state["seed"]
        if not isinstance(step, int) or not 0 <= step < 1 << 62 or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"step must be an int in [0, 2**62) and seed in [0, 2**64), got {step!r} / {seed!r}")
        stats = CommStats()
        stats_from = step  # a checkpoint without counters: count from here
        if "stats" in state:
            stats.load(dict(state["stats"]))
            stats_from = state.get("stats_from_step", 0)
            if not isinstance(stats_from, int) or not 0 <= stats_from <= step:
                raise ValueError(f"stats_from_step must be an int in [0, step], got {stats_from!r}")
        mine = {p.name: list(p.shape) for p in self.plans.values() if p.compressed}
        theirs = {str(k): [int(d) for d in v] for k, v in dict(state["shapes"]).items()}
        if theirs != mine:
            extra, lost = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
            changed = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
            raise ValueError(
                "compressed parameters differ from the checkpoint: "
                f"only in checkpoint {extra}, only here {lost}, shape changed {changed}"
            )
        if float(state["momentum"]) != self.momentum:
            raise ValueError(f"momentum mismatch: checkpoint {state['momentum']!r}, this state {self.momentum!r}")
        saved_rules = {
            str(k): check_rule(v, f"momentum_rules[{k!r}]") for k, v in dict(state.get("momentum_rules") or {}).items()
        }
        if self.optimizer is None and saved_rules != self.momentum_rules:
            raise ValueError(
                "momentum rules differ from the checkpoint (it was written with optimizer=...): "
                "register with the same optimizer settings"
            )
        velocity: dict[str, torch.Tensor] = {}
        for name, v in dict(state["velocity"]).items():
            plan = self.plans.get(name)
            if plan is None or not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() != plan.numel:
                raise ValueError(f"velocity {name!r} does not match a parameter of this model")
            if v.dtype not in (torch.float32, torch.float64) or not bool(torch.isfinite(v).all()):
                raise ValueError(f"velocity {name!r} must be a finite float32/float64 tensor")
            if v.numel() and float(v.abs().max()) > MAX_PLAUSIBLE_ABS:
                raise ValueError(f"velocity {name!r} holds {float(v.abs().max()):.3g}, beyond {MAX_PLAUSIBLE_ABS:g}")
            velocity[name] = v.detach().clone()
        worker, server = self._new_feedback()
        for what, fb, saved_fb in (
            ("feedback", worker, state["feedback"]), ("server_feedback", server, state["server_feedback"]),
        ):
            if (fb is None) != (saved_fb is None):
                raise ValueError(f"{what}: checkpoint {'has' if saved_fb is not None else 'lacks'} it, this state does not agree")
            if fb is not None:
                fb.load_state_dict(saved_fb)  # validates keys, shapes, dtypes, finiteness
        if "guard" in state:
            self.guard.load(state["guard"])
        self.feedback, self.server_feedback = worker, server
        if self._momentum_in_optimizer:  # the checkpoint's velocities are the momentum now: the hook applies it
            self._take_momentum(keep_velocity=True)
        self.velocity = velocity
        self.step, self.seed = step, seed
        self._stats.load(stats.as_dict())  # in place: the collectives hold this object
        self._stats_from_step = stats_from

    def __repr__(self) -> str:
        dense = sum(1 for p in self.plans.values() if not p.compressed)
        return (
            f"CompressionState(codec={self.codec!r}, algorithm={self.algorithm!r}, "
            f"error_feedback={self.error_feedback}, step={self.step}, rank={self.rank}/{self.world_size}, "
            f"params={len(self.plans)} ({dense} dense))"
        )
