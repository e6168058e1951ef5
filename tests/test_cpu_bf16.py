"""The CPU's bfloat16-weight GEMM (kernels/cpu_bf16.py, gemm_bf16w.c): against float32 F.linear on random inputs,
row-exact, used only where it holds the same weights, and a machine where it cannot be built keeps oneDNN's GEMM."""

from __future__ import annotations

import logging

import pytest
import torch

from molora.kernels import cpu_bf16, cpu_decode
from molora.kernels.torch_ops import cpu_linear, pack_exact_rows

needs_kernel = pytest.mark.skipif(not cpu_bf16.available(), reason="no C compiler with AVX-512 here")


def _bf16_valued(*shape: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight whose values are bfloat16 values (as the embedded model's checkpoint gives)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16().float()


@needs_kernel
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("d_out, d_in", [(768, 256), (256, 1024), (2048, 256), (48, 7), (1088, 256)])
def test_the_kernel_matches_float32_linear_and_a_row_never_depends_on_its_neighbours(d_out, d_in):
    weight = _bf16_valued(d_out, d_in)
    copy = cpu_bf16.bf16_weight(weight)
    assert copy is not None and copy.dtype == torch.bfloat16
    assert torch.equal(copy.transpose(1, 2).reshape(d_out, d_in).float(), weight)  # blocks of 16 outputs
    x = torch.randn(19, d_in, generator=torch.Generator().manual_seed(1)) * 3
    every = cpu_bf16.gemm_bf16w(x, copy)
    torch.testing.assert_close(every, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13):
        for at in (0, 1, 6):
            assert torch.equal(cpu_bf16.gemm_bf16w(x[at:at + rows], copy), every[at:at + rows])
    shuffled = torch.randperm(19, generator=torch.Generator().manual_seed(2))
    assert torch.equal(cpu_bf16.gemm_bf16w(x[shuffled], copy), every[shuffled])
    assert torch.equal(cpu_bf16.gemm_bf16w(x[:, :][::2], copy), every[::2])  # a strided x is made contiguous


@needs_kernel
@pytest.mark.usefixtures("one_torch_thread")
def test_the_engine_form_is_the_bfloat16_copy_only_where_it_holds_the_same_weights():
    weight = _bf16_valued(64, 256)
    packed = pack_exact_rows(weight)
    assert packed is not None and packed.dtype == torch.bfloat16
    x = torch.randn(6, 256)
    assert torch.equal(cpu_linear(x, weight, packed), cpu_bf16.gemm_bf16w(x, packed))
    assert pack_exact_rows(weight, bf16=False) is None or pack_exact_rows(weight, bf16=False).dtype != torch.bfloat16
    # a float32 weight that is not bfloat16-valued, or outputs not in blocks of 16: not copied
    assert cpu_bf16.bf16_weight(weight + 1e-4) is None
    assert cpu_bf16.bf16_weight(_bf16_valued(40, 256)) is None
    assert cpu_bf16.bf16_weight(weight.double()) is None


@needs_kernel
def test_with_more_torch_threads_the_engine_keeps_onednn(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # oneDNN's GEMM would use them all
    assert cpu_bf16.bf16_weight(_bf16_valued(64, 256)) is None


@needs_kernel
def test_bad_arguments_are_refused_before_the_kernel_runs():
    copy = cpu_bf16.bf16_weight(_bf16_valued(32, 64))
    with pytest.raises(ValueError, match="bf16_weight makes it"):
        cpu_bf16.gemm_bf16w(torch.randn(2, 48), copy)
    with pytest.raises(ValueError, match="float32 x"):
        cpu_bf16.gemm_bf16w(torch.randn(2, 64).double(), copy)
    with pytest.raises(ValueError, match="bfloat16 weight"):
        cpu_bf16.gemm_bf16w(torch.randn(2, 64), copy.float())
    with pytest.raises(ValueError, match="bfloat16 weight"):
        cpu_bf16.gemm_bf16w(torch.randn(2, 64), _bf16_valued(32, 64).bfloat16())  # not the blocked layout
    with pytest.raises(ValueError, match="on the CPU"):  # a pointer the kernel must never read
        cpu_bf16.gemm_bf16w(torch.randn(2, 64), copy.to("meta"))
    with torch.device("meta"):  # the output is made on x's device, not torch's default one
        y = cpu_bf16.gemm_bf16w(torch.randn(2, 64, device="cpu"), copy)
    assert y.device.type == "cpu" and torch.isfinite(y).all()
    empty = cpu_bf16.bf16_weight(torch.zeros(32, 0))  # no input features: zeros, like F.linear
    assert torch.equal(cpu_bf16.gemm_bf16w(torch.zeros(3, 0), empty), torch.zeros(3, 32))


@pytest.mark.parametrize("machine", ["a compiler that fails", "no compiler"])
def test_a_machine_where_the_kernel_cannot_be_built_keeps_onednn_with_one_log_line(machine, monkeypatch, caplog):
    if machine == "no compiler":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(cpu_bf16.shutil, "which", lambda name: None)
    else:
        monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_bf16.library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="molora.kernels.cpu_bf16"):
            assert not cpu_bf16.available()
            assert not cpu_bf16.available()  # tried once a process
            weight = _bf16_valued(64, 256)
            assert cpu_bf16.bf16_weight(weight) is None
            packed = pack_exact_rows(weight)
            assert packed is None or packed.dtype != torch.bfloat16  # oneDNN's form, or MKL's
        lines = [r for r in caplog.records if "bfloat16 GEMM" in r.getMessage()]
        assert len(lines) == 1
        assert ("no C compiler" if machine == "no compiler" else "failed") in lines[0].getMessage()
        with pytest.raises(RuntimeError, match="not built"):
            cpu_bf16.gemm_bf16w(torch.randn(2, 256), weight.bfloat16().view(4, 16, 256).transpose(1, 2).contiguous())
    finally:
        cpu_bf16.library.cache_clear()


@needs_kernel
@pytest.mark.usefixtures("one_torch_thread")
def test_the_two_core_gemm_gives_the_one_thread_numbers_and_two_callers_at_once_share_the_helper_safely():
    """molora_gemm_bf16w_team (the C step's GEMM: a helper thread computes half the output blocks of a call of few
    rows, or the caller takes them back) against molora_gemm_bf16w, bit for bit, at the embedded model's shapes and
    row counts on both sides of TEAM_MAX_ROWS; then from two threads at once (one job at a time: the other
    computes alone), and with the helper off."""
    import ctypes
    import threading

    built = cpu_bf16.library()
    team = built.molora_gemm_bf16w_team
    team.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3

    def both(x: torch.Tensor, copy: torch.Tensor, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        plain, shared = torch.zeros(x.shape[0], d_out), torch.full((x.shape[0], d_out), float("nan"))
        built.molora_gemm_bf16w(x.data_ptr(), copy.data_ptr(), plain.data_ptr(), x.shape[0], d_out, x.shape[1])
        team(x.data_ptr(), copy.data_ptr(), shared.data_ptr(), x.shape[0], d_out, x.shape[1])
        return plain, shared

    shapes = [(768, 256), (256, 1024), (2048, 256), (1088, 256), (48, 7)]
    copies = {shape: cpu_bf16.bf16_weight(_bf16_valued(*shape, seed=sum(shape))) for shape in shapes}
    try:
        assert built.molora_gemm_team(1) == 1
        for (d_out, d_in), copy in copies.items():
            for rows in (1, 2, 3, 4, 5, 9):
                x = torch.randn(rows, d_in, generator=torch.Generator().manual_seed(rows)) * 3
                plain, shared = both(x, copy, d_out)
                assert torch.equal(plain, shared), (d_out, d_in, rows)
        failures = []

        def caller(seed: int) -> None:
            for i in range(200):
                d_out, d_in = shapes[(seed + i) % 4]
                x = torch.randn(2, d_in, generator=torch.Generator().manual_seed(seed * 1000 + i))
                plain, shared = both(x, copies[(d_out, d_in)], d_out)
                if not torch.equal(plain, shared):
                    failures.append((seed, i))

        callers = [threading.Thread(target=caller, args=(seed,)) for seed in (1, 2)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join()
        assert not failures, failures[:5]
    finally:
        built.molora_gemm_team(0)
        cpu_decode._TEAM["on"] = False  # (the engine's next step switches it on again where it wants it)
    x = torch.randn(2, 256)
    plain, shared = both(x, copies[(2048, 256)], 2048)
    assert torch.equal(plain, shared)
