"""Rank program of the emulated-cluster test (tests/test_shaped_net.py): one rank of 2 nodes x 2.

Started by ``ShapedNetwork(2, rate, ranks_per_node=2).run`` with torchrun's variables (``env://``
rendezvous). Every rank writes ``<out>/<rank>.json``: the topology commpress detects from its
environment and, on local rank 0, its node's counters (``eth0``: the shaped veth, ``lo``) around
an all-reduce inside each node, then one between the nodes.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from commpress.comm import topology

PAYLOAD = 1 << 20  # float32 elements: 4 MB per all-reduce
REPS = 2


def counters() -> dict[str, int]:
    """This namespace's transmitted bytes on the shaped link and on loopback."""
    return {dev: int(open(f"/sys/class/net/{dev}/statistics/tx_bytes").read()) for dev in ("eth0", "lo")}


def main() -> int:
    """Detect the layout, then count the bytes of intra-node and cross-node all-reduces."""
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = topology.from_environment(None, 30.0)
    L = int(os.environ["LOCAL_WORLD_SIZE"])
    intra = [dist.new_group([n * L + j for j in range(L)]) for n in range(world // L)]
    inter = [dist.new_group([n * L + j for n in range(world // L)]) for j in range(L)]
    x = torch.ones(PAYLOAD)
    phases = {}
    for name, group in (("intra", intra[rank // L]), ("inter", inter[rank % L])):
        dist.barrier()
        before = counters()
        for _ in range(REPS):
            dist.all_reduce(x, group=group)
        dist.barrier()
        after = counters()
        phases[name] = {dev: after[dev] - before[dev] for dev in before}
    report = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
              "master": os.environ["MASTER_ADDR"], "topology": topo.config(),
              "payload": PAYLOAD * 4 * REPS, "phases": phases}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
