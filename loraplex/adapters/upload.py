"""Unpack an uploaded PEFT adapter into a staging folder, safely.

An upload is either the two files (`adapter_config.json`, `adapter_model.safetensors`) or one
`.zip` / `.tar.gz` holding them, at its root or in one folder, each optionally with the
adapter's own tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`);
other files (a README) are ignored. Archive members that are links,
devices, absolute paths or paths with `..` are refused, as are pickle checkpoints and anything
larger than the size limit; nothing is written outside the staging folder.
"""

from __future__ import annotations

import functools
import io
import posixpath
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from loraplex.adapters.adapter_tokenizer import TOKENIZER_FILES
from loraplex.adapters.peft_format import (
    CONFIG_FILE,
    PICKLE_SUFFIXES,
    WEIGHTS_FILE,
    AdapterValidationError,
)

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
#: the files an upload may hold: the adapter's, then its tokenizer's (optional)
UPLOADED_FILES = ADAPTER_FILES + TOKENIZER_FILES
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
MAX_CONFIG_BYTES = 1024 * 1024
_CHUNK = 1024 * 1024  # bytes copied at a time


class UploadTooLargeError(AdapterValidationError):
    """The upload is over the size limit."""


@dataclass(frozen=True)
class UploadedFile:
    """One uploaded file: its name as sent, and its content as a readable, seekable binary file
    (a temporary file on disk for a large upload, so no upload is held in memory)."""

    filename: str
    file: BinaryIO


def unpack_upload(files: list[UploadedFile], dest: Path, max_bytes: int) -> None:
    """Write the adapter's files into `dest`; AdapterValidationError if the upload is bad.

    Files are copied in chunks, and archive members are counted as they are extracted, so memory
    stays bounded whatever the upload's size, and extraction stops at `max_bytes`."""
    if not files:
        raise AdapterValidationError(
            f"no files uploaded; send {list(ADAPTER_FILES)} or one .zip / .tar.gz"
        )
    if sum(_size(f.file) for f in files) > max_bytes:
        raise UploadTooLargeError(f"the upload is over the limit of {max_bytes} bytes")
    names = [_check_name(f.filename) for f in files]
    archives = [n for n in names if n.endswith(ARCHIVE_SUFFIXES)]
    if archives:
        if len(files) != 1:
            raise AdapterValidationError("send either one archive or the adapter files, not both")
        _unpack_archive(names[0], files[0].file, dest, max_bytes)
    else:
        for name, upload in zip(names, files):
            if name in UPLOADED_FILES:
                upload.file.seek(0)
                _copy(upload.file, dest / name, max_bytes, max_bytes)
    _check_unpacked(dest)


def _size(file: BinaryIO) -> int:
    file.seek(0, io.SEEK_END)
    return file.tell()


def _copy(source: BinaryIO, target: Path, budget: int, max_bytes: int) -> int:
    """Copy `source` to `target` in chunks; UploadTooLargeError (naming `max_bytes`, the whole
    upload's limit) past `budget` bytes. Returns the bytes written."""
    written = 0
    with open(target, "wb") as out:
        while chunk := source.read(_CHUNK):
            written += len(chunk)
            if written > budget:
                raise UploadTooLargeError(f"the upload unpacks to over {max_bytes} bytes")
            out.write(chunk)
    return written


def _check_name(filename: str) -> str:
    name = filename or ""
    if "\x00" in name or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise AdapterValidationError(f"bad file name {filename!r}")
    if name.endswith(PICKLE_SUFFIXES):
        raise AdapterValidationError(
            f"{name}: pickle checkpoints are refused; save the adapter as {WEIGHTS_FILE}"
        )
    return name


def _member_path(raw: str) -> str:
    """The archive member's normalized relative path; refuses paths that escape the folder."""
    if "\x00" in raw or "\\" in raw or raw.startswith("/"):
        raise AdapterValidationError(f"archive member {raw!r} has an unsafe path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise AdapterValidationError(f"archive member {raw!r} escapes the archive's folder")
    return posixpath.join(*parts) if parts else ""


def _archive_members(
    name: str, archive: zipfile.ZipFile | tarfile.TarFile
) -> Iterator[tuple[str, int, Callable[[], BinaryIO]]]:
    """(normalized path, declared size, opener) of every regular file of the archive; links,
    devices and unsafe paths are refused."""
    if isinstance(archive, zipfile.ZipFile):
        for info in archive.infolist():
            path = _member_path(info.filename)
            if info.is_dir() or not path:
                continue
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise AdapterValidationError(f"archive member {path!r} is a link")
            yield path, info.file_size, functools.partial(archive.open, info)
        return
    for member in archive:
        path = _member_path(member.name)
        if member.isdir() or not path:
            continue
        if not member.isfile():
            raise AdapterValidationError(f"archive member {path!r} is not a file")
        yield path, member.size, functools.partial(_tar_member, archive, member, name)


def _tar_member(archive: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> BinaryIO:
    handle = archive.extractfile(member)
    if handle is None:
        raise AdapterValidationError(f"{name}: archive member {member.name!r} is not a file")
    return handle


def _unpack_archive(name: str, file: BinaryIO, dest: Path, max_bytes: int) -> None:
    """Extract the adapter's files of an archive into `dest`, in one pass: every file that may
    be one of them goes to a scratch folder under `dest` (counted against `max_bytes`, as every
    other member's size is), then those of the folder holding the one adapter_config.json move
    into place."""
    scratch = dest / ".unpack"
    scratch.mkdir()
    extracted: dict[str, Path] = {}
    total = 0
    file.seek(0)
    try:
        opened = (
            zipfile.ZipFile(file)
            if name.endswith(".zip")
            else tarfile.open(fileobj=file, mode="r:gz")
        )
        with opened as archive:
            for path, size, open_member in _archive_members(name, archive):
                base = _check_name(posixpath.basename(path))
                if base not in UPLOADED_FILES:
                    total += size
                    if total > max_bytes:
                        raise UploadTooLargeError(f"the archive unpacks to over {max_bytes} bytes")
                    continue
                target = scratch / str(len(extracted))
                with open_member() as member:
                    total += _copy(member, target, max_bytes - total, max_bytes)
                extracted[path] = target
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as error:
        raise AdapterValidationError(f"{name}: unreadable archive ({error})") from None
    configs = [p for p in extracted if posixpath.basename(p) == CONFIG_FILE]
    if len(configs) != 1:
        raise AdapterValidationError(f"{name}: expected one {CONFIG_FILE}, found {len(configs)}")
    folder = posixpath.dirname(configs[0])
    for path, target in extracted.items():
        if posixpath.dirname(path) == folder:
            target.replace(dest / posixpath.basename(path))
    shutil.rmtree(scratch)


def _check_unpacked(dest: Path) -> None:
    if not (dest / CONFIG_FILE).is_file():
        raise AdapterValidationError(f"missing {CONFIG_FILE}")
    if not (dest / WEIGHTS_FILE).is_file():
        raise AdapterValidationError(f"missing {WEIGHTS_FILE}")
    if (dest / CONFIG_FILE).stat().st_size > MAX_CONFIG_BYTES:
        raise UploadTooLargeError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
