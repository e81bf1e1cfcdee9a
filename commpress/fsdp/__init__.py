"""FSDP2 with a compressed reduce-scatter.

``state = commpress.fsdp.register(model, "topk", ratio=0.01)`` (after ``fully_shard``) puts a
:class:`~.state.CompressedReduceScatter` on every FSDP module of ``model`` and returns the
:class:`FSDPCompressionState` (statistics, residual memory, checkpointing). Each rank encodes
the chunks of the flat gradient bound for the other ranks, exchanges them with one all_to_all,
and decodes and sums its own shard (:mod:`commpress.comm.reducescatter`). ``"none"`` is FSDP's
own reduce-scatter, bit for bit. The parameter all-gathers (forward and backward) follow the
codec unless ``param_codec=`` says otherwise: a codec that compresses (``topk``, ``sign``,
``qsgd``, ``randomk``, ...) gathers block-scaled int8 parameters in the forward, a quarter of the
float32 bytes, and the backward decodes the forward's kept frames (0 bytes); ``none`` and the casts
``fp16`` / ``bf16`` keep FSDP's own all-gather (:mod:`commpress.fsdp.allgather`; the sharded
parameters stay exact). ``param_codec="none"`` is gradient-only. ``register(model, "auto")``
chooses per module, for each of the two collectives, exact, bf16 or compressed from the cost
model (:mod:`commpress.fsdp.auto`), so a fast link keeps FSDP's own collectives.

On several nodes, shard inside each node (HSDP): ``fully_shard(..., mesh=commpress.fsdp.node_mesh("cuda"))``.
FSDP's own reduce-scatter and all-gather then run on the fast links inside the node, and
``register`` compresses the one thing that crosses nodes, the all-reduce of each gradient shard
among the ranks that hold the same shard (error feedback on the shard: no residual for the
chunks sent to other ranks, so one shard of residual memory), with the same optimizer modes.

Example::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = commpress.fsdp.register(model, "sign", optimizer=opt)  # its momentum moves into the reduce-scatter
    ...
    torch.save(state.state_dict(), f"commpress_rank{rank}.pt")  # residuals are per rank
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp()}, checkpoint_id=d)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import options as opts
from ..codecs import Codec
from ..comm import topology
from .allgather import AllGatherPlan, CompressedAllGather, ParamAllGather
from .auto import FSDPAuto, ModuleChoice
from .dcp import DCPState
from .state import CompressedReduceScatter, FSDPCompressionState, ModulePlan, ShardPlan

__all__ = [
    "AllGatherPlan", "CompressedAllGather", "CompressedReduceScatter", "DCPState", "FSDPAuto", "FSDPCompressionState",
    "ModuleChoice", "ModulePlan", "ParamAllGather", "ShardPlan", "node_mesh", "register",
]

logger = logging.getLogger("commpress")


def node_mesh(device_type: str = "cuda", local_world_size: int | None = None, *, timeout_s: float = 60.0) -> DeviceMesh:
    """The 1-D device mesh of this rank's node: pass it to ``fully_shard(..., mesh=)`` to shard inside nodes.

    The layout comes from ``local_world_size`` (ranks per node), else torchrun's ``LOCAL_WORLD_SIZE``
    and ``GROUP_RANK`` (:func:`commpress.comm.topology.resolve`: nodes of contiguous ranks, all the
    same size). One node, or a layout that is not homogeneous: the mesh of every rank, so FSDP
    shards over all of them as usual (logged). Call it on every rank, after ``init_process_group``.

    Example (2 nodes of 8 GPUs under torchrun)::

        mesh = commpress.fsdp.node_mesh("cuda")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = commpress.fsdp.register(model, "topk", ratio=0.01, optimizer=opt)
    """
    opts.require_process_group()
    topo = topology.resolve(None, local_world_size, opts.check_timeout(timeout_s))
    if not topo.hierarchical:
        logger.info("commpress.fsdp.node_mesh: one mesh of all %d ranks (%s)", topo.world_size,
                    topo.reason or "one node")
        return init_device_mesh(device_type, (topo.world_size,))
    mesh = init_device_mesh(device_type, (topo.nodes, topo.local_world_size), mesh_dim_names=("node", "local"))
    return mesh["local"]


def register(model: torch.nn.Module, codec: str | Codec, **options: Any) -> FSDPCompressionState:
    """Install commpress's reduce-scatter (and parameter all-gather) on every FSDP module of ``model``; return its state.

    ``options`` are those of :class:`FSDPCompressionState` (``optimizer=``, ``warmup_steps=``,
    ``divergence_guard=``, ``residual_dtype=`` as on DDP's ``register``; ``param_codec=`` the
    parameter all-gather) plus, when ``codec`` is a name, the codec's parameters; ``codec="auto"``
    takes ``auto_link=`` and ``auto_calibration_numel=`` instead (:mod:`.auto`) and no ``param_codec=``.

    ``param_codec=`` left out: a compressing ``codec`` (anything but ``"none"``, ``"fp16"``,
    ``"bf16"``) also compresses the parameter all-gathers, ``{"forward": "int8", "backward":
    "reuse"}``, so all three of a sharded step's volumes shrink (gradient-only, the step's bytes
    fall at most 1.5x); ``none`` and the casts keep FSDP's own all-gather. The registration logs
    which and why (``state.param_codec_why``; ``state.stats()["param_codec_defaulted"]``).
    ``param_codec="none"`` (or ``None``) is gradient-only, as before this default.

    Call it on every rank, after ``fully_shard`` and before the first backward pass.
    """
    return FSDPCompressionState(model, codec, **options)
