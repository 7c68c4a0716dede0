"""``enable_resume``'s settings: our own YAML and ``LOADER_RESUME_*`` environment variables, read
with omegaconf against a typed schema.

Accelerate's config file cannot carry them: it rejects top-level keys it does not know, and its
dict-valued sections drop unknown keys silently. What ``accelerate launch`` hands every rank is the
environment, so, as Accelerate reads its own ``ACCELERATE_*`` variables, ours are read on every
rank. Layers, each over the one before: the schema's defaults; a YAML file (the ``config`` path,
else ``$LOADER_RESUME_CONFIG``); ``LOADER_RESUME_<FIELD>`` variables
(``LOADER_RESUME_SAVE_EVERY_N_STEPS=100``); ``config`` given as a mapping; the ``overrides``
dotlist. The schema below *is* the defaults; ``configs/accelerate_resume.yaml`` ships the same
values with comments (a test keeps the two equal). Unknown or mistyped keys and variables fail at
``enable_resume`` naming them and the closest valid one.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loader_resume.job.fresh_start import NO_CHECKPOINT_VARIABLE
from loader_resume.job.preemption import signal_numbers
from loader_resume.job.remote_lease import LEASE_VARIABLE
from loader_resume.keyed.keyed_rng import KEYING_MODES, generator_mask

__all__ = ["CONFIG_VARIABLE", "ENV_PREFIX", "ResumeConfig", "load_config"]

ENV_PREFIX: Final = "LOADER_RESUME_"
"""Environment variables ``LOADER_RESUME_<FIELD>`` (the field's name in capitals) set a field on
every rank."""
CONFIG_VARIABLE: Final = "LOADER_RESUME_CONFIG"
"""A YAML file of ``ResumeConfig`` keys, read when ``enable_resume`` is given no path."""



@dataclass
class ResumeConfig:
    """What ``enable_resume`` does. Every field has a default: a bare ``enable_resume(accelerator)``
    is armed."""

    checkpoint_dir: Optional[str] = None  # noqa: UP045 (omegaconf reads the annotation at runtime)
    """Where checkpoints go (``step_000000042/`` each); ``None``:
    ``<project_dir>/resume_checkpoints`` (``project_dir``: the Accelerator's, else the working
    directory)."""
    remote: Optional[str] = None  # noqa: UP045
    """An fsspec URL (``s3://bucket/run``, ``gs://...``) each sealed checkpoint is copied to, its
    manifest last; at an automatic resume the complete remote checkpoints newer than the local ones
    are downloaded first (a new machine's rerun resumes from them). One job at a time holds it (a
    lease). ``None``: local checkpoints only."""
    audit: Optional[str] = None  # noqa: UP045
    """A directory or fsspec URL where each rank logs the batches its loaders hand over, for
    ``loader-resume audit DIR`` (``ResumableDataLoader(audit=...)``); ``None``: no log."""
    save_every_n_steps: int = 0
    """Also checkpoint every N optimizer steps (0: only on preemption)."""
    keep: int = 2
    """How many checkpoints to keep (the oldest are deleted after a new one is sealed)."""
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that request a checkpoint at the next step boundary and an exit ([] for none)."""
    exit_code: int = 143
    """The process's exit code after a preemption checkpoint (143 = 128 + SIGTERM: schedulers
    requeue)."""
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
    slurm_requeue: bool = False
    """Inside a SLURM job, after a checkpoint requested by SIGUSR1 (``sbatch --signal=USR1@90``) the
    main process runs ``scontrol requeue`` (``loader_resume.job.slurm``); other signals stop without
    one."""
    enabled: bool = True
    """``False`` (e.g. ``LOADER_RESUME_ENABLED=0``, no code edited): ``enable_resume`` leaves the
    Accelerator stock — Accelerate's own loaders, no preemption handling, no checkpoints of ours, no
    automatic resume — and says so in a warning."""

    def __post_init__(self) -> None:
        for name in ("save_every_n_steps", "keep", "check_every_n_steps"):
            value, least = getattr(self, name), 0 if name == "save_every_n_steps" else 1
            if value < least:
                raise ValueError(f"resume config: {name}={value}; expected an integer >= {least}")
        if self.keying in ("False", "false"):
            # NOTE: YAML reads an unquoted `off` as the boolean false (and omegaconf then as
            # "False").
            self.keying = "off"
        if self.keying not in KEYING_MODES:
            raise ValueError(
                f"resume config: keying={self.keying!r}; expected one of {list(KEYING_MODES)}"
            )
        signal_numbers(self.signals)
        generator_mask(self.keyed_generators)


def load_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | DictConfig | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> ResumeConfig:
    """The schema's defaults, merged with a YAML file (``config`` if it is a path, else the one
    ``$LOADER_RESUME_CONFIG`` names), then ``LOADER_RESUME_<FIELD>`` variables of ``environ``
    (default: ``os.environ``), then ``config`` if it is a dict or DictConfig, then ``overrides`` (an
    omegaconf dotlist such as ``["save_every_n_steps=50", "keying=off"]``). A dict or dotlist
    argument thus wins over a variable, a variable over the YAML file (a path argument too), the
    file over the defaults."""
    environ = os.environ if environ is None else environ
    schema = OmegaConf.structured(ResumeConfig)
    layers: list[tuple[str, Any]] = []  # (where it comes from, the layer)
    path = (
        os.fspath(config)
        if isinstance(config, (str, os.PathLike))
        else environ.get(CONFIG_VARIABLE)
    )
    if path:
        where = (
            "resume config"
            if isinstance(config, (str, os.PathLike))
            else f"{CONFIG_VARIABLE}={path}"
        )
        layers.append((where, _read_yaml(path)))
    variables = _variables(environ)
    if variables:
        layers.append(
            (
                "environment",
                OmegaConf.from_dotlist([f"{key}={value}" for key, value in variables.items()]),
            )
        )
    if config is not None and not isinstance(config, (str, os.PathLike)):
        layers.append(
            (
                "resume config",
                config if isinstance(config, DictConfig) else OmegaConf.create(dict(config)),
            )
        )
    if overrides:
        layers.append(("resume config", OmegaConf.from_dotlist(list(overrides))))
    for where, layer in layers:
        _check_keys(layer)
        try:
            schema = OmegaConf.merge(schema, layer)
        except OmegaConfBaseException as error:
            key, message = getattr(error, "full_key", None), str(error.msg).splitlines()[0]
            if where == "environment":
                raise ValueError(
                    f"{ENV_PREFIX}{str(key).upper()}={variables.get(str(key))!r}: {message}; "
                    "expected the types of ResumeConfig"
                ) from None
            raise ValueError(
                f"{where}: {key}: {message}; expected the types of ResumeConfig"
            ) from None
    try:
        resolved = OmegaConf.to_container(schema, resolve=True)
    except OmegaConfBaseException as error:  # an interpolation (${...}) that does not resolve
        key, message = getattr(error, "full_key", None), str(error.msg).splitlines()[0]
        raise ValueError(
            f"resume config: {key} (or {ENV_PREFIX}{str(key).upper()}): {message}; expected a "
            "plain value (interpolations are omegaconf's, not the shell's)"
        ) from None
    assert isinstance(resolved, dict)
    return ResumeConfig(**{str(key): value for key, value in resolved.items()})


def _variables(environ: Mapping[str, str]) -> dict[str, str]:
    """``{field: value}`` of the ``LOADER_RESUME_<FIELD>`` variables; an unknown one fails, naming
    the closest."""
    valid = {ENV_PREFIX + f.name.upper(): f.name for f in fields(ResumeConfig)}
    # NOTE: ours, not fields (loader_resume's)
    other = [CONFIG_VARIABLE, LEASE_VARIABLE, NO_CHECKPOINT_VARIABLE]
    found = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in other:
            continue
        if name not in valid:
            close = difflib.get_close_matches(name, [*valid, *other], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"environment variable {name}: unknown{hint}; expected one of {[*valid, *other]}"
            )
        found[valid[name]] = value
    return found


def _read_yaml(path: str) -> DictConfig:
    loaded = OmegaConf.load(path)
    if not isinstance(loaded, DictConfig):
        raise ValueError(
            f"resume config {path}: a YAML list; expected a mapping of ResumeConfig keys"
        )
    return loaded


def _check_keys(layer: DictConfig) -> None:
    valid = [f.name for f in fields(ResumeConfig)]
    for key in layer:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"resume config: unknown key {key!r}{hint}; expected one of {valid}")

