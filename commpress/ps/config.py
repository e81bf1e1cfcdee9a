"""Options of a parameter-server run (:class:`PSConfig`) and codec specs like ``topk:ratio=0.01``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import codecs
from ..codecs import Codec
from ..errors import CodecError
from .errors import ConfigError

MODES = ("sync", "async", "ssp")


def parse_codec(spec: str | Codec) -> Codec:
    """Build a codec from ``name[:key=value,...]`` (:func:`commpress.codecs.from_spec`)."""
    if isinstance(spec, Codec):
        return spec
    try:
        return codecs.from_spec(spec)
    except CodecError as exc:
        raise ConfigError(str(exc)) from None


codec_spec = codecs.to_spec  # inverse of parse_codec, for printing


def contractive(codec: Codec) -> bool:
    """True when error feedback is safe with ``codec``: ``||C(x) - x|| < ||x||`` for every x.

    Unbiased codecs with variance above ``||x||^2`` (QSGD with few levels, scaled random-k)
    would make a residual grow, so error feedback is off for them under ``"auto"``.
    """
    if codec.name in ("fp16", "bf16"):
        return True  # relative rounding error <= 2**-8
    return codec.delta(4096) is not None


@dataclass
class PSConfig:
    """Everything a run needs besides the task. Defaults suit the demos.

    Attributes:
        servers: the first ``servers`` ranks are servers, the rest workers.
        mode: ``sync`` (every step waits for all workers), ``async`` (each push applied on
            arrival) or ``ssp`` (async, but no worker more than ``staleness`` steps ahead of the
            slowest live worker).
        staleness: the ssp bound K.
        steps: steps each worker runs.
        codec: push codec (workers -> servers), a :class:`~commpress.codecs.Codec` or a spec.
        pull_codec: codec of the servers' updates, ``"same"`` (the push codec; ``none`` for
            random-k, see :meth:`reply_codec`) or a spec; ``none`` sends the parameters.
        error_feedback: worker-side error feedback: ``auto`` (on for contractive codecs),
            ``on`` or ``off``.
        min_compress: ``min_numel`` of the selection rule shared with DDP
            (:class:`commpress.selection.SelectionRule`): pieces of >= 2-D parameters with fewer
            elements, and all 1-D parameters, travel dense.
        max_drift: bound on ``||x_server - x_worker|| / ||x_server||`` per shard after every
            reply; an update that would leave more drift is replaced by the dense parameters.
        max_push_norm: plausibility bound of the servers: a push whose decoded norm exceeds
            this many times the running norm of accepted pushes (per shard) is dropped, counted
            and its worker named (:class:`~commpress.ps.server.ShardServer`); 0 disables it.
        resync_every: also send dense parameters every this many replies (0: never).
        timeout: seconds of silence after which a worker counts as gone; in sync mode the run
            stops naming it, in async/ssp it is dropped.
        checkpoint: directory for checkpoints (None: none); ``checkpoint_every`` steps (0: at
            the end only); ``resume`` continues from the newest complete checkpoint there.
        seed: seeds the model initialisation and every codec seed.
        progress: progress bar on rank 0 (stderr).
        log_dir: where servers write JSON-lines event logs (replies with staleness, drops,
            rejections).
        device: device the workers compute on (``cpu``, ``cuda``, ``cuda:1``...).
        cuda_aware: ``auto``/``yes``/``no``: hand MPI device buffers (via CuPy) instead of
            host copies.
        faults: testing only: fault injections (:mod:`commpress.ps.faults`).
        preemption: turn SIGTERM on any rank into a stop of every rank at one step, with a
            checkpoint there when ``checkpoint`` is set (:mod:`commpress.ps.preempt`); False
            leaves SIGTERM's default (the rank dies).
        local_steps: 0 (default): workers push a gradient every step. ``H >= 1``: the servers
            become DiLoCo's outer-step servers: each step, a worker takes ``H`` inner steps of
            the task's optimizer (on batches ``H*t .. H*t + H - 1``) and pushes the pseudo-gradient
            (its parameters at the step's start minus where the ``H`` steps ended), compressed
            like any push; the servers apply the outer optimizer to it. ``steps`` then counts
            syncs, each of ``H`` inner steps.
        outer_lr, outer_momentum, outer_nesterov: the servers' outer optimizer with
            ``local_steps``: ``SGD(lr, momentum, nesterov)``; the defaults (lr 1, no momentum)
            make a sync step the workers' average, as ``commpress.local.DiLoCo``'s defaults do.
    """

    servers: int = 1
    mode: str = "sync"
    staleness: int = 2
    steps: int = 100
    codec: str | Codec = "none"
    pull_codec: str | Codec = "same"
    error_feedback: str = "auto"
    min_compress: int = 512
    max_drift: float = 0.01
    max_push_norm: float = 1e3
    resync_every: int = 0
    timeout: float = 30.0
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    seed: int = 0
    progress: bool = True
    log_dir: str | None = None
    device: str = "cpu"
    cuda_aware: str = "auto"
    faults: tuple[Any, ...] = field(default_factory=tuple)
    preemption: bool = True
    local_steps: int = 0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    outer_nesterov: bool = False

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad option."""
        if not isinstance(self.servers, int) or self.servers < 1:
            raise ConfigError(f"servers must be an int >= 1, got {self.servers!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"steps must be an int >= 0, got {self.steps!r}")
        if self.error_feedback not in ("auto", "on", "off"):
            raise ConfigError(f"error_feedback must be auto, on or off, got {self.error_feedback!r}")
        if not (isinstance(self.max_drift, (int, float)) and self.max_drift > 0):
            raise ConfigError(f"max_drift must be > 0 (inf disables the guard), got {self.max_drift!r}")
        if (isinstance(self.max_push_norm, bool) or not isinstance(self.max_push_norm, (int, float))
                or not (self.max_push_norm == 0 or 1 <= self.max_push_norm < math.inf)):
            raise ConfigError(f"max_push_norm must be 0 (off) or a finite factor >= 1, got {self.max_push_norm!r}")
        if not isinstance(self.resync_every, int) or self.resync_every < 0:
            raise ConfigError(f"resync_every must be an int >= 0, got {self.resync_every!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if self.resume and not self.checkpoint:
            raise ConfigError("resume needs a checkpoint directory")
        if self.cuda_aware not in ("auto", "yes", "no"):
            raise ConfigError(f"cuda_aware must be auto, yes or no, got {self.cuda_aware!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.min_compress, int) or self.min_compress < 1:
            raise ConfigError(f"min_compress must be an int >= 1, got {self.min_compress!r}")
        if not isinstance(self.local_steps, int) or isinstance(self.local_steps, bool) or self.local_steps < 0:
            raise ConfigError(f"local_steps must be an int >= 0 (0: push gradients), got {self.local_steps!r}")
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if not isinstance(self.outer_nesterov, bool) or (self.outer_nesterov and self.outer_momentum == 0):
            raise ConfigError(f"outer_nesterov must be a bool, and True needs outer_momentum > 0, got {self.outer_nesterov!r}")
        self.push_codec()
        self.reply_codec()

    def outer_optimizer(self) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        """The servers' optimizer with ``local_steps``: SGD on the workers' averaged pseudo-gradients."""
        lr, momentum, nesterov = float(self.outer_lr), float(self.outer_momentum), self.outer_nesterov
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)

    def push_codec(self) -> Codec:
        """The codec workers push with."""
        return parse_codec(self.codec)

    def reply_codec(self) -> Codec:
        """The codec servers answer with (``none``: dense parameters).

        ``same`` means the push codec, except random-k: as a pull codec its drift exceeds any
        useful ``max_drift`` almost every step (measured on digits: 400 of 400 replies resynced
        for scaled, 314 of 400 for unscaled), so ``same`` sends dense parameters instead. With
        ``local_steps`` a reply carries a whole outer step, and a 4-bit or sparse one drifts past
        ``max_drift`` at every sync (digits, H = 10, 30 syncs: QSGD 4-bit and top-k 5% 30 of 30
        resynced, dense bytes every time; 8-bit 3 of 30), so ``same`` means 8-bit QSGD there
        (a 16-bit push codec stays itself).
        """
        if isinstance(self.pull_codec, str) and self.pull_codec == "same":
            push = self.push_codec()
            if self.local_steps and push.name not in ("none", "fp16", "bf16"):
                return codecs.get("qsgd", bits=8)
            return codecs.get("none") if push.name == "randomk" else push
        return parse_codec(self.pull_codec)

    def use_error_feedback(self) -> bool:
        """Whether workers keep an error-feedback memory."""
        codec = self.push_codec()
        if codec.name == "none" or self.error_feedback == "off":
            return False
        return self.error_feedback == "on" or contractive(codec)

    def describe(self) -> dict[str, Any]:
        """The options that must agree between ranks and across a resume (fingerprinted)."""
        return {
            "servers": self.servers,
            "mode": self.mode,
            "staleness": self.staleness if self.mode == "ssp" else None,
            "codec": self.push_codec().config(),
            "pull_codec": self.reply_codec().config(),
            "error_feedback": self.use_error_feedback(),
            "max_drift": self.max_drift,
            "resync_every": self.resync_every,
            "seed": self.seed,
            # only when set: the fingerprints of gradient-pushing runs (and their checkpoints) stay as they were
            **({"local_steps": self.local_steps, "outer": [float(self.outer_lr), float(self.outer_momentum),
                                                          self.outer_nesterov]} if self.local_steps else {}),
        }
