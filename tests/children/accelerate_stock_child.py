"""A ResumableDataLoader handed to a stock Accelerator (no ``enable_resume``), for
test_accelerate.py.

    accelerate launch --multi_gpu --num_processes 2 accelerate_stock_child.py OUT [--stateful]

Each rank writes OUT/refused-RANK.txt (the error ``accelerator.prepare`` raised) or
OUT/replaced-RANK.txt (the type Accelerate made of the loader); then, with ``enable_resume``,
OUT/kept-RANK.txt: whether a loader converted by it is kept as it is by Accelerate's own
``prepare_data_loader``.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration

from accelerate_resume import AcceleratedResumableDataLoader, enable_resume
from loader_resume import ResumableDataLoader
from loader_resume.distributed import init_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--stateful",
        action="store_true",
        help="DataLoaderConfiguration(use_stateful_dataloader=True)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        init_process_group("gloo")
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(out),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.stateful),
    )
    assert accelerator.num_processes == 2, accelerator.num_processes
    rank = accelerator.process_index
    loader = ResumableDataLoader(list(range(20)), batch_size=2, shuffle=True, seed=3)
    try:
        prepared = accelerator.prepare(loader)
        (out / f"replaced-{rank}.txt").write_text(type(prepared).__name__)
    except TypeError as error:
        (out / f"refused-{rank}.txt").write_text(str(error))
    resume = enable_resume(accelerator, {"auto_resume": False, "signals": []})
    converted = accelerator.prepare(loader)
    kept = isinstance(converted, AcceleratedResumableDataLoader) \
        and accelerator.prepare_data_loader(converted) is converted
    (out / f"kept-{rank}.txt").write_text(str(kept))
    resume.close()
    accelerator.wait_for_everyone()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
