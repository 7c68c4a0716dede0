"""Every benchmark of the project, each in its own process, tables printed and written into the
docs.

    python benchmarks/run_all.py        # ~7 min on 2 cores
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["bench_core.py", "bench_lightning.py", "bench_accelerate.py", "bench_resume_plot.py",
              "bench_litdata_resume.py", "bench_mixture.py", "bench_out_of_order.py"]

if __name__ == "__main__":
    for script in BENCHMARKS:
        print(f"== {script}", flush=True)
        subprocess.run([sys.executable, "-W", "ignore", str(HERE / script)], cwd=HERE, check=True)
