"""How well the cost model's link calibration predicts all-reduces, on emulated shaped links.

    python scripts/bench_link_fit.py --ranks 2 4 --links unshaped 10gbit 1gbit

For each (ranks, link), one process per emulated host (``scripts/shaped_net.py``; loopback
without root) runs :func:`commpress.comm.costmodel.calibrate_link` as ``codec="auto"`` does, then
times gloo all-reduces of the calibration sizes and of ``--big`` bytes (default: the speed
workload's 67 MB bucket), median of ``--reps``, MAX over ranks. Prints, per size, the measured
time, the effective rate and the calibrated link's prediction with its error. About 1 minute.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def worker(rank: int, world: int, master: str, port: int, out: str, big: int, reps: int) -> None:
    """One rank: calibrate, then time every size (collectives: every rank runs this)."""
    import torch
    import torch.distributed as dist

    from commpress.comm.costmodel import (
        CALIBRATION_BYTES,
        _max_over_ranks,
        _median_time,
        calibrate_link,
    )

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
    try:
        link = calibrate_link()
        sizes = [*CALIBRATION_BYTES, big]
        buf = torch.zeros(max(sizes) // 4)
        times = {}
        for b in sizes:
            view = buf[: b // 4]
            times[b] = _max_over_ranks([_median_time(lambda v=view: dist.all_reduce(v), reps)], None, "cpu")[0]
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"alpha": link.alpha, "beta": link.beta, "times": times}, f)
    finally:
        dist.destroy_process_group()


def measure(world: int, link: str, big: int, reps: int) -> dict[str, Any]:
    """Run the workers on ``world`` emulated hosts joined by ``link``; rank 0's JSON."""
    from shaped_net import ShapedNetwork

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    with ShapedNetwork(world, None if link == "unshaped" else link, quiet=True) as net:
        codes = net.run(lambda r: [sys.executable, os.path.abspath(__file__), "--worker", str(r), str(world),
                                   net.addr(0), str(port), out, str(big), str(reps)], timeout=600)
    if any(codes):
        raise SystemExit(f"a rank failed (exit codes {codes})")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--links", nargs="+", default=["unshaped", "10gbit", "1gbit"])
    p.add_argument("--big", type=int, default=67_289_128, help="the largest size timed, bytes")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    from commpress.comm.costmodel import Link

    print("| link | ranks | size (bytes) | measured (ms) | effective Gbit/s | predicted (ms) | error |")
    print("|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for link in args.links:
            d = measure(world, link, args.big, args.reps)
            fitted = Link(d["alpha"], d["beta"])
            print(f"| {link} | {world} | calibrated: {fitted.gbit:.2f} Gbit/s, alpha {fitted.alpha * 1e6:.0f} us |"
                  " | | | |")
            for b, t in ((int(k), v) for k, v in d["times"].items()):
                pred = fitted.allreduce(b, world)
                rate = 2 * (world - 1) / world * b * 8 / t / 1e9
                print(f"| {link} | {world} | {b} | {t * 1e3:.2f} | {rate:.2f} | {pred * 1e3:.2f} | "
                      f"{100 * (pred / t - 1):+.0f}% |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, m, port, o, big, reps = sys.argv[2:9]
        worker(int(r), int(w), m, int(port), o, int(big), int(reps))
    else:
        main()
