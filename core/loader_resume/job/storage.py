"""Where checkpoints live: a local directory, or an fsspec URL (``s3://``, ``gs://``,
``memory://``...).

A path is *local* when it has no protocol, or is a ``file:`` URL (``file:///data/run``, or
``file:/data/run`` as Lightning writes one): those mean the local path, with its guarantees (rename,
directory lock). Anything else is *remote* and goes through fsspec (imported only then; the
filesystem's own package, ``s3fs`` or ``gcsfs``, is the user's). What differs on an object store:
there is no rename, so a file is written as one upload that becomes visible only once complete, and
a directory counts as complete only once its manifest, written last, is there.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["is_remote", "join", "local_path", "open_remote", "remote_filesystem"]

_PROTOCOL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_FILE_URL = re.compile(r"^file:(//(localhost)?)?(?=/)")


def local_path(path: str | os.PathLike[str]) -> str:
    """``path`` with a ``file:`` URL turned into the local path it names; other paths and URLs as
    they are."""
    text = os.fspath(path)
    return _FILE_URL.sub("", text, count=1) if text.startswith("file:") else text


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of another filesystem than the local one (``file:`` URLs are
    local)."""
    text = local_path(path)
    return _PROTOCOL.match(text) is not None


def join(directory: str, name: str) -> str:
    """``directory/name`` for a local path or a URL (a URL's separator is always ``/``)."""
    return (
        f"{directory.rstrip('/')}/{name}" if is_remote(directory) else os.path.join(directory, name)
    )


def remote_filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it; an ImportError names the package to
    install."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)  # type: ignore[no-any-return]
    except ImportError as error:
        raise ImportError(
            f"{url}: {error} (fsspec needs the package of this filesystem to reach it)"
        ) from error


def open_remote(url: str) -> Any:
    """``url`` opened for reading (a seekable file object; close it)."""
    fs, path = remote_filesystem(url)
    return fs.open(path, "rb")
