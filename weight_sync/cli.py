"""``weight-sync``: the command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weight-sync",
        description="Push a trainer's weights to inference workers over a dedicated process group.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a trainer actor and N worker actors, push after each step, verify",
        description="Start (or join) a Ray cluster, create a trainer actor and N inference-worker "
        "actors on CPU, take optimizer steps with a push after each, print a table per push and "
        "verify that every worker holds the trainer's weights bit for bit.",
    )
    demo.add_argument("--workers", type=_positive, default=7, help="worker actors (default 7)")
    demo.add_argument("--steps", type=_positive, default=5, help="optimizer steps (default 5)")
    demo.add_argument("--bucket-mb", type=_positive, default=64, help="bucket size in MiB (default 64)")
    demo.add_argument(
        "--address", default=None,
        help="Ray cluster to join (e.g. 'auto'); default: start a local one",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "demo":
        from weight_sync.demo import run_demo

        return run_demo(args.workers, args.steps, args.address, args.bucket_mb)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
