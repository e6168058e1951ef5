"""Every documented way in starts the way a user starts it, and what our dependencies import still imports there.

The guard against shadowing (issue: a new transformers release required Hugging Face's `kernels` package, which a
top-level `kernels/` of ours hid): each entry point runs in a subprocess from the folder a user runs it from, with a
`sitecustomize` probe on the path that, inside that process (at its first import of molora or its first parse of
arguments), imports what transformers, diffusers, peft and accelerate import from the process's own `sys.path` and
writes what it found. A folder of ours that shadows any of them makes the probe fail here, not on a user's machine.

A second probe makes `triton` unimportable, as on a CPU machine that installed requirements.txt (the README's CPU
command and the Space), and the command line then writes a document with both style adapters on the embedded model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the dependencies import (transformers' `is_kernels_available` asks for Hugging Face's `kernels`; diffusers'
# VQ model imports its `CUDAProperties` through it), checked inside the entry point's own process at its first import of
# `molora` or its first parse of arguments, whichever comes first: after the entry point's own path setup (a script's
# sys.path.insert, pytest's rootdir and pythonpath), or with the script's own folder first on the path.
PROBE = '''
import argparse, json, os, sys

def _molora_probe():
    if os.path.exists(os.environ["MOLORA_PROBE_OUT"]):
        return
    found = {"sys_path": list(sys.path), "triton": "triton" in sys.modules}
    try:
        import kernels
        found["kernels"] = kernels.__file__
        kernels.CUDAProperties
        from transformers.utils.import_utils import is_kernels_available
        found["kernels_available"] = bool(is_kernels_available())
        from diffusers.models.autoencoders.vq_model import VQModel
        import accelerate, peft
        found["ok"] = True
    except Exception as exc:
        found["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.environ["MOLORA_PROBE_OUT"], "w") as f:
        json.dump(found, f)

class _MoloraProbe:
    def find_spec(self, name, path=None, target=None):
        if name == "molora":
            sys.meta_path.remove(self)
            _molora_probe()
        return None

_parse_known_args = argparse.ArgumentParser.parse_known_args

def _parse_then_probe(self, *args, **kwargs):
    _molora_probe()
    return _parse_known_args(self, *args, **kwargs)

argparse.ArgumentParser.parse_known_args = _parse_then_probe
sys.meta_path.insert(0, _MoloraProbe())
'''

NO_TRITON = '''
import sys

class _NoTriton:
    """As on a machine without triton: every import of it fails as a missing module does."""
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
'''


def _run(args: list[str], cwd: Path, tmp_path: Path, probe: str = PROBE, timeout: int = 300) -> tuple[dict, str]:
    """Run `args` in `cwd` with the probe as sitecustomize (PYTHONPATH holds only the probe's folder, after the
    entry point's own first path entry, as Python puts PYTHONPATH); return what the probe found and the output."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(probe)
    out = tmp_path / "probe.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(PYTHONPATH=str(probe_dir), MOLORA_PROBE_OUT=str(out), MOLORA_THREADS="1")
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} failed in {cwd}:\n{output[-3000:]}"
    return (json.loads(out.read_text()) if out.is_file() else {}), output


def _assert_dependencies_import(found: dict, what: str) -> None:
    assert found.get("ok"), f"{what}: {found.get('error', 'the probe did not run')}"
    assert not Path(found["kernels"]).resolve().is_relative_to(ROOT / "molora"), found["kernels"]
    assert Path(found["kernels"]).parent.name == "kernels" and "site-packages" in found["kernels"], (
        f"{what}: `import kernels` found {found['kernels']}, not Hugging Face's installed package")


def _scripts(folder: str) -> list[str]:
    """The folder's runnable .py files (those with a command line)."""
    return sorted(p.name for p in (ROOT / folder).glob("*.py") if "argparse" in p.read_text())


def test_no_top_level_name_of_ours_is_a_regular_package_a_dependency_could_meet():
    """Only `molora` (our package) and `app` (app.py, the Space's app_file) are importable names at the root; every
    other top-level folder is data or a folder of scripts without __init__.py, which Python only takes when no
    installed package of that name exists (PEP 420)."""
    importable = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith(".")
                        and ((p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"))
    assert importable == ["app.py", "molora"], importable


@pytest.mark.parametrize("args", [["app.py", "--help"], ["-m", "molora", "--help"],
                                  ["-c", "from molora.models import InterleavedPipeline"]],
                         ids=["app.py", "python -m molora", "README snippet"])
def test_entry_points_from_the_repository_root(args: list[str], tmp_path: Path):
    found, _ = _run([sys.executable, *args], ROOT, tmp_path)
    _assert_dependencies_import(found, " ".join(args))


def test_pytest_from_the_repository_root(tmp_path: Path):
    found, output = _run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_layers.py"], ROOT, tmp_path)
    assert "test_no_import_cycles_at_module_level" in output
    _assert_dependencies_import(found, "python -m pytest")


@pytest.mark.parametrize("script", _scripts("scripts"))
def test_every_script_starts(script: str, tmp_path: Path):
    found, output = _run([sys.executable, f"scripts/{script}", "--help"], ROOT, tmp_path)
    assert "usage:" in output
    _assert_dependencies_import(found, f"scripts/{script}")


@pytest.mark.parametrize("script", _scripts("benchmarks"))
def test_every_benchmark_starts(script: str, tmp_path: Path):
    found, output = _run([sys.executable, f"benchmarks/{script}", "--help"], ROOT, tmp_path)
    assert "usage:" in output
    _assert_dependencies_import(found, f"benchmarks/{script}")


def test_the_project_runs_without_triton(tmp_path: Path):
    """The CPU install has no triton: the command line writes a document with a text and an image adapter routed by
    vocabulary range (the routed kernels' torch path), and nothing imported triton."""
    found, output = _run([sys.executable, "-m", "molora", "generate", "Draw a red circle.", "--seed", "0",
                          "--text-adapter", "pirate", "--image-adapter", "outline", "--start-image",
                          "--out", str(tmp_path / "doc.html")], ROOT, tmp_path, probe=NO_TRITON + PROBE, timeout=600)
    assert (tmp_path / "doc.html").is_file(), output[-2000:]
    assert found["triton"] is False and "triton" not in output
    _assert_dependencies_import(found, "molora generate without triton")


def test_no_module_of_ours_on_an_entry_points_path_is_named_like_an_installed_or_standard_one():
    """`python scripts/x.py` puts scripts/ first on the path, `python benchmarks/x.py` benchmarks/, pytest tests/
    (no __init__.py there) and `python app.py` the root: a file in any of them named like a module that a
    dependency or the standard library imports would be taken instead of it (benchmarks/kernels.py did that to
    Hugging Face's `kernels`)."""
    from importlib.metadata import packages_distributions

    taken = set(packages_distributions()) | set(sys.stdlib_module_names)
    ours = {p.stem for folder in (ROOT, ROOT / "scripts", ROOT / "benchmarks", ROOT / "tests")
            for p in folder.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    clashes = sorted(ours & taken)
    assert not clashes, f"these names of ours hide an installed or standard module: {clashes}"
