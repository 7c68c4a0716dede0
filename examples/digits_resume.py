"""The main job: train on scikit-learn's digits, SIGTERM it mid-epoch, resume, compare.

    python examples/digits_resume.py   # ~15 s on 2 CPU cores; the same as `loader-resume demo`

The plain-PyTorch loop lives in loader_resume/tools/demo.py (core/loader_resume/tools/demo.py): a
training loop with ResumableDataLoader, torch.save/torch.load checkpoints written atomically
(temporary file + rename), the model's RNG saved, and preemption handled at step boundaries. Exit
code 0 only if the resumed run's batches and final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import sys

from loader_resume.tools import demo

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    demo.add_arguments(parser)
    sys.exit(demo.main(parser.parse_args()))
