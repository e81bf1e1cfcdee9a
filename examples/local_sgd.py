"""DiLoCo: local steps, then a compressed outer step every H steps, under torchrun (CPU, gloo).

Run::

    torchrun --nproc-per-node 2 examples/local_sgd.py                             # 320 steps, ~10 s
    torchrun --nproc-per-node 2 examples/local_sgd.py --steps 8 --sync-every 4   # smoke run
    torchrun --nproc-per-node 2 examples/local_sgd.py --fragments 2 --overlap 4  # streaming DiLoCo
    torchrun --nproc-per-node 4 examples/local_sgd.py --replica-size 2           # FSDP2 inside replicas of 2

No DDP wrapper: each rank trains its own copy with its own optimizer, and every ``--sync-every``
inner steps ``opt.step()`` also averages the pseudo-gradient (global copy - local copy) over the
ranks through 1-bit sign compression with error feedback (what a sync's frame drops is sent
at later syncs) and lets the outer optimizer (plain SGD, lr 1: the global copy becomes
the replicas' average) step on it; then every rank continues
from the same new global copy. The training loop itself does not change. With ``--fragments K``
each sync moves 1/K of the parameters (a fragment every H/K steps); with ``--overlap T`` it runs
behind the next T inner steps and is merged then; ``diloco.finish()`` after the loop loads the
global copy into the model. With ``--replica-size L`` each worker is a replica of L ranks that
shards the model with FSDP2 (dense traffic inside the replica, over its fast links); DiLoCo then
syncs each rank's shard with the same shard of the other replicas, so a rank sends 1/L of the model.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commpress.local


def main() -> None:
    """Train a small MLP on synthetic data with DiLoCo; print loss and bytes on rank 0."""
    parser = argparse.ArgumentParser(description="DiLoCo with commpress under torchrun")
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--sync-every", type=int, default=16, help="inner steps H between syncs")
    parser.add_argument("--fragments", type=int, default=1, help="streaming: fragments synced in turn")
    parser.add_argument("--overlap", type=int, default=0, help="streaming: inner steps a sync runs behind")
    parser.add_argument("--replica-size", type=int, default=1, help="ranks per replica, FSDP2 inside (1: none)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    L = args.replica_size
    if L < 1 or world % L:
        raise SystemExit(f"--replica-size {L} must divide the {world} ranks")
    worker = rank // L  # this rank's replica: its own data stream
    torch.manual_seed(worker)  # different on purpose: DiLoCo starts every replica from the first one's weights

    # Synthetic task: a fixed random "teacher" labels Gaussian inputs (10 classes).
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x_eval = torch.randn(2048, 32, generator=torch.Generator().manual_seed(2))
    y_eval = (x_eval @ teacher).argmax(1)

    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))  # plain module
    replica = {}
    if L > 1:  # replicas of L ranks: FSDP2 shards the model inside each, DiLoCo syncs the shards across them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        inner = init_device_mesh("cpu", (world // L, L), mesh_dim_names=("replica", "shard"))["shard"]
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=inner)
        fully_shard(model, mesh=inner)
        replica = {"replica_group": inner.get_group()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the inner optimizer

    def eval_loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(model(x_eval), y_eval).item()

    # The default outer codec is sign with error feedback; codec="qsgd", bits=4, codec="topk", ratio=0.01
    # or codec="none" also work.
    with commpress.local.DiLoCo(model, opt, sync_every=args.sync_every, fragments=args.fragments,
                                overlap=args.overlap, **replica) as diloco:
        first = eval_loss()  # after construction: rank 0's weights on every rank
        for step in range(args.steps):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 + step * world + rank))  # 64 per rank
            opt.zero_grad()
            F.cross_entropy(model(x), (x @ teacher).argmax(1)).backward()
            opt.step()  # every sync_every-th call also synchronises the ranks
    diloco.finish()  # merge the sync still in flight (overlap), load the global copy into the model
    last = eval_loss()

    if rank == 0:
        s = diloco.stats()
        print(f"stats: {s['steps']} inner steps, {s['syncs']} syncs ({s['skipped_syncs']} skipped), "
              f"outer compression x{s['compression_ratio']:.1f}")
        ddp = 4 * sum(p.numel() for p in model.parameters()) * s["steps"]  # what dense DDP would send: every step
        if L > 1:
            print(f"replicas: {world // L} of {L} ranks (FSDP2 inside); this rank syncs {diloco.numel} of "
                  f"{sum(p.numel() for p in model.parameters())} elements (bytes below: the outer sync's only; "
                  "FSDP's traffic inside the replica is dense)")
        print(f"done: loss {first:.3f} -> {last:.3f}, bytes/sync {s['bytes_sent_per_step']:.0f} "
              f"(dense {s['dense_bytes_per_step']:.0f}, peak in flight {s['peak_bytes_in_flight']:.0f}), "
              f"x{ddp / max(s['bytes_sent'], 1):.0f} fewer than DDP")
    dist.barrier()  # every rank done with its collectives before the group goes (as the other examples)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
