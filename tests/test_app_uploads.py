"""Upload validation (app/uploads.py): what a visitor may send, and the clear refusals of everything else."""

from __future__ import annotations

import json
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from molora.app import uploads
from molora.app.session import SessionState
from molora.app.uploads import CONFIG_NAME, WEIGHTS_NAME, UploadError, check_adapter_name, validate_upload
from molora.routing.errors import MoLoRAError, UnknownAdapterError

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


@pytest.fixture
def adapter_files(tmp_path: Path) -> Path:
    folder = tmp_path / "my-adapter"
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(json.dumps(CONFIG))
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 8)}, str(folder / WEIGHTS_NAME))
    return folder


def make_zip(path: Path, entries: dict[str, bytes], *, symlink: str | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        if symlink is not None:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, "/etc/passwd")
    return path


def good_entries(folder: Path, prefix: str = "my-adapter/") -> dict[str, bytes]:
    return {prefix + CONFIG_NAME: (folder / CONFIG_NAME).read_bytes(),
            prefix + WEIGHTS_NAME: (folder / WEIGHTS_NAME).read_bytes()}


def test_upload_error_is_a_project_error():
    assert issubclass(UploadError, MoLoRAError)


def test_the_two_peft_files_are_accepted_and_written_to_a_fresh_folder(adapter_files, tmp_path):
    upload = validate_upload([adapter_files / CONFIG_NAME, adapter_files / WEIGHTS_NAME])
    assert upload.config["peft_type"] == "LORA"
    out = upload.write(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    assert (out / WEIGHTS_NAME).read_bytes() == (adapter_files / WEIGHTS_NAME).read_bytes()


@pytest.mark.parametrize("prefix", ["my-adapter/", ""])
def test_a_zipped_peft_folder_is_accepted_with_its_folder_name_suggested(adapter_files, tmp_path, prefix):
    archive = make_zip(tmp_path / "a.zip", good_entries(adapter_files, prefix))
    upload = validate_upload([archive])
    assert upload.suggested_name == ("my-adapter" if prefix else None)
    assert upload.weights_bytes == (adapter_files / WEIGHTS_NAME).read_bytes()


@pytest.mark.parametrize("bad_name, message", [
    ("../adapter_config.json", "path traversal"),
    ("my-adapter/../../adapter_config.json", "path traversal"),
    ("/abs/adapter_config.json", "absolute"),
    ("C:/x/adapter_config.json", "absolute"),
    ("my-adapter\\adapter_config.json", "absolute"),
])
def test_zip_entries_that_escape_the_folder_are_refused(adapter_files, tmp_path, bad_name, message):
    entries = good_entries(adapter_files)
    entries[bad_name] = entries.pop("my-adapter/" + CONFIG_NAME)
    with pytest.raises(UploadError, match=message):
        validate_upload([make_zip(tmp_path / "a.zip", entries)])


def test_a_symlink_in_the_zip_is_refused(adapter_files, tmp_path):
    archive = make_zip(tmp_path / "a.zip", good_entries(adapter_files), symlink="my-adapter/link")
    with pytest.raises(UploadError, match="symbolic link"):
        validate_upload([archive])


def test_any_file_beyond_the_two_is_refused(adapter_files, tmp_path):
    entries = good_entries(adapter_files)
    entries["my-adapter/evil.py"] = b"import os"
    with pytest.raises(UploadError, match="unexpected file"):
        validate_upload([make_zip(tmp_path / "a.zip", entries)])


def test_a_shipped_adapter_folder_zipped_as_is_is_accepted(tmp_path):
    """`cd assets/adapters && zip -r outline.zip outline/`: the folder holds molora.json beside the PEFT files."""
    shipped = Path(__file__).resolve().parent.parent / "assets" / "adapters" / "outline"
    archive = tmp_path / "outline.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(shipped, "outline/")
        for path in sorted(shipped.iterdir()):
            zf.write(path, f"outline/{path.name}")
    upload = validate_upload([archive])
    assert upload.suggested_name == "outline"
    assert upload.metadata["modality"] == "image"
    assert upload.weights_bytes == (shipped / WEIGHTS_NAME).read_bytes()


def test_documentation_and_archiver_leftovers_are_skipped(adapter_files, tmp_path):
    entries = good_entries(adapter_files)
    entries.update({"my-adapter/README.md": b"# my adapter", "my-adapter/notes.txt": b"x",
                    "my-adapter/.DS_Store": b"\0\0", "__MACOSX/my-adapter/._adapter_config.json": b"\0"})
    upload = validate_upload([make_zip(tmp_path / "a.zip", entries)])
    assert upload.suggested_name == "my-adapter" and upload.metadata is None
    assert sorted(p.name for p in upload.write(tmp_path).iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])


@pytest.mark.parametrize("name", ["run.sh", "weights.bin", "adapter_model.pt", "setup.py", "x.pkl"])
def test_code_and_pickles_beside_the_metadata_are_still_refused(adapter_files, tmp_path, name):
    entries = {**good_entries(adapter_files), "my-adapter/molora.json": b'{"modality": "text"}',
               f"my-adapter/{name}": b"import os"}
    with pytest.raises(UploadError, match="unexpected file"):
        validate_upload([make_zip(tmp_path / "a.zip", entries)])


@pytest.mark.parametrize("meta", [b"{not json", b'{"modality": "audio"}', b"[1]"])
def test_a_bad_molora_json_is_refused(adapter_files, tmp_path, meta):
    entries = {**good_entries(adapter_files), "my-adapter/molora.json": meta}
    with pytest.raises(UploadError, match="molora.json"):
        validate_upload([make_zip(tmp_path / "a.zip", entries)])


def test_a_zip_missing_the_weights_is_refused(adapter_files, tmp_path):
    entries = good_entries(adapter_files)
    entries.pop("my-adapter/" + WEIGHTS_NAME)
    with pytest.raises(UploadError, match="lacks adapter_model.safetensors"):
        validate_upload([make_zip(tmp_path / "a.zip", entries)])


def test_a_zip_bomb_stops_at_the_size_cap(adapter_files, tmp_path, monkeypatch):
    entries = good_entries(adapter_files)
    entries["my-adapter/" + WEIGHTS_NAME] = b"\0" * 5_000_000  # compresses to a few KB
    archive = make_zip(tmp_path / "bomb.zip", entries)
    assert archive.stat().st_size < 100_000
    monkeypatch.setattr(uploads, "MAX_WEIGHTS_BYTES", 1_000_000)
    with pytest.raises(UploadError, match="zip bomb"):
        validate_upload([archive])


def test_a_zip_whose_headers_understate_the_size_is_refused(adapter_files, tmp_path):
    entries = good_entries(adapter_files)
    entries["my-adapter/" + WEIGHTS_NAME] = b"\0" * 3_000_000
    raw = bytearray(make_zip(tmp_path / "liar.zip", entries).read_bytes())
    # claim 10 bytes in the local (offset 22) and central (offset 24) headers of the big entry
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = -1
        while (at := raw.find(signature, at + 1)) != -1:
            if struct.unpack_from("<I", raw, at + offset)[0] == 3_000_000:
                struct.pack_into("<I", raw, at + offset, 10)
    liar = tmp_path / "liar2.zip"
    liar.write_bytes(bytes(raw))
    with pytest.raises(UploadError, match="damaged zip|zip bomb"):
        validate_upload([liar])


def test_non_zip_and_wrong_file_sets_are_refused(adapter_files, tmp_path):
    fake = tmp_path / "fake.zip"
    fake.write_bytes(b"not a zip at all")
    with pytest.raises(UploadError, match="not a valid zip"):
        validate_upload([fake])
    with pytest.raises(UploadError, match="expected exactly"):
        validate_upload([adapter_files / CONFIG_NAME])
    with pytest.raises(UploadError, match="no file uploaded"):
        validate_upload([])


def test_pickled_weights_and_bad_configs_are_refused(adapter_files, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / WEIGHTS_NAME)  # a pickle under the safetensors name
    (folder / CONFIG_NAME).write_text(json.dumps(CONFIG))
    with pytest.raises(UploadError, match="not a safetensors file"):
        validate_upload([folder / CONFIG_NAME, folder / WEIGHTS_NAME])
    (folder / WEIGHTS_NAME).write_bytes((adapter_files / WEIGHTS_NAME).read_bytes())
    (folder / CONFIG_NAME).write_text("{not json")
    with pytest.raises(UploadError, match="not valid JSON"):
        validate_upload([folder / CONFIG_NAME, folder / WEIGHTS_NAME])
    (folder / CONFIG_NAME).write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(UploadError, match="only LoRA"):
        validate_upload([folder / CONFIG_NAME, folder / WEIGHTS_NAME])


def test_oversized_plain_files_are_refused(adapter_files, monkeypatch):
    monkeypatch.setattr(uploads, "MAX_WEIGHTS_BYTES", 10)
    with pytest.raises(UploadError, match="limit"):
        validate_upload([adapter_files / CONFIG_NAME, adapter_files / WEIGHTS_NAME])


@pytest.mark.parametrize("name", ["", "../x", "a b", "x" * 41, "-lead", "naïve"])
def test_unsafe_adapter_names_are_refused(name):
    with pytest.raises(UploadError, match="not allowed"):
        check_adapter_name(name)


def test_session_names_are_private_and_unique():
    builtin = {"plain": "text", "outline": "image"}
    mine, theirs = SessionState(), SessionState()
    mine.bind("session-aaaaaaaaaaaa")
    theirs.bind("session-bbbbbbbbbbbb")
    with pytest.raises(UploadError, match="built-in"):
        mine.check_new_name("plain", builtin)
    assert mine.internal_name("x") != theirs.internal_name("x")
    with pytest.raises(UnknownAdapterError, match="unknown adapter"):
        theirs.resolve(mine.internal_name("x"), builtin)
    assert theirs.resolve("none", builtin) == (None, None)
    assert theirs.resolve("plain", builtin) == ("plain", "plain")
