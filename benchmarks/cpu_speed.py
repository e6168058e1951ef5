"""C1: wall time of one image plus ~60 words with the embedded model on the CPU, against transformers in the same run.

Workload: one request with vocabulary routing (pirate text LoRA + outline image LoRA), starting with an image
(the vocabulary's image span: 256 codes and 16 row markers, then <eoi>) and continuing with TEXT_TOKENS of text
(`min_new_tokens` masks <eos>), so every run does the same amount of work (and the VQ decodes the picture).

Rows, interleaved round by round so a busy or slow machine moves them together (CPU VMs differ by 3x):
    engine (C step)                the default: each decode step one C call (models/engine/cpu_step.py)
    engine (C step), learned routing    the same request routed by the shipped learned gates (assets/router/:
                                   text gates with a routing state, image gates per picture), decided inside the C call
    engine (lean decoder, torch's step)   EngineConfig(cpu_step=False): the engine's own forward in torch ops
                                   (models/engine/decoder.py); and its learned-routing row (torch's gates)
    engine (transformers forward)  EngineConfig(lean_decoder=False)
    transformers generate, eager   the same LM weights (assets/model/lm, no adapters, one row, greedy) writing the
                                   same number of new tokens with its own KV cache: the ratio C1 is measured against

    python benchmarks/cpu_speed.py [--threads 1] [--runs 5]      (one thread: the app's default)

The engine's rows also give the median of their decode steps' wall times (Engine.step_ms).

--unpacked-too adds torch's step with its exact-row GEMMs in the other forms: oneDNN's float32 GEMM on packed
weights (when the engine packed bfloat16 copies for our kernel, kernels/cpu_bf16.py) and MKL's chunked form on the
weights as they are (kernels/torch_ops.py pack_exact_rows: the engine packs at setup); --together N also times N
requests at once for the C step and each of torch's forms (unguided pictures: N rows).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's molora, as `python benchmarks/x.py`

from molora.kernels.torch_ops import pack_exact_rows  # noqa: E402
from molora.models import InterleavedPipeline  # noqa: E402
from molora.models.engine.runtime import configure_cpu_threads  # noqa: E402

TEXT_TOKENS = 83  # ~64 words at this tokenizer's 1.15 ids per word (+ <eos>)


def engine_run(pipe: InterleavedPipeline, seed: int, new_tokens: int, routing: str = "vocab"
               ) -> tuple[float, int, int]:
    """One request: vocabulary routing (pirate text, outline pictures) or the shipped learned gates."""
    adapters = {"text_adapter": "pirate", "image_adapter": "outline"} if routing == "vocab" else {}
    start = time.perf_counter()
    doc = pipe.generate("", routing=routing, seed=seed, start_image=True, max_images=1, min_new_tokens=new_tokens,
                        max_new_tokens=new_tokens, **adapters)
    seconds = time.perf_counter() - start
    words = sum(len(p.split()) for p in doc.parts if isinstance(p, str))
    images = sum(1 for p in doc.parts if not isinstance(p, str))
    return seconds, images, words


def together_run(pipe: InterleavedPipeline, seeds: list[int], new_tokens: int) -> float:
    """Wall time of len(seeds) engine_run requests submitted at once (one thread each, as app visitors)."""
    threads = [threading.Thread(target=engine_run, args=(pipe, seed, new_tokens)) for seed in seeds]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def set_packing(groups: list, forms: list) -> None:
    """The routed groups' exact-row GEMM forms: (packed weight, source) each, as ProjectionGroup keeps them
    ((None, None): MKL's chunked form)."""
    for group, (weight, source) in zip(groups, forms):
        group.packed, group._packed_from = weight, source


def transformers_run(lm, bos: int, new_tokens: int) -> float:
    """transformers' eager generate of the same LM: one row, greedy, exactly `new_tokens` new tokens."""
    ids = torch.tensor([[bos]])
    start = time.perf_counter()
    with torch.no_grad():
        lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--unpacked-too", action="store_true",
                        help="also the lean decoder with its exact-row GEMMs in the other forms (oneDNN float32, MKL)")
    parser.add_argument("--together", type=int, default=0, metavar="N",
                        help="with --unpacked-too: also N requests at once, for each GEMM form")
    args = parser.parse_args()
    configure_cpu_threads(args.threads)
    pipe = InterleavedPipeline.from_pretrained(device="cpu")
    new_tokens = pipe.vocab.tokens_per_image + 1 + TEXT_TOKENS  # the image span, <eoi>, the text
    lm = pipe.routed.model  # the routed layers run as plain linears outside a routed call
    engine = pipe.engine
    lean = engine._setup() or engine.decoder
    c_step = engine.cpu_step

    def with_forward(decoder, step=None, routing: str = "vocab"):
        def run(seed: int) -> tuple[float, int, int]:
            engine.decoder, engine.cpu_step = decoder, step
            return engine_run(pipe, seed, new_tokens, routing)
        return run

    groups = pipe.routed.projection_groups()
    packed = [(group.packed, group._packed_from) for group in groups]  # as the engine made them
    forms = {"packed": packed,
             "oneDNN float32": [(pack_exact_rows(group.weight, bf16=False), source) for group, (_, source)
                                in zip(groups, packed)],
             "MKL": [(None, None)] * len(groups)}

    def gemms(form: str, run):
        def timed(seed: int) -> tuple[float, int, int]:
            set_packing(groups, forms[form])
            try:
                return run(seed)
            finally:
                set_packing(groups, packed)
        return timed

    def one_thread(run):  # the C step in one thread: no GEMM helper (C1's "one thread each" against transformers)
        def timed(seed: int) -> tuple[float, int, int]:
            c_step.threads, threads = 1, c_step.threads
            try:
                return run(seed)
            finally:
                c_step.threads = threads
        return timed

    rows = {"engine (C step)": with_forward(lean, c_step)} if c_step is not None else {}
    if c_step is not None and c_step.threads > 1:
        rows["engine (C step, one thread)"] = one_thread(with_forward(lean, c_step))
    if c_step is not None and pipe.gates is not None:
        rows["engine (C step), learned routing"] = with_forward(lean, c_step, "learned")
    rows |= {"engine (lean decoder, torch's step)": with_forward(lean), "engine (transformers forward)": with_forward(None),
            "transformers generate, eager (no adapters)": lambda seed: (transformers_run(lm, pipe.vocab.bos_id,
                                                                                       new_tokens), 0, 0)}
    if args.unpacked_too:
        if any(weight is not None and weight.dtype == torch.bfloat16 for weight, _ in packed):
            rows["engine (torch's step, oneDNN's float32 GEMMs)"] = gemms("oneDNN float32", with_forward(lean))
        rows["engine (torch's step, MKL's GEMMs, unpacked)"] = gemms("MKL", with_forward(lean))
        if args.together:
            n = args.together

            def at_once(step):
                def run(seed: int) -> tuple[float, int, int]:
                    engine.decoder, engine.cpu_step = lean, step
                    return together_run(pipe, [1000 * (seed + 1) + i for i in range(n)], new_tokens), 0, 0
                return run

            if c_step is not None:
                rows[f"engine (C step), {n} requests at once"] = at_once(c_step)
            for form, label in (("packed", "as packed"), ("oneDNN float32", "oneDNN's float32 GEMMs"),
                                ("MKL", "MKL's GEMMs, unpacked")):
                rows[f"engine (torch's step, {label}), {n} requests at once"] = gemms(form, at_once(None))
    if pipe.gates is not None:
        rows["engine (lean decoder, torch's step), learned routing"] = with_forward(lean, None, "learned")
    bf16 = sum(w is not None and w.dtype == torch.bfloat16 for w, _ in packed)
    print(f"exact-row GEMMs: {bf16} of {len(groups)} routed groups on bfloat16 copies (kernels/cpu_bf16.py), "
          f"{sum(w is not None for w, _ in packed) - bf16} oneDNN-packed")
    for run in rows.values():  # warm-up
        run(1000)
    times: dict[str, list[float]] = {name: [] for name in rows}
    steps: dict[str, list[float]] = {name: [] for name in rows}  # the engine's decode steps, ms
    shapes: dict[str, tuple[int, int]] = {}
    for seed in range(args.runs):
        for name, run in rows.items():
            engine.step_ms = []
            seconds, images, words = run(seed)
            times[name].append(seconds)
            steps[name] += engine.step_ms
            shapes[name] = (images, words)
    engine.step_ms = None
    engine.decoder, engine.cpu_step = lean, c_step
    set_packing(groups, packed)
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {new_tokens} new tokens per run, {args.runs} interleaved rounds")
    print("| row | median s | median step ms | runs (s) |\n|---|---|---|---|")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        step = f"{statistics.median(steps[name]):.2f}" if steps[name] else "-"
        print(f"| {name} | {medians[name]:.2f} | {step} | {', '.join(f'{s:.2f}' for s in t)} |")
    reference = medians["transformers generate, eager (no adapters)"]
    default = "engine (C step)" if c_step is not None else "engine (lean decoder, torch's step)"
    images, words = shapes[default]
    torch_step = medians["engine (lean decoder, torch's step)"]
    print(f"C1 ({default}): {medians[default]:.2f} s for {images} image + {words} words = "
          f"{medians[default] / reference:.2f}x transformers' eager generate (target <= 0.40x, <= 1.0 s); torch's step "
          f"{torch_step / reference:.2f}x, transformers forward in the engine "
          f"{medians['engine (transformers forward)'] / reference:.2f}x")
    if "engine (C step, one thread)" in medians:
        alone = medians["engine (C step, one thread)"]
        print(f"the C step in one thread (no GEMM helper, one thread each): {alone:.2f} s = {alone / reference:.2f}x; "
              f"with the helper {medians[default] / alone:.2f}x of that")


if __name__ == "__main__":
    main()
