"""Compress a real gradient with every codec and print what it costs and what it loses.

The gradient comes from a small byte-level transformer language model trained for a few
steps on the source text of Python's own standard library (no download). Each parameter is
encoded separately, as the DDP hook does, and serialised with commpress.wire: the byte counts
are the real wire sizes, headers included.
"""

import argparse
import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

import commpress
from commpress import codecs, wire
from commpress.demo.workloads import ByteLM, TextBatches, lm_loss

CONFIGS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"ratio": 0.01}),
    ("topk", {"ratio": 0.001}),
    ("randomk", {"ratio": 0.01}),
    ("sign", {}),
    ("sign", {"block_size": 256}),
    ("qsgd", {"bits": 8}),
    ("qsgd", {"bits": 4}),
    ("qsgd", {"bits": 2}),
]


def real_gradients(steps: int, dim: int, layers: int, context: int, batch: int) -> tuple[dict, float]:
    torch.manual_seed(0)
    text = TextBatches(context)
    model = ByteLM(dim, layers, context)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = torch.tensor(0.0)
    for step in tqdm(range(steps), desc="training byte LM on stdlib text", unit="step", file=sys.stderr):
        loss = lm_loss(model, *text.batch(step, 0, batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())


def measure(codec, grads: dict, repeats: int) -> dict:
    nbytes = 0
    err2 = norm2 = 0.0
    enc_t, dec_t = [], []
    for r in range(repeats):
        enc = dec = 0.0
        for i, (name, g) in enumerate(grads.items()):
            t0 = time.perf_counter()
            buf = wire.to_bytes(codec.encode(g, seed=i))
            t1 = time.perf_counter()
            out = codec.decode(wire.from_bytes(buf))
            t2 = time.perf_counter()
            enc += t1 - t0
            dec += t2 - t1
            if r == 0:
                nbytes += buf.numel()
                err2 += float((out.double() - g.reshape(-1).double()).square().sum())
                norm2 += float(g.double().square().sum())
        enc_t.append(enc)
        dec_t.append(dec)
    return {
        "bytes": nbytes,
        "rel_error": (err2 / norm2) ** 0.5,
        "encode_ms": 1e3 * statistics.median(enc_t),
        "decode_ms": 1e3 * statistics.median(dec_t),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps before the gradient is taken")
    ap.add_argument("--dim", type=int, default=128, help="model width")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (median reported)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    if min(args.steps, args.dim, args.layers, args.repeats) < 1 or args.dim % 4:
        ap.error("--steps, --layers, --repeats must be >= 1 and --dim a positive multiple of 4")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    grads, loss = real_gradients(args.steps, args.dim, args.layers, context=64, batch=16)
    numel = sum(g.numel() for g in grads.values())
    dense = 4 * numel
    native = commpress.info()["native"]
    print(f"\ngradient of a byte-level transformer ({numel:,} parameters in {len(grads)} tensors, "
          f"loss {loss:.3f} after {args.steps} steps); native kernels: {'yes' if native['loaded'] else 'no'}")
    rows = []
    for name, params in tqdm(CONFIGS, desc="codecs", file=sys.stderr):
        codec = codecs.get(name, **params)
        rows.append({"codec": repr(codec), **measure(codec, grads, args.repeats)})
    head = f"{'codec':<48} {'wire bytes':>11} {'bytes/elem':>10} {'ratio':>8} {'rel.err':>8} {'enc ms':>8} {'dec ms':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['codec']:<48} {r['bytes']:>11,} {r['bytes'] / numel:>10.4f} {dense / r['bytes']:>7.1f}x "
              f"{r['rel_error']:>8.4f} {r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f}")
    print("ratio: float32 bytes / wire bytes (headers included); rel.err: ||C(g) - g|| / ||g|| over all "
          "tensors, without error feedback; times: reference or native path, per whole gradient.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": numel, "tensors": len(grads), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
