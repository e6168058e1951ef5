"""A tiny random Emu3 (model + processor) saved with save_pretrained, for tests: nothing is downloaded.

    path = build_tiny_emu3(tmp_path / "emu3")        # ~0.5M parameters, 16 visual codes, pictures of 8 px per code
    pipe = InterleavedPipeline.from_pretrained(path, device="cpu", grid=(4, 4))
"""

from __future__ import annotations

from pathlib import Path

import torch

from molora.models.families.hf import tiny_byte_bpe

TEXTS = ["a red circle in the top left", "two blue squares on a green field", "draw a picture of a cat",
         "describe this picture", "hello world 0 1 2 3 4 5 6 7 8 9 * ."]
SPECIALS = ["<|endoftext|>", "<|extra_203|>", "<|extra_204|>", "<|image start|>", "<|image end|>",
            "<|image token|>", "<|extra_200|>", "<|extra_201|>", "<image>"]


def tiny_emu3_tokenizer(codebook: int = 16, text_vocab: int = 300):
    """A byte-level BPE over a few sentences + Emu3's specials + `codebook` visual tokens (contiguous ids)."""
    from transformers import PreTrainedTokenizerFast

    tok = tiny_byte_bpe(TEXTS, SPECIALS + [f"<|visual token {i:06d}|>" for i in range(codebook)], text_vocab)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|extra_203|>", eos_token="<|extra_204|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
                              "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"})


def build_tiny_emu3(path: str | Path, *, codebook: int = 16, hidden_size: int = 32, num_layers: int = 2,
                    seed: int = 0) -> Path:
    """Save a tiny random Emu3ForConditionalGeneration and its Emu3Processor into `path`; returns it."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3ImageProcessor, Emu3Processor

    path = Path(path)
    tokenizer = tiny_emu3_tokenizer(codebook)
    config = Emu3Config(
        vq_config=dict(codebook_size=codebook, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[], hidden_size=32),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vocabulary_map=tokenizer.get_vocab())
    torch.manual_seed(seed)
    model = Emu3ForConditionalGeneration(config).eval()
    processor = Emu3Processor(Emu3ImageProcessor(min_pixels=16 * 16, max_pixels=64 * 64), tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
