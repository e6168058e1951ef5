"""Our routed LoRA op side by side with vLLM's Triton LoRA ops, every rank (issue 13: >= 1.2x vLLM at every N).

    PYTHONUNBUFFERED=1 python3 benchmarks/vllm_ops.py --with-out              # vLLM installed (vllm.lora.ops)
    PYTHONUNBUFFERED=1 python3 benchmarks/vllm_ops.py --vllm-ops DIR --with-out  # vLLM's op files in DIR
    python3 benchmarks/vllm_ops.py --vllm-ops DIR --dry-run                  # CPU: interpreter, tiny, correctness

vLLM's code is not part of this repository. Either install vLLM, or give --vllm-ops a folder holding a package
`vllm_lora_ops` made of vLLM's own lora_shrink_op.py, lora_expand_op.py, kernel_utils.py, utils.py and
lora_kernel_metadata.py (vllm/lora/ops/triton_ops/) with their `vllm.*` imports pointed at local stand-ins, whose
__init__ exports lora_shrink, lora_expand, LoRAKernelMeta and utils. RESULTS.md (issue 13, eighth pass) names the
vLLM commit measured.

Per (r, N): d_in = d_out = 4096, 4 slots, bf16, k = 1 (a seeded random slot per token).
  ours  routed_lora(x, A, B, slots, scale, meta=...), the metadata prebuilt where the path reads it (a model builds
        it once per forward); --with-out also times routed_lora(..., out=y) (the delta added into an output).
  vLLM  what its punica wrapper's add_lora_linear does for one linear: a float32 [1, N, r] buffer, lora_shrink,
        lora_expand with add_inputs into y; the scale folded into B (vLLM folds it at load time), LoRAKernelMeta
        prepared outside the timed region.
Both are checked against kernels/reference.py (eagerly, and after one replay of the captured graph), then each
captured graph's replays are timed with triton.testing.do_bench (median, L2 flushed before each), as in
benchmarks/lora_kernels.py. Captured by the project's capture_graph, or with --plain-capture as an outside harness
does (eager warm-up, then torch.cuda.graph). Writes vllm_ops.json to $OUT when set.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 2.5e-2  # bf16 relative max error
TARGET = 1.2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-ops", type=Path, default=None, help="folder holding the vllm_lora_ops package")
    p.add_argument("--with-out", action="store_true", help="also time ours adding its delta into an output")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, correctness only")
    p.add_argument("--plain-capture", action="store_true",
                   help="capture as an outside harness does: eager warm-up calls on a side stream, then "
                        "torch.cuda.graph (default: the project's capture_graph)")
    p.add_argument("--ranks", default="8,16,32,64,128")
    p.add_argument("--ns", default="1,32,128,256,2048,8192")
    return p.parse_args()


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

import molora.kernels.dispatch as dispatch  # noqa: E402
from molora.kernels import build_routing_meta, routed_lora  # noqa: E402
from molora.kernels.graphs import capture_graph, graph_paths  # noqa: E402
from molora.kernels.reference import routed_lora_reference  # noqa: E402

DEV = "cpu" if ARGS.dry_run else "cuda"
DTYPE = torch.float16 if ARGS.dry_run else torch.bfloat16  # (bf16 tl.dot is wrong in the interpreter)
D = 64 if ARGS.dry_run else 4096
S = 4
RANKS = [8, 16] if ARGS.dry_run else [int(v) for v in ARGS.ranks.split(",")]
NS = [1, 5, 40] if ARGS.dry_run else [int(v) for v in ARGS.ns.split(",")]


def load_vllm_ops():
    """(lora_shrink, lora_expand, LoRAKernelMeta, utils module) from --vllm-ops or an installed vLLM."""
    if ARGS.vllm_ops is not None:
        sys.path.insert(0, str(ARGS.vllm_ops.resolve()))
        ops = importlib.import_module("vllm_lora_ops")
        return ops.lora_shrink, ops.lora_expand, ops.LoRAKernelMeta, ops.utils
    try:
        ops = importlib.import_module("vllm.lora.ops.triton_ops")
        meta = importlib.import_module("vllm.lora.ops.triton_ops.lora_kernel_metadata")
        utils = importlib.import_module("vllm.lora.ops.triton_ops.utils")
    except ImportError as exc:
        sys.exit(f"vLLM's LoRA ops not found ({exc}): install vllm or pass --vllm-ops DIR (see the module doc)")
    return ops.lora_shrink, ops.lora_expand, meta.LoRAKernelMeta, utils


LORA_SHRINK, LORA_EXPAND, LORA_META, VLLM_UTILS = load_vllm_ops()


def vllm_add_lora_linear(y, x, lora_a, lora_b, meta) -> torch.Tensor:
    """vLLM's add_lora_linear for one output slice: add_shrink into a fresh float32 buffer, add_expand into y."""
    buffer = torch.empty((1, x.size(0), lora_b[0].size(-1)), dtype=torch.float32, device=x.device)
    LORA_SHRINK(x, lora_a, buffer, *meta.meta_args(x.size(0), False), 1.0)
    LORA_EXPAND(buffer, lora_b, y, *meta.meta_args(x.size(0), False), offset_start=0, add_inputs=True)
    return y


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() if got.isfinite().all() else 1e9


def capture(fn):
    """(graph, what fn returned while captured): capture_graph, or with --plain-capture PyTorch's documented recipe
    (three eager calls on a side stream, then torch.cuda.graph), which knows nothing of the project's graph mode."""
    if not ARGS.plain_capture:
        return capture_graph(fn, warmup=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def checked_time(fn, reset, result, ref) -> tuple[float, float]:
    """(relative error after one replay of fn's captured graph, median us of its replays)."""
    graph, out = capture(fn)
    reset(out)
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(result(out), ref)
    return err, triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median") * 1e3


def run_case(r: int, n: int) -> dict:
    g = torch.Generator(device=DEV).manual_seed(1000 * r + n)
    A = (torch.randn(S, r, D, device=DEV, generator=g) / D ** 0.5).to(DTYPE)
    B = (torch.randn(S, D, r, device=DEV, generator=g) / r ** 0.5).to(DTYPE)
    scale = torch.rand(S, device=DEV, generator=g) + 0.5
    x = torch.randn(n, D, device=DEV, generator=g).to(DTYPE)
    slots = torch.randint(0, S, (n,), device=DEV, generator=g).to(torch.int32)
    meta = build_routing_meta(slots[:, None], S) if dispatch.reads_meta(x, 1, A) else None
    with graph_paths():
        path = dispatch.choose_path(x, 1, meta is not None, S, r)
    for cache in ("_LORA_A_PTR_DICT", "_LORA_B_PTR_DICT"):  # vLLM caches pointers by data_ptr: a new tensor
        getattr(VLLM_UTILS, cache, {}).clear()                 # may reuse an old one's address
    lora_a = (A[:, None].contiguous(),)
    lora_b = ((B.float() * scale[:, None, None]).to(DTYPE)[:, None].contiguous(),)
    vmeta = LORA_META.make(S, max(NS), device=DEV)
    vmeta.prepare_tensors(slots.long())
    y = torch.zeros(n, D, device=DEV, dtype=DTYPE)
    y_ours = torch.zeros(n, D, device=DEV, dtype=DTYPE)

    def ours():
        return routed_lora(x, A, B, slots, scale, meta=meta)

    def vllm():
        return vllm_add_lora_linear(y, x, lora_a, lora_b, vmeta)

    ref = routed_lora_reference(x.float(), A.float(), B.float(), slots, scale.float())
    row = {"r": r, "N": n, "path": path, "err_ours": rel_err(ours(), ref), "err_vllm": rel_err(vllm(), ref)}
    if DEV == "cuda":
        row["err_ours_graph"], row["ours_us"] = checked_time(ours, lambda out: out.fill_(float("nan")),
                                                             lambda out: out, ref)
        row["err_vllm_graph"], row["vllm_us"] = checked_time(vllm, lambda _out: y.zero_(), lambda _out: y, ref)
        row["ratio"] = row["vllm_us"] / row["ours_us"]
        if ARGS.with_out:
            row["err_out_graph"], row["ours_out_us"] = checked_time(
                lambda: routed_lora(x, A, B, slots, scale, out=y_ours, meta=meta), lambda _out: y_ours.zero_(),
                lambda _out: y_ours, ref)
            row["ratio_out"] = row["vllm_us"] / row["ours_out_us"]
    return row


def main() -> None:
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"ours vs vLLM's LoRA ops: d={D}, {S} slots, {DTYPE}, k=1, {device}, torch {torch.__version__}, "
          f"triton {triton.__version__}; median us, vLLM time / ours (>= {TARGET}x wanted); captured by "
          f"{'torch.cuda.graph after eager calls' if ARGS.plain_capture else 'capture_graph'}")
    rows = []
    for r in RANKS:
        for n in NS:
            row = run_case(r, n)
            rows.append(row)
            errs = [v for key, v in row.items() if key.startswith("err")]
            timing = (f"ours {row['ours_us']:7.2f} [{row['path']}]  vLLM {row['vllm_us']:7.2f}  {row['ratio']:.2f}x"
                      if "ratio" in row else "(no timing)")
            if "ratio_out" in row:
                timing += f"  | ours out=y {row['ours_out_us']:7.2f}  {row['ratio_out']:.2f}x"
            print(f"  r={r:3d} N={n:5d}  {timing}  max err {max(errs):.1e} {'ok' if max(errs) <= TOL else 'FAIL'}")
    for r in RANKS:
        ratios = [row["ratio"] for row in rows if row["r"] == r and "ratio" in row]
        if ratios:
            verdict = "met" if min(ratios) >= TARGET else "MISSED"
            print(f"r={r:3d}: lowest vLLM/ours over N {min(ratios):.2f}x ({verdict})")
    if os.environ.get("OUT") and not ARGS.dry_run:
        Path(os.environ["OUT"], "vllm_ops.json").write_text(json.dumps(
            {"device": device, "torch": torch.__version__, "triton": triton.__version__,
             "plain_capture": ARGS.plain_capture, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
