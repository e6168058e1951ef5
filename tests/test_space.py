"""Hugging Face Space readiness: README front matter, requirements, and @spaces.GPU applied only when present."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import gradio

ROOT = Path(__file__).resolve().parents[1]


def front_matter() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "README.md must start with the Space's YAML front matter"
    block = text.split("---\n", 2)[1]
    pairs = (line.split(":", 1) for line in block.splitlines() if ":" in line)
    return {key.strip(): value.strip().strip('"') for key, value in pairs}


def test_readme_front_matter_describes_a_gradio_space():
    meta = front_matter()
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py"
    assert meta["sdk_version"] == gradio.__version__
    for key in ("title", "python_version", "license", "short_description"):
        assert meta.get(key), f"front matter lacks {key}"
    assert len(meta["short_description"]) <= 60  # the Hub's limit
    assert (ROOT / meta["app_file"]).exists()


def test_requirements_name_what_the_app_imports():
    names = {line.split(">")[0].split("=")[0].split(";")[0].strip().lower()
             for line in (ROOT / "requirements.txt").read_text().splitlines() if line and not line.startswith("#")}
    assert {"torch", "transformers", "diffusers", "safetensors", "gradio", "peft", "pillow"} <= names


def test_spaces_gpu_wraps_the_generation_function_only_when_spaces_is_installed(monkeypatch):
    import molora.app.ui as ui

    plain = ui.stream_events
    assert not getattr(plain, "on_gpu", False)

    fake = types.ModuleType("spaces")

    def GPU(fn):  # noqa: N802 - the real decorator's name
        fn.on_gpu = True
        return fn

    fake.GPU = GPU
    monkeypatch.setitem(sys.modules, "spaces", fake)
    try:
        reloaded = importlib.reload(ui)
        assert reloaded.stream_events.on_gpu is True
    finally:
        monkeypatch.delitem(sys.modules, "spaces")
        importlib.reload(ui)
    assert not getattr(ui.stream_events, "on_gpu", False)
