"""The ``loader-resume`` command: ``loader-resume check MODULE:FACTORY`` verifies your pipeline
resumes exactly."""

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
    commands = parser.add_subparsers(dest="command")
    from . import audit, check, demo

    check.add_arguments(
        commands.add_parser(
            "check",
            help="verify that a DataLoader factory resumes exactly (cut, resume in fresh "
                 "processes, compare)",
        )
    )
    demo.add_arguments(
        commands.add_parser(
            "demo",
            help="train on digits, SIGTERM it mid-epoch, resume, and compare with the "
                 "uninterrupted run",
        )
    )
    audit.add_arguments(
        commands.add_parser(
            "audit",
            help="check a job's audit=DIR logs: every sample delivered exactly once across its "
                 "restarts",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from .. import __version__

        sys.stdout.write(f"loader-resume {__version__}\n")
        return 0
    if args.command == "check":
        sys.path.insert(0, ".")
        from . import check

        return check.main(args)
    if args.command == "audit":
        from . import audit

        return audit.main(args)
    if args.command == "demo":
        from . import demo

        return demo.main(args)
    parser.print_help()
    return 0
