"""A tiny random Chameleon (model + processor) saved with save_pretrained, for tests: nothing is downloaded.

    path = build_tiny_chameleon(tmp_path / "chameleon")    # 16 image codes, 4x4 codes per picture (32 px input)
"""

from __future__ import annotations

from pathlib import Path

import torch

from molora.models.families.hf import tiny_byte_bpe

TEXTS = ["a red circle in the top left", "two blue squares on a green field", "draw a picture of a cat",
         "describe this picture"]
DIGITS = {str(i): chr(ord("A") + i) for i in range(10)}


def image_token_name(code: int) -> str:
    """Chameleon's name of image code `code`: IMGIMG + its digits spelled A-J + Z."""
    return "IMGIMG" + "".join(DIGITS[c] for c in str(code)) + "Z"


def build_tiny_chameleon(path: str | Path, *, codebook: int = 16, side: int = 4, hidden_size: int = 32,
                         num_layers: int = 2, seed: int = 0) -> Path:
    """Save a tiny random ChameleonForConditionalGeneration and its ChameleonProcessor into `path`."""
    from transformers import (
        ChameleonConfig,
        ChameleonForConditionalGeneration,
        ChameleonImageProcessor,
        ChameleonProcessor,
        PreTrainedTokenizerFast,
    )

    path = Path(path)
    tok = tiny_byte_bpe(TEXTS, ["<s>", "<pad>", "</s>", "<image>", "<racm3:break>", "<eoss>"]
                        + [image_token_name(c) for c in range(codebook)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>", "boi_token": "<racm3:break>", "eoi_token": "<eoss>"})
    pixels = side * 8  # the VQ encoder below halves the resolution 3 times
    config = ChameleonConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        vq_config=dict(embed_dim=8, num_embeddings=codebook, latent_channels=8, resolution=pixels, base_channels=32,
                       channel_multiplier=[1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[]),
        vocabulary_map=tokenizer.get_vocab(), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(config).eval()
    image_processor = ChameleonImageProcessor(size={"shortest_edge": pixels},
                                              crop_size={"height": pixels, "width": pixels})
    processor = ChameleonProcessor(image_processor, tokenizer, image_seq_length=side * side)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
