"""`pip install .` makes one top-level package, `molora`, with a `molora` command, and shadows no other distribution:
installed beside Hugging Face's `kernels` package (which transformers may import), `import kernels` stays theirs.

The Hugging Face wheel comes from scripts/test.sh (downloaded into .venv/wheels, never installed into the venv:
in a checkout the repository's own top-level `kernels/` is on the path). Without it the test skips, unless
MOLORA_REQUIRE_HF_KERNELS=1 (CI), where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE = ("molora", "assets", "pyproject.toml", "README.md",
          "requirements.txt", "LICENSE")
HF_KERNELS = sorted((REPO / ".venv" / "wheels").glob("kernels-*.whl"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project installed with pip into a folder of its own (built from a copy of its source, so the checkout
    gets no build/ folder), with Hugging Face's kernels package beside it."""
    if not HF_KERNELS:
        if os.environ.get("MOLORA_REQUIRE_HF_KERNELS") == "1":
            pytest.fail("no Hugging Face kernels wheel in .venv/wheels: scripts/test.sh downloads it")
        pytest.skip("no Hugging Face kernels wheel in .venv/wheels (scripts/test.sh downloads it)")
    root = tmp_path_factory.mktemp("install")
    source, site = root / "source", root / "site"
    source.mkdir()
    for name in SOURCE:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([*pip, str(source)], check=True, capture_output=True, timeout=300)
    subprocess.run([*pip, str(HF_KERNELS[-1])], check=True, capture_output=True, timeout=300)
    return site


def _run(site: Path, args: list[str], cwd: Path, *, without_triton: bool = False) -> subprocess.CompletedProcess:
    # the installed folder only: no checkout on the path (cwd is elsewhere, PYTHONPATH names just the install);
    # without_triton: as a CPU machine that installed requirements.txt (tests/test_entry_points.py's probe)
    path = [str(site)]
    if without_triton:
        from test_entry_points import NO_TRITON

        (cwd / "no_triton").mkdir(exist_ok=True)
        (cwd / "no_triton" / "sitecustomize.py").write_text(NO_TRITON)
        path.insert(0, str(cwd / "no_triton"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "MOLORA_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_install_adds_one_top_level_package_and_a_command(installed: Path):
    ours = {p.name for p in installed.iterdir()} - {"bin", "kernels"} - {p.name for p in installed.glob("*.dist-info")}
    assert ours == {"molora"}
    assert (installed / "molora" / "assets" / "model" / "lm" / "model.safetensors").is_file()
    assert (installed / "bin" / "molora").is_file()


def test_hugging_face_kernels_stays_importable_beside_the_installed_copy(installed: Path, tmp_path: Path):
    code = ("import kernels, molora.kernels, molora.routing, transformers\n"
            "from transformers.utils.import_utils import is_kernels_available\n"
            "is_kernels_available()\n"
            "print(kernels.__file__); print(molora.kernels.__file__); print(molora.__path__)\n")
    result = _run(installed, [sys.executable, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    hf_file, ours_file, molora_path = result.stdout.split("\n")[:3]
    assert hf_file == str(installed / "kernels" / "__init__.py")  # Hugging Face's, not ours
    assert ours_file == str(installed / "molora" / "kernels" / "__init__.py")
    assert molora_path == repr([str(installed / "molora")])  # no checkout searched


def test_the_installed_command_writes_a_document_on_the_embedded_model(installed: Path, tmp_path: Path):
    """... with triton unimportable, as on a CPU machine that installed the project and requirements.txt."""
    result = _run(installed, [str(installed / "bin" / "molora"), "generate", "Draw a red circle.", "--seed", "0",
                              "--start-image", "--out", "doc.html"], tmp_path, without_triton=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "doc.html").is_file()
    usage = _run(installed, [str(installed / "bin" / "molora"), "--help"], tmp_path)
    assert usage.returncode == 0 and all(c in usage.stdout for c in ("generate", "evaluate", "serve"))
    unknown = _run(installed, [str(installed / "bin" / "molora"), "train"], tmp_path)
    assert unknown.returncode == 2 and "unknown command 'train'" in unknown.stderr


def test_it_installs_from_a_git_url(tmp_path: Path):
    """`pip install git+<url>` builds from a clone of the committed tree: the tracked files alone make the package."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), f"git+file://{REPO}"], check=True, capture_output=True, timeout=300)
    assert (site / "molora" / "models" / "pipeline.py").is_file() and (site / "bin" / "molora").is_file()
    assert (site / "molora" / "assets" / "router" / "gates.safetensors").is_file()
    result = _run(site, [sys.executable, "-c", "from molora.models import InterleavedPipeline"], tmp_path)
    assert result.returncode == 0, result.stderr
