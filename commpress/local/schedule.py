"""The local-step schedule every low-communication trainer shares: hook, counting, group, agreement.

A trainer here (:class:`~commpress.local.LocalSGD`, :class:`~commpress.local.DiLoCo`) wraps a
plain module per rank (no DDP wrapper) and its inner optimizer. Used as a context manager it
installs a step post-hook on that optimizer (``register_step_post_hook``); every ``sync_every``
inner steps the hook runs the trainer's :meth:`LocalSchedule.sync`, inside the user's
``optimizer.step()``, so the training loop does not change. Leaving the context removes the hook.

What lives here, once: the argument checks (a module, a ``torch.optim`` optimizer over its
parameters, ``sync_every >= 1``), the flat layout of the trainable parameters (one floating
dtype, one device), the process group and its :class:`~commpress.comm.faults.FaultChannel`
(every sync runs in a guarded scope: a failure on one rank is every rank's error, waits are
bounded), and the cross-rank configuration check (:func:`~commpress.comm.agreement.check_same_config`:
ranks built differently fail at construction, on every rank, naming what differs).

**Replicas of several ranks** (``replica_group=``): a worker may be a group of ranks that keep
identical parameters themselves (the user runs DDP, or anything that keeps them equal, inside the
group, over its fast links). :func:`cross_replica_group` pairs the ranks by their position in
their replica (position ``i`` of every replica forms one group, as INTELLECT-1 and torchft do),
and the trainer syncs over that group: the outer traffic crosses replicas, the inner traffic stays
the user's. Every position holds the same parameters as its replica's other positions, sends the
same bytes and reads the same averages with the same seeds, so the replica stays identical.

**FSDP2 inside a replica**: a replica may instead shard its parameters over its own ranks
(``fully_shard(..., mesh=<the replica's 1-D mesh>)``, ``replica_group=`` that mesh's group). Then
position ``i`` of every replica holds the same shard, and the trainer syncs this rank's local shards
(:attr:`LocalSchedule.params`): each rank sends and keeps a global copy of ``1/L`` of the model, where
DDP inside a replica sends and keeps all of it. :func:`check_replica_sharding` refuses what would sync
the wrong tensors: sharded parameters without ``replica_group``, a mesh other than the replica's, HSDP's
2-D mesh (it all-reduces across replicas every step itself).

**A rank that dies or never arrives.** The fault channel turns a failure a rank *raises* into every
rank's error; a rank that is killed, or hangs, raises nothing. So every sync also writes this
rank's sync number into the process group's store (one ``set`` per sync, not per step), and
:meth:`LocalSchedule.wait_sync` waits for the sync's collective for at most ``sync_timeout``
seconds: when the collective breaks (gloo: "Connection reset by peer" once the peer's process is
gone) or the time runs out (a peer that hangs, or whose machine vanished without closing its
connections), it reads the others' sync numbers and raises
:class:`~commpress.errors.RankFailedError` naming the rank(s) that did not arrive at this sync (or,
when all arrived, that the collective broke after they did). The trainer then stays failed: every
later sync raises the same error at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .. import options as opts
from ..comm import callbacks
from ..comm.agreement import check_same_config
from ..comm.faults import FaultChannel
from ..comm.store import group_name, tcp_store
from ..errors import ConfigurationError, RankFailedError

logger = logging.getLogger("commpress")

#: seconds every rank has to construct the trainer before the others fail (configuration check)
VERIFY_TIMEOUT_S = 60.0
#: seconds a sync waits for every other rank's part before it names the missing rank(s): long
#: enough for a straggler's slow step plus a large transfer on a slow link, far below gloo's 30 min
SYNC_TIMEOUT_S = 300.0
#: how often a blocked sync wait looks at the fault channel (a failure another rank posted)
_WAIT_SLICE_S = 0.1


def check_replica_sharding(names: Sequence[str], params: Sequence[torch.Tensor], replica_group: Any) -> None:
    """FSDP2 parameters (DTensors) must live on a 1-D mesh of exactly ``replica_group``'s ranks.

    Each rank then syncs its own shard with the same position of the other replicas (module
    docstring); a parameter sharded over any other set of ranks would be averaged with a different
    shard. ``ConfigurationError`` naming the parameter otherwise.
    """
    from torch.distributed.tensor import DTensor

    replica = None if replica_group is None else sorted(dist.get_process_group_ranks(replica_group))
    for name, p in zip(names, params):
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        if mesh.ndim != 1:
            raise ConfigurationError(
                f"parameter {name!r} lives on a {mesh.ndim}-D device mesh (HSDP: it all-reduces across replicas every "
                "step): shard each replica over its own ranks, fully_shard(model, mesh=mesh['shard']), and pass "
                "replica_group=mesh['shard'].get_group()")
        if replica is None and len(ranks) > 1:
            raise ConfigurationError(
                f"parameter {name!r} is sharded over ranks {ranks} (FSDP2): pass replica_group= the group it is "
                "sharded over (mesh.get_group()); each shard is then synced with the same shard of the other replicas")
        if replica is not None and ranks != replica:
            raise ConfigurationError(
                f"parameter {name!r} is sharded over ranks {ranks}, but replica_group holds ranks {replica}: shard "
                "each replica over exactly its own ranks")


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor as this rank holds it: a DTensor's local shard (shares its storage), else itself."""
    if hasattr(p, "to_local"):
        with torch.no_grad():  # the shard itself, not an autograd view of it
            return p.to_local()
    return p


def check_sync_every(sync_every: Any) -> int:
    """``sync_every`` (H): an int >= 1."""
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ConfigurationError(f"sync_every must be an int >= 1 (inner steps between syncs), got {sync_every!r}")
    return sync_every


#: (world ranks of every replica) -> this rank's cross-replica group, so one layout builds its groups once
_CROSS_GROUPS: dict[tuple[tuple[int, ...], ...], Any] = {}


def cross_replica_group(replica_group: Any) -> Any:
    """The process group of the ranks at this rank's position in every replica (see the module docstring).

    Collective over the whole world: every rank calls it, with its own replica's group. Replicas
    must partition the world into groups of one size (ConfigurationError on every rank otherwise).
    """
    mine = dist.get_process_group_ranks(replica_group)
    world = dist.get_world_size()
    size = torch.tensor([len(mine)], dtype=torch.int64)
    sizes = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, size)
    if not bool((sizes == sizes[0]).all()):
        raise ConfigurationError(f"replica_group: replicas must have one size, got sizes {sizes.tolist()} by rank")
    layout = torch.empty(world * len(mine), dtype=torch.int64)
    dist.all_gather_into_tensor(layout, torch.tensor(mine, dtype=torch.int64))
    seen = {tuple(layout[r * len(mine) : (r + 1) * len(mine)].tolist()) for r in range(world)}
    replicas = tuple(sorted(seen))
    flat = sorted(r for rep in replicas for r in rep)
    if flat != list(range(world)):
        raise ConfigurationError(f"replica_group: the replicas {list(replicas)} must split the world's {world} ranks "
                                 "into disjoint groups of one size")
    if replicas not in _CROSS_GROUPS:
        groups = [dist.new_group([rep[i] for rep in replicas]) for i in range(len(mine))]  # every rank, one order
        _CROSS_GROUPS[replicas] = groups
    return _CROSS_GROUPS[replicas][mine.index(dist.get_rank())]


class LocalSchedule:
    """Base of the local-step trainers: counts inner steps and calls :meth:`sync` every ``sync_every``.

    Subclasses define :meth:`sync` (all ranks, in the same order) and :meth:`config`.
    """

    #: names the trainer in errors and the agreement check
    what = "commpress.local"
    #: trainers built in this process, per process group (their arrival keys' namespace)
    _built: ClassVar[dict[str, int]] = {}

    def __init__(self, model: Any, optimizer: Any, sync_every: int, *, process_group: Any = None,
                 verify_timeout: float = VERIFY_TIMEOUT_S, sync_timeout: float = SYNC_TIMEOUT_S,
                 replica_group: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigurationError(f"model must be a torch.nn.Module (a plain module per rank), got {type(model).__name__}")
        if hasattr(model, "require_backward_grad_sync"):
            raise ConfigurationError(f"{self.what} takes the plain module, not a DDP wrapper: pass ddp.module")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.sync_every = check_sync_every(sync_every)
        self.timeout_s = opts.check_timeout(verify_timeout)
        self.sync_timeout_s = opts.check_timeout(sync_timeout, "sync_timeout")
        self.model = model
        self.optimizer = optimizer
        self.names, self._params = self._trainable(model, optimizer)
        opts.require_process_group()
        check_replica_sharding(self.names, self._params, replica_group)
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.replica_group = replica_group
        if replica_group is not None:
            if process_group is not None:
                raise ConfigurationError("pass process_group (the workers) or replica_group (this rank's replica), not both")
            process_group = cross_replica_group(replica_group)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.faults = FaultChannel.of(process_group)
        store = tcp_store(process_group)
        self._store: Any = store.clone() if store is not None else None
        # one key space per trainer: a second trainer on the group must not read the first one's numbers
        # (every rank constructs its trainers in one order, the configuration check makes sure of it)
        name = group_name(process_group)
        LocalSchedule._built[name] = LocalSchedule._built.get(name, 0) + 1
        self._arrive_prefix = f"commpress/local/{name}/{LocalSchedule._built[name]}/arrived/"
        self._failed: BaseException | None = None  # a peer lost at a sync: every later sync raises it
        self.step = 0  # inner steps taken (the schedule's clock; checkpointed)
        self.syncs = 0  # syncs run by the schedule (checkpoints check it against the step)
        self.final_syncs = 0  # syncs run by finish(), of the steps the schedule had not synced
        self._handle: Any = None

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors synced, in :attr:`names` order: the trainable parameters, or their local shards (FSDP2).

        Looked up at each use, not kept: FSDP2 can give a parameter a new local tensor
        (``FSDPParam.reset_sharded_param``, after ``nn.Module._apply`` or a load that replaced
        it), and the sync must write into the one the model reads.
        """
        return [_local(p) for p in self._params]

    @staticmethod
    def _trainable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[str], list[torch.nn.Parameter]]:
        """Names and parameters synced: every trainable one, in ``named_parameters`` order (the same on every rank)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigurationError("model has no trainable parameters to synchronise")
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        stray = [n for n, p in named if id(p) not in owned]
        if stray:
            raise ConfigurationError(f"optimizer does not update parameter(s) {stray[:3]}: pass the model's own optimizer")
        kinds = {(p.dtype, p.device) for _, p in named}
        if len(kinds) != 1 or not named[0][1].is_floating_point():
            raise ConfigurationError(f"trainable parameters must share one floating dtype and device, got {sorted(map(str, kinds))}")
        return [n for n, _ in named], [p for _, p in named]

    # ----- the hook ------------------------------------------------------------------------------
    def __enter__(self) -> LocalSchedule:
        if self._handle is not None:
            raise RuntimeError(f"{self.what} is already entered")
        self._handle = self.optimizer.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step += 1
        if self._failed is not None:
            raise self._failed
        try:
            self.tick()
        except RankFailedError as exc:
            self._failed = exc
            raise

    def tick(self) -> None:
        """After inner step :attr:`step`: run the sync when it is due (every ``sync_every`` steps)."""
        if self.step % self.sync_every == 0:
            self._run_sync(final=False)

    @property
    def sync_index(self) -> int:
        """Syncs run so far, the schedule's and :meth:`finish`'s: the next sync's index (arrival key, seeds)."""
        return self.syncs + self.final_syncs

    def _count_sync(self, final: bool) -> None:
        """Count a sync that ran: :meth:`finish`'s apart, so :attr:`syncs` keeps matching the step."""
        if final:
            self.final_syncs += 1
        else:
            self.syncs += 1

    def _run_sync(self, final: bool) -> None:
        """One sync on every rank: the schedule's, or (``final``) :meth:`finish`'s."""
        index = self.sync_index
        with torch.no_grad(), self.faults.guarded(self.where(index)):
            self.arrive(index)
            error = self.sync()
        self._count_sync(final)
        if error is not None:  # the same on every rank (decided from one collective's result)
            raise error

    def finish(self) -> None:
        """Sync the steps taken since the last sync: call it once after the last inner step, every rank.

        Every rank then ends with the same model (nothing is sent when the loop ended at a sync).
        """
        if self.step % self.sync_every:
            self._run_sync(final=True)

    def where(self, sync: int | None = None, step: int | None = None) -> str:
        """Names a sync in errors: ``"commpress.local.DiLoCo sync 3 (inner step 8)"``."""
        return f"{self.what} sync {self.syncs if sync is None else sync} (inner step {self.step if step is None else step})"

    # ----- arrival and the bounded wait ---------------------------------------------------------
    def _arrived_key(self, rank: int) -> str:
        return f"{self._arrive_prefix}{rank}"

    def arrive(self, sync: int) -> None:
        """Record in the store that this rank reached sync ``sync`` (read only when a sync fails)."""
        if self._store is not None and self.world_size > 1:
            self._store.set(self._arrived_key(self.rank), str(sync))

    def missing(self, sync: int) -> tuple[list[int], str]:
        """The ranks that did not reach sync ``sync`` (by the store), and a sentence on what was seen."""
        if self._store is None:
            return [], "no TCPStore to tell which rank is missing"
        seen: dict[int, int] = {}
        try:
            for r in range(self.world_size):
                if r != self.rank:
                    key = self._arrived_key(r)
                    seen[r] = int(self._store.get(key)) if self._store.check([key]) else -1
        except Exception as exc:  # noqa: BLE001 - the store's host (the group's first rank) is gone
            return [0] if self.rank != 0 else [], f"the store is unreachable ({type(exc).__name__}): its host, rank 0, is gone"
        absent = sorted(r for r, s in seen.items() if s < sync)
        last = ", ".join(f"rank {r}: {'none' if seen[r] < 0 else f'sync {seen[r]}'}" for r in absent)
        return absent, f"last sync reached: {last}" if absent else "every rank reached it"

    def wait_sync(self, fut: torch.futures.Future[Any], sync: int, step: int) -> float:
        """Wait for sync ``sync``'s future for at most ``sync_timeout``; the seconds this thread blocked.

        Raises :class:`RankFailedError` naming the missing rank(s) when the collective breaks or
        the time runs out (module docstring), or the fault another rank posted.
        """
        start = time.perf_counter()
        if not fut.done():
            done = threading.Event()
            callbacks.add_done_callback(fut, lambda _: done.set())
            deadline = start + self.sync_timeout_s
            while not done.wait(_WAIT_SLICE_S):
                self.faults.check()
                if time.perf_counter() > deadline:
                    absent, seen = self.missing(sync)
                    raise RankFailedError(absent[0] if absent else self.rank, self.where(sync, step),
                                          f"the sync's collective did not complete within sync_timeout="
                                          f"{self.sync_timeout_s:g} s; rank(s) {absent} did not arrive ({seen}): "
                                          "dead, hung, or slower than sync_timeout")
        blocked = time.perf_counter() - start
        try:
            fut.wait()
        except RankFailedError:
            raise
        except Exception as exc:  # noqa: BLE001 - a collective that broke: tell whose absence broke it
            self.faults.check()
            absent, seen = self.missing(sync)
            if absent:
                reason = f"did not arrive and its connection is gone ({seen}); the collective failed with: {exc}"
            else:
                reason = f"the collective failed after every rank arrived (a peer gone mid-sync?): {exc}"
            raise RankFailedError(absent[0] if absent else self.rank, self.where(sync, step), reason) from exc
        return blocked

    def sync(self) -> Exception | None:
        """Synchronise the ranks (every rank calls it at the same inner step).

        Returns an error every rank raises after the guarded scope (one that is not a failure of
        this rank alone, so it is not posted to the others), or None.
        """
        raise NotImplementedError

    # ----- helpers for subclasses -----------------------------------------------------------------
    def flat_params(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The trainable parameters as one flat buffer, in :attr:`names` order."""
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        off = 0
        for p in self.params:
            out[off : off + p.numel()].copy_(p.detach().reshape(-1))
            off += p.numel()
        return out

    def set_params(self, flat: torch.Tensor) -> None:
        """Copy a flat buffer (any device) into the trainable parameters."""
        off = 0
        for p in self.params:
            p.detach().copy_(flat[off : off + p.numel()].view(p.shape))
            off += p.numel()

    def config(self) -> dict[str, Any]:
        """Everything all ranks must agree on (plain types)."""
        return {
            "trainer": type(self).__name__, "sync_every": self.sync_every, "world_size": self.world_size,
            "params": [[n, list(p.shape), str(p.dtype)] for n, p in zip(self.names, self.params)],
        }

    def verify_ranks(self, summary: str) -> None:
        """Fail on every rank when ranks constructed the trainer differently (or not at all)."""
        check_same_config(self.config(), summary=summary, group=self.process_group, timeout_s=self.timeout_s,
                          what=self.what)


__all__ = ["VERIFY_TIMEOUT_S", "LocalSchedule", "check_replica_sharding", "check_sync_every"]
