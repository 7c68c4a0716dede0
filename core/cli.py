"""The ``loader-resume`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loader-resume",
        description="Exact, elastic mid-epoch resume for PyTorch data loading. "
        "Run `python examples/digits_resume.py` for the main demonstration.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.version:
        from . import __version__

        sys.stdout.write(f"loader-resume {__version__}\n")
        return 0
    _parser().print_help()
    return 0
