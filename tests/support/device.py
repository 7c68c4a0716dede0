"""The GPU tier's options of the child scripts: where the model trains, bf16 autocast, pinned
batches.

``--device cpu`` (the default) keeps a child as the CPU suite runs it;
``tests/frontdoors/test_gpu.py`` passes ``--device cuda --bf16 --pin-memory`` (CUDA dropout under
autocast: the CUDA generators must be restored as well)."""

from __future__ import annotations

import argparse

__all__ = ["add_device_options"]


def add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains"
    )
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast (the framework's mixed precision)"
    )
    parser.add_argument(
        "--pin-memory",
        action="store_true",
        help="DataLoader(pin_memory=True) for the training data",
    )
