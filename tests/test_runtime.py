"""The CPU thread count: one rule (models/engine/runtime.py) shared by the app, the Python API and the CLI."""

from __future__ import annotations

import pytest
import torch

from molora.models.engine import runtime
from molora.models.engine.runtime import DEFAULT_CPU_THREADS, THREADS_ENV, configure_cpu_threads, cpu_threads
from molora.models.families.shapes.loading import load_model_dir
from molora.routing.errors import MoLoRAError


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(runtime, "_chosen", None)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "_TORCH_AT_IMPORT", before)  # nobody has chosen yet
    yield
    torch.set_num_threads(before)


def test_default_is_the_measured_constant_and_the_environment_overrides_it(monkeypatch):
    assert cpu_threads() == DEFAULT_CPU_THREADS == 1
    monkeypatch.setenv(THREADS_ENV, "2")
    assert cpu_threads() == 2
    assert cpu_threads(3) == 3  # an explicit argument wins


@pytest.mark.parametrize("bad", ["two", "-1", "1.5"])
def test_a_bad_environment_value_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv(THREADS_ENV, bad)
    with pytest.raises(MoLoRAError, match=THREADS_ENV):
        cpu_threads()


def test_zero_leaves_torch_alone():
    torch.set_num_threads(2)
    assert configure_cpu_threads(0) == 2


def test_loading_a_model_sets_one_thread_by_default(tiny_model_dir, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(runtime, "_TORCH_AT_IMPORT", 2)  # as if torch had started with 2 threads
    load_model_dir(tiny_model_dir, device="cpu")
    assert torch.get_num_threads() == 1


def test_a_choice_made_with_torch_or_omp_is_left_alone(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(runtime, "_TORCH_AT_IMPORT", 1)
    torch.set_num_threads(2)  # the user's own call, after importing models
    load_model_dir(tiny_model_dir, device="cpu")
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(runtime, "_TORCH_AT_IMPORT", 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads() == 0


def test_an_explicit_choice_survives_loading_a_model(tiny_model_dir):
    configure_cpu_threads(2)  # what `molora generate --threads 2` and `python app.py --threads 2` do first
    load_model_dir(tiny_model_dir, device="cpu")
    assert torch.get_num_threads() == 2


def test_the_app_and_the_cli_take_a_threads_flag():
    from molora.app.server import parse_args as app_args
    from molora.models.cli import parse_args as cli_args

    assert app_args(["--threads", "2"]).threads == 2 and app_args([]).threads is None
    assert cli_args(["x", "--threads", "2"]).threads == 2 and cli_args(["x"]).threads is None


@pytest.mark.parametrize("v2,v1,want", [
    ("150000 100000\n", None, 2),    # cgroup v2: 1.5 CPUs of quota -> 2 threads
    ("max 100000\n", None, 8),       # no limit: the affinity mask
    (None, ("100000", "100000"), 1),  # cgroup v1: one CPU
    (None, ("-1", "100000"), 8),     # v1 without a quota
    (None, None, 8),                 # no cgroup files
    ("400000 x\n", None, 8),         # unreadable: ignored
])
def test_available_cpus_is_the_affinity_mask_within_the_containers_cpu_quota(tmp_path, monkeypatch, v2, v1, want):
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(runtime, "CGROUP_CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(runtime, "CGROUP_V1_QUOTA", (str(tmp_path / "quota"), str(tmp_path / "period")))
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "quota").write_text(v1[0])
        (tmp_path / "period").write_text(v1[1])
    assert runtime.available_cpus() == want
