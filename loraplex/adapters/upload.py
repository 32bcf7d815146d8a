"""Unpack an uploaded PEFT adapter into a staging folder, safely.

An upload is either the two files (`adapter_config.json`, `adapter_model.safetensors`) or one
`.zip` / `.tar.gz` holding them, at its root or in one folder, each optionally with the
adapter's own tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`);
other files (a README) are ignored. Archive members that are links,
devices, absolute paths or paths with `..` are refused, as are pickle checkpoints and anything
larger than the size limit; nothing is written outside the staging folder.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

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


class UploadTooLargeError(AdapterValidationError):
    """The upload is over the size limit."""


@dataclass(frozen=True)
class UploadedFile:
    filename: str
    data: bytes


def unpack_upload(files: list[UploadedFile], dest: Path, max_bytes: int) -> None:
    """Write the adapter's files into `dest`; AdapterValidationError if the upload is bad."""
    if not files:
        raise AdapterValidationError(
            f"no files uploaded; send {list(ADAPTER_FILES)} or one .zip / .tar.gz"
        )
    if sum(len(f.data) for f in files) > max_bytes:
        raise UploadTooLargeError(f"the upload is over the limit of {max_bytes} bytes")
    names = [_check_name(f.filename) for f in files]
    archives = [n for n in names if n.endswith(ARCHIVE_SUFFIXES)]
    if archives:
        if len(files) != 1:
            raise AdapterValidationError("send either one archive or the adapter files, not both")
        members = _read_archive(names[0], files[0].data, max_bytes)
    else:
        members = {n: f.data for n, f in zip(names, files) if n in UPLOADED_FILES}
    _write(members, dest)


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


def _read_archive(name: str, data: bytes, max_bytes: int) -> dict[str, bytes]:
    """Regular-file members of the archive by normalized path, checked before extraction."""
    entries: dict[str, bytes] = {}
    total = 0
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for info in archive.infolist():
                    path = _member_path(info.filename)
                    if info.is_dir() or not path:
                        continue
                    if (info.external_attr >> 16) & 0o170000 == 0o120000:
                        raise AdapterValidationError(f"archive member {path!r} is a link")
                    total += info.file_size
                    if total > max_bytes:
                        raise UploadTooLargeError(f"the archive unpacks to over {max_bytes} bytes")
                    entries[path] = archive.read(info)
        else:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
                for member in archive.getmembers():
                    path = _member_path(member.name)
                    if member.isdir() or not path:
                        continue
                    if not member.isfile():
                        raise AdapterValidationError(f"archive member {path!r} is not a file")
                    total += member.size
                    if total > max_bytes:
                        raise UploadTooLargeError(f"the archive unpacks to over {max_bytes} bytes")
                    handle = archive.extractfile(member)
                    entries[path] = handle.read() if handle is not None else b""
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as error:
        raise AdapterValidationError(f"{name}: unreadable archive ({error})") from None
    configs = [p for p in entries if posixpath.basename(p) == CONFIG_FILE]
    if len(configs) != 1:
        raise AdapterValidationError(f"{name}: expected one {CONFIG_FILE}, found {len(configs)}")
    folder = posixpath.dirname(configs[0])
    members = {}
    for path, content in entries.items():
        base = _check_name(posixpath.basename(path))
        if posixpath.dirname(path) == folder and base in UPLOADED_FILES:
            members[base] = content
    return members


def _write(members: dict[str, bytes], dest: Path) -> None:
    if CONFIG_FILE not in members:
        raise AdapterValidationError(f"missing {CONFIG_FILE}")
    if WEIGHTS_FILE not in members:
        raise AdapterValidationError(f"missing {WEIGHTS_FILE}")
    if len(members[CONFIG_FILE]) > MAX_CONFIG_BYTES:
        raise UploadTooLargeError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    for name in UPLOADED_FILES:
        if name in members:
            (dest / name).write_bytes(members[name])
