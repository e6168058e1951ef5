"""Dry runs of the GPU benchmarks on the CPU, at toy shapes: each must run through and report what it measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_picture_benchmark_decodes_one_whole_guided_picture(tmp_path: Path):
    """E3's mode of benchmarks/decode_step.py: a 4 x 4 grid with a row marker after each row is 4 * 5 ids and <eoi>
    after the forced <boi>, one decode step of the pair (row and CFG twin) each; the stream also emits the <boi>.
    (On the CPU both attention modes run sdpa: the split-K kernel is CUDA's.)"""
    out = tmp_path / "e3.json"
    run = subprocess.run([sys.executable, "benchmarks/decode_step.py", "--picture", "--shape", "tiny", "--device",
                          "cpu", "--grid", "4", "4", "--codebook", "64", "--sdpa-too", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    picture = json.loads(out.read_text())["picture"]
    assert picture["steps"] == 4 * 5 + 1 and picture["tokens"] == picture["steps"] + 1
    assert picture["seconds"] > 0 and picture["limit_s"] > 0
    assert abs(picture["E3"] / (picture["seconds"] / picture["limit_s"]) - 1) < 0.02
    assert picture["limit_with_kv_s"] > picture["limit_s"]
    assert "E3 tiny (split-K decode attention): one guided 4x4 picture" in run.stdout
    sdpa = json.loads(out.read_text())["picture_sdpa"]  # --sdpa-too: the same picture through sdpa
    assert sdpa["steps"] == picture["steps"] and not sdpa["split_attention"] and picture["split_attention"]
    assert "E3 split-K / sdpa seconds:" in run.stdout


def test_the_app_load_benchmark_serves_visitors_from_a_client_process_and_checks_their_solo_runs():
    """S1's benchmark (benchmarks/app_load.py) on the embedded model: the visitors' clients run in a process of
    their own (spawned: `visit` must travel to it), two at once and then one by one, and each output is compared
    with its solo run."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.app_load", "--users", "2", "--sequential",
                          "--same-length"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "users 2, rounds 1, completed 2, cancelled 0" in run.stdout, run.stdout
    assert "one by one:" in run.stdout and "throughput ratio" in run.stdout
    assert "outputs equal to their solo runs: 2/2" in run.stdout, run.stdout
    assert "engine idle after the load (no running, waiting or pinned): True" in run.stdout
