"""The ``mtplx`` command line. Each subcommand lives in ``mtplx/commands/<name>.py`` and
exposes ``add_parser(subparsers)`` (which sets ``func``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mtplx import __version__
from mtplx.errors import MtplxError

COMMANDS = ("generate", "serve", "bench", "tune", "forge", "inspect", "config")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtplx", description="Exact MTP speculative decoding on PyTorch.")
    parser.add_argument("--version", action="version", version=f"mtplx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"mtplx.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"mtplx.commands.{name}":
                raise
            continue  # not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MtplxError as exc:
        print(f"mtplx {args.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (`mtplx generate ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
