"""Split-K decode attention (kernels/triton_attention.py) against its float32 reference.

The CPU cases run the Triton kernels in the interpreter, in ONE child process started with TRITON_INTERPRET=1
(triton reads it when kernels/ is first imported; see test_kernels_triton.py), which prints one JSON line per
case. Shapes are tiny; the cache views are strided like the engine's (rows and columns cut from a larger cache,
the query a permuted view) and the lengths cover 1, the cache's whole length, beyond it and 0 (clamped to 1..L).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# name: (rows, KV heads, query heads per KV head, head dim, columns, dtype, columns per split or None)
CASES = {
    "gqa4_fp32_default_splits": (3, 2, 4, 64, 300, "float32", None),
    "mha_fp16_many_splits": (2, 3, 1, 40, 130, "float16", 64),
    "odd_group_fp32_one_split": (2, 1, 5, 16, 70, "float32", 128),
    "wide_group_fp16": (1, 2, 16, 32, 200, "float16", 64),
    "odd_chunk_fp32": (4, 2, 2, 32, 257, "float32", 192),
}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _case(name: str, device: str = "cpu") -> dict:
    from molora.kernels.reference import decode_attention_reference
    from molora.kernels.triton_attention import decode_attention

    n, kv_heads, groups, head_dim, columns, dtype_name, chunk = CASES[name]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(len(name))
    cache_k = torch.randn(n + 1, kv_heads, columns + 9, head_dim, generator=gen).to(device, dtype)
    cache_v = torch.randn(n + 1, kv_heads, columns + 9, head_dim, generator=gen).to(device, dtype)
    keys, values = cache_k[:n, :, :columns], cache_v[:n, :, :columns]
    q = torch.randn(n, 1, kv_heads, groups, head_dim, generator=gen).to(device, dtype)
    q = q.permute(0, 2, 3, 1, 4).reshape(n, kv_heads, groups, head_dim)  # the decoder's [n, Hkv, G*T, D] view
    lengths = torch.randint(1, columns + 1, (n,), generator=gen).to(device)
    lengths[0] = columns
    if n > 1:
        lengths[1] = 1
    if n > 2:
        lengths[2] = 0  # a padding row: reads column 0
    if n > 3:
        lengths[3] = columns + 50  # beyond the cache: reads all of it
    got = decode_attention(q, keys, values, lengths, head_dim ** -0.5, chunk=chunk).float()
    want = decode_attention_reference(q, keys, values, lengths.clamp(1, columns), head_dim ** -0.5).float()
    error = float((got - want).abs().max() / want.abs().max())
    return {"case": name, "error": error, "shape": list(got.shape) == list(q.shape), "finite": bool(got.isfinite().all())}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    # On a CUDA machine the compiled kernel takes these cases (test_cuda_decode_attention_cases): the device images
    # carry triton 3.6, whose interpreter cannot run a loop to a bound read from memory under numpy 2.
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the compiled kernel runs the cases")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {row["case"]: row for row in map(json.loads, run.stdout.splitlines())}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_attention_equals_the_reference_in_the_interpreter(interpreted, name):
    pytest.importorskip("triton")
    row = interpreted[name]
    assert row["shape"] and row["finite"]
    assert row["error"] <= TOLERANCE[CASES[name][5]], row


def test_decode_attention_refuses_mismatched_inputs_by_name():
    from molora.kernels.errors import KernelInputError
    from molora.kernels.triton_attention import decode_attention

    q = torch.zeros(2, 2, 4, 16)
    with pytest.raises(KernelInputError, match="needs triton and CUDA tensors|keys and values|lengths"):
        decode_attention(q, torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16), torch.ones(2, dtype=torch.long), 1.0)


def test_splits_cover_the_gpu_and_stay_whole_blocks():
    from molora.kernels.triton_attention import BLOCK_N, split_chunk

    chunk = split_chunk(16, 8300, 264)  # Emu3-8B: a guided pair x 8 KV heads on an H200
    assert chunk % BLOCK_N == 0 and 16 * -(-8300 // chunk) >= 264 * 0.9
    assert split_chunk(64, 100, 264) == BLOCK_N  # more programs than columns need: one block a split


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_decode_attention_cases(name):
    row = _case(name, "cuda")
    assert row["shape"] and row["finite"]
    assert row["error"] <= 2 * TOLERANCE[CASES[name][5]], row  # fp32 dots in "ieee", fp16 on tensor cores


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_decode_attention_on_a_long_cache(dtype):
    from molora.kernels.reference import decode_attention_reference
    from molora.kernels.triton_attention import decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(3, 8, 8400, 128, device="cuda", generator=gen).to(dtype)
    values = torch.randn(3, 8, 8400, 128, device="cuda", generator=gen).to(dtype)
    q = torch.randn(2, 8, 4, 128, device="cuda", generator=gen).to(dtype)
    lengths = torch.tensor([8300, 17], device="cuda")
    got = decode_attention(q, keys[:2, :, :8300], values[:2, :, :8300], lengths, 128 ** -0.5).float()
    want = decode_attention_reference(q, keys[:2, :, :8300], values[:2, :, :8300], lengths, 128 ** -0.5).float()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2


if __name__ == "__main__":  # the interpreter's child process: one JSON line per case
    for case in CASES:
        print(json.dumps(_case(case)), flush=True)
