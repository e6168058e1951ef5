"""The embedded LM's shape and tiny random model directories for tests.

`llama_config` is the one place that says what the embedded LM looks like; scripts/train_lm.py builds the real
model from it and `write_tiny_model_dir` builds a tiny random one in the exact assets/model layout, so tests of
generation, routing and the app can run on a fresh machine in seconds without the shipped weights.

The base-model name: `transformers` overwrites `config._name_or_path` with the directory a model is loaded from,
so the stable name adapters refer to (`base_model_name_or_path` in adapter_config.json) is stored in the LM config
as `molora_base_model` as well; loaders set `model.name_or_path = model.config.molora_base_model` after loading.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import VQModel
from transformers import LlamaConfig, LlamaForCausalLM

from molora.models.engine.vocab import UnifiedVocab
from molora.models.families.shapes.image_tokenizer import vq_config
from molora.models.families.shapes.tokenizer import UnifiedTokenizer, build_tiny_tokenizer

BASE_MODEL_NAME = "molora/shapes-lm"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_config(
    vocab: UnifiedVocab,
    *,
    hidden_size: int = 256,
    num_layers: int = 6,
    num_heads: int = 4,
    intermediate_size: int = 1024,
    max_positions: int = 1024,
    name: str = BASE_MODEL_NAME,
) -> LlamaConfig:
    """The embedded LM: a tiny Llama over the unified vocabulary (defaults: ~7M parameters)."""
    return LlamaConfig(
        vocab_size=vocab.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=vocab.pad_id,
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
        name_or_path=name,
        molora_base_model=name,
    )


def set_base_model_name(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Give a loaded LM its stable name back (from_pretrained replaces it with the directory path)."""
    model.name_or_path = getattr(model.config, "molora_base_model", BASE_MODEL_NAME)
    return model


def write_tiny_model_dir(
    path: str | Path,
    *,
    seed: int = 0,
    texts: Sequence[str] | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    max_positions: int = 640,
    codebook_size: int = 32,
) -> Path:
    """Write a RANDOM model in the assets/model layout (vocab.json, tokenizer.json, lm/, vq/, README.md).

    64x64 images, 16x16 codes as the real model, but a few thousand parameters: for tests only.
    """
    path = Path(path)
    torch.manual_seed(seed)
    tok: UnifiedTokenizer = build_tiny_tokenizer(texts, image_size=codebook_size, row_markers=True)
    tok.save(path)
    lm = LlamaForCausalLM(llama_config(tok.vocab, hidden_size=hidden_size, num_layers=num_layers,
                                       num_heads=num_heads, intermediate_size=intermediate_size,
                                       max_positions=max_positions))
    lm.save_pretrained(path / "lm", safe_serialization=True)
    vq = VQModel(**vq_config(block_out_channels=(8, 8, 8), latent_channels=8, codebook_size=codebook_size,
                             norm_num_groups=4))
    vq.save_pretrained(path / "vq", safe_serialization=True)
    (path / "README.md").write_text(f"# tiny random test model (seed {seed})\n\nUntrained; for tests only.\n")
    return path


def write_tiny_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    modality: str,
    r: int = 4,
    seed: int = 0,
    description: str = "random test adapter",
) -> Path:
    """Write a random (non-zero) PEFT LoRA for the LM in `model_dir`, plus molora.json, to `out_dir`."""
    from peft import LoraConfig, get_peft_model

    if modality not in ("text", "image"):
        raise ValueError(f"modality must be 'text' or 'image', got {modality!r}")
    torch.manual_seed(seed)
    lm = set_base_model_name(LlamaForCausalLM.from_pretrained(Path(model_dir) / "lm"))
    peft_model = get_peft_model(lm, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS),
                                               init_lora_weights=False))
    out_dir = Path(out_dir)
    peft_model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    (out_dir / "molora.json").write_text(json.dumps({"modality": modality, "description": description}, indent=2))
    return out_dir
