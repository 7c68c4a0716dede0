"""The README's main job runs as documented and proves its own claim (exit 0 only if exact)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_digits_example_resumes_exactly_in_fresh_processes() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "digits_resume.py"), "--workers", "0", "--stop-at", "25"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical ids and noise: yes; final weights identical: yes" in done.stdout
    assert "plain DataLoader + skipping seen batches: diverges at the first step after resume" in done.stdout
