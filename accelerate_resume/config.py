"""``enable_resume``'s settings: our own YAML, read with omegaconf against a typed schema.

Accelerate's config file rejects keys it does not know, so ours live apart. The schema below *is* the
defaults; ``configs/accelerate_resume.yaml`` ships the same values with comments (a test keeps the two
equal). Unknown or mistyped keys fail at ``enable_resume`` with the key named and the closest valid one.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loader_resume.keyed_rng import KEYING_MODES, generator_mask
from loader_resume.preemption import signal_numbers

__all__ = ["ResumeConfig", "load_config"]



@dataclass
class ResumeConfig:
    """What ``enable_resume`` does. Every field has a default: a bare ``enable_resume(accelerator)`` is armed."""

    checkpoint_dir: Optional[str] = None  # noqa: UP045 (omegaconf reads the annotation at runtime)
    """Where checkpoints go (``step_000000042/`` each); ``None``: ``<project_dir>/resume_checkpoints``
    (``project_dir``: the Accelerator's, else the working directory)."""
    save_every_n_steps: int = 0
    """Also checkpoint every N optimizer steps (0: only on preemption)."""
    keep: int = 2
    """How many checkpoints to keep (the oldest are deleted after a new one is sealed)."""
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that request a checkpoint at the next step boundary and an exit ([] for none)."""
    exit_code: int = 143
    """The process's exit code after a preemption checkpoint (143 = 128 + SIGTERM: schedulers requeue)."""
    check_every_n_steps: int = 1
    """Agree on signals every N optimizer steps (one tiny all_reduce each time when distributed)."""
    seed: int = 0
    """The data order and keyed-randomness seed of the loaders passed to ``prepare``."""
    keying: str = "batch"
    """Keyed randomness: ``batch``, ``sample`` or ``off`` (see ``ResumableDataLoader``)."""
    keyed_generators: list[str] = field(default_factory=lambda: ["torch", "numpy", "random"])
    """Which global generators are keyed inside data loading."""
    auto_resume: bool = True
    """On start, load the newest complete checkpoint in ``checkpoint_dir`` without user code."""
    verify_checksums: bool = True
    """Seal each checkpoint with SHA-256 sums and verify them on load (else sizes only)."""

    def __post_init__(self) -> None:
        for name in ("save_every_n_steps", "keep", "check_every_n_steps"):
            value, least = getattr(self, name), 0 if name == "save_every_n_steps" else 1
            if value < least:
                raise ValueError(f"resume config: {name}={value}; expected an integer >= {least}")
        if self.keying in ("False", "false"):
            # NOTE: YAML reads an unquoted `off` as the boolean false (and omegaconf then as "False").
            self.keying = "off"
        if self.keying not in KEYING_MODES:
            raise ValueError(f"resume config: keying={self.keying!r}; expected one of {list(KEYING_MODES)}")
        signal_numbers(self.signals)
        generator_mask(self.keyed_generators)


def load_config(config: str | os.PathLike[str] | Mapping[str, Any] | DictConfig | None = None,
                overrides: Sequence[str] = ()) -> ResumeConfig:
    """The schema's defaults, merged with ``config`` (a YAML path, a dict or a DictConfig), then with
    ``overrides`` (an omegaconf dotlist such as ``["save_every_n_steps=50", "keying=off"]``)."""
    schema = OmegaConf.structured(ResumeConfig)
    layers: list[Any] = []
    if isinstance(config, (str, os.PathLike)):
        layers.append(_read_yaml(os.fspath(config)))
    elif config is not None:
        layers.append(config if isinstance(config, DictConfig) else OmegaConf.create(dict(config)))
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    for layer in layers:
        _check_keys(layer)
        try:
            schema = OmegaConf.merge(schema, layer)
        except OmegaConfBaseException as error:
            where, message = getattr(error, "full_key", None), str(error.msg).splitlines()[0]
            raise ValueError(f"resume config: {where}: {message}; expected the types of ResumeConfig") from None
    resolved = OmegaConf.to_container(schema, resolve=True)
    assert isinstance(resolved, dict)
    return ResumeConfig(**{str(key): value for key, value in resolved.items()})


def _read_yaml(path: str) -> DictConfig:
    loaded = OmegaConf.load(path)
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"resume config {path}: a YAML list; expected a mapping of ResumeConfig keys")
    return loaded


def _check_keys(layer: DictConfig) -> None:
    valid = [f.name for f in fields(ResumeConfig)]
    for key in layer:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"resume config: unknown key {key!r}{hint}; expected one of {valid}")

