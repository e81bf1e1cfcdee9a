"""Predicted, not measured: where each codec pays, from commpress.comm.costmodel.
17M-parameter MLP gradient (buckets 16.82M + 0.27M float32; matrices compressed, biases dense),
alpha 50 us per message, beta from the bandwidth; device costs calibrated on this CPU (1 thread)
and, as a what-if, 10x cheaper encode/decode/cast (a faster device)."""
import dataclasses
import sys

import torch

import commpress
from commpress.comm import default_algorithm
from commpress.comm.costmodel import Entry, Link, calibrate_device, predict

torch.set_num_threads(1)
CODECS = {
    "top-k 1%": (commpress.codecs.get("topk", ratio=0.01), True),
    "random-k 1%": (commpress.codecs.get("randomk", ratio=0.01, scaled=False), True),
    "sign": (commpress.codecs.get("sign"), True),
    "QSGD 4-bit": (commpress.codecs.get("qsgd"), False),
}
BUCKETS = [(Entry(4096 * 4096, True), Entry(4096, False), Entry(10 * 4096, True), Entry(10, False)),
           (Entry(64 * 4096, True), Entry(4096, False))]
costs = {name: calibrate_device(c, feedback=fb) for name, (c, fb) in CODECS.items()}
for name, c in costs.items():
    print(name, {k: round(v * 1e9, 2) for k, v in dataclasses.asdict(c).items()}, file=sys.stderr)
cast = min(c.cast_s for c in costs.values())
worlds, gbits = [8, 64, 256, 1024], [1, 10, 25, 100, 400]

def times(n, g, scale):
    link = Link.from_gbit(g, 50e-6)
    out = {}
    for name, (codec, _) in CODECS.items():
        c = costs[name]
        c = dataclasses.replace(c, encode_s=c.encode_s / scale, decode_s=c.decode_s / scale, pass_s=c.pass_s / scale, cast_s=cast / scale)
        alg = default_algorithm(codec, n)
        p = [predict(b, n, link, c, codec, alg) for b in BUCKETS]
        out["dense"] = sum(x["dense"] for x in p)
        out["fp16"] = sum(x["fp16"] for x in p)
        out[name] = sum(x["compressed"] for x in p)
    return out

def breakeven(n, name, scale):
    lo, hi = 0.01, 10000.0
    if times(n, hi, scale)[name] < times(n, hi, scale)["dense"]:
        return f"> {hi:g}"
    if times(n, lo, scale)[name] >= times(n, lo, scale)["dense"]:
        return "never"
    for _ in range(50):
        mid = (lo * hi) ** 0.5
        t = times(n, mid, scale)
        lo, hi = (mid, hi) if t[name] < t["dense"] else (lo, mid)
    return f"{lo:.3g}"

for scale, title in ((1, "device costs of this CPU"), (10, "what-if: every per-element cost 10x cheaper (a faster device)")):
    print(f"\n{title}: predicted reduction time / dense all-reduce's, and the bandwidth below which the option pays\n")
    print("| option | ranks | " + " | ".join(f"{g} Gbit/s" for g in gbits) + " | pays below (Gbit/s) |")
    print("|---|---|" + "---|" * (len(gbits) + 1))
    for name in ["fp16", *CODECS]:
        for n in worlds:
            cells = []
            for g in gbits:
                t = times(n, g, scale)
                cells.append(f"{t[name] / t['dense']:.2f}")
            print(f"| {name} ({default_algorithm(CODECS[name][0], n) if name in CODECS else 'allreduce'}) | {n} | "
                  + " | ".join(cells) + f" | {breakeven(n, name, scale)} |")
