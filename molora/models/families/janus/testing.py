"""A tiny random Janus (model + processor) saved with save_pretrained, for tests: nothing is downloaded.

    path = build_tiny_janus(tmp_path / "janus")    # 16 generation codes, 4x4 codes per picture (32 px)
"""

from __future__ import annotations

from pathlib import Path

import torch

from molora.models.families.hf import tiny_byte_bpe

TEXTS = ["a red circle in the top left", "two blue squares on a green field", "draw a picture of a cat"]
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<image_placeholder>",
            "<begin_of_image>", "<end_of_image>"]


def build_tiny_janus(path: str | Path, *, codebook: int = 16, side: int = 4, hidden_size: int = 32,
                     num_layers: int = 2, seed: int = 0) -> Path:
    """Save a tiny random JanusForConditionalGeneration and its JanusProcessor into `path`."""
    from transformers import (
        JanusConfig,
        JanusForConditionalGeneration,
        JanusImageProcessor,
        JanusProcessor,
        PreTrainedTokenizerFast,
    )

    path = Path(path)
    tok = tiny_byte_bpe(TEXTS, SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[2],
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"})
    pixels = side * 8  # the VQ decoder below doubles the resolution 3 times
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=pixels,
                           patch_size=8, projection_dim=hidden_size, intermediate_size=64,
                           num_image_tokens=side * side),
        vq_config=dict(embed_dim=8, num_embeddings=codebook, latent_channels=8, base_channels=32,
                       channel_multiplier=[1, 1, 1, 1], num_res_blocks=1, projection_dim=hidden_size,
                       image_token_embed_dim=hidden_size),
        image_token_id=tokenizer.convert_tokens_to_ids("<image_placeholder>"))
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(config).eval()
    processor = JanusProcessor(JanusImageProcessor(size={"height": pixels, "width": pixels}), tokenizer,
                               num_image_tokens=side * side)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
