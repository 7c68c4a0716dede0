"""The documentation's diagrams, drawn from the names the code defines.

    python docs/figures.py   # writes docs/img/checkpoint_contents.svg and preemption_timeline.svg

Every file name, key, signal and exit code the figures show that the code defines is imported from
it here (the Accelerate, transformers and Lightning names from those libraries), so a figure changes
when the code does; tests/docs/test_docs_figures.py redraws them and compares the files byte for
byte. The few names no module exports (Lightning's own checkpoint keys, the plain example's file,
the step directories' pattern) are spelled out here, and that test finds each in the code. Output is
deterministic: SVG with text as text (DejaVu, the font Matplotlib ships, with common fallbacks), no
date, a fixed hash salt. Each figure checks its own layout before it is written: no text overlaps
another or leaves its box.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import matplotlib
from accelerate.utils.constants import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SCHEDULER_NAME,
)
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyBboxPatch
from transformers import trainer as hf_trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from accelerate_resume.config import ResumeConfig
from accelerate_resume.saving import STATE_FILE
from lightning_resume import CHECKPOINT_KEY, FabricResume, ResumeCallback
from lightning_resume.fabric import CHECKPOINT_FILE
from loader_resume.job.checkpoint import MANIFEST, temporary_name
from loader_resume.job.checkpoint_dir import FAILED_SAVE_EXIT_CODE
from loader_resume.job.preemption import Preemption
from transformers_resume import ResumableTrainer
from transformers_resume.checkpoint_files import LOADER_STATE_FILE, RNG_STATE_FILE, TRAINER_STATE

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
FIGURES = ("checkpoint_contents.svg", "preemption_timeline.svg")

# Lightning's own keys in its checkpoints (lightning.pytorch's checkpoint connector writes them; not
# importable)
LIGHTNING_KEYS = (
    "state_dict",
    "optimizer_states",
    "lr_schedulers",
    "loops",
    "callbacks",
    "epoch",
    "global_step",
)
PLAIN_FILE = "state.pt"  # what examples/plain_digits.py names its file
WORLD = 2  # the job the figures show: 2 processes, stopped after step 42
STEP = 42
# a sealed checkpoint's directory (Fabric, Accelerate, the plain example, Ray)
SEALED = f"step_{STEP:09d}"

WIDTH = 340.0  # points: a phone shows it about 358 px wide, 10-point text as 10.5 px
SLACK = 1.04  # a browser's text, in a font of its own, may be a little wider than Matplotlib's
# text stays text; DejaVu is Matplotlib's own font (so the layout is the same everywhere), the
# others fallbacks
RC = {
    "svg.fonttype": "none", "svg.hashsalt": "loader-resume", "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial"],
    "font.monospace": ["DejaVu Sans Mono", "Menlo", "Consolas"],
}
INK, SOFT, LINE = "#1c1f24", "#414b55", "#9fa8da"
# fill, edge: the framework's own (or yours), what loader-resume adds, the file written last that
# seals it
KINDS = {
    "theirs": ("#eceff1", "#90a4ae"),
    "ours": ("#dce4ff", "#3949ab"),
    "seal": ("#ffefc7", "#d08f00"),
}


# --- the facts, from the code ---------------------------------------------------------------------
@functools.cache
def _ray_files() -> ModuleType:
    """``ray_resume/files.py`` alone: the package's ``__init__`` imports Ray, which the docs'
    environment lacks."""
    spec = importlib.util.spec_from_file_location(
        "ray_resume_files", ROOT / "ray_resume" / "files.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _default(function: Any, name: str) -> Any:
    return inspect.signature(function).parameters[name].default


def exit_code() -> int:
    """The exit code after a preemption checkpoint: every front-end's default, which must be one
    number."""
    config = {f.name: f.default for f in dataclasses.fields(ResumeConfig)}["exit_code"]
    defaults = {config, _default(ResumeCallback, "exit_code"), _default(FabricResume, "exit_code"),
                _default(ResumableTrainer, "exit_code")}
    assert len(defaults) == 1, f"the front-ends' exit codes differ: {defaults}"
    return int(defaults.pop())


def signals() -> tuple[str, ...]:
    return tuple(_default(Preemption, "signals"))


def lightning_file() -> str:
    """The Lightning callback's preemption checkpoint."""
    return str(_default(ResumeCallback, "filename")) + ResumeCallback.FILE_EXTENSION


def accelerate_files(world: int) -> list[str]:
    """What ``accelerator.save_state`` writes for one model, optimizer and scheduler (Accelerate's
    names)."""
    return [SAFE_WEIGHTS_NAME, f"{OPTIMIZER_NAME}.bin", f"{SCHEDULER_NAME}.bin",
            *(f"{RNG_STATE_NAME}_{rank}.pkl" for rank in range(world))]


@dataclass(frozen=True)
class Item:
    """A file (or a key inside one), by who writes it; ``inside``: the keys of a file that holds
    ours."""

    name: str
    kind: str
    inside: tuple[Item, ...] = ()


@dataclass(frozen=True)
class Door:
    name: str
    where: str
    items: tuple[Item, ...]
    note: str


def doors(world: int = WORLD) -> list[Door]:
    """What a checkpoint holds, per front-end, for a job of ``world`` processes stopped after
    ``STEP``."""
    ranks = range(world)
    rank_file, lightning = _ray_files().RANK_FILE, lightning_file()
    ours = Item(f'"{CHECKPOINT_KEY}"', "ours")
    return [
        Door(
            "Plain PyTorch",
            f"{SEALED}/  (examples/plain_digits.py)",
            (
                Item(
                    PLAIN_FILE,
                    "theirs",
                    (
                        *(Item(k, "theirs") for k in ("model", "optimizer", "step", "epoch")),
                        Item('"loader"', "ours"),
                        Item('"rng"', "ours"),
                    ),
                ),
                Item(MANIFEST, "seal"),
            ),
            "loader, rng: every rank's loader position and generators (gather_states, "
            "gather_rng_states).",
        ),
        Door(
            "Lightning Trainer",
            f"default_root_dir/{lightning}",
            (
                Item(
                    lightning,
                    "theirs",
                    (*(Item(k, "theirs") for k in (*LIGHTNING_KEYS, "…")), ours),
                ),
            ),
            f"{CHECKPOINT_KEY}: every rank's loader positions and RNG states. The file is renamed "
            "into place once "
            "written, and torch's CRC-32 of every record is checked before Lightning loads it.",
        ),
        Door(
            "Lightning Fabric",
            f"resume_checkpoints/{SEALED}/",
            (
                Item(
                    CHECKPOINT_FILE,
                    "theirs",
                    (Item("your state: model, optimizer, …", "theirs"), ours),
                ),
                Item(MANIFEST, "seal"),
            ),
            f"{CHECKPOINT_KEY}: every rank's loader positions and RNG states, the step and the "
            "epoch.",
        ),
        Door(
            "Accelerate",
            f"project_dir/resume_checkpoints/{SEALED}/",
            (
                *(Item(name, "theirs") for name in accelerate_files(world)),
                Item(STATE_FILE, "ours"),
                Item(MANIFEST, "seal"),
            ),
            f"{STATE_FILE}: every process's loader positions and RNG states, the step and the "
            "epoch.",
        ),
        Door(
            "transformers Trainer",
            f"output_dir/{PREFIX_CHECKPOINT_DIR}-{STEP}/",
            (
                *(
                    Item(name, "theirs")
                    for name in (
                        hf_trainer.SAFE_WEIGHTS_NAME,
                        hf_trainer.OPTIMIZER_NAME,
                        hf_trainer.SCHEDULER_NAME,
                        hf_trainer.TRAINING_ARGS_NAME,
                        *(RNG_STATE_FILE.format(rank=r) for r in ranks),
                    )
                ),
                *(Item(LOADER_STATE_FILE.format(rank=r), "ours") for r in ranks),
                Item(TRAINER_STATE, "seal"),
            ),
            f"{LOADER_STATE_FILE.format(rank='<rank>')}: the rank's loader position and the step "
            "(the RNG states "
            f"are Trainer's). {TRAINER_STATE} is written once every rank's files exist.",
        ),
        Door(
            "Ray Train",
            f"{SEALED}/  (reported to Ray)",
            (
                *(Item(f"{name}.pt", "theirs") for name in ("model", "optimizer", "scheduler")),
                *(Item(rank_file.format(rank=r), "ours") for r in ranks),
            ),
            "Each worker's file: its loader positions and RNG states, the step and the epoch. The "
            "model, optimizer and scheduler are rank 0's.",
        ),
    ]


# --- drawing --------------------------------------------------------------------------------------
FONTS = {
    "title": dict(family="sans-serif", size=13, weight="bold"),
    "head": dict(family="sans-serif", size=11.5, weight="bold"),
    "text": dict(family="sans-serif", size=10),
    "path": dict(family="monospace", size=9.5),
    "name": dict(family="monospace", size=10),
    "file": dict(family="monospace", size=10, weight="bold"),
}


@dataclass
class Sheet:
    """Boxes, texts and marks placed top-down in points (y grows downwards); drawn once the height
    is known."""

    width: float = WIDTH
    boxes: list[tuple[float, float, float, float, str, str, float]] = field(default_factory=list)
    # box: its index
    texts: list[tuple[float, float, str, str, str, int | None]] = field(default_factory=list)
    marks: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    _renderer: RendererAgg = field(default_factory=lambda: RendererAgg(10, 10, 72))

    def measure(self, text: str, font: str) -> float:
        """``text``'s width in points, with ``SLACK``."""
        width, _, _ = self._renderer.get_text_width_height_descent(
            text, FontProperties(**FONTS[font]), ismath=False
        )
        return float(width) * SLACK

    def inset(self, font: str, height: float) -> float:
        """How far below a box's top a line of ``font`` starts, to sit in the middle of
        ``height``."""
        _, tall, _ = self._renderer.get_text_width_height_descent(
            "Ag_", FontProperties(**FONTS[font]), ismath=False
        )
        return (height - float(tall)) / 2

    @staticmethod
    def line(font: str) -> float:
        return float(FONTS[font]["size"]) * 1.3  # type: ignore[arg-type]

    def wrap(self, text: str, font: str, width: float) -> list[str]:
        lines: list[str] = []
        for word in text.split(" "):
            if lines and self.measure(f"{lines[-1]} {word}", font) <= width:
                lines[-1] += f" {word}"
            else:
                lines.append(word)
        return lines

    def text(self, x: float, y: float, text: str, font: str, width: float, color: str = INK,
             box: int | None = None) -> float:
        """``text`` wrapped to ``width`` from (``x``, ``y``): the height it takes."""
        lines = self.wrap(text, font, width)
        for number, line in enumerate(lines):
            self.texts.append((x, y + number * self.line(font), line, font, color, box))
        return len(lines) * self.line(font)

    def box(
        self, x: float, y: float, w: float, h: float, fill: str, edge: str, radius: float = 3.0
    ) -> int:
        self.boxes.append((x, y, w, h, fill, edge, radius))
        return len(self.boxes) - 1

    def draw(self, height: float, path: Path) -> None:
        figure = Figure(figsize=(self.width / 72, height / 72), dpi=72)
        FigureCanvasAgg(figure)
        axes = figure.add_axes((0, 0, 1, 1))
        axes.set_xlim(0, self.width)
        axes.set_ylim(height, 0)
        axes.set_axis_off()
        for x, y, w, h, fill, edge, radius in self.boxes:
            axes.add_patch(
                FancyBboxPatch(
                    (x, y),
                    w,
                    h,
                    boxstyle=f"round,pad=0,rounding_size={radius}",
                    facecolor=fill,
                    edgecolor=edge,
                    linewidth=0.9,
                )
            )
        for method, args, options in self.marks:
            getattr(axes, method)(*args, **options)
        drawn = [
            (
                axes.text(
                    x,
                    y,
                    line,
                    va="top",
                    ha="left",
                    color=color,
                    fontproperties=FontProperties(**FONTS[font]),
                ),
                box,
            )
            for x, y, line, font, color, box in self.texts
        ]
        _check_layout(figure, axes, drawn, self.boxes)
        figure.savefig(path, format="svg", metadata={"Date": None})


def _check_layout(figure: Figure, axes: Any, drawn: Sequence[tuple[Any, int | None]],
                  boxes: Sequence[tuple[float, ...]]) -> None:
    """No text overlaps another or comes within 3 points of it on its line, leaves the figure, or
    (placed in a box) leaves its box."""
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    page = figure.bbox
    extents = [(text.get_window_extent(renderer), text.get_text(), box) for text, box in drawn]
    for number, (extent, words, box) in enumerate(extents):
        assert (
            page.x0 <= extent.x0
            and extent.x1 <= page.x1
            and page.y0 <= extent.y0
            and extent.y1 <= page.y1
        ), f"{words!r} leaves the figure"
        if box is not None:
            x, y, w, h = boxes[box][:4]
            (left, bottom), (right, top) = axes.transData.transform([(x, y + h), (x + w, y)])
            inside = (
                left <= extent.x0
                and extent.x0 + extent.width * SLACK <= right
                and bottom <= extent.y0 <= top
            )
            assert inside and extent.y1 <= top, f"{words!r} leaves its box"
        for other, words_other, _ in extents[number + 1:]:
            overlap = min(extent.x1, other.x1) - max(extent.x0, other.x0) + 3, \
                min(extent.y1, other.y1) - max(extent.y0, other.y0)
            assert min(overlap) <= 0.5, f"{words!r} overlaps {words_other!r}"


# --- figure 1: what a checkpoint holds ------------------------------------------------------------
MARGIN, CARD_PAD, CHIP_X, CHIP_Y, GAP = 8.0, 7.0, 4.0, 3.5, 4.0


def _chips(sheet: Sheet, items: Sequence[Item], x0: float, y0: float, width: float) -> float:
    """``items`` as chips flowing from (``x0``, ``y0``) over ``width``; a file holding keys spans
    the width, its keys flowing inside it. The height they take."""
    x, y, row = x0, y0, 0.0
    chip = sheet.line("name") + 2 * CHIP_Y - 3
    for item in items:
        if item.inside:
            if x > x0:
                x, y = x0, y + row + GAP
            top, inner = y, width - 2 * CHIP_X
            fill, edge = KINDS[item.kind]
            index = sheet.box(x0, top, width, 0, fill, edge)
            sheet.texts.append((x0 + CHIP_X, top + CHIP_Y, item.name, "file", INK, index))
            height = _chips(
                sheet, item.inside, x0 + CHIP_X, top + CHIP_Y + sheet.line("file"), inner
            )
            sheet.boxes[index] = (
                x0,
                top,
                width,
                CHIP_Y + sheet.line("file") + height + CHIP_Y,
                fill,
                edge,
                3.0,
            )
            x, y, row = x0, top + sheet.boxes[index][3] + GAP, 0.0
            continue
        w = sheet.measure(item.name, "name") + 2 * CHIP_X
        if x > x0 and x + w > x0 + width:
            x, y = x0, y + row + GAP
        fill, edge = KINDS[item.kind]
        index = sheet.box(x, y, w, chip, fill, edge, 2.5)
        sheet.texts.append(
            (x + CHIP_X, y + sheet.inset("name", chip), item.name, "name", INK, index)
        )
        x, row = x + w + GAP, chip
    return y + row - y0 if row else y - GAP - y0


def checkpoint_contents(path: Path) -> None:
    sheet = Sheet()
    inner = sheet.width - 2 * MARGIN
    y = (
        MARGIN
        + sheet.text(MARGIN, MARGIN, "What a checkpoint holds, per front-end", "title", inner)
        + 2
    )
    y += (
        sheet.text(
            MARGIN,
            y,
            f"A job of {WORLD} processes, checkpointed after step {STEP}.",
            "text",
            inner,
            SOFT,
        )
        + 6
    )
    x = MARGIN
    chip = sheet.line("text") + 2 * CHIP_Y - 3
    for kind, label in (("theirs", "the framework's, or yours"), ("ours", "added by loader-resume"),
                        ("seal", "written last, sealing it")):
        w = sheet.measure(label, "text") + 2 * CHIP_X
        if x + w > MARGIN + inner:
            x, y = MARGIN, y + chip + GAP
        index = sheet.box(x, y, w, chip, *KINDS[kind], 2.5)
        sheet.texts.append((x + CHIP_X, y + sheet.inset("text", chip), label, "text", INK, index))
        x += w + GAP
    y += chip + 10
    for door in doors():
        top, width = y, inner - 2 * CARD_PAD
        card = sheet.box(MARGIN, top, inner, 0, "#ffffff", LINE, 4.0)
        y += CARD_PAD
        title = sheet.measure(door.name, "head")
        sheet.texts.append((MARGIN + CARD_PAD, y, door.name, "head", INK, card))
        if title + 10 + sheet.measure(door.where, "path") <= width:
            sheet.texts.append(
                (
                    MARGIN + inner - CARD_PAD - sheet.measure(door.where, "path"),
                    y + 1.5,
                    door.where,
                    "path",
                    SOFT,
                    card,
                )
            )
            y += sheet.line("head") + 2
        else:
            y += sheet.line("head")
            y += sheet.text(MARGIN + CARD_PAD, y, door.where, "path", width, SOFT, card) + 3
        y += _chips(sheet, door.items, MARGIN + CARD_PAD, y, width) + 5
        y += sheet.text(MARGIN + CARD_PAD, y, door.note, "text", width, SOFT, card) + CARD_PAD - 2
        sheet.boxes[card] = (MARGIN, top, inner, y - top, "#ffffff", LINE, 4.0)
        y += 8
    sheet.draw(y - 8 + MARGIN, path)


# --- figure 2: from a signal to the rerun's first batch -------------------------------------------
LANES = (26.0, 68.0)  # rank 0, rank 1
TEXT_X = 92.0


def _steps() -> list[tuple[str, str, str]]:
    """(phase, title, detail) of each step; a phase starts where it changes."""
    temporary = temporary_name(Path(SEALED), "TOKEN").name
    code, stop, rerun = exit_code(), "The run that is stopped", "The rerun: the same command"
    assert code == 128 + signal.SIGTERM, f"step 4 reads '128 + SIGTERM'; the exit code is {code}"
    return [
        (
            stop,
            "A signal reaches one rank",
            f"{' or '.join(signals())}, mid-step. The handler only sets a flag: "
            "no I/O, no collective, no save.",
        ),
        (
            stop,
            "The ranks agree at the step boundary",
            f"After the optimizer step, one all_reduce asks whether any "
            f"rank was signalled: every rank stops after step {STEP}.",
        ),
        (
            stop,
            "The checkpoint is written atomically",
            f"Every rank takes part in writing {temporary}; the main one adds {MANIFEST} (size and "
            f"SHA-256 of every file) and renames it {SEALED}.",
        ),
        (
            stop,
            f"Every process exits {code}",
            f"128 + SIGTERM: stopped, to be continued. A save that failed "
            f"exits {FAILED_SAVE_EXIT_CODE} instead; the checkpoint before stays.",
        ),
        (
            "",
            "The job starts again",
            "SLURM requeues it (after SIGUSR1), torchrun or Kubernetes restarts it, or you "
            "run the same command again.",
        ),
        (
            rerun,
            "The newest checkpoint is loaded",
            "Verified first (one that does not verify is passed over for the one before): weights, "
            "optimizer, each rank's loader positions and generators.",
        ),
        (
            rerun,
            "The first batch is the next one",
            f"Step {STEP + 1}'s batch of the uninterrupted run, on every "
            "rank: the same samples and augmentation values, bit for bit.",
        ),
    ]


def preemption_timeline(path: Path) -> None:
    sheet = Sheet()
    inner = sheet.width - 2 * MARGIN
    y = (
        MARGIN
        + sheet.text(MARGIN, MARGIN, "From a signal to the rerun's first batch", "title", inner)
        + 2
    )
    y += (
        sheet.text(
            MARGIN,
            y,
            "Two ranks, under Fabric or Accelerate; Lightning and the transformers Trainer "
            "differ in their files only (below).",
            "text",
            inner,
            SOFT,
        )
        + 10
    )
    for x, name in zip(LANES, ("rank 0", "rank 1"), strict=True):
        sheet.texts.append((x - sheet.measure(name, "text") / 2, y, name, "text", SOFT, None))
    y += sheet.line("text") + 6
    width, phase, centres, spans = sheet.width - MARGIN - TEXT_X, None, [], []
    for number, (now, title, detail) in enumerate(_steps(), 1):
        if now != phase:
            if now:
                band = sheet.box(
                    TEXT_X - 6, y, width + 6, sheet.line("text") + 4, "#f3f4fb", "#f3f4fb", 2.0
                )
                sheet.texts.append((TEXT_X, y + 2, now, "text", SOFT, band))
                y += sheet.line("text") + 10
            phase = now
            spans.append([now, y - 4, y])
        top = y
        y += sheet.text(TEXT_X, y, f"{number}. {title}", "head", width)
        y += sheet.text(TEXT_X, y, detail, "text", width, SOFT) + 12
        centres.append(top + sheet.line("head") / 2)
        spans[-1][2] = y - 12
    for name, start, end in spans:
        style = "-" if name else ":"
        for x in LANES:
            sheet.marks.append(
                (
                    "plot",
                    ([x, x], [start, end]),
                    dict(color=LINE if name else "#bbbbbb", linestyle=style, linewidth=2, zorder=1),
                )
            )
    signalled, agree, write, leave, again, load, first = centres
    dot = dict(zorder=3, markersize=9, markeredgewidth=1.2, linestyle="none")
    sheet.marks += [
        ("plot", ([LANES[1]], [signalled]), dict(marker="v", color="#d32f2f", **dot)),
        (
            "annotate",
            ("", (LANES[0] + 5, agree), (LANES[1] - 5, agree)),
            dict(arrowprops=dict(arrowstyle="<->", color=KINDS["ours"][1], linewidth=1.4)),
        ),
        ("plot", (list(LANES), [agree, agree]), dict(marker="o", color=KINDS["ours"][1], **dot)),
        ("plot", ([LANES[1]], [write]), dict(marker="s", color=KINDS["ours"][1], **dot)),
        ("plot", ([LANES[0]], [write]), dict(marker="s", color=KINDS["seal"][1], **dot)),
        ("plot", (list(LANES), [leave, leave]), dict(marker="X", color="#546e7a", **dot)),
        (
            "plot",
            ([sum(LANES) / 2], [again]),
            dict(
                marker=r"$\circlearrowleft$",
                color="#546e7a",
                markersize=14,
                linestyle="none",
                zorder=3,
            ),
        ),
        ("plot", (list(LANES), [load, load]), dict(marker="s", color=KINDS["ours"][1], **dot)),
        ("plot", (list(LANES), [first, first]), dict(marker="o", color="#2e7d32", **dot)),
    ]
    lightning = lightning_file()
    temporary = temporary_name(Path(lightning), "TOKEN").name
    y += sheet.text(
        MARGIN,
        y,
        f"Lightning writes one file the same way: {temporary}, renamed {lightning}. The "
        f"transformers Trainer writes {PREFIX_CHECKPOINT_DIR}-{STEP}, {TRAINER_STATE} last, "
        "once every rank's files exist.",
        "text",
        inner,
        SOFT,
    )
    sheet.draw(y + MARGIN, path)


def main(out: Path = IMG) -> list[Path]:
    """Draw every figure into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context(RC):
        checkpoint_contents(out / FIGURES[0])
        preemption_timeline(out / FIGURES[1])
    return [out / name for name in FIGURES]


if __name__ == "__main__":
    for written in main(Path(sys.argv[1]) if len(sys.argv) > 1 else IMG):
        print(written)
