"""C1: wall time of one image plus ~60 words with the embedded model on the CPU (KV cache on).

Workload: one request with vocabulary routing (pirate text LoRA + outline image LoRA), starting with an image
(256 codes + <eoi>) and continuing with text to exactly 340 new tokens (`min_new_tokens` masks <eos>), so every
run does the same amount of work. One warm-up run, then the median of 5.

    python -m benchmarks.cpu_speed [--threads 2] [--runs 5]      (from the repo root)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from models import InterleavedPipeline

NEW_TOKENS = 340


def one_run(pipe: InterleavedPipeline, seed: int) -> tuple[float, int, int]:
    start = time.perf_counter()
    doc = pipe.generate("", text_adapter="pirate", image_adapter="outline", routing="vocab", seed=seed,
                        start_image=True, max_images=1, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS)
    seconds = time.perf_counter() - start
    words = sum(len(p.split()) for p in doc.parts if isinstance(p, str))
    images = sum(1 for p in doc.parts if not isinstance(p, str))
    return seconds, images, words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = InterleavedPipeline.from_pretrained(device="cpu")
    one_run(pipe, seed=1000)  # warm-up
    results = [one_run(pipe, seed) for seed in range(args.runs)]
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| run | seconds | images | words |")
    print("|---|---|---|---|")
    for i, (seconds, images, words) in enumerate(results):
        print(f"| {i} | {seconds:.2f} | {images} | {words} |")
    print(f"median: {statistics.median(r[0] for r in results):.2f} s for 1 image + "
          f"{statistics.median(r[2] for r in results):.0f} words ({NEW_TOKENS} new tokens)")


if __name__ == "__main__":
    main()
