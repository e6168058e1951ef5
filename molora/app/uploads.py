"""Checking an adapter a visitor uploads before any of it reaches the model.

An upload is either one zip of a PEFT folder or the folder's two files picked directly. Everything is checked
here, on bytes, before the pipeline sees a path: sizes (declared and actually read, so a zip bomb stops at the
cap), entry names (no absolute paths, no `..`, no links), JSON that parses, and a safetensors header that is well
formed. A zip may hold, beside the two PEFT files, what this project writes into an adapter folder (`molora.json`,
checked like the config) and harmless documentation or archiver leftovers (README.md, *.txt, .DS_Store,
__MACOSX/), which are skipped unread; any other file (code, pickles, executables) is refused. Only then are the two files written into a fresh private folder, which
`routing.load_peft_adapter` (through the pipeline) validates again tensor by tensor. A rejected upload leaves no
folder behind and changes no state.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import struct
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from molora.routing.adapters import parse_adapter_config
from molora.routing.errors import AdapterError, MoLoRAError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
METADATA_NAME = "molora.json"  # the modality and description our scripts write beside the PEFT files
EXPECTED_FILES = (CONFIG_NAME, WEIGHTS_NAME)
# skipped unread (never written to disk): documentation and what archivers add on their own
IGNORED_SUFFIXES = (".md", ".txt")
IGNORED_NAMES = ("LICENSE", ".DS_Store", ".gitattributes", ".gitignore", "Thumbs.db")
IGNORED_FOLDERS = ("__MACOSX",)
MODALITIES = ("text", "image", "any")

# The embedded model's largest adapter (rank 16 on every projection) is ~1 MB; 64 MiB leaves room for bigger bases
# while keeping a hostile upload from filling memory or disk.
MAX_WEIGHTS_BYTES = 64 * 1024 * 1024
MAX_CONFIG_BYTES = 64 * 1024
MAX_ZIP_BYTES = MAX_WEIGHTS_BYTES + MAX_CONFIG_BYTES + 1024 * 1024
MAX_ZIP_ENTRIES = 16  # the two files plus folder entries; a real PEFT zip has at most 3-4
MAX_SAFETENSORS_HEADER = 16 * 1024 * 1024
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
_READ_CHUNK = 1 << 20


class UploadError(MoLoRAError):
    """An uploaded adapter that is refused before it reaches the model; the message says why and what to send."""


@dataclass(frozen=True)
class ValidatedUpload:
    """The two PEFT files of an upload, checked and held in memory."""

    config: dict
    config_bytes: bytes
    weights_bytes: bytes
    suggested_name: str | None  # the folder name inside a zip, if it had one
    metadata: dict | None = None  # the zip's molora.json (modality, description), if it had one

    def write(self, parent: str | Path) -> Path:
        """Write the two files into a new folder under `parent` and return it."""
        folder = Path(tempfile.mkdtemp(prefix="adapter-", dir=parent))
        (folder / CONFIG_NAME).write_bytes(self.config_bytes)
        (folder / WEIGHTS_NAME).write_bytes(self.weights_bytes)
        return folder


def check_adapter_name(name: str) -> str:
    """Return the stripped name if it is a safe adapter name, else raise UploadError."""
    name = (name or "").strip()
    if not NAME_PATTERN.match(name):
        raise UploadError(
            f"adapter name {name!r} is not allowed: use 1-40 letters, digits, '_', '-' or '.', starting with a "
            "letter or digit")
    return name


def validate_upload(paths: list[str | Path]) -> ValidatedUpload:
    """Check uploaded files (one .zip, or adapter_config.json + adapter_model.safetensors) and return their bytes."""
    paths = [Path(p) for p in (paths or [])]
    if not paths:
        raise UploadError("no file uploaded: send a .zip of a PEFT adapter folder, or its "
                          f"{CONFIG_NAME} and {WEIGHTS_NAME}")
    if len(paths) == 1 and paths[0].suffix.lower() == ".zip":
        return _validate_zip(paths[0])
    names = sorted(p.name for p in paths)
    if sorted(n for n in names if n != METADATA_NAME) != sorted(EXPECTED_FILES) or names.count(METADATA_NAME) > 1:
        raise UploadError(f"expected exactly {CONFIG_NAME} and {WEIGHTS_NAME}, optionally with {METADATA_NAME} (or "
                          f"one .zip of them), got {', '.join(names)}")
    by_name = {p.name: p for p in paths}
    config_bytes = _read_capped_file(by_name[CONFIG_NAME], MAX_CONFIG_BYTES)
    weights_bytes = _read_capped_file(by_name[WEIGHTS_NAME], MAX_WEIGHTS_BYTES)
    metadata = None
    if METADATA_NAME in by_name:
        metadata = _parse_metadata(_read_capped_file(by_name[METADATA_NAME], MAX_CONFIG_BYTES))
    return _validated(config_bytes, weights_bytes, suggested_name=None, metadata=metadata)


def _read_capped_file(path: Path, cap: int) -> bytes:
    size = path.stat().st_size
    if size > cap:
        raise UploadError(f"{path.name} is {size / 1e6:.1f} MB; the limit is {cap / 1e6:.1f} MB")
    return path.read_bytes()


def _validate_zip(path: Path) -> ValidatedUpload:
    size = path.stat().st_size
    if size > MAX_ZIP_BYTES:
        raise UploadError(f"{path.name} is {size / 1e6:.1f} MB; the limit is {MAX_ZIP_BYTES / 1e6:.1f} MB")
    if not zipfile.is_zipfile(path):
        raise UploadError(f"{path.name} is not a valid zip archive")
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if len(infos) > MAX_ZIP_ENTRIES:
                raise UploadError(f"the zip holds {len(infos)} entries; a PEFT adapter needs only {CONFIG_NAME} "
                                  f"and {WEIGHTS_NAME}")
            files, folders = _check_entries(infos)
            contents = {name: _read_capped_entry(archive, info, cap)
                        for name, (info, cap) in files.items()}
    except zipfile.BadZipFile as err:
        raise UploadError(f"{path.name} is a damaged zip archive ({err})") from err
    suggested = folders.pop() if len(folders) == 1 else None
    metadata = _parse_metadata(contents[METADATA_NAME]) if METADATA_NAME in contents else None
    return _validated(contents[CONFIG_NAME], contents[WEIGHTS_NAME], suggested_name=suggested, metadata=metadata)


def _ignored(parts: tuple[str, ...]) -> bool:
    """Documentation and archiver leftovers that an adapter folder may carry; skipped, never read."""
    name = parts[-1]
    return (parts[0] in IGNORED_FOLDERS or name in IGNORED_NAMES or name.startswith("._")
            or name.lower().endswith(IGNORED_SUFFIXES))


def _parse_metadata(raw: bytes) -> dict:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        raise UploadError(f"{METADATA_NAME} is not valid JSON ({err})") from err
    if not isinstance(meta, dict) or meta.get("modality", "any") not in MODALITIES:
        raise UploadError(f"{METADATA_NAME} must be a JSON object whose modality is one of {', '.join(MODALITIES)}")
    return meta


def _check_entries(infos: list[zipfile.ZipInfo]) -> tuple[dict[str, tuple[zipfile.ZipInfo, int]], set[str]]:
    """Map each expected file name to its entry; refuse anything unsafe or unexpected."""
    caps = {CONFIG_NAME: MAX_CONFIG_BYTES, WEIGHTS_NAME: MAX_WEIGHTS_BYTES, METADATA_NAME: MAX_CONFIG_BYTES}
    files: dict[str, tuple[zipfile.ZipInfo, int]] = {}
    folders: set[str] = set()
    for info in infos:
        raw = info.filename
        if "\\" in raw or raw.startswith("/") or re.match(r"^[A-Za-z]:", raw) or "\x00" in raw:
            raise UploadError(f"zip entry {raw!r} has an absolute or non-portable path; refusing it")
        parts = PurePosixPath(raw).parts
        if any(part in ("..", ".") for part in parts):
            raise UploadError(f"zip entry {raw!r} tries to leave the adapter folder (path traversal); refusing it")
        if info.flag_bits & 0x1:
            raise UploadError(f"zip entry {raw!r} is encrypted; upload an unencrypted zip")
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise UploadError(f"zip entry {raw!r} is a symbolic link; refusing it")
        if parts and parts[0] in IGNORED_FOLDERS:
            continue  # macOS's resource forks: skipped, never read
        if info.is_dir():
            if len(parts) > 1:
                raise UploadError(f"zip entry {raw!r} is nested too deep; zip the adapter folder itself")
            folders.add(parts[0])
            continue
        if len(parts) > 2:
            raise UploadError(f"zip entry {raw!r} is nested too deep; zip the adapter folder itself")
        if len(parts) == 2:
            folders.add(parts[0])
        name = parts[-1]
        if name not in caps:
            if _ignored(parts):
                continue
            raise UploadError(f"unexpected file {raw!r} in the zip: an adapter folder holds {CONFIG_NAME} and "
                              f"{WEIGHTS_NAME} (and optionally {METADATA_NAME} and README/text files); nothing "
                              "else, code and pickles least of all, is accepted")
        if name in files:
            raise UploadError(f"the zip holds {name} twice")
        if info.file_size > caps[name]:
            raise UploadError(f"{name} unpacks to {info.file_size / 1e6:.1f} MB; the limit is "
                              f"{caps[name] / 1e6:.1f} MB (zip bomb protection)")
        files[name] = (info, caps[name])
    if len(folders) > 1:
        raise UploadError(f"the zip holds several folders ({', '.join(sorted(folders))}); zip one adapter folder")
    missing = [name for name in EXPECTED_FILES if name not in files]
    if missing:
        raise UploadError(f"the zip lacks {' and '.join(missing)}; a PEFT adapter folder holds {CONFIG_NAME} and "
                          f"{WEIGHTS_NAME}")
    return files, folders


def _read_capped_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
    """Read one entry, stopping at `cap` bytes whatever its header claims (a lying header is a zip bomb)."""
    chunks, total = [], 0
    with archive.open(info) as handle:
        while chunk := handle.read(_READ_CHUNK):
            total += len(chunk)
            if total > cap:
                raise UploadError(f"{info.filename} unpacks to more than {cap / 1e6:.1f} MB (zip bomb protection)")
            chunks.append(chunk)
    return b"".join(chunks)


def _validated(config_bytes: bytes, weights_bytes: bytes, suggested_name: str | None,
               metadata: dict | None = None) -> ValidatedUpload:
    try:
        config = parse_adapter_config(config_bytes, CONFIG_NAME)
    except AdapterError as err:
        raise UploadError(str(err)) from err
    _check_safetensors_header(weights_bytes)
    if suggested_name is not None and not NAME_PATTERN.match(suggested_name):
        suggested_name = None
    return ValidatedUpload(config, config_bytes, weights_bytes, suggested_name, metadata)


def _check_safetensors_header(data: bytes) -> None:
    """A safetensors file is an 8-byte length, a JSON header, then raw tensor bytes; pickles fail here."""
    if len(data) < 8:
        raise UploadError(f"{WEIGHTS_NAME} is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > len(data):
        raise UploadError(f"{WEIGHTS_NAME} is not a safetensors file (bad header length; pickled .bin weights are "
                          "not accepted)")
    try:
        header = json.loads(data[8:8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise UploadError(f"{WEIGHTS_NAME} has a corrupt safetensors header ({err})") from err
    if not isinstance(header, dict) or not any(key != "__metadata__" for key in header):
        raise UploadError(f"{WEIGHTS_NAME} holds no tensors")


def remove_folder(folder: str | Path | None) -> None:
    """Delete an adapter folder written by `ValidatedUpload.write` (ignoring one already gone)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
