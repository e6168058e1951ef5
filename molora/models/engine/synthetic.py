"""Random stand-ins for benchmarks and GPU tests: a transformers causal LM of a given shape, a vocabulary that
calls one id range "image", and random LoRA adapters for the routed layers.  No files, no downloads, no
diffusers (the GPU machine's image has none), so the serving engine can be measured on any model shape.

    routed, vocab = random_routed_model("qwen3-1.7b", device="cuda", dtype=torch.bfloat16)
    for adapter in random_adapters(routed, ["a", "b"], rank=16):
        routed.add_adapter(adapter)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from molora.models.engine.vocab import UnifiedVocab
from molora.routing import LoraAdapter, RoutedModel, attach_routed_lora

# Qwen3-1.7B's published shape (config.json of Qwen/Qwen3-1.7B), Emu3-8B's language model (config.json of
# BAAI/Emu3-Gen: a Llama; its last 32,768 ids are the VQ codes of a picture), and a tiny Qwen3 for tests.
# ARCHITECTURE names the transformers class of a shape (default "qwen3").
ARCHITECTURE = {"emu3-8b": "llama"}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "emu3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=184622, max_position_embeddings=9216,
                    tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512,
                 tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6),
}


def plain_model(shape: str, *, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of `shape` with random weights (from the global torch seed), no routed layers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[ARCHITECTURE.get(shape, "qwen3")]
    with torch.device(device):
        return model_class(config_class(**SHAPES[shape], attn_implementation="sdpa")).to(dtype).eval()


def id_range_vocab(vocab_size: int, *, image_size: int, grid: tuple[int, int] = (4, 4),
                   row_end: bool = False) -> UnifiedVocab:
    """Specials 0-4 (<pad> <bos> <eos> <boi> <eoi>), then text, then the last `image_size` ids as image codes;
    `row_end`: the id just below the codes is a marker after each row of a picture (as Emu3's end of line)."""
    image_start = vocab_size - image_size
    text_end = image_start - 1 if row_end else image_start
    return UnifiedVocab(vocab_size=vocab_size, text_start=5, text_size=text_end - 5, image_start=image_start,
                        image_size=image_size, pad_id=0, bos_id=1, eos_id=2, boi_id=3, eoi_id=4, image_grid=grid,
                        row_end_ids=(text_end,) if row_end else ())


def random_routed_model(shape: str, *, device: torch.device | str, dtype: torch.dtype, num_slots: int = 4,
                        r_max: int = 16, seed: int = 0, image_size: int | None = None,
                        grid: tuple[int, int] = (4, 4), row_end: bool = False) -> tuple[RoutedModel, UnifiedVocab]:
    """A causal LM of `shape` (SHAPES, ARCHITECTURE) with random weights, built on `device`, routed on all 7
    projections; and its id-range vocabulary (image codes: the last `image_size` ids, default 1/16 of them)."""
    torch.manual_seed(seed)
    model = plain_model(shape, device=device, dtype=dtype)
    routed = attach_routed_lora(model, num_slots=num_slots, r_max=r_max)
    vocab_size = model.config.vocab_size
    vocab = id_range_vocab(vocab_size, image_size=image_size or vocab_size // 16, grid=grid, row_end=row_end)
    return routed, vocab


def random_adapters(routed: RoutedModel, names: Sequence[str], *, rank: int = 16, seed: int = 0,
                    std: float = 0.02) -> list[LoraAdapter]:
    """One random LoRA per name over every routed layer (float32 on the CPU, as loaded adapters are)."""
    generator = torch.Generator().manual_seed(seed)
    adapters = []
    for name in names:
        weights = {}
        for module, layer in routed.cache.layers.items():
            a = torch.randn(rank, layer.in_features, generator=generator) * std
            b = torch.randn(layer.out_features, rank, generator=generator) * std
            weights[module] = (a, b)
        adapters.append(LoraAdapter(name, weights, {m: 2.0 for m in weights}, {"r": rank, "lora_alpha": 2 * rank}))
    return adapters
