"""The documentation's figures (docs/figures.py): the committed SVGs are what the script draws
today, byte for byte, so a figure cannot drift from the names the code defines (the script imports
them); the few names it spells out are checked against the code and a real checkpoint here."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import matplotlib
import pytest
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "figures.py"


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_committed_figures_are_what_the_script_draws(
    figures: ModuleType, tmp_path: Path
) -> None:
    committed = {name: (ROOT / "docs" / "img" / name).read_bytes() for name in figures.FIGURES}
    found = [re.search(rb"Matplotlib v([^,<]+)", data) for data in committed.values()]
    drawn_with = {match.group(1).decode() for match in found}  # type: ignore[union-attr]
    if drawn_with != {matplotlib.__version__}:
        pytest.skip(
            f"the figures were drawn with Matplotlib {drawn_with}, this is "
            f"{matplotlib.__version__} (CI's lock has theirs)"
        )
    stale = [
        path.name for path in figures.main(tmp_path) if path.read_bytes() != committed[path.name]
    ]
    assert not stale, (
        f"docs/img/{stale} differ from what docs/figures.py draws: run it and commit the files"
    )


def test_every_figure_is_shown_with_alt_text(figures: ModuleType) -> None:
    pages = "\n".join(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))
    for name in figures.FIGURES:
        shown = re.findall(rf"!\[([^\]]*)\]\(img/{re.escape(name)}\)", pages)
        assert len(shown) == 1 and len(shown[0]) > 40, (
            f"{name}: shown {len(shown)} times, alt text {shown}"
        )


@pytest.mark.parametrize(("path", "text"), [
    ("examples/plain_digits.py", 'temporary / "state.pt"'),
    ("examples/plain_digits.py", '"loader": gather_states(loader)'),
    ("examples/plain_digits.py", '"rng": gather_rng_states()'),
    ("lightning_resume/integrity.py", 'f".{name}.tmp-{writer_token(strategy.broadcast)}"'),
    ("examples/plain_digits.py", 'f"step_{step:09d}"'),
    # Fabric's and Accelerate's
    ("core/loader_resume/job/loop_session.py", 'f"step_{self.step:09d}"'),
    ("lightning_resume/fabric.py", '"resume_checkpoints"'),
    ("accelerate_resume/hook.py", '"resume_checkpoints"'),
    ("ray_resume/resume.py", 'checkpoint_dir_name=f"step_{self.step:09d}"'),
    ("ray_resume/resume.py", '{"model": model, "optimizer": optimizer, "scheduler": scheduler}'),
    ("ray_resume/resume.py", 'f"{name}.pt"'),
])
def test_a_name_the_script_spells_out_is_the_codes(path: str, text: str) -> None:
    assert text in (ROOT / path).read_text()


def test_lightnings_own_keys_are_the_ones_lightning_writes(figures: ModuleType) -> None:
    spec = importlib.util.find_spec("lightning.pytorch.trainer.connectors.checkpoint_connector")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    assert [key for key in figures.LIGHTNING_KEYS if f'"{key}"' not in source] == []
    assert figures.PLAIN_FILE == "state.pt"


def test_the_accelerate_card_lists_the_files_of_a_real_checkpoint(
    figures: ModuleType, tmp_path: Path
) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_resume import enable_resume

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    resume = enable_resume(accelerator)
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        accelerator.prepare(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1),
                            DataLoader(list(range(8)), batch_size=4))
        written = resume.save()
    finally:
        resume.close()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert written is not None
    card = next(door for door in figures.doors(world=1) if door.name == "Accelerate")
    assert sorted(item.name for item in card.items) == sorted(os.listdir(written))
