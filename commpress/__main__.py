"""Command line: ``python -m commpress {info,train,advise,bench,ps}`` (also installed as ``commpress``).

Exit codes: 0 success, 2 usage error (argparse), 1 a run that failed (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .info import format_info, info


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; return the process exit code."""
    parser = argparse.ArgumentParser(prog="commpress", description="Gradient compression for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="show versions, native kernels and available backends")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_train = sub.add_parser(
        "train", help="demo: time to accuracy of a 10.8M-parameter LM on a 1 Gbit/s link, dense vs fp16 vs commpress",
        description="Train the communication-bound byte-level LM (10.8M parameters, AdamW) on local ranks three "
                    "times from the same start: DDP's all-reduce, PyTorch's fp16_compress_hook and commpress. As root "
                    "with `ip netns` every rank gets its own emulated host on a shaped link; otherwise the ranks use "
                    "loopback and the link's cost is a projection from the cost model.")
    p_train.add_argument("--codec", default="qsgd", help="commpress codec (default qsgd: 4-bit QSGD, unbiased)")
    p_train.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                         help="codec parameter, repeatable (default for topk: ratio=0.01)")
    p_train.add_argument("--steps", type=int, default=64, help="training steps per method (default 64)")
    p_train.add_argument("--link", default="1gbit", help="link rate in tc syntax: 1gbit (default), 10gbit, 500mbit")
    p_train.add_argument("--loopback", action="store_true",
                         help="use loopback even as root; the link's cost is then projected (cost model)")
    p_train.add_argument("--workers", type=int, default=2, help="ranks, one per emulated host (default 2)")
    p_train.add_argument("--batch", type=int, help="32-byte windows per rank and step (default 4)")
    p_train.add_argument("--out", default="out", help="folder for the plot train_demo.png (default ./out)")
    p_train.add_argument("--no-baseline", action="store_true", help="skip the dense and fp16 runs (no time to target)")
    sub.add_parser("advise", add_help=False,
                   help="predicted step time per option (dense, fp16, each codec, auto) for your model and link (--help)")
    sub.add_parser("bench", add_help=False, help="kernel benchmark: native vs copy_, reference, torch.topk (--help)")
    sub.add_parser("ps", add_help=False, help="parameter-server training under mpirun (python -m commpress.ps --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "advise":
        from .advise import main as advise_main

        return advise_main(rest)
    if args.command == "bench":
        from .bench_kernels import main as bench_main

        return bench_main(rest)
    if args.command == "ps":
        from .ps.__main__ import main as ps_main

        return ps_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "info":
        report = info()
        print(json.dumps(report, indent=2) if args.json else format_info(report))
        return 0
    if args.command == "train":
        return _train(parser, args)
    return 0


def _parse_params(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``--param KEY=VALUE`` items, read with the package's one option parser."""
    from .codecs import parse_option
    from .errors import CodecError

    params: dict[str, Any] = {}
    for item in items:
        try:
            key, value = parse_option(item, "--param")
        except CodecError:
            parser.error(f"--param expects KEY=VALUE, got {item!r}")
        params[key] = value
    return params


def _train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .codecs import get
    from .errors import CodecError

    params = _parse_params(parser, args.param)
    if args.codec == "topk" and not params:
        params = {"ratio": 0.01}
    try:
        get(args.codec, **params)  # validate before starting any process
    except CodecError as exc:
        parser.error(str(exc))
    if args.workers < 1 or args.steps < 3 or (args.batch is not None and args.batch < 1):
        parser.error("--workers >= 1, --steps >= 3 and --batch >= 1 are required")
    from .demo.train import parse_link, train_demo

    try:
        parse_link(args.link)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        train_demo(args.codec, params, args.workers, args.steps, args.batch, args.out, link=args.link,
                   loopback=args.loopback, baseline=not args.no_baseline)
    except Exception as exc:  # a worker died: say so on stderr, exit 1
        print(f"commpress train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
