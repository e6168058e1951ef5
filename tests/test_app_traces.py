"""What a visit leaves behind (issue 30, README's privacy line): a closed tab leaves nothing reachable in Gradio's
cache, a downloaded document names adapters as the visitor does and no server path, and SIGTERM cleans up like
Ctrl+C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from gradio_client import Client, handle_file

from molora.app.ui import MoLoRAApp
from molora.models import InterleavedPipeline
from molora.models.document import Document
from molora.models.families.shapes.testing import write_tiny_adapter
from tests.app_process import free_port, wait_until_served

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pirate_zip(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("traces")
    folder = write_tiny_adapter(tiny_assets / "model", root / "mypirate", modality="text", seed=21)
    archive = root / "mypirate.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(folder / name, f"mypirate/{name}")
    return archive


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_a_closed_tab_leaves_no_upload_or_output_in_gradios_cache(tiny_assets, pirate_zip, tmp_path, monkeypatch):
    cache = tmp_path / "gradio"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(cache))
    app = MoLoRAApp(InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu"))
    tab = SimpleNamespace(session_hash="gfn37vpsu9xyz")
    state = app.sessions.new_state()
    uploaded = cache / "0123abcd" / pirate_zip.name  # where Gradio puts an upload
    uploaded.parent.mkdir(parents=True)
    shutil.copy(pirate_zip, uploaded)
    app.track_uploads([str(uploaded)], tab)  # the File component's upload event
    app.upload_adapter([str(uploaded)], "mypirate", "text", state, tab)
    outputs = list(app.generate("Draw a red circle.", "mypirate", "image_style", "vocab", True, 1.0, 0, 1.0, 1.0, 0,
                                1.0, 0, 280, 1, state, tab))
    images, download = outputs[-1][1], outputs[-1][2]
    assert images and all(Path(p).is_relative_to(cache) for p in images)
    assert Path(download).is_relative_to(cache)  # handed out from the cache: Gradio makes no untracked copy
    html = Path(download).read_text()
    doc = Document.load(download)
    assert "@" not in (doc.meta["text_adapter"] or "") and "gfn37vpsu9" not in html
    assert {r.adapter for r in doc.routing} <= {"mypirate", "image_style", None}
    assert doc.meta["model"] == "model" and str(tiny_assets) not in html  # no server path
    assert files_under(cache)
    app.end_session(tab)  # the tab closed
    assert files_under(cache) == [], "a closed tab left files reachable in Gradio's cache"
    app.close()


def test_sigterm_removes_the_apps_folder_and_its_files_in_gradios_cache(tiny_assets, pirate_zip, tmp_path):
    temp, cache = tmp_path / "tmp", tmp_path / "gradio"
    temp.mkdir()
    port = free_port()
    env = {**os.environ, "TMPDIR": str(temp), "GRADIO_TEMP_DIR": str(cache), "GRADIO_ANALYTICS_ENABLED": "False",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "molora", "serve", "--model", str(tiny_assets / "model"),
                             "--host", "127.0.0.1", "--port", str(port), "--no-warmup"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_served(proc, port, 120, "the app")
        visitor = Client(f"http://127.0.0.1:{port}/", verbose=False)
        visitor.predict([handle_file(str(pirate_zip))], "mypirate", "text", api_name="/upload_adapter")
        visitor.predict(prompt="Draw a red circle.", text_choice="mypirate", image_choice="image_style",
                        routing="vocab", start_image=True, text_temperature=1.0, text_top_k=0, text_top_p=1.0,
                        image_temperature=1.0, image_top_k=0, cfg_scale=1.0, seed=0, max_new_tokens=280,
                        best_of=1, api_name="/generate")
        assert list(temp.glob("molora-app-*")) and files_under(cache)
        proc.send_signal(signal.SIGTERM)  # what Docker and Spaces send
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(temp.glob("molora-app-*")), "the app's temporary folder outlived SIGTERM"
    left = [p for p in files_under(cache) if p.stat().st_size]  # Gradio's upload parser leaves an empty temp file
    assert left == [], f"SIGTERM left files in Gradio's cache: {left}"


def test_the_page_is_served_before_the_warm_up_ends(tiny_assets, tmp_path):
    """Start-up to a served page is loading alone: the warm-up generation runs once the page is up."""
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--model", str(tiny_assets / "model"), "--host",
                             "127.0.0.1", "--port", str(port)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("warm-up done" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "\n".join(lines)
            lines.append(line)
        served = next(i for i, line in enumerate(lines) if "Running on local URL" in line)
        warmed = next(i for i, line in enumerate(lines) if "warm-up done" in line)
        assert served < warmed, "".join(lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_sigterms_during_the_warm_up_stop_the_app_cleanly(tiny_assets, tmp_path):
    """SIGTERM while the warm-up generates (three in a row, as an impatient supervisor sends them): the app closes
    its server and exits 0, with no traceback (one shutdown, however many signals; the engine's thread, stopped
    mid-start or mid-request, ends its requests inside its own inference mode)."""
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--model", str(tiny_assets / "model"), "--host",
                             "127.0.0.1", "--port", str(port)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        while not any("warming up" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        for _ in range(3):
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + out
    assert "Traceback" not in out and "Exception" not in out, out
