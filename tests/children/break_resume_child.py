"""Resume saved loader states in a fresh process, for tests/loader/test_break_then_save.py.

    python break_resume_child.py CASES OUT

CASES: a ``torch.save`` file of ``[(config, state), ...]``; each config builds a loader
(``support.passes.build``), the state is loaded into it and the loader iterated until its last epoch
is done. OUT: JSON, one list of records (``support.passes.record``) per case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.passes import build, rest


def main() -> None:
    out = []
    for config, state in torch.load(sys.argv[1], weights_only=True):
        loader = build(config)
        loader.load_state_dict(state)
        out.append(rest(loader))
    with open(sys.argv[2], "w") as file:
        json.dump(out, file)


if __name__ == "__main__":
    main()
