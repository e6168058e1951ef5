"""C1: wall time of one image plus ~60 words with the embedded model on the CPU (KV cache on).

Workload: one request with vocabulary routing (pirate text LoRA + outline image LoRA), starting with an image
(the vocabulary's image span: 256 codes and 16 row markers, then <eoi>) and continuing with TEXT_TOKENS of text
(`min_new_tokens` masks <eos>), so every run does the same amount of work. One warm-up run, then the median of 5.

    python -m benchmarks.cpu_speed [--threads 2] [--runs 5]      (from the repo root)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's molora, as `python benchmarks/x.py`

from molora.models import InterleavedPipeline  # noqa: E402
from molora.models.engine.runtime import configure_cpu_threads  # noqa: E402

TEXT_TOKENS = 83  # ~64 words at this tokenizer's 1.15 ids per word (+ <eos>)


def one_run(pipe: InterleavedPipeline, seed: int, new_tokens: int) -> tuple[float, int, int]:
    start = time.perf_counter()
    doc = pipe.generate("", text_adapter="pirate", image_adapter="outline", routing="vocab", seed=seed,
                        start_image=True, max_images=1, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    seconds = time.perf_counter() - start
    words = sum(len(p.split()) for p in doc.parts if isinstance(p, str))
    images = sum(1 for p in doc.parts if not isinstance(p, str))
    return seconds, images, words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    configure_cpu_threads(args.threads)
    pipe = InterleavedPipeline.from_pretrained(device="cpu")
    new_tokens = pipe.vocab.tokens_per_image + 1 + TEXT_TOKENS  # the image span, <eoi>, the text
    one_run(pipe, 1000, new_tokens)  # warm-up
    results = [one_run(pipe, seed, new_tokens) for seed in range(args.runs)]
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| run | seconds | images | words |")
    print("|---|---|---|---|")
    for i, (seconds, images, words) in enumerate(results):
        print(f"| {i} | {seconds:.2f} | {images} | {words} |")
    print(f"median: {statistics.median(r[0] for r in results):.2f} s for 1 image + "
          f"{statistics.median(r[2] for r in results):.0f} words ({new_tokens} new tokens)")


if __name__ == "__main__":
    main()
