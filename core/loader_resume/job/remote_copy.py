"""A copy of a job's sealed checkpoint directories on object storage, for front-ends whose
frameworks write local directories only (Accelerate's ``save_state``, Fabric's sharded saves, a
plain loop's ``write_sealed``).

Each checkpoint is first written and sealed locally, with every guarantee of a local directory
(``write_sealed``); then the main process uploads it to ``URL/step_N/``: every file, then the
manifest last. The manifest is the commit: a remote directory without one (a kill during the upload,
a link cut) is incomplete, and is skipped, named, at a resume; an upload that fails is reported as a
failed save (a preemption exits 74: nothing that outlives the machine was written). Older remote
copies beyond ``keep`` are deleted after a new one is complete.

At a resume the main process downloads the remote complete checkpoints newer than the newest local
one (a new machine has none) into the local directory — each into a temporary name, renamed into
place once whole — and the local rules apply from there: the newest that verifies byte for byte
against its manifest is loaded, the one before it if it does not.
"""

from __future__ import annotations

import atexit
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loader_resume.errors import RemoteCopyError
from loader_resume.job.checkpoint import MANIFEST, complete_checkpoints, temporary_name
from loader_resume.job.checkpoint_dir import claim
from loader_resume.job.remote_lease import RemoteLease
from loader_resume.job.storage import is_remote, remote_filesystem

__all__ = ["RemoteCopy", "RemoteCopyError", "fetch_newer", "start_remote_copy"]

logger = logging.getLogger(__name__)



class RemoteCopy:
    """Sealed checkpoints of the local directory ``local_root``, copied to the fsspec URL ``url``
    (``s3://``, ``gs://``, ``memory://``...)."""

    def __init__(
        self, url: str, local_root: Path, *, keep: int = 2, pattern: str = r"step_(\d+)"
    ) -> None:
        if not is_remote(url):
            raise ValueError(
                f"remote copy {url!r}: expected an fsspec URL of another store (s3://bucket/run, "
                "gs://...); a local path or a file: URL is a local directory already"
            )
        self.url, self.local_root, self.keep, self.pattern = (
            url.rstrip("/"),
            local_root,
            keep,
            pattern,
        )
        self.lease: RemoteLease | None = None
        """This job's lease of ``url`` (``start_remote_copy``), ``None`` where the store cannot
        lock."""

    def release(self) -> None:
        """Let the lease go (the end of the job, or of a preemption stop)."""
        if self.lease is not None:
            atexit.unregister(self.release)
            self.lease.release()
            self.lease = None

    def hold(self, *, main: bool, agree: Callable[[bool], bool]) -> None:
        """Take the lease of ``url`` until ``release()`` or the process's exit (``claim``: a store
        that cannot be reached, or another job holding it, is refused on every process, naming the
        URL and the cause)."""
        lease = claim(self.url, main=main, agree=agree, remote=True)
        self.lease = lease if isinstance(lease, RemoteLease) else None
        # NOTE: let go at the process's exit (a preemption stop's SystemExit too)
        if self.lease is not None:
            atexit.register(self.release)

    def __repr__(self) -> str:
        return f"RemoteCopy({self.url!r})"

    def upload(self, sealed: Path) -> str:
        """Copy the sealed directory ``sealed`` to ``URL/<its name>``, its manifest last; then
        delete remote checkpoints beyond ``keep``. Returns the remote directory's URL."""
        target = f"{self.url}/{sealed.name}"

        def put(fs: Any, root: str) -> None:
            path = f"{root}/{sealed.name}"
            # NOTE: an earlier attempt's copy of this step, complete or not: replaced whole
            if fs.exists(path):
                fs.rm(path, recursive=True)
            files = sorted(p for p in sealed.rglob("*") if p.is_file() and p.name != MANIFEST)
            for file in files:
                fs.put_file(str(file), f"{path}/{file.relative_to(sealed).as_posix()}")
            # NOTE: the commit, written last
            fs.put_file(str(sealed / MANIFEST), f"{path}/{MANIFEST}")

        self._call(f"upload {sealed} to {target}", put)
        try:
            for old in self.complete()[:-self.keep]:
                self._call(f"delete {self.url}/{old}", _remove, old)
        except RemoteCopyError as error:
            logger.warning(
                "%s uploaded; deleting older remote checkpoints failed: %s", target, error
            )
        return target

    def complete(self) -> list[str]:
        """Names of the complete remote checkpoints, oldest first; incomplete ones are skipped with
        a warning."""
        def names(fs: Any, root: str) -> list[str]:
            # NOTE: another process (an earlier attempt) wrote it; never a cached listing
            fs.invalidate_cache(root)
            return (
                [
                    entry["name"].rstrip("/").rsplit("/", 1)[-1]
                    for entry in fs.ls(root, detail=True)
                    if entry["type"] == "directory"
                ]
                if fs.exists(root)
                else []
            )

        found: list[tuple[int, str]] = []
        for name in self._call(f"list {self.url}", names):
            match = re.fullmatch(self.pattern, name)
            if match is None:
                continue
            if not self._call(f"list {self.url}/{name}", _sealed, name):
                logger.warning(
                    "skipping %s/%s: it has no %s, so its upload did not complete (a kill or a cut "
                    "link during it)",
                    self.url,
                    name,
                    MANIFEST,
                )
                continue
            found.append((int(match.group(1)), name))
        return [name for _, name in sorted(found)]

    def download_newer(self) -> list[Path]:
        """Download the complete remote checkpoints newer than the newest complete local one (at
        most ``keep``, newest last) into ``local_root``; returns the local directories made."""
        local = complete_checkpoints(self.local_root, self.pattern)
        newest_local = self._number(local[-1].name) if local else -1
        newer = [name for name in self.complete() if self._number(name) > newest_local][-self.keep:]
        made = []
        for name in newer:
            final = self.local_root / name
            temporary = temporary_name(final, "download")
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.parent.mkdir(parents=True, exist_ok=True)
            self._call(f"download {self.url}/{name} to {final}", _get, name, temporary)
            if final.exists():  # NOTE: an unsealed local leftover of the same name
                shutil.rmtree(final)
            temporary.rename(final)
            logger.info("downloaded %s/%s to %s", self.url, name, final)
            made.append(final)
        return made

    def _number(self, name: str) -> int:
        match = re.fullmatch(self.pattern, name)
        return int(match.group(1)) if match else -1

    def _call(self, what: str, action: Callable[..., Any], *args: Any) -> Any:
        """``action(fs, root, *args)``; any error raised as a ``RemoteCopyError`` naming ``what``
        and the cause."""
        try:
            fs, root = remote_filesystem(self.url)
            return action(fs, root.rstrip("/"), *args)
        # NOTE: fsspec stores raise their own errors (botocore's, aiohttp's...)
        except Exception as error:
            raise RemoteCopyError(f"{what}: {type(error).__name__}: {error}") from error



def _remove(fs: Any, root: str, name: str) -> None:
    fs.rm(f"{root}/{name}", recursive=True)


def _sealed(fs: Any, root: str, name: str) -> bool:
    return bool(fs.exists(f"{root}/{name}/{MANIFEST}"))


def _get(fs: Any, root: str, name: str, into: Path) -> None:
    """Every file under the remote ``root/name`` into the local ``into``, at the same relative
    paths."""
    directory = f"{root}/{name}"
    prefix = fs._strip_protocol(directory).rstrip("/") + "/"
    for path in fs.find(directory):
        local = into / path[len(prefix):] if path.startswith(prefix) else None
        if local is None:
            raise OSError(f"{path}: not under {prefix}")
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local))


def start_remote_copy(
    url: str | None,
    local_root: Path,
    *,
    keep: int,
    main: bool,
    agree: Callable[[bool], bool],
    pattern: str = r"step_(\d+)",
) -> RemoteCopy | None:
    """The ``RemoteCopy`` of ``url`` (``None``: no copy), holding its lease
    (``RemoteCopy.hold``)."""
    if url is None:
        return None
    copy = RemoteCopy(url, local_root, keep=keep, pattern=pattern)
    copy.hold(main=main, agree=agree)
    return copy


def fetch_newer(copy: RemoteCopy | None, *, main: bool, agree: Callable[[bool], bool]) -> None:
    """``copy.download_newer()`` on the main process, before a resume looks for local checkpoints; a
    failure there is raised on every process (the main process's ``RemoteCopyError`` naming the URL
    and the cause)."""
    if copy is None:
        return
    error: RemoteCopyError | None = None
    if main:
        try:
            copy.download_newer()
        except RemoteCopyError as failed:
            error = failed
    if agree(error is not None):
        raise error or RemoteCopyError(
            f"{copy.url}: the download before the resume failed on the main process "
            "(its log names why)"
        )
