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
- ``residual_dtype=torch.bfloat16`` halves the residuals (``2 (n-1)/n d`` bytes), ``"int8"`` /
  ``"int4"`` store them blockwise quantized with stochastic rounding, and ``"auto"`` (the default) takes the
  widest kind that keeps them within one gradient shard at the world size (float32 at 2 ranks,
  bfloat16 at 3, int8 at 4, int4 up to 8: :mod:`.residuals`); the float32 working copy exists
  only for one module during its reduce-scatter;
- an owner-side residual cannot replace them: the error is made by the sender's encoder, and
  the owner only ever sees its decode.

**The user's optimizer** (``optimizer=``, chosen by :func:`commpress.optim.optimizer_mode` as on
DDP). Where each mode sits, given that a rank holds the full local gradient only inside the
reduce-scatter and keeps only its shard afterwards:

- SGD momentum on a parameter sent dense (1-D, small), and on every parameter during warm-up and
  the guard's dense steps: a velocity on the *shard after the reduction*. Averaging is linear, so
  this is SGD momentum exactly, and the velocity is shard-sized (DDP's local velocity would be a
  full unsharded copy per rank).
- SGD momentum on a compressed parameter of a codec that takes momentum as its gain
  (:func:`commpress.optim.momentum_as_gain`: the value-blind random-k): the gain multiplies the
  *reduced shard*. Scaling commutes with these codecs and
  with error feedback (``C(a x) = a C(x)``), so it equals DDP's gain before compression, keeps the
  residuals in gradient units, and needs no velocity at all.
- SGD momentum on other compressed parameters (``sign``, ``topk``) and Adam's
  compressed momentum: DGC / 1-bit Adam need each rank's *local* momentum compressed through
  error feedback (the momentum of the averaged gradient is the optimizer's own momentum on
  error-feedback gradients, the order that measured 21.7% for sign on DDP). That velocity covers
  the full local gradient of those parameters (one per chunk, before compression): an
  unsharded copy per rank, the memory price of these two modes, reported in ``stats()``. It is
  stored like the residuals (``velocity_kind``: ``residual_dtype``'s kind, or with ``"auto"`` the
  pair that keeps residuals and velocities together within one gradient shard, int8/int8 at 2
  ranks, int4/int4 at 4, ternary/int4 at 5, ternary/ternary up to 8 but for top-k's SGD momentum:
  :func:`.residuals.auto_kinds`), decoded for one chunk at a time inside
  the reduce-scatter.

The rank's own chunk is never compressed (added exactly), so it needs no residual.

**Sharded inside a node** (HSDP: ``fully_shard(..., mesh=commpress.fsdp.node_mesh(...))``, FSDP's
group is one node's ``L`` contiguous ranks): the comm object runs FSDP's own reduce-scatter in
the node, then the codec's all-gather (or all-reduce) of the node's mean shard across the nodes
over the ranks that hold the same shard (``topology``, ``chunks = 1``, ``own_chunk = None``):
one residual and one local velocity per parameter shard, nothing travels exact; agreement,
faults and the guard span every rank (``_group`` is the world). Adam's variance is frozen there:
a live one would follow each node's own gradient and part the replicas.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .. import checkpoint, codecs, comm
from .. import options as opts
from ..checks import check_loaded_tensor
from ..codecs import Codec, NoneCodec
from ..codecs.base import all_finite
from ..comm import CommStats, Slot, piece_key, resolve_codec
from ..comm import topology as comm_topology
from ..comm.agreement import check_same_config
from ..comm.faults import FaultChannel
from ..comm.stats import LevelStats
from ..errors import CodecError, ConfigurationError
from ..feedback import ErrorFeedback, check_state_header, residual_dtype
from ..optim import (
    DISCOVER,
    DivergenceGuard,
    FrozenVarianceAdam,
    MomentumCorrection,
    OptimizerDiscovery,
    SGDHandover,
    Warmup,
    adopt_adam,
    momentum_as_gain,
    optimizer_mode,
)
from ..rng import derive_seed
from ..selection import DEFAULT_MIN_NUMEL, CompressFilter, SelectionRule, embedding_like
from ..statslog import LogsStats, StatsLogger
from . import residuals as rstore
from .allgather import DEFAULT, REUSE, ParamAllGather, default_param_codec, resolve_param_codec
from .auto import AUTO_OPTIONS, FSDPAuto, is_auto
from .dcp import DCPState

logger = logging.getLogger("commpress")

STATE_FORMAT = 1
VERIFY_TIMEOUT_S = 60

#: Residual dtypes on offer as torch dtypes (``"int8"``, ``"int4"``, ``"auto"``: :mod:`.residuals`).
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
#: ``adam_variance=``: after the warm-up, Adam's second moment keeps moving with each owner's own
#: gradient chunk (``"live"``) or stays frozen (``"frozen"``: 1-bit Adam, as on DDP)
ADAM_VARIANCES = ("live", "frozen")


@dataclass(frozen=True)
class ShardPlan:
    """One parameter of an FSDP module: name, index, global shape, numel per chunk, compressed.

    ``offset``: where the parameter starts inside each chunk of the flat gradient (and inside
    the output shard).
    """

    name: str
    index: int
    shape: tuple[int, ...]
    chunk_numel: int
    compressed: bool
    offset: int = 0


@dataclass
class ModulePlan:
    """One FSDP module's reduce-scatter: its parameters in FSDP's order and its call count."""

    name: str
    params: list[ShardPlan]
    world_size: int
    calls: int = 0
    #: this module's own reduce-scatter codec (``codec="auto"`` chooses per module); None: the state's
    codec: Codec | None = None

    @property
    def chunk_numel(self) -> int:
        """Elements of one chunk (one rank's shard of every parameter, padded)."""
        return sum(p.chunk_numel for p in self.params)


def _is_plain(t: torch.Tensor) -> bool:
    """True for a plain tensor (not an FSDP parameter's sharded DTensor)."""
    return not isinstance(t, DTensor)


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


class FSDPCompressionState(checkpoint.StateFile, LogsStats):
    """State of commpress's reduce-scatter on an FSDP2 model (one per model and rank).

    Args:
        model: the root module after ``fully_shard`` (it, or modules inside it, are
            ``FSDPModule`` s); every FSDP module inside gets a :class:`CompressedReduceScatter`.
        codec: a codec name or a :class:`commpress.codecs.Codec` (fixed-size); ``"auto"`` chooses
            per FSDP module, for its reduce-scatter and its parameter all-gather, exact, bf16 or the
            recommended setting's codecs (2-bit QSGD; int8 forward, backward reusing its frames)
            from a calibrated cost model (:mod:`commpress.fsdp.auto`; options ``auto_link=`` a
            :class:`~commpress.comm.costmodel.Link` instead of timing the link,
            ``auto_calibration_numel=``; no ``param_codec=``, codec parameters or error feedback).
            Sharded inside the node (:func:`commpress.fsdp.node_mesh`) it chooses each module's
            all-reduce across nodes (dense, bf16 or 2-bit QSGD) and leaves the all-gather to FSDP.
        error_feedback: keep residuals of what compression dropped; ``None`` (default): on for
            the biased codecs (topk, sign, unscaled randomk), off for the unbiased ones (qsgd,
            scaled randomk) and never for none/fp16/bf16.
        residual_dtype: how the compression state is stored between steps, residuals and the local
            velocities of top-k / sign with SGD momentum or AdamW alike: ``"auto"`` (default since
            2026-12-04): the widest kinds that keep residuals and local velocities together within
            one gradient shard at this world size (:func:`.residuals.auto_kinds`; registered
            without ``optimizer=``, it budgets for the velocities an adopted one keeps: up to 5
            ranks for top-k with SGD momentum, 8 otherwise, then it warns; residuals alone up to 16);
            ``torch.float32`` (the default before: about 3 shards at 2 ranks for top-k or sign
            with AdamW), ``torch.bfloat16``, ``"int8"`` / ``"int4"`` / ``"ternary"`` (blockwise,
            stochastic rounding; ternary: levels -1, 0, 1, five per byte).
        optimizer: the user's optimizer; ``"auto"`` (default) adopts the one that steps every
            compressed parameter (found at the first reduce-scatter, else after its first step), where error feedback needs it
            (:mod:`commpress.optim.discovery`, as on DDP), ``None`` opts out. An SGD-like one's
            momentum moves into the reduce-scatter (the optimizer then runs without momentum;
            ``optimizer.state_dict()`` keeps the settings), Adam/AdamW gets 1-bit Adam's
            compressed momentum with its variance frozen after the warm-up
            (:class:`~commpress.optim.FrozenVarianceAdam`); otherwise it runs unchanged
            (:func:`commpress.optim.optimizer_mode`, as on DDP). The module docstring says
            where each mode sits and what memory it costs.
        warmup_steps: the first steps are reduced by ``warmup_codec`` before compression starts;
            ``None`` (default): 50 where compression needs it (Adam's variance must settle;
            value-blind codecs with error feedback), else 0 (:class:`~commpress.optim.Warmup`).
        warmup_codec: how the warm-up steps are reduced: an unbiased codec or a cast through the
            all_to_all (no residuals), default 8-bit QSGD (a quarter of FSDP's float32 bytes, as
            on DDP); ``"dense"``: FSDP's own reduce-scatter.
        divergence_guard: watch ``||residuals|| / ||compressed input||`` every few steps and
            reduce dense for a while (flushing the residuals) when it runs away; ``True``
            (default), ``False`` or a :class:`~commpress.optim.DivergenceGuard`.
        min_numel, dense_1d, compress_filter: which parameters are compressed (the DDP rule:
            ``commpress.selection.SelectionRule`` on the full parameter shape); ``compress_filter``
            replaces the rule and ``exact_embeddings`` both.
        exact_embeddings: ``True`` reduces and gathers the embedding-like parameters exact
            (:func:`commpress.selection.embedding_like`: ``nn.Embedding`` / ``EmbeddingBag``
            weights, parameters tied to them, ``nn.Linear`` weights of an embedding table's shape,
            i.e. the output projection onto the vocabulary): their rows scale with token frequency
            and one scale or top-k per tensor buries the rare ones. ``False``: the rule alone, as
            on DDP. ``None`` (default): True for every codec but ``sign``, the one it made worse
            (measured on the byte LM with AdamW and with SGD momentum, ``docs/fsdp.md``); sharded
            inside a node (HSDP) True for ``sign`` too: no rank's own chunk travels exact there
            (byte LM, SGD momentum, 2 nodes x 2: sign +27.7% over fp32, with exact embeddings +1.0%).
        seed: base of every derived seed; torch's global RNG is never used.
        verify: compare a digest of the configuration across ranks at construction (through the
            process group's store, as DDP's ``register`` does) so ranks set up
            differently fail with :class:`ConfigurationError` instead of hanging.
        param_codec: the parameter all-gather (:mod:`commpress.fsdp.allgather`). Not given
            (default): ``{"forward": "int8", "backward": "reuse"}`` when ``codec`` compresses
            (anything but ``none``, ``fp16``, ``bf16``), else FSDP's own, untouched
            (:func:`~commpress.fsdp.allgather.default_param_codec`; logged at registration,
            ``param_codec_why``). ``None`` leaves FSDP's own untouched and ``"none"`` is FSDP's
            own with its bytes counted: gradient-only. ``"int8"`` / ``"int4"`` (block-scaled, any
            ``"int8:block_size=128"`` spec, or a fixed-size non-sparse :class:`Codec`) quantises
            the gathered copy of the parameters the selection rule compresses (the sharded
            parameters stay exact); ``{"forward": ..., "backward": ...}`` chooses per direction
            (``"backward": "reuse"``: the backward decodes the forward's kept frames, 0 bytes).
            The parameter all-gather keeps nothing between steps and checkpoints do not record
            it: a checkpoint loads whatever this run's ``param_codec`` is.
        adam_variance: with Adam/AdamW adopted (top-k, sign, random-k), what Adam's second
            moment ``v`` does once the compressed momentum starts: ``"live"`` (default) keeps
            updating each shard's ``v`` with its owner's own local gradient chunk (exact, no bytes,
            no memory: :meth:`_own_variance`); ``"frozen"`` keeps 1-bit Adam's variance frozen at
            the end of the warm-up, as DDP does (byte LM, AdamW, 2 ranks, seed 0: top-k 1% +2.5%
            over fp32 frozen, -0.4% live; docs/fsdp.md). ``None`` (default): ``"live"``, except when
            FSDP shards inside a node (HSDP, :func:`commpress.fsdp.node_mesh`): there every node
            holds a replica of the shard and a node's own gradient would move the replicas' ``v``
            apart, so ``"frozen"`` (``"live"`` is a ``ConfigurationError``).
        **codec_params: codec parameters when ``codec`` is a name.

    Checkpoints: residuals and velocities differ per rank. Either one file per rank
    (:meth:`save` / :meth:`load`, or :meth:`state_dict` / :meth:`load_state_dict` with
    ``torch.save`` and ``torch.load(weights_only=True)``), or ``torch.distributed.checkpoint``
    next to the model and optimizer through :meth:`dcp`, the ``Stateful`` that namespaces every
    entry per rank (passing the state itself to DCP would let DCP deduplicate the ranks'
    same-named entries: :mod:`commpress.fsdp.dcp`)::

        dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp()}, checkpoint_id=d)
        dcp.load({"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp(checkpoint_id=d)},
                 checkpoint_id=d)

    A checkpoint written at another world size loads what is the same on every rank (configuration,
    step, seed, call counts, guard state, ``codec="auto"``'s choices) and drops this rank's
    residuals and velocities with one warning (:meth:`load_state_dict`); through DCP that needs
    the checkpoint named at load (``state.dcp(checkpoint_id=d)``; a bare ``state.dcp()`` reads only
    an entry of this world size). The same world size with another rank's state is refused.
    """

    file_what = "commpress FSDP state"
    __slots__ = (
        "codec", "error_feedback", "residual_dtype", "residual_kind", "seed", "world_size", "rank", "modules",
        "feedback", "_low", "_stats", "_rule", "_group", "faults", "step", "warmup", "guard", "correction",
        "optimizer", "discovery", "adam", "handover", "_placement", "_params", "_measured", "allgather",
        "_stats_log", "auto", "_first_gradients", "keeping_first_gradients", "_find_timeout", "velocity_kind",
        "_vstore", "param_codec_defaulted", "param_codec_why", "adam_variance", "topology", "_node_group",
        "_inter_group", "chunks", "own_chunk", "_auto_kinds",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        codec: str | Codec,
        *,
        error_feedback: bool | None = None,
        residual_dtype: torch.dtype | str = "auto",
        optimizer: torch.optim.Optimizer | str | None = DISCOVER,
        warmup_steps: int | None = None,
        warmup_codec: str | Codec | None = None,
        divergence_guard: DivergenceGuard | bool = True,
        min_numel: int = DEFAULT_MIN_NUMEL,
        dense_1d: bool = True,
        compress_filter: CompressFilter | None = None,
        exact_embeddings: bool | None = None,
        seed: int = 0,
        verify: bool = True,
        verify_timeout: float = VERIFY_TIMEOUT_S,
        param_codec: Any = DEFAULT,
        adam_variance: str | None = None,
        **codec_params: Any,
    ) -> None:
        self.auto: FSDPAuto | None = None
        if is_auto(codec):
            self.auto = FSDPAuto.from_options(codec_params, param_codec=param_codec, error_feedback=error_feedback,
                                              warmup_codec=warmup_codec, warmup_steps=warmup_steps)
            codec, codec_params = self.auto.grad_codec, {}
            param_codec = {"forward": self.auto.param_codec, "backward": REUSE}
            #: param_codec= was left out (the default); why this all-gather (logged at registration)
            self.param_codec_defaulted, self.param_codec_why = True, "codec='auto' chooses each module's all-gather"
        elif any(k in AUTO_OPTIONS for k in codec_params):
            raise CodecError(f"{', '.join(sorted(k for k in codec_params if k in AUTO_OPTIONS))} are options of "
                             f"codec='auto', not of {codec!r}")
        self.codec = resolve_codec(codec, codec_params, "the all_to_all")
        if adam_variance is not None and adam_variance not in ADAM_VARIANCES:
            raise CodecError(f"adam_variance must be one of {ADAM_VARIANCES}, got {adam_variance!r}")
        if param_codec is not DEFAULT:  # a bad one fails here, before any collective (the default needs the layout)
            resolve_param_codec(param_codec)
        error_feedback = opts.error_feedback_default(error_feedback, self.codec)
        exact_defaulted = exact_embeddings is None
        if exact_embeddings is None:  # measured: helps every codec but sign (docs/fsdp.md); HSDP: sign too, below
            exact_embeddings = self.codec.name != "sign"
        opts.check_bools(error_feedback=error_feedback, dense_1d=dense_1d, verify=verify,
                         exact_embeddings=exact_embeddings)
        assert isinstance(error_feedback, bool)
        kind = rstore.resolve_kind(residual_dtype)
        self.warmup = Warmup(warmup_steps, warmup_codec, needed=self.codec.value_blind and error_feedback,
                             compressor=self.codec, where="the all_to_all")
        discover = isinstance(optimizer, str) and optimizer == DISCOVER
        if not discover and optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise CodecError(f"optimizer must be a torch.optim.Optimizer, None or {DISCOVER!r}, got {optimizer!r}")
        if isinstance(divergence_guard, bool):
            divergence_guard = DivergenceGuard() if divergence_guard else DivergenceGuard(threshold=0.0)
        if not isinstance(divergence_guard, DivergenceGuard):
            raise CodecError(f"divergence_guard must be a bool or a DivergenceGuard, got {divergence_guard!r}")
        self.seed = opts.check_seed(seed)
        if compress_filter is not None and not callable(compress_filter):
            raise CodecError(f"compress_filter must be callable(name, parameter) -> bool, got {compress_filter!r}")
        try:
            rule = SelectionRule(min_numel, dense_1d)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module after fully_shard, got {type(model).__name__}")
        exact = embedding_like(model) if exact_embeddings else set()  # reduced and gathered exact (docs/fsdp.md)
        self._rule: CompressFilter = compress_filter or (
            lambda name, p: id(p) not in exact and rule(name, tuple(p.shape), p.numel()))
        opts.require_process_group()
        self.error_feedback = error_feedback
        self._stats = CommStats()
        self._group: Any = None
        self.modules = self._plan(model)
        self._node_group = self._group  # the group FSDP shards over
        self._inter_group: Any = None
        self.topology = self._find_topology()
        if self.topology.hierarchical and exact_defaulted and not exact_embeddings and compress_filter is None:
            # no exact own chunk here: sign on the embeddings measured +27.7% over fp32, exact +1.0% (docs/fsdp.md)
            exact = embedding_like(model)
            self._rule = lambda name, p: id(p) not in exact and rule(name, tuple(p.shape), p.numel())
            self._group = None
            self.modules = self._plan(model)
        if self.topology.hierarchical:  # HSDP: every rank takes part in agreement, faults and the guard
            if self.auto is not None:  # auto chooses the cross-node all-reduce; the node gathers on its fast links
                param_codec = None
                self.param_codec_why = ("codec='auto' sharded inside the node: FSDP's own parameter all-gather on "
                                        "the node's links; auto chooses each module's all-reduce across nodes")
            self._group = dist.group.WORLD
            self._inter_group = comm_topology.node_groups(self.topology, None).inter
        if self.topology.hierarchical and adam_variance == "live":
            raise ConfigurationError(
                "adam_variance='live' updates Adam's variance from one node's gradient: with FSDP sharded inside "
                "a node every node keeps a replica of the shard, and the replicas would drift apart; use 'frozen'")
        self.adam_variance = adam_variance or ("frozen" if self.topology.hierarchical else "live")
        self.world_size = dist.get_world_size(self._group)
        self.rank = dist.get_rank(self._group)
        #: local gradient pieces a rank keeps velocities for (one per destination rank; HSDP: its node's shard)
        self.chunks = 1 if self.topology.hierarchical else self.world_size
        #: the piece added exact, with no residual (flat: this rank's own chunk; HSDP: none, all of it crosses)
        self.own_chunk: int | None = None if self.topology.hierarchical else self.rank
        if self.auto is None:
            param_codec, self.param_codec_defaulted, self.param_codec_why = default_param_codec(
                param_codec, self.codec, inside_node=self.topology.hierarchical)
        param_codecs = resolve_param_codec(param_codec)
        requested = kind
        if kind == "auto":  # sized again below, once the optimizer (and so the local velocities) is known
            kind = rstore.auto_kind(self._residual_chunks() + 1)
        self._set_kinds(kind, "float32" if requested == "auto" else kind)
        self.faults = FaultChannel.of(self._group)  # one rank's failure is every rank's error
        opts.warn_unbiased_feedback(error_feedback, self.codec)
        self.feedback = self._new_feedback()
        self.allgather = None if param_codecs is None else ParamAllGather(model, param_codecs[0], self._rule,
                                                                          self.faults, reuse=param_codecs[1])
        self.step = 0
        self._stats_log: StatsLogger | None = None  # log_to's
        self._measured = False
        if self.feedback is None:  # nothing to watch without residuals (the caller's object untouched)
            divergence_guard = dataclasses.replace(divergence_guard, threshold=0.0)
        self.guard = divergence_guard
        self.correction = MomentumCorrection()
        self.optimizer: torch.optim.Optimizer | None = None
        self.adam: FrozenVarianceAdam | None = None
        self.handover: SGDHandover | None = None
        self._params = {n: p for n, p in model.named_parameters()}
        self._placement: dict[str, str] = {}  # name -> "shard" | "gain" | "local" (see the module docstring)
        self.discovery: OptimizerDiscovery | None = None
        #: each compressed parameter's local gradient chunks of the step before an optimizer is discovered
        self._first_gradients: dict[str, tuple[str, torch.Tensor]] = {}
        #: the reduce-scatter keeps them only while this is True (off the hot path after adoption)
        self.keeping_first_gradients = False
        #: set while discovery may still find the optimizer at the first reduce-scatter (then run once)
        self._find_timeout: float | None = None
        if self.world_size == 1:
            # FSDP2 runs no reduce-scatter or all-gather on one rank, so nothing here ever runs: taking
            # the optimizer's momentum over would silently drop it (measured: SGD momentum 0.9 with top-k
            # differed from plain FSDP2 after 3 steps). The optimizer is left as the user set it.
            logger.info("commpress.fsdp.register: 1 rank, nothing to compress (FSDP2 runs no collectives); "
                        "the optimizer is left unchanged")
            self.optimizer = None if discover else optimizer  # type: ignore[assignment]
        elif discover and self.uses_feedback:
            # no optimizer= given: adopt the one that steps these parameters, after its first step
            planned = self._shard_plans()
            self.discovery = OptimizerDiscovery([self._params[n] for n in planned], self._discovered,
                                                "commpress.fsdp.register")
            self.keeping_first_gradients = True
            self._find_timeout = opts.check_timeout(verify_timeout)
        elif not discover:
            assert not isinstance(optimizer, str)
            self._adopt_optimizer(optimizer)
        #: residual_dtype="auto": the kinds are sized here, and the velocities' again when an optimizer is discovered
        self._auto_kinds = requested == "auto"
        if self._auto_kinds:  # residuals and local velocities together within one gradient shard
            self._set_kinds(*self._sized_kinds())
            self._stash_velocities()  # any adopted from the optimizer's buffers above
        if verify:
            self._verify_ranks(opts.check_timeout(verify_timeout))
        if self.auto is not None:  # every rank calibrates together (after the check: ranks agree to)
            self.auto.choose(self, model)
            self._apply_auto()
            if verify:  # the choices too: computed from all-reduced numbers, so equal unless something is wrong
                self._verify_ranks(opts.check_timeout(verify_timeout))
        modules = {n or "<root>": m for n, m in model.named_modules() if isinstance(m, FSDPModule)}
        for plan in self.modules:  # a module without parameters of its own has no plan
            modules[plan.name].set_custom_reduce_scatter(CompressedReduceScatter(self, plan))  # type: ignore[arg-type]
        if self.allgather is not None:
            self.allgather.install(model)
        if self.rank == 0:
            logger.info("commpress.fsdp.register: %s", self.param_codec_why)

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
            if getattr(group.mesh_info, "replicate_process_group", None) is not None:
                raise ConfigurationError(
                    f"FSDP module {label!r} runs on a 2-D (replicate, shard) mesh: FSDP would all-reduce every "
                    "gradient shard across nodes dense after commpress. Shard on the node's 1-D mesh instead "
                    "(fully_shard(..., mesh=commpress.fsdp.node_mesh(device_type))): commpress then compresses "
                    "the cross-node all-reduce itself")
            if self._group is None:
                self._group = mesh
            elif dist.get_world_size(mesh) != dist.get_world_size(self._group):
                raise ConfigurationError("FSDP modules shard over groups of different sizes")
            params = []
            offset = 0
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
                params.append(ShardPlan(name, index[name], tuple(p.shape), chunk, compressed, offset))
                offset += chunk
            plans.append(ModulePlan(label, params, dist.get_world_size(mesh)))
        if not plans:
            raise ConfigurationError(
                f"{type(model).__name__} holds no FSDP module: call fully_shard on it before commpress.fsdp.register"
            )
        return plans

    def _find_topology(self) -> comm_topology.Topology:
        """Flat when FSDP shards over every rank; HSDP (nodes of contiguous ranks) when it shards over fewer.

        Sharded over a sub-group (``fully_shard(..., mesh=node_mesh(...))``), that group must be one node:
        ``L`` contiguous ranks, ``L`` dividing the world (``ConfigurationError`` otherwise).
        """
        world, members = dist.get_world_size(), dist.get_process_group_ranks(self._group)
        L = len(members)
        if L == world:
            return comm_topology.flat(world, "FSDP shards over every rank")
        node = members[0] // L if L else 0
        if world % L or members != list(range(node * L, node * L + L)):
            raise ConfigurationError(
                f"FSDP shards over ranks {members} of {world}: sharded inside a node, commpress needs every node "
                "to hold the same number of contiguous ranks (make the mesh with commpress.fsdp.node_mesh)")
        return comm_topology.Topology(world, L, "explicit")

    def _residual_chunks(self) -> int:
        """Pieces a rank keeps residuals for: the chunks it sends (flat), or its node's shard (HSDP)."""
        return self.chunks - (0 if self.own_chunk is None else 1)

    @property
    def uses_feedback(self) -> bool:
        """True when residuals are kept (error feedback on, and a codec that drops something)."""
        return self.error_feedback and not self.codec.lossless

    def _set_kinds(self, residual: str, velocity: str) -> None:
        """Storage of the compression state between steps: residuals and local velocities (:mod:`.residuals`)."""
        self.residual_kind = residual
        #: the residual dtype as given (a torch dtype, or the kind's name for int8 / int4)
        self.residual_dtype: torch.dtype | str = getattr(torch, residual) if residual in ("float32", "bfloat16") else residual
        #: how the local velocities (top-k / sign with SGD momentum, Adam) are stored between steps
        self.velocity_kind = velocity
        self._low = rstore.ResidualStore(residual)  # residuals between steps unless float32
        self._vstore = rstore.ResidualStore(velocity, "velocity", rstore.VELOCITY_BLOCK)  # local velocities unless float32

    def _sized_kinds(self) -> tuple[str, str]:
        """``residual_dtype="auto"``'s kinds for this optimizer mode (:func:`.residuals.auto_kinds`).

        Ternary velocities where they were measured to cost nothing: Adam's compressed momentum
        (top-k, sign) and sign's SGD momentum, not top-k's (:data:`.residuals.PAIRS`). While
        discovery is pending a top-k budget is SGD momentum's: the residual kind is the same
        either way, so adopting Adam later only narrows the velocities.
        """
        pending = self.discovery is not None and self.discovery.pending
        ternary = self.adam is not None or self.codec.name == "sign"
        return rstore.auto_kinds(self._residual_chunks() + 1, self._keeps_local_velocities(),
                                 velocity_chunks=self.chunks, ternary_velocities=ternary, warn=not pending)

    def _keeps_local_velocities(self) -> bool:
        """True when the optimizer mode keeps per-chunk local velocities (or may, once discovered)."""
        if self.discovery is not None and self.discovery.pending:  # budget for what adoption would keep
            return not momentum_as_gain(self.codec)
        return (self.adam is not None or self.handover is not None) and "local" in self._placement.values()

    def residual_shapes(self) -> dict[str, tuple[int]]:
        """Key -> shape of every residual this rank keeps (the chunks it sends, not its own)."""
        if not self.uses_feedback:
            return {}
        return {
            piece_key(p.name, j): (p.chunk_numel,)
            for plan in self.modules for p in plan.params if p.compressed
            for j in range(self.chunks) if j != self.own_chunk
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
            "topology": self.topology.config(),
            **self.warmup.config(),
            "momentum_rules": self.correction.rules_state(),
            "adam": self.adam is not None,
            **({} if self.adam is None else {"adam_variance": self.adam_variance}),
            "modules": [[m.name, [[p.name, list(p.shape), p.chunk_numel, p.compressed] for p in m.params]]
                        for m in self.modules],
            **({} if self.allgather is None else {"param_codec": self.allgather.config()}),
            "param_codec_defaulted": self.param_codec_defaulted,
            **({} if self.auto is None else {"auto": self.auto.config()}),
        }

    def _verify_ranks(self, timeout_s: float) -> None:
        """Fail on every rank, never hang, when ranks register differently or not at all."""
        summary = f"{self.codec!r}, residual_dtype={self.residual_dtype}, {len(self.modules)} FSDP modules"
        check_same_config(self.config(), summary=summary, group=self._group, timeout_s=timeout_s,
                          what="commpress.fsdp.register")

    def _apply_auto(self) -> None:
        """Give every module the codecs of its ``codec="auto"`` choice (reduce-scatter and all-gather)."""
        assert self.auto is not None
        for m in self.modules:
            m.codec = self.auto.reduce_codec(m.name)
        if self.allgather is not None:
            for label in self.allgather.plans:
                self.allgather.set_module(label, *self.auto.gather_codecs(label))

    def auto_report(self) -> list[dict[str, Any]]:
        """``codec="auto"``'s choice per FSDP module with every option's predicted seconds ([] otherwise)."""
        return [] if self.auto is None else self.auto.report()

    # ----- the user's optimizer ----------------------------------------------------------------
    def _keep_first_gradients(self, plan: ModulePlan, flat: torch.Tensor) -> None:
        """While an optimizer is still to be discovered: keep this module's local gradient chunks (one step).

        Passed as ``optimizer=``, a ``"local"`` velocity (top-k, sign) starts from each rank's own
        gradient chunks; the discovered optimizer's momentum buffer after that step is the
        *reduced, compressed* shard. Starting those velocities from the kept chunks instead makes
        a discovered run the same run as one with ``optimizer=``, bit for bit (as on DDP). Costs one
        copy of the compressed parameters' full local gradient for one step.
        """
        if self.discovery is None or not self.discovery.pending or self.correction.rules:
            # adopted, refused (a subset optimizer), or resumed: a checkpoint's rules and velocities
            # already run in the reduce-scatter, and they go on as they were saved
            self._first_gradients.clear()
            self.keeping_first_gradients = False
            return
        for j in range(self.chunks):
            base = j * plan.chunk_numel
            for p in plan.params:
                if p.compressed:
                    view = flat[base + p.offset : base + p.offset + p.chunk_numel]
                    self._first_gradients[piece_key(p.name, j)] = (p.name, view.to(residual_dtype(view.dtype), copy=True))

    def _adopt_if_found(self, timeout_s: float) -> None:
        """At a fresh run's first reduce-scatter: adopt the optimizer already built, as if passed (all ranks agree)."""
        if self.step != 0 or self.correction.rules or self.discovery is None:
            return  # resumed: the checkpoint's rules run, and the step hook adopts after this step
        optimizer = self.discovery.find_agreed(group=self._group, timeout_s=timeout_s)
        if optimizer is not None:
            self.keeping_first_gradients = False
            self._first_gradients.clear()
            self._adopt_optimizer(optimizer)
            self._size_found_velocities()

    def _size_found_velocities(self) -> None:
        """``residual_dtype="auto"`` and a discovered optimizer: size its velocities' kind again.

        Adam's may be stored narrower than the budget made for SGD's at registration (none is
        stored yet), or need one where the budget had none (random-k, whose SGD momentum keeps no
        velocity). Only the velocities change (the residuals may already hold a step): the widest
        kind that fits beside the residual kind (:func:`.residuals.velocity_kind_beside`).
        """
        if not self._auto_kinds or self.adam is None:
            return
        velocity = rstore.velocity_kind_beside(self.residual_kind, self._residual_chunks() + 1,
                                               velocity_chunks=self.chunks, ternary_velocities=True)
        if velocity != self.velocity_kind:
            self.velocity_kind = velocity
            self._vstore = rstore.ResidualStore(velocity, "velocity", rstore.VELOCITY_BLOCK)

    def _discovered(self, optimizer: torch.optim.Optimizer) -> None:
        """Adopt the optimizer found after its first step; local velocities start from the kept gradients."""
        self._adopt_optimizer(optimizer)
        self._size_found_velocities()
        if self.handover is not None and self.adam is None:
            for key, (name, g) in self._first_gradients.items():
                if self._placement.get(name) == "local" and name in self.correction.rules and all_finite(g):
                    self.correction.velocity[key] = g
        self._stash_velocities(made_at_last_call=True)
        self._first_gradients = {}
        self.keeping_first_gradients = False

    def _shard_plans(self) -> dict[str, ShardPlan]:
        return {p.name: p for m in self.modules for p in m.params}

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Take the optimizer's momentum where error feedback needs it (:func:`optimizer_mode`, as DDP).

        At registration, or after the optimizer's first step when it was discovered: its momentum
        buffers then become the reduce-scatter's velocities (as after a warm-up).
        """
        self.optimizer = optimizer
        mode = optimizer_mode(optimizer, self.codec, uses_feedback=self.uses_feedback, by_hand_momentum=0.0)
        if mode == "unchanged":
            return
        assert optimizer is not None
        plans = self._shard_plans()
        if mode == "adam":
            compressed = {id(self._params[n]): (n, p.chunk_numel) for n, p in plans.items() if p.compressed}
            # masking is not built on FSDP (the residual pieces are chunks): False, not the DDP default
            self.adam, self.warmup.steps, _ = adopt_adam(optimizer, compressed, self.codec, self.warmup.steps, False)
            if self.adam is not None:
                self.adam.live_variance = self.adam_variance == "live"
                if self.topology.hierarchical and self.rank == 0:  # measured: docs/fsdp.md#several-nodes
                    logger.warning(
                        "commpress.fsdp.register: %s with %s, sharded inside a node, runs 1-bit Adam's frozen variance "
                        "(byte LM, 2 nodes x 2: top-k 1%% +34%%, sign +6%% over fp32 at 200 steps); qsgd bits=2 leaves "
                        "AdamW as it is and matched fp32", type(optimizer).__name__, self.codec.name)
            self._placement = {name: "local" for name, _ in compressed.values()}
            return
        self.handover = SGDHandover(
            optimizer, {id(self._params[n]): n for n in plans}, self.correction,
            {n: (p.chunk_numel, self._params[n].dtype) for n, p in plans.items()}, group=self._group,
            faults=self.faults, device=lambda: torch.device("cpu"), want_optimizer=lambda: False,
            where=lambda: f"step {self.step}",
        )
        self._placement = {
            n: ("gain" if momentum_as_gain(self.codec) else "local") if p.compressed else "shard"
            for n, p in plans.items()
        }
        self._localize_velocities()
        # after the handover's own hook (which adopts the loaded buffers): make them this rank's
        optimizer.register_load_state_dict_post_hook(lambda *_: self._localize_velocities())
        logger.info("commpress: %s momentum moved into the FSDP reduce-scatter for %d parameters",
                    type(optimizer).__name__, len(self.correction.rules))

    def _start_adam(self) -> None:
        """End of warm-up: Adam's variance freezes, each rank's b1 momentum is compressed from now on.

        :meth:`FrozenVarianceAdam.start` on sharded parameters: every rank's local momentum starts
        from the gathered ``exp_avg`` (a resumed run keeps the velocities it loaded).
        """
        assert self.adam is not None
        self.correction.rules = self.adam.rules()
        for name, m in sorted(self.adam.momenta().items()):
            self.correction.velocity.setdefault(name, m)
        self.adam.active = True
        self._localize_velocities()

    def _localize_velocities(self) -> None:
        """Optimizer buffers (sharded DTensors, by name) -> the velocities this rank keeps.

        A ``"shard"`` / ``"gain"`` parameter keeps its padded local shard; a ``"local"`` one one
        velocity per chunk, all started from the gathered buffer (every rank alike, as DDP starts
        every rank's velocity from the same buffer): a collective, in name order on every rank.
        """
        velocity = self.correction.velocity
        plans = self._shard_plans()
        for name in sorted(k for k, v in velocity.items() if k in plans and not _is_plain(v)):
            v, p = velocity.pop(name), plans[name]
            if self._placement.get(name) == "local" and self.topology.hierarchical:
                if piece_key(name, 0) in velocity or piece_key(name, 0) in self._vstore.codes:
                    continue  # a resumed run keeps the velocities it loaded
                local = torch.zeros(p.chunk_numel, dtype=torch.float32)  # the node's velocity: the buffer's shard
                flat = v.to_local().reshape(-1)  # type: ignore[attr-defined]
                local[: flat.numel()] = flat
                velocity[piece_key(name, 0)] = local
            elif self._placement.get(name) == "local":
                if any(piece_key(name, j) in velocity or piece_key(name, j) in self._vstore.codes
                       for j in range(self.world_size)):
                    continue  # a resumed run keeps the velocities it loaded
                full = torch.zeros(self.world_size * p.chunk_numel, dtype=torch.float32)
                flat = v.full_tensor().reshape(-1)  # type: ignore[attr-defined]
                full[: flat.numel()] = flat
                for j in range(self.world_size):
                    velocity[piece_key(name, j)] = full[j * p.chunk_numel : (j + 1) * p.chunk_numel].clone()
            else:
                local = torch.zeros(p.chunk_numel, dtype=torch.float32)
                flat = v.to_local().reshape(-1)  # type: ignore[attr-defined]
                local[: flat.numel()] = flat
                velocity[name] = local
        self._stash_velocities()

    def _stash_velocities(self, made_at_last_call: bool = False) -> None:
        """Local velocities held in float32 (just started or adopted) -> their stored kind (``velocity_kind``).

        ``made_at_last_call``: they are the velocities of the module's last reduce-scatter (the
        kept first gradients of a discovered optimizer), stored with that call's seed, as the
        reduce-scatter would have stored them: a discovered run stays the ``optimizer=`` run bit
        for bit. Otherwise (started from the optimizer's buffers) a seed of their own.
        """
        if self.velocity_kind == "float32":
            return
        velocity = self.correction.velocity
        for m in self.modules:
            for p in m.params:
                if self._placement.get(p.name) != "local":
                    continue
                for j in range(self.chunks):
                    u = velocity.pop(piece_key(p.name, j), None)
                    if u is None:
                        continue
                    seed = (derive_seed(self.seed, m.calls - 1, p.index, j, 2 << 20) if made_at_last_call and m.calls
                            else derive_seed(self.seed, m.calls, p.index, j, 3 << 20))
                    self._vstore.put(piece_key(p.name, j), u, seed)

    def _momentum_before(self, plan: ModulePlan, input: torch.Tensor) -> None:
        """DGC / 1-bit Adam: each ``"local"`` parameter's chunks replaced by this rank's velocity.

        A quantised velocity (``velocity_kind`` not float32) is decoded into a float32 working copy
        for its chunk only, updated, and stored again (stochastic rounding seeded by the module's
        call, the parameter and the chunk, so a resumed run is bit-exact): between steps only the
        stored form exists, and the working memory is one chunk's velocity.
        """
        if not self.correction.rules:
            return
        stored = None if self.velocity_kind == "float32" else self._vstore
        velocity = self.correction.velocity
        for j in range(self.chunks):
            base = j * plan.chunk_numel
            for p in plan.params:
                if self._placement.get(p.name) == "local":
                    key = piece_key(p.name, j)
                    view = input[base + p.offset : base + p.offset + p.chunk_numel]
                    if stored is None or p.name not in self.correction.rules:
                        self.correction.apply(p.name, view, key=key)
                        continue
                    if (u := stored.get(key)) is not None:
                        velocity[key] = u
                    self.correction.apply(p.name, view, key=key)
                    if (u := velocity.pop(key, None)) is not None:
                        stored.put(key, u, derive_seed(self.seed, plan.calls, p.index, j, 2 << 20))

    def _own_variance(self, plan: ModulePlan, flat_in: torch.Tensor, scale: float) -> None:
        """``adam_variance="live"``: Adam's second moment of this rank's shard from its own gradient chunk.

        After the warm-up the reduce-scatter carries each rank's compressed *momentum*, so the
        owner never sees the averaged gradient that Adam's ``v = b2*v + (1-b2)*g**2`` needs. It
        does hold its own local gradient for its own chunk, exact and before anything is
        compressed: ``v`` keeps moving with that (no bytes, no memory; ``v`` lives only on the
        owner, so no rank has to agree). A local gradient is noisier than the average (its
        batch is ``1/n`` of the global one), so ``v`` reads somewhat high where noise dominates:
        a smaller step, measured far better than a variance frozen at the warm-up's end
        (docs/fsdp.md). ``scale``: ``n`` when FSDP sums instead of averaging.
        """
        assert self.adam is not None
        k = 0 if self.own_chunk is None else self.own_chunk  # HSDP: flat_in is the node's mean shard
        own = flat_in[k * plan.chunk_numel : (k + 1) * plan.chunk_numel]
        for p in plan.params:
            param = self._params[p.name]
            if id(param) not in self.adam.compressed:
                continue
            v = self.adam.optimizer.state.get(param, {}).get("exp_avg_sq")
            if not isinstance(v, torch.Tensor):
                continue
            local = (v.to_local() if hasattr(v, "to_local") else v).view(-1)
            g = own[p.offset : p.offset + local.numel()]
            b2 = self.adam.beta2[id(param)]
            local.mul_(b2).addcmul_(g, g, value=(1.0 - b2) * scale * scale)

    def _momentum_after(self, plan: ModulePlan, output: torch.Tensor, compressing: bool) -> None:
        """SGD momentum on the reduced shard: a velocity (``"shard"``, dense steps) or the gain (``"gain"``)."""
        if not self.correction.rules:
            return
        for p in plan.params:
            where = self._placement.get(p.name)
            if where in ("shard", "gain"):
                view = output[p.offset : p.offset + p.chunk_numel]
                self.correction.apply(p.name, view, as_gain=compressing and where == "gain")

    def _flush(self, slots: Sequence[Slot], input: torch.Tensor) -> None:
        """A guard's dense step: add this rank's residuals into what it sends, and zero them."""
        assert self.feedback is not None
        for s in slots:
            if s.feedback is None:
                continue
            e = self.feedback.residual(s.key)
            if e is not None:
                input[s.offset : s.offset + e.numel()].add_(e.reshape(-1).to(input.dtype))
            self.feedback.reset(s.key)
            self._low.drop(s.key)

    def _norms_sq(self, slots: Sequence[Slot], input: torch.Tensor | None) -> float:
        """Squared norm of the compressed slots' input, or (``input=None``) of their residuals."""
        total = 0.0
        for s in slots:
            if s.feedback is None:
                continue
            if input is not None:
                total += float(input[s.offset : s.offset + math.prod(s.shape)].float().pow(2).sum())
            elif (e := s.feedback.residual(s.key)) is not None:
                total += float(e.float().pow(2).sum())
        return total

    def _end_module(self, plan: ModulePlan, device: torch.device) -> None:
        """After a module's reduce-scatter: at the step's last module, let the guard decide; advance ``step``."""
        plan.calls += 1
        if min(m.calls for m in self.modules) <= self.step:
            return
        if not self.warmup.active(self.step):
            self.guard.end_step(self._measured, self._group, device)
        self._measured = False
        self.step += 1
        if self._stats_log is not None:
            self._stats_log.after_step(self.step)

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
        if self._find_timeout is not None:  # the first reduce-scatter: adopt an optimizer already built
            timeout_s, self._find_timeout = self._find_timeout, None
            self._adopt_if_found(timeout_s)
        average = op == dist.ReduceOp.AVG
        n = dist.get_world_size(group)
        if n != plan.world_size:
            raise ConfigurationError(f"module {plan.name!r}: reduce-scatter over {n} ranks, planned for {plan.world_size}")
        codec = plan.codec or self.codec
        dense = isinstance(codec, NoneCodec)
        if not dense and input.numel() != n * plan.chunk_numel:
            raise ConfigurationError(
                f"module {plan.name!r}: FSDP reduce-scatters {input.numel()} elements, its parameters make "
                f"{n * plan.chunk_numel}; a parameter got no gradient this step: call "
                "module.set_reduce_scatter_unused_params(True) so FSDP always sends every parameter"
            )
        hsdp = self.topology.hierarchical
        chunks = 1 if hsdp else n  # the pieces compressed below: one per destination, or the node's shard
        flat_in, flat_out = input.view(-1), output.view(-1)
        # a failure here is every rank's error; a rank waiting on a failed peer raises, never hangs
        with self.faults.guarded(f"module {plan.name!r}, reduce-scatter {plan.calls}"):
            if hsdp:  # FSDP's own reduce-scatter inside the node (fast links): its mean (or sum) shard
                comm.run("reducescatter-dense", flat_in, self._dense_slots(plan, output.numel(), n), group=group,
                         stats=LevelStats(self._stats, "intra"), output=flat_out, average=average).wait()
                flat_in = flat_out  # what crosses the nodes, reduced in place below
            slots = self._dense_slots(plan, flat_out.numel(), chunks) if dense else self._slots(plan, chunks)
            if self.keeping_first_gradients:  # no optimizer= yet: its first step's local gradients start the velocities
                self._keep_first_gradients(plan, flat_in)
            working_set = self.feedback is not None and self.residual_kind != "float32"
            if self.adam is not None and not self.adam.active and self.step >= self.warmup.steps:
                self._start_adam()
            compressing = not dense and not self.warmup.active(self.step) and not self.guard.dense_now()
            warm = None if dense else self.warmup.codec_now(self.step)  # warm-up through an unbiased codec
            # error feedback computes in float32 whatever FSDP reduces in (a MixedPrecisionPolicy's
            # bf16/fp16 reduce dtype): velocities written into a bf16 chunk and bf16 codec input broke
            # top-k + AdamW under the bf16 policy (byte LM: 3.20 vs the policy's 2.66; upcast here 2.73)
            low = flat_in if self.feedback is not None and (compressing or warm is not None) and \
                flat_in.dtype in (torch.bfloat16, torch.float16) else None
            if low is not None:
                flat_in = low.float()
                flat_out = flat_in if hsdp else torch.empty(flat_out.numel(), dtype=torch.float32, device=flat_out.device)
            if self.adam is not None and self.adam.active and self.adam.live_variance:
                self._own_variance(plan, flat_in, 1.0 if average else float(n))
            self._momentum_before(plan, flat_in)
            if working_set:
                self._load_working_set(slots)
            if not dense and not compressing:  # warm-up, or the guard's dense steps (flushing residuals)
                if self.feedback is not None:
                    self._flush(slots, flat_in)
                slots = (self._dense_slots(plan, output.numel(), chunks) if warm is None
                         else self._slots(plan, chunks, warm))
            measured = compressing and self.guard.due(self.step)
            input_sq = self._norms_sq(slots, flat_in) if measured else 0.0
            if hsdp:  # the compressed all-reduce of the node's shard across nodes: the mean of the nodes'
                algorithm = self._cross_algorithm(warm or codec, slots)
                fut = comm.run(algorithm, flat_in, slots, group=self._inter_group,
                               stats=LevelStats(self._stats, "inter", LevelStats.TOTALS))
            else:
                algorithm = "reducescatter" if compressing or warm is not None else "reducescatter-dense"
                fut = comm.run(algorithm, flat_in, slots, group=group, stats=self._stats,
                               output=flat_out, average=average)
            fut.wait()
            if measured:  # the encode above updated the residuals
                self.guard.add(self._norms_sq(slots, None), input_sq)
                self._measured = True
            if working_set:
                self._store_working_set(slots, plan.calls)
            self._momentum_after(plan, flat_out, compressing)
            if low is not None:
                output.view(-1).copy_(flat_out)  # the reduced shard, back in FSDP's reduce dtype
            self._end_module(plan, output.device)
        if async_op:
            return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]
        return None

    def _cross_algorithm(self, codec: Codec, slots: Sequence[Slot]) -> str:
        """The algorithm of the node shard's all-reduce across nodes (sharded inside the node).

        Summable codecs (and dense steps) all-reduce; a re-encodable codec without residuals (QSGD,
        a warm-up codec) runs the two-phase all-reduce from 3 nodes on, whose bytes per rank stay
        about two frames where an all-gather's grow with the nodes; everything else all-gathers
        (the two-phase server side would need residuals of its own).
        """
        if codec.summable or isinstance(codec, NoneCodec):
            return "allreduce"
        if codec.reencodable and self.topology.nodes > 2 and all(s.feedback is None for s in slots):
            return "twophase"
        return "allgather"

    def _dense_slots(self, plan: ModulePlan, chunk: int, n: int) -> list[Slot]:
        return [Slot(f"{plan.name}#{j}", j * chunk, (chunk,), codecs.get("none")) for j in range(n)]

    def _slots(self, plan: ModulePlan, n: int, warm: Codec | None = None) -> list[Slot]:
        """The chunks' slots: the compressed parameters through the codec (``warm``: the warm-up's, no residuals)."""
        dense = codecs.get("none")
        codec = (plan.codec or self.codec) if warm is None else warm
        slots = []
        off = 0
        for j in range(n):
            for p in plan.params:
                seed = derive_seed(self.seed, plan.calls, p.index)
                fb = self.feedback if p.compressed and j != self.own_chunk and warm is None else None
                slots.append(Slot(piece_key(p.name, j), off, (p.chunk_numel,), codec if p.compressed else dense,
                                  seed, fb))
                off += p.chunk_numel
        return slots

    def _load_working_set(self, slots: Sequence[Slot]) -> None:
        """Stored residuals (bfloat16, int8, int4) -> float32 working copies for this module's step only."""
        assert self.feedback is not None
        for s in slots:
            low = self._low.get(s.key) if s.feedback is not None else None
            if low is not None:
                self.feedback.set_residual(s.key, low)

    def _store_working_set(self, slots: Sequence[Slot], call: int) -> None:
        """float32 working copies -> the stored kind (bfloat16: nearest; int8/int4: stochastic); copies freed."""
        assert self.feedback is not None
        for i, s in enumerate(slots):
            if s.feedback is None:
                continue
            e = self.feedback.residual(s.key)
            if e is not None:
                self._low.put(s.key, e, derive_seed(self.seed, call, i, 1 << 20))
            self.feedback.reset(s.key)

    # ----- memory and statistics --------------------------------------------------------------
    def residuals(self) -> dict[str, torch.Tensor]:
        """Every residual this rank keeps between steps, by key (live tensors; clone to keep)."""
        if self.feedback is None:
            return {}
        if self.residual_kind == "bfloat16":
            return dict(self._low.codes)
        if self.residual_kind != "float32":  # int8 / int4: float32 decodings (copies)
            return {k: e for k in self._low.codes if (e := self._low.get(k)) is not None}
        return {k: e for k in self.feedback.keys() if (e := self.feedback.residual(k)) is not None}

    def residual_bytes(self) -> int:
        """Bytes of error-feedback memory this rank keeps between steps (codes and scales)."""
        if self.feedback is not None and self.residual_kind != "float32":
            return self._low.nbytes()
        return sum(e.numel() * e.element_size() for e in self.residuals().values())

    def velocities(self) -> dict[str, torch.Tensor]:
        """Every velocity this rank keeps between steps, by key (float32 ones live; quantised ones decoded copies)."""
        out = dict(self.correction.velocity)
        out.update({k: v for k in self._vstore.codes if (v := self._vstore.get(k)) is not None})
        return out

    def velocity_bytes(self) -> int:
        """Bytes of the optimizer modes' velocities this rank keeps (shard-sized or local, see above).

        Local velocities in their stored kind (codes and scales, ``velocity_kind``); float32 otherwise.
        """
        return self._vstore.nbytes() + sum(v.numel() * v.element_size() for v in self.correction.velocity.values())

    def shard_bytes(self) -> int:
        """Bytes of this rank's gradient shard (every FSDP module's padded chunk, parameter dtype)."""
        return sum(p.chunk_numel * self._params[p.name].element_size() for m in self.modules for p in m.params)

    @property
    def counters(self) -> CommStats:
        """The raw thread-safe counters."""
        return self._stats

    def stats(self) -> dict[str, float]:
        """Steps, bytes handed to collectives vs FSDP's reduce-scatter, ratios, time, residual bytes.

        ``dense_bytes`` (= ``dense_wire``): what FSDP's own ring reduce-scatter sends per rank,
        ``(n-1)/n`` of its input; ``bytes_sent`` (= ``bytes_wire``): what the all_to_all sends
        to other ranks. ``*_per_step``: divided by the most reduce-scatters of one module.
        Memory: ``residual_bytes`` + ``velocity_bytes`` = ``compression_state_bytes``, against
        ``shard_bytes`` (this rank's gradient shard); the guard's and the SGD hand-over's counters.
        With a parameter all-gather installed (``param_codec=``, or its default for a compressing
        codec), the ``allgather_*`` keys of :meth:`ParamAllGather.stats` too; ``param_codec_defaulted``
        is 1 when ``param_codec=`` was left out (:attr:`param_codec_why` says what that chose and why).

        Sharded inside a node (HSDP): ``hierarchical`` (1.0 / 0.0), ``nodes``, ``local_world_size``;
        ``intra_bytes_sent`` (FSDP's reduce-scatter inside the node) and ``inter_bytes_sent`` /
        ``inter_bytes_wire`` (the cross-node all-reduce of the shard), per step in
        ``*_per_step``; ``inter_compression_ratio``: the float32 shard a dense HSDP all-reduce would
        hand over per step (``shard_bytes``) over ``inter_bytes_sent_per_step``.
        """
        s: dict[str, float] = dict(self._stats.as_dict())
        steps = max((m.calls for m in self.modules), default=0)
        s["steps"] = steps
        opts.ratio_stats(s, steps)
        s["hierarchical"] = float(self.topology.hierarchical)
        s["nodes"] = float(self.topology.nodes)
        s["local_world_size"] = float(self.topology.local_world_size)
        s["inter_bytes_sent_per_step"] = s["inter_bytes_sent"] / max(steps, 1)
        s["intra_bytes_sent_per_step"] = s["intra_bytes_sent"] / max(steps, 1)
        if self.topology.hierarchical:
            s["inter_compression_ratio"] = (self.shard_bytes() / s["inter_bytes_sent_per_step"]
                                            if s["inter_bytes_sent"] else 1.0)
        s["residual_bytes"] = self.residual_bytes()
        s["velocity_bytes"] = self.velocity_bytes()
        s["compression_state_bytes"] = s["residual_bytes"] + s["velocity_bytes"]
        s["shard_bytes"] = self.shard_bytes()
        s.update(self.guard.stats())
        if self.handover is not None:
            s.update(self.handover.stats())
        s["param_codec_defaulted"] = float(self.param_codec_defaulted)
        if self.allgather is not None:  # the parameter all-gather's counters (commpress.fsdp.allgather)
            s.update(self.allgather.stats())
        if self.auto is not None:  # codec="auto": each module's choice and predictions (commpress.fsdp.auto)
            s.update(self.auto.stats())
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
            "residuals": self._stored_residuals(),
            **({"residual_scales": self._low.state()[1]} if self.residual_kind in rstore.QUANTIZED else {}),
            "step": self.step,
            "momentum_rules": self.correction.rules_state(),
            "velocity": (self.handover.velocities() if self.handover is not None
                         else {k: v.detach().clone() for k, v in self.correction.velocity.items()}),
            "velocity_dtype": self.velocity_kind,
            **self._stored_velocities(),
            "guard": self.guard.state(),
            **({} if self.auto is None else {"auto": self.auto.state([m.name for m in self.modules])}),
        }

    def dcp(self, checkpoint_id: str | os.PathLike[str] | None = None, *, storage_reader: StorageReader | None = None,
            key: str | None = None) -> DCPState:
        """The state as a ``torch.distributed.checkpoint`` ``Stateful`` (:mod:`commpress.fsdp.dcp`).

        An adapter rather than the state itself, because :meth:`state_dict` keeps its per-rank
        file form (the same keys on every rank, which DCP would deduplicate); the adapter holds
        nothing, so ``state.dcp()`` can be written straight into the ``dcp.save`` / ``dcp.load`` dict.
        For ``dcp.load``, ``state.dcp(checkpoint_id=d)`` (or ``storage_reader=``) also resumes a
        checkpoint written at another world size: it reads the checkpoint's metadata to find the
        saved entries (``key``: the entry's name in the dcp dict, needed only when it holds several
        commpress states). Do not pass it to ``dcp.save``.
        """
        return DCPState(self, checkpoint_id, storage_reader=storage_reader, key=key)

    def _stored_residuals(self) -> dict[str, torch.Tensor]:
        if self.feedback is not None and self.residual_kind != "float32":
            return self._low.state()[0]
        return {k: v.detach().clone() for k, v in self.residuals().items()}

    def _stored_velocities(self) -> dict[str, dict[str, torch.Tensor]]:
        """The quantised local velocities in checkpoint form (``velocity_codes``, ``velocity_scales``)."""
        if self.velocity_kind == "float32":
            return {}
        codes, scales = self._vstore.state()
        return {"velocity_codes": codes, **({"velocity_scales": scales} if self.velocity_kind in rstore.QUANTIZED else {})}

    def _velocity_layout(self) -> tuple[dict[str, int], dict[str, int]]:
        """:meth:`_velocity_numels` split: ``(kept in float32, stored as velocity_kind codes)``."""
        numels = self._velocity_numels()
        if self.velocity_kind == "float32":
            return numels, {}
        local = {piece_key(n, j) for n, where in self._placement.items() if where == "local" for j in range(self.chunks)}
        return ({k: v for k, v in numels.items() if k not in local}, {k: v for k, v in numels.items() if k in local})

    def _velocity_numels(self) -> dict[str, int]:
        """Key -> elements of every velocity this rank may keep (shard-sized, or one per chunk)."""
        out = {}
        for name, p in self._shard_plans().items():
            if self._placement.get(name) == "local":
                out.update({piece_key(name, j): p.chunk_numel for j in range(self.chunks)})
            elif name in self._placement:
                out[name] = p.chunk_numel
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output after validating all of it (all or nothing).

        Written at another world size (one rank's file, any rank's for a rank the old run did not
        have), it loads what is the same on every rank: configuration, step, seed, call counts,
        guard state and ``codec="auto"``'s choices; this rank's residuals and velocities (local
        ones and those of the reduced shards, which move when the world size changes) start empty,
        with one warning on the ``commpress`` logger naming what was dropped
        (:func:`commpress.checkpoint.resize_warning`). Their storage kinds stay this state's own
        (``residual_dtype="auto"`` resolved at this world size), whatever the checkpoint's were.
        The same world size with another rank's state raises (a mix-up, not a resize).
        """
        self._load_state_dict(state, "file")

    def _load_state_dict(self, state: Mapping[str, Any], source: str) -> None:
        """:meth:`load_state_dict`; ``source`` names where ``state`` came from in the resize warning."""
        required = {"error_feedback", "residual_dtype", "world_size", "rank", "seed", "calls", "residuals"}
        check_state_header(state, required=required, fmt=STATE_FORMAT, codec=self.codec, what="commpress FSDP state")
        hint = ("residuals are per rank: save and load one commpress state per rank; "
                "in torch.distributed.checkpoint pass state.dcp(), not the state")
        resized = checkpoint.resized(state, self.world_size, self.rank, hint)
        # at another world size the storage kinds are this state's own: nothing stored in them is loaded
        compared = (("error_feedback", self.error_feedback),) + (() if resized else (("residual_dtype", str(self.residual_dtype)),))
        for what, mine in compared:
            if state[what] != mine:
                fix = (f"register with residual_dtype={state[what]} to resume it (the default is 'auto' since "
                       "2026-12-04, float32 before)" if what == "residual_dtype" else hint)
                raise ValueError(f"{what} mismatch: checkpoint has {state[what]!r}, this state {mine!r} ({fix})")
        seed = opts.check_saved_seed(state)
        calls = dict(state["calls"])
        if sorted(calls) != sorted(m.name for m in self.modules) or not all(
            isinstance(c, int) and c >= 0 for c in calls.values()
        ):
            raise ValueError(f"calls {calls!r} do not match this model's FSDP modules {[m.name for m in self.modules]}")
        shapes = self.residual_shapes()
        residuals = {} if resized else dict(state["residuals"])
        low = rstore.ResidualStore(self.residual_kind)
        if self.residual_kind == "float32":
            for key, value in residuals.items():
                if key not in shapes:
                    raise ValueError(f"residual {key!r} is not one this rank keeps")
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes[key]:
                    raise ValueError(f"residual {key!r} must be a tensor of shape {shapes[key]}")
                check_loaded_tensor(value, f"residual {key!r}", dtypes=(torch.float32,))
        elif not resized:
            low.load(residuals, dict(state.get("residual_scales") or {}), {k: v[0] for k, v in shapes.items()})
        step = state.get("step", min(calls.values(), default=0))
        if not isinstance(step, int) or not 0 <= step < 1 << 62:
            raise ValueError(f"step must be an int in [0, 2**62), got {step!r}")
        if self.discovery is not None and self.discovery.pending and (
            state.get("velocity") or state.get("velocity_codes") or state.get("momentum_rules")
        ):
            raise ValueError(
                "the checkpoint holds the optimizer's momentum (it was written after the optimizer was "
                "adopted), but this state has not adopted one yet (no optimizer= given: it is found after "
                "its first step): register with optimizer=<your optimizer> to resume from it"
            )
        chosen = None
        if self.auto is not None:
            if "auto" not in state:
                raise ValueError("codec mismatch: the checkpoint was not written by codec='auto' (it holds no per-module "
                                 "choices); register with the codec it was written with")
            chosen = self.auto.load(state["auto"], [m.name for m in self.modules])
        elif "auto" in state:
            raise ValueError("codec mismatch: the checkpoint was written by codec='auto'; register with codec='auto' "
                             "to resume it")
        if resized:
            dropped = checkpoint.resize_warning(
                "commpress FSDP state", state, self.world_size, self.rank, source=source, dropped=_per_rank(state),
                kept=f"the configuration, step {step}, seed, call counts"
                     f"{', codec=auto choices' if chosen is not None else ''} and guard state")
            velocity: dict[str, torch.Tensor] = {}
            vstore = rstore.ResidualStore(self.velocity_kind, "velocity", rstore.VELOCITY_BLOCK)
        else:
            velocity, vstore = self._load_velocities(state)
        guard = dataclasses.replace(self.guard)
        if "guard" in state:
            guard.load(state["guard"])
        self.feedback = self._new_feedback()
        self._low = low
        if self.residual_kind == "float32":
            for key, value in residuals.items():
                assert self.feedback is not None
                self.feedback.set_residual(key, value.detach().clone())
        for m in self.modules:
            m.calls = int(calls[m.name])
        self.seed = seed
        self.step = step
        self.guard = guard
        if self.handover is not None:
            self.handover.take(keep_velocity=True)
        self.correction.velocity = velocity
        self._vstore = vstore
        if self.auto is not None and chosen is not None:  # the saved choices, whatever this run's calibration said
            self.auto.choices, self.auto.loaded = chosen, True
            self._apply_auto()
        if resized:
            logger.warning("%s", dropped)

    def _load_velocities(self, state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], rstore.ResidualStore]:
        """Validate the checkpoint's velocities: float32 ones and ``velocity_dtype`` codes (nothing adopted yet)."""
        saved_kind = state.get("velocity_dtype", "float32")  # files written before velocities were quantised
        floats, stored = self._velocity_layout()
        saved = dict(state.get("velocity") or {})
        codes = dict(state.get("velocity_codes") or {})
        if saved_kind != self.velocity_kind and (codes or set(saved) & set(stored)):
            raise ValueError(
                f"velocity_dtype mismatch: the checkpoint stores local velocities as {saved_kind!r}, this state as "
                f"{self.velocity_kind!r} (residual_dtype={self.residual_dtype}): register with the residual_dtype it was "
                "written with"
            )
        if set(saved) & set(stored):
            raise ValueError(f"velocity {sorted(set(saved) & set(stored))[0]!r} is float32 in the checkpoint, but this "
                             f"state stores it as {self.velocity_kind} codes (velocity_codes)")
        velocity = MomentumCorrection.load_velocities(saved, floats)
        vstore = rstore.ResidualStore(self.velocity_kind, "velocity", rstore.VELOCITY_BLOCK)
        if self.velocity_kind != "float32":
            vstore.load(codes, dict(state.get("velocity_scales") or {}), stored)
        elif codes:
            raise ValueError("the checkpoint holds quantised velocities (velocity_codes), this state keeps float32 ones")
        return velocity, vstore

    def __repr__(self) -> str:
        return (
            f"FSDPCompressionState(codec={self.codec!r}, error_feedback={self.error_feedback}, "
            f"residual_dtype={self.residual_dtype}, rank={self.rank}/{self.world_size}, modules={len(self.modules)}, "
            f"all-gather={'FSDP' if self.allgather is None else self.allgather.config()})"
        )


def _per_rank(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's per-rank parts, decoded to float32: what a load at another world size drops (its warning)."""
    kind = str(state["residual_dtype"]).removeprefix("torch.")
    parts: dict[str, Any] = {}
    for name in ("residuals", "residual_scales", "velocity", "velocity_codes", "velocity_scales"):
        value = state.get(name) or {}
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
        parts[name] = value
    velocity_kind = state.get("velocity_dtype", "float32")
    velocities = {k: v for k, v in parts["velocity"].items() if isinstance(v, torch.Tensor)}
    velocities.update(rstore.decoded(velocity_kind, parts["velocity_codes"], parts["velocity_scales"],
                                     rstore.VELOCITY_BLOCK, "velocity"))
    return {"error-feedback residual(s)": rstore.decoded(kind, parts["residuals"], parts["residual_scales"], rstore.BLOCK),
            "velocity(ies)": velocities}
