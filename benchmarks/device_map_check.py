"""Models placed over devices (accelerate's device_map): the same greedy tokens as on one device, and tokens/s.

    python3 benchmarks/device_map_check.py                 # GPU rows when CUDA is there; CPU rows always
    python3 benchmarks/device_map_check.py --shape tiny --new 8 --requests 2      # a quick run (the CPU test's)

A random Qwen3ForCausalLM (models/engine/synthetic.py shapes; "small" by default on CUDA, "tiny" on the CPU), saved with
save_pretrained and loaded back for each placement, routed on all 7 projections with two random rank-16 adapters
by vocabulary range (models.synthetic.id_range_vocab: the last 1/16 of the ids are "image" ids), served by the
engine (models/engine/core.py); --requests greedy requests at once, each --new tokens, float32 (so a layer computed
on the CPU rounds as close to the GPU as it can).  Each row is compared with the one-device row of its kind:

    cpu                         the reference on the CPU
    cpu, hooks on every block   accelerate's dispatch_model(force_hooks=True): per-block {module: "cpu"}
    cpu + disk offload          transformers from_pretrained(device_map=...) with the last block on "disk"
    cuda:0                      the reference on the GPU (CUDA graphs)
    cuda:0 + cpu offload        from_pretrained(device_map=...), second half of the blocks on "cpu": accelerate
                                keeps those weights in host memory and streams them to cuda:0 each step
    cuda:0 + cpu compute        dispatch_model(main_device="cpu"): the second half of the blocks COMPUTES on the
                                CPU (their slots, KV cache and routing copies live there)
    cuda:0 + cuda:1             from_pretrained(device_map=...), blocks split in half (only with 2+ GPUs)

Prints one table (placement, devices, tokens/s, x of its reference, tokens equal) and exits with status 1 when
any row's tokens differ from its reference.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from molora.models.engine.core import Done, Engine, EngineConfig  # noqa: E402
from molora.models.engine.generation import GenerationConfig, Request  # noqa: E402
from molora.models.engine.sampling import SamplingConfig  # noqa: E402
from molora.models.engine.synthetic import SHAPES, id_range_vocab, random_adapters  # noqa: E402
from molora.routing import VocabRangeRouter, attach_routed_lora  # noqa: E402

GREEDY = dict(text=SamplingConfig(0.0), image=SamplingConfig(0.0), cfg_scale=1.0)
EXTRA_SHAPES = {
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=1024,
                  tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6),
}


def build_model_dir(shape: str, folder: Path, seed: int = 0) -> Path:
    """A random Qwen3ForCausalLM of `shape`, saved; large initial weights keep greedy choices far from ties."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**SHAPES, **EXTRA_SHAPES}[shape], initializer_range=0.1, attn_implementation="sdpa")
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def block_map(num_layers: int, first: str, second: str, split: int | None = None) -> dict[str, str]:
    """{module: device}: embeddings and blocks [0, split) on `first`, the rest, norm and head on `second`."""
    split = num_layers // 2 if split is None else split
    mapping = {"model.embed_tokens": first, "model.rotary_emb": first}
    mapping.update({f"model.layers.{i}": first if i < split else second for i in range(num_layers)})
    mapping.update({"model.norm": second, "lm_head": second})
    return mapping


def load(folder: Path, how: str, num_layers: int, offload: Path) -> torch.nn.Module:
    """The saved model placed as row `how` says (see the module docstring)."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.float32)
    if how in ("cpu", "cuda:0"):
        return AutoModelForCausalLM.from_pretrained(folder, **kw).to(how).eval()
    if how == "cpu, hooks on every block":
        model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
        return dispatch_model(model, block_map(num_layers, "cpu", "cpu"), force_hooks=True,
                              skip_keys=model._skip_keys_device_placement)
    if how == "cpu + disk offload":
        mapping = block_map(num_layers, "cpu", "cpu")
        mapping[f"model.layers.{num_layers - 1}"] = "disk"
        return AutoModelForCausalLM.from_pretrained(folder, device_map=mapping, offload_folder=str(offload),
                                                    **kw).eval()
    if how == "cuda:0 + cpu offload":
        return AutoModelForCausalLM.from_pretrained(folder, device_map=block_map(num_layers, "cuda:0", "cpu"),
                                                    **kw).eval()
    if how == "cuda:0 + cpu compute":
        model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
        return dispatch_model(model, block_map(num_layers, "cuda:0", "cpu"), main_device="cpu",
                              skip_keys=model._skip_keys_device_placement)
    if how == "cuda:0 + cuda:1":
        return AutoModelForCausalLM.from_pretrained(folder, device_map=block_map(num_layers, "cuda:0", "cuda:1"),
                                                    **kw).eval()
    raise ValueError(how)


def run(model: torch.nn.Module, prompts: list[list[int]], new: int, rank: int) -> tuple[list[list[int]], float, str]:
    """(greedy tokens per request, tokens/s of the timed run, devices) through the engine, vocabulary routing."""
    vocab_size = int(model.config.vocab_size)
    vocab = id_range_vocab(vocab_size, image_size=vocab_size // 16)
    routed = attach_routed_lora(model, num_slots=4, r_max=rank)
    for adapter in random_adapters(routed, ["text", "image"], rank=rank):
        routed.add_adapter(adapter)
    engine = Engine(routed, vocab, device=routed.device, config=EngineConfig(max_rows=8, max_len=256))
    router = VocabRangeRouter(vocab, text_adapter="text", image_adapter="image")
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, seed=0, **GREEDY)
    requests = [Request(p, router) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    elapsed = 0.0
    try:
        for _warm in range(2):  # the first run warms up (and captures CUDA graphs); the second is timed
            tokens = [[] for _ in prompts]
            started = time.perf_counter()
            for index, item in engine.stream(requests, config):
                if not isinstance(item, Done):
                    tokens[index].append(item.token)
            elapsed = time.perf_counter() - started
    finally:
        engine.close()
    placement = routed.placement
    devices = "+".join(str(d) for d in placement.devices) if placement is not None else str(routed.device)
    if placement is not None and placement.offloaded:
        devices += " (offloaded)"
    return tokens, sum(len(t) for t in tokens) / elapsed, devices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted({**SHAPES, **EXTRA_SHAPES}), default=None,
                        help="model shape (default: small with CUDA, tiny without)")
    parser.add_argument("--new", type=int, default=32, help="tokens per request")
    parser.add_argument("--requests", type=int, default=4, help="requests decoded together")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-gpu", action="store_true", help="CPU rows only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs on the GPU as close to the CPU's as they get
    cuda = torch.cuda.is_available() and not args.no_gpu
    shape = args.shape or ("small" if cuda else "tiny")
    num_layers = {**SHAPES, **EXTRA_SHAPES}[shape]["num_hidden_layers"]
    vocab_size = {**SHAPES, **EXTRA_SHAPES}[shape]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    # prompts of text ids and image ids both (the last 1/16 of the ids), after <bos> (= 1)
    prompts = [[1, *torch.randint(5, vocab_size, (args.prompt,), generator=generator).tolist()]
               for _ in range(args.requests)]
    rows: list[tuple[str, str]] = [("cpu", "cpu"), ("cpu, hooks on every block", "cpu"), ("cpu + disk offload", "cpu")]
    skipped = []
    if cuda:
        rows += [("cuda:0", "cuda:0"), ("cuda:0 + cpu offload", "cuda:0"), ("cuda:0 + cpu compute", "cuda:0")]
        if torch.cuda.device_count() >= 2:
            rows.append(("cuda:0 + cuda:1", "cuda:0"))
        else:
            skipped.append("cuda:0 + cuda:1 (one GPU)")
    else:
        skipped.append("every GPU row (no CUDA)" if not args.no_gpu else "every GPU row (--no-gpu)")
    results: dict[str, tuple[list[list[int]], float, str]] = {}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_dir(shape, Path(tmp) / "model")
        for how, reference in rows:
            model = load(folder, how, num_layers, Path(tmp) / f"offload-{len(results)}")
            results[how] = run(model, prompts, args.new, args.rank)
            del model
            if results[how][0] != results[reference][0]:
                failed.append(how)
    width = max(len(how) for how, _ in rows)
    print(f"device_map check: {shape} Qwen3 ({num_layers} blocks), {args.requests} requests x {args.new} greedy "
          f"tokens, vocabulary routing over 2 rank-{args.rank} adapters, float32")
    print(f"{'placement':<{width}}  {'devices':<28}  {'tokens/s':>9}  {'x ref':>6}  same tokens as")
    for how, reference in rows:
        tokens, speed, devices = results[how]
        ref_speed = results[reference][1]
        same = "yes" if tokens == results[reference][0] else "NO"
        print(f"{how:<{width}}  {devices:<28}  {speed:9.1f}  {speed / ref_speed:6.2f}  {reference}: {same}")
    for row in skipped:
        print(f"skipped: {row}")
    if failed:
        print(f"MISMATCH: {', '.join(failed)} gave other tokens than the one-device run")
        return 1
    print("all placements gave the one-device tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
