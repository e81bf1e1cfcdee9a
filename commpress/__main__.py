"""Command line: ``python -m commpress info [--json]`` (also installed as ``commpress``)."""

from __future__ import annotations

import argparse
import json
import sys

from .info import format_info, info


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; return the process exit code."""
    parser = argparse.ArgumentParser(prog="commpress", description="Gradient compression for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="show versions, native kernels and available backends")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "info":
        report = info()
        print(json.dumps(report, indent=2) if args.json else format_info(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
