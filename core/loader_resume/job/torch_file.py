"""A file written by ``torch.save`` verified before it is loaded: every record against the CRC-32
that torch's writer stores for it in the file's zip directory
(``torch.serialization.set_crc32_options``, on by default).

``torch.load`` itself does not check them: a flipped bit in a weight loads as another weight, and a
truncated file fails with an error that names no file. ``verify_torch_file`` refuses both, naming
the file and the record. It reads the whole file once (about as fast as the disk; the load that
follows then reads from the page cache). A changed file is refused; a file written again by
``torch.save`` is a new, consistent file.

A safetensors file stores no checksum: ``verify_safetensors`` checks its structure only (a header
that parses, tensors that end where the file ends), which refuses a truncated or overwritten file
but not a flipped bit inside a tensor's bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zipfile
from typing import Any

from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.storage import is_remote, local_path, open_remote

__all__ = ["verify_safetensors", "verify_torch_file"]


def verify_torch_file(path: str | os.PathLike[str]) -> None:
    """Raise ``CheckpointError`` unless ``path`` (a local path or an fsspec URL) is a complete
    ``torch.save`` zip file whose every record matches its stored CRC-32. What cannot be checked is
    let through: a file in torch's legacy format (no zip), records whose CRC-32 was not computed
    (``set_crc32_options(False)`` stores 0)."""
    try:
        with contextlib.ExitStack() as stack:
            # NOTE: a URL (s3://...) is read through fsspec, as a seekable file: ranged reads of the
            # zip directory
            source: Any = (
                stack.enter_context(open_remote(os.fspath(path)))
                if is_remote(path)
                else local_path(path)
            )
            bad = _bad_record(source)
    except FileNotFoundError:
        raise CheckpointError(f"{os.fspath(path)}: no such checkpoint file") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(
            f"{os.fspath(path)}: not a complete torch checkpoint ({type(error).__name__}: "
            f"{error}; truncated?); refusing to load it"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"{os.fspath(path)}: record {bad!r} does not match the CRC-32 stored for it "
            "(changed on disk after it was written); refusing to load it"
        )


def verify_safetensors(path: str | os.PathLike[str]) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a whole safetensors file: an 8-byte header
    length, a JSON header within the file, and the last tensor ending at the file's last byte."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(file.read(length))
        ends = [
            entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"
        ]
        expected = 8 + length + max(ends, default=0)
    except FileNotFoundError:
        raise CheckpointError(f"{os.fspath(path)}: no such checkpoint file") from None
    except (
        OSError,
        struct.error,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
    ) as error:
        raise CheckpointError(
            f"{os.fspath(path)}: not a complete safetensors file ({type(error).__name__}: "
            f"{error}; truncated?); refusing to load it"
        ) from None
    if expected != size:
        raise CheckpointError(
            f"{os.fspath(path)}: {size} bytes, its header describes {expected} (truncated or "
            "changed on disk after it was written); refusing to load it"
        )


def _bad_record(source: Any) -> str | None:
    """The first record of ``source`` (a path or a seekable file) whose CRC-32 does not match, else
    None."""
    if not zipfile.is_zipfile(source):
        if _cut_zip(source):
            raise zipfile.BadZipFile("its zip directory is missing")
        # NOTE: torch's legacy format (or a custom CheckpointIO's): nothing to check it against
        return None
    with zipfile.ZipFile(source) as archive:
        return next(
            (
                info.filename
                for info in archive.infolist()
                if info.CRC and not _matches(archive, info)
            ),
            None,
        )


def _matches(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    try:
        with archive.open(info) as record:
            while record.read(1 << 20):
                pass
    except zipfile.BadZipFile:
        return False
    return True


def _cut_zip(source: Any) -> bool:
    """Whether ``source`` begins as a zip file (torch's format) although it has no zip directory:
    cut short."""
    if not isinstance(source, str):
        source.seek(0)
        return bool(source.read(4) == b"PK\x03\x04")
    with open(source, "rb") as file:
        return file.read(4) == b"PK\x03\x04"
