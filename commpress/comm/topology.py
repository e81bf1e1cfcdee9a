"""Which ranks share a node: :class:`Topology`, its detection, and the node sub-groups.

A cluster is ``nodes`` machines of ``local_world_size`` (L) ranks each, joined by a network much
slower than the links inside a node. The hierarchical algorithm (:mod:`.hierarchical`) needs to
know the layout; it comes from, in order:

1. an explicit ``local_world_size=L`` (:func:`explicit`): the world must be ``nodes x L`` with the
   ranks of a node contiguous (ranks ``n*L .. n*L+L-1`` are node ``n``); anything else is a
   :class:`~commpress.errors.ConfigurationError` naming what does not fit;
2. torchrun's environment (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), read on every rank that has
   both and exchanged through the process group's store (:func:`from_environment`, decided by the pure
   :func:`decide`): used only when it describes a homogeneous layout of more than one node with
   each node's ranks contiguous; any other layout (nodes of different sizes, interleaved ranks,
   variables set on some ranks only) falls back to flat, with a log line saying why;
3. otherwise flat (every rank its own "node" as far as commpress is concerned: today's behaviour).

One node (``L == world``) or one rank per node (``L == 1``) is flat too: there is no slow hop to
single out. :func:`node_groups` creates the intra-node and inter-node process groups once per
process group and layout (``torch.distributed.new_group`` is collective over its members: every
rank calls it for its own two groups, intra first, in the same order).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigurationError
from .store import group_name, store_of

logger = logging.getLogger("commpress")

#: where a topology came from
SOURCES = ("explicit", "torchrun", "flat")


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks as ``nodes`` nodes of ``local_world_size`` contiguous ranks; ``source`` says how it was found.

    A flat topology has ``local_world_size == 1`` (``nodes == world_size``).
    """

    world_size: int
    local_world_size: int
    source: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"topology source must be one of {SOURCES}, got {self.source!r}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"{self.world_size} ranks do not make nodes of {self.local_world_size}")

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return self.world_size // self.local_world_size

    @property
    def hierarchical(self) -> bool:
        """True when there are several nodes of several ranks (a slow hop worth singling out)."""
        return self.local_world_size > 1 and self.nodes > 1

    def node_of(self, rank: int) -> int:
        """The node of group rank ``rank``."""
        return rank // self.local_world_size

    def local_rank(self, rank: int) -> int:
        """The position of group rank ``rank`` inside its node."""
        return rank % self.local_world_size

    def config(self) -> dict[str, Any]:
        """Plain-type form for the configuration agreement and ``stats()``."""
        return {"nodes": self.nodes, "local_world_size": self.local_world_size, "source": self.source}


def flat(world_size: int, reason: str = "") -> Topology:
    """Every rank alone: today's behaviour."""
    return Topology(world_size, 1, "flat", reason)


def explicit(world_size: int, local_world_size: Any) -> Topology:
    """The topology a user asked for with ``local_world_size=``; :class:`ConfigurationError` if it cannot be."""
    if not isinstance(local_world_size, int) or isinstance(local_world_size, bool) or local_world_size < 1:
        raise ConfigurationError(f"local_world_size must be an int >= 1 (ranks per node), got {local_world_size!r}")
    if world_size % local_world_size:
        raise ConfigurationError(
            f"local_world_size={local_world_size} does not divide the {world_size} ranks of the process group: "
            "the hierarchical algorithm needs every node to hold the same number of ranks (a homogeneous layout)"
        )
    if local_world_size in (1, world_size):
        return flat(world_size, f"local_world_size={local_world_size}: "
                                f"{'one node' if local_world_size == world_size else 'one rank per node'}, no slow hop")
    return Topology(world_size, local_world_size, "explicit")


@dataclass(frozen=True)
class RankPlace:
    """What one rank's environment says of its node: ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (None: unset)."""

    local_world_size: int | None
    node: int | None

    def encode(self) -> str:
        """Store form: ``"L node"`` with ``-`` for an unset value."""
        return f"{'-' if self.local_world_size is None else self.local_world_size} {'-' if self.node is None else self.node}"

    @staticmethod
    def decode(text: str) -> RankPlace:
        """Inverse of :meth:`encode` (a malformed entry reads as unset)."""
        parts = text.split()
        if len(parts) != 2:
            return RankPlace(None, None)
        vals = [int(p) if p.lstrip("-").isdigit() and p != "-" else None for p in parts]
        return RankPlace(vals[0], vals[1])


def read_environment(env: Mapping[str, str] | None = None) -> RankPlace:
    """The ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` of this rank (torchrun sets both), None where unset."""
    env = os.environ if env is None else env

    def number(key: str) -> int | None:
        value = env.get(key, "").strip()
        return int(value) if value.isdigit() else None

    return RankPlace(number("LOCAL_WORLD_SIZE"), number("GROUP_RANK"))


def decide(places: Sequence[RankPlace]) -> Topology:
    """The topology the ranks' environments describe (``places[r]``: group rank r's), else flat with the reason.

    Hierarchical only when every rank has both variables, all ``LOCAL_WORLD_SIZE`` are one L that
    divides the world, and group rank ``r`` is on node ``r // L`` of the nodes in order of first
    appearance (each node's ranks contiguous, every node L ranks) and there is more than one node.
    """
    world = len(places)
    if not places or any(p.local_world_size is None or p.node is None for p in places):
        missing = [r for r, p in enumerate(places) if p.local_world_size is None or p.node is None]
        return flat(world, "" if len(missing) == world else f"LOCAL_WORLD_SIZE/GROUP_RANK unset on ranks {missing}")
    sizes = sorted({p.local_world_size for p in places if p.local_world_size is not None})
    if len(sizes) != 1:
        return flat(world, f"non-homogeneous layout: LOCAL_WORLD_SIZE differs across ranks {sizes}")
    size = sizes[0]
    order: list[int] = []
    for p in places:
        if p.node not in order:
            order.append(p.node)  # type: ignore[arg-type]
    counts = [sum(1 for p in places if p.node == n) for n in order]
    if world % size or any(c != size for c in counts):
        return flat(world, f"non-homogeneous layout: nodes hold {counts} ranks of this group, LOCAL_WORLD_SIZE={size}")
    if any(order.index(p.node) != r // size for r, p in enumerate(places)):  # type: ignore[arg-type]
        return flat(world, "ranks of a node are not contiguous in the process group: "
                           f"nodes by rank {[p.node for p in places]}")
    if size in (1, world):
        return flat(world, f"LOCAL_WORLD_SIZE={size}: {'one node' if size == world else 'one rank per node'}, no slow hop")
    return Topology(world, size, "torchrun")


#: per process group: how many environment exchanges it has run (keys are never reused)
_rounds: dict[str, int] = {}


def _exchange(text: str, group: Any, timeout_s: float) -> list[str]:
    """Every rank's ``text`` in rank order, through the process group's store (a collective without one)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    store = store_of(group)
    if store is None:
        mine = torch.zeros(32, dtype=torch.uint8)
        raw = text.encode()[:32]
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        everyone = torch.empty(world * 32, dtype=torch.uint8)
        dist.all_gather_into_tensor(everyone, mine, group=group)
        return [bytes(everyone[r * 32 : (r + 1) * 32].tolist()).rstrip(b"\0").decode() for r in range(world)]
    name = group_name(group)
    round_ = _rounds.get(name, 0)
    _rounds[name] = round_ + 1
    keys = [f"commpress/topology/{round_}/{r}" for r in range(world)]
    store.set(keys[rank], text)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:
        try:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        except RuntimeError:  # the store went away with its host rank
            missing = list(range(world))
        raise ConfigurationError(
            f"commpress: rank {rank} read the node layout from torchrun's variables, but ranks {missing} did not "
            f"within {timeout_s:g} s (verify_timeout): call commpress.ddp.register on every rank, each with "
            "LOCAL_WORLD_SIZE and GROUP_RANK set (torchrun sets both), or pass local_world_size="
        ) from None
    return [store.get(k).decode() for k in keys]


def from_environment(group: Any, timeout_s: float, env: Mapping[str, str] | None = None) -> Topology:
    """The topology torchrun's variables describe for ``group`` (all ranks exchange theirs), else flat.

    A layout that is not homogeneous is logged and run flat (detected, not asked for).
    """
    world = dist.get_world_size(group)
    mine = read_environment(env)
    if world < 2 or mine.local_world_size is None or mine.node is None:
        return flat(world)  # not launched by torchrun (mp.spawn, mpirun): nothing to exchange
    places = [RankPlace.decode(t) for t in _exchange(mine.encode(), group, timeout_s)]
    topo = decide(places)
    if topo.reason:  # a single node is the usual case: only a layout that cannot be used is worth a line
        level = logging.DEBUG if "no slow hop" in topo.reason else logging.INFO
        logger.log(level, "commpress: running flat: %s", topo.reason)
    return topo


def resolve(group: Any, local_world_size: int | None, timeout_s: float, env: Mapping[str, str] | None = None) -> Topology:
    """The topology a registration runs: explicit ``local_world_size``, else torchrun's environment, else flat."""
    world = dist.get_world_size(group)
    if local_world_size is not None:
        return explicit(world, local_world_size)
    return from_environment(group, timeout_s, env)


@dataclass(frozen=True)
class NodeGroups:
    """The two sub-groups of a rank: ``intra`` (its node's ranks), ``inter`` (the same local rank on every node)."""

    intra: Any
    inter: Any
    local_rank: int
    node: int


_GROUPS: dict[tuple[str, int, int], NodeGroups] = {}


def node_groups(topology: Topology, group: Any) -> NodeGroups:
    """The intra-node and inter-node groups of this rank for ``topology`` over ``group`` (created once).

    Each rank creates only the two groups it belongs to, intra first (``use_local_synchronization``:
    only the members call it), so a registration on a sub-group of the world needs nothing of
    the ranks outside it.
    """
    if not topology.hierarchical:
        raise ConfigurationError(f"node_groups needs a multi-node topology, got {topology}")
    rank = dist.get_rank(group)
    key = (group_name(group), topology.local_world_size, topology.world_size)
    found = _GROUPS.get(key)
    if found is not None:
        return found
    pg = group if group is not None else dist.group.WORLD
    members = dist.get_process_group_ranks(pg)  # global ranks in group-rank order
    L, node, local = topology.local_world_size, topology.node_of(rank), topology.local_rank(rank)
    intra_ranks = [members[node * L + j] for j in range(L)]
    inter_ranks = [members[n * L + local] for n in range(topology.nodes)]
    intra = dist.new_group(intra_ranks, use_local_synchronization=True)
    inter = dist.new_group(inter_ranks, use_local_synchronization=True)
    found = _GROUPS[key] = NodeGroups(intra, inter, local, node)
    return found


__all__ = ["NodeGroups", "RankPlace", "Topology", "decide", "explicit", "flat", "from_environment", "node_groups",
           "read_environment", "resolve"]
