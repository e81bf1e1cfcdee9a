"""Throughput of one parameter server: messages/s and MB/s with K workers pushing.

    mpirun -n 3 --oversubscribe python scripts/bench_ps.py            # 1 server, 2 workers
    mpirun -n 5 --oversubscribe python scripts/bench_ps.py --sizes 65536,1048576

Two measurements per payload size, both on rank 0 (the server):

* ``transport``: workers blast ready-made PUSH messages (window of 4 in flight, each
  acknowledged by a 48-byte reply); the server only receives, checks the header and CRC-32
  and acknowledges. This is the MPI + checksum ceiling.
* ``server``: the real thing, ``commpress.ps.run`` (async mode unless ``--mode sync``) with a model of that many
  float32 parameters whose gradient costs nothing to compute (loss = <W, G>), so workers push
  as fast as they can encode. The server decodes, steps SGD, encodes a reply per push.

Bytes count both directions, headers included. The ``where the server's time goes`` columns
split its wall time into MPI receive, validation (header, CRC, wire checks), decode,
optimizer, reply encoding, MPI send and idle (polling for the next message).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from commpress import ps
from commpress.ps.protocol import TO_SERVER, MsgType, build, parse_header
from commpress.ps.transport import Backoff, Inbox, Outbox


def transport(comm: MPI.Comm, nbytes: int, seconds: float) -> dict[str, float] | None:
    rank, size = comm.Get_rank(), comm.Get_size()
    tag = 99
    if rank == 0:
        inbox = Inbox(comm, 48 + nbytes, tag=tag)
        out = Outbox(comm)
        ack = build(MsgType.BYE, shard=0, worker=0, step=0).numpy()
        msgs = byts = 0
        done = 0
        t0 = time.perf_counter()
        backoff = Backoff()
        while done < size - 1:
            src = inbox.probe()
            if src is None:
                backoff.wait()
                continue
            backoff.reset()
            buf = inbox.receive(src)
            head = parse_header(buf, src, TO_SERVER)
            if head.type == MsgType.BYE:
                done += 1
                continue
            msgs += 1
            byts += len(buf) + len(ack)
            out.post(src, ack, tag)
            out.poll()
        wall = time.perf_counter() - t0
        out.flush(time.monotonic() + 10)
        return {"msgs_per_s": msgs / wall, "MB_per_s": byts / wall / 1e6}
    msg = build(MsgType.PUSH, shard=0, worker=rank - 1, step=0, parts=[torch.randint(0, 255, (nbytes,), dtype=torch.uint8)])
    out = Outbox(comm)
    inbox = Inbox(comm, 64, tag=tag)
    inflight = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while inflight < 4:
            out.post(0, msg, tag)
            inflight += 1
        got = inbox.wait([0], time.monotonic() + 30)
        assert got is not None
        inflight -= 1
        out.poll()
    while inflight:
        assert inbox.wait([0], time.monotonic() + 30) is not None
        inflight -= 1
    out.post(0, build(MsgType.BYE, shard=0, worker=rank - 1, step=0), tag)
    out.flush(time.monotonic() + 30)
    return None


class Flat(torch.nn.Module):
    """``n`` parameters as one (n/64, 64) matrix; loss <W, G> has gradient G for free.

    Random initial values keep ``||x||`` realistic, which the relative drift bound refers to.
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n // 64, 64) * 0.05)


def server_run(comm: MPI.Comm, n: int, codec: str, steps: int, servers: int, mode: str) -> dict[str, float] | None:
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(n // 64, 64, generator=g)
    task = ps.Task(
        model=lambda: Flat(n),
        loss=lambda m, b: (m.weight * grad).sum(),
        batch=lambda w, workers, step: None,
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-5, momentum=0.9),
    )
    cfg = ps.PSConfig(servers=servers, mode=mode, steps=steps, codec=codec, progress=False)
    result = ps.run(task, cfg, comm)
    if result.rank != 0:
        return None
    s = result.stats["per_server"][0]
    wall = s["wall_seconds"]
    sec = s["seconds"]
    busy = sum(sec.values())
    row = {
        "msgs_per_s": s["msgs_in"] / wall,
        "MB_per_s": (s["bytes_in"] + s["reply_bytes"]) / wall / 1e6,
        "push_B": s["push_bytes"] / max(s["push_msgs"], 1),
        "reply_B": s["step_reply_bytes"] / max(s["step_reply_msgs"], 1),
        "resyncs": s["resyncs"],
    }
    for key in ("recv", "validate", "decode", "apply", "reply", "send"):
        row[key] = sec.get(key, 0.0) / wall
    row["idle"] = max(0.0, 1 - busy / wall)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16384,262144,1048576", help="parameters per server (float32)")
    p.add_argument("--codecs", default="none;topk:ratio=0.01;qsgd:bits=4", help="';'-separated codec specs")
    p.add_argument("--seconds", type=float, default=2.0, help="per transport measurement")
    p.add_argument("--budget", type=float, default=3.0, help="approximate seconds per server run")
    p.add_argument("--mode", choices=("async", "sync"), default="async")
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    workers = comm.Get_size() - 1
    if workers < 1:
        print("run under mpirun with at least 2 ranks", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        r = transport(comm, 4 * n, args.seconds)
        if r is not None:
            rows.append(("transport (recv+CRC+ack)", n, "-", r))
        for codec in args.codecs.split(";"):
            steps = max(20, int(args.budget * 2e7 / max(n, 1) / workers))
            r = server_run(comm, n, codec, steps, 1, args.mode)
            if r is not None:
                rows.append((f"server ({args.mode}, full path)", n, codec, r))
        comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"1 server, {workers} workers, {MPI.Get_library_version().splitlines()[0][:40]}, torch {torch.__version__}, "
              f"1 thread per rank, {'%d' % (len(__import__('os').sched_getaffinity(0)))} cores")
        print(f"{'what':26} {'params':>8} {'codec':16} {'msgs/s':>8} {'MB/s':>7} {'push B':>8} {'reply B':>8} | "
              "where the server's time goes (fraction of wall): recv valid decode apply reply send idle")
        for what, n, codec, r in rows:
            if "push_B" in r:
                tail = (f"{r['push_B']:8.0f} {r['reply_B']:8.0f} | " +
                        " ".join(f"{r[k]:.2f}" for k in ("recv", "validate", "decode", "apply", "reply", "send", "idle")))
            else:
                tail = f"{4 * n + 48:8d} {48:8d} |"
            print(f"{what:26} {n:8d} {codec:16} {r['msgs_per_s']:8.0f} {r['MB_per_s']:7.1f} {tail}")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
