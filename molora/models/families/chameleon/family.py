"""Chameleon / Anole (transformers' ChameleonForConditionalGeneration + ChameleonProcessor) as a model family.

A directory written by `model.save_pretrained(d)` and `processor.save_pretrained(d)` (config.json `model_type`
"chameleon") is recognised by models/families/family.py; its adapters sit in d/adapters (or adapters_dir=).

Vocabulary (mapped onto models.vocab.UnifiedVocab):
    image codes     the `IMGIMG...Z` tokens (model.vocabulary_mapping: code digits spelled A-J); they must fill one
                    id range (in any order: the tokenizer maps codes through a table)
    <boi> / <eoi>   `<racm3:break>` / `<eoss>`
    grid            a square of processor.image_seq_length codes (32x32 = 1024 for the released checkpoints), no
                    row markers
    text            the longest run of ids that are neither image codes nor added (special) tokens

What the output is: CODES, NOT PIXELS.  transformers ships only the encoder half of Chameleon's VQ-VAE, so a
generated picture cannot be decoded here.  Each generated picture is kept as its codes: the document's image is a
code map (one flat colour per code, 16 px a side: a picture of the codes, not of the scene), and the codes
themselves are in `image.info["molora_codes"]` (rows of ints).  Prompt pictures are encoded by the VQ encoder,
so image -> text works.

Image generation: ChameleonForConditionalGeneration.forward sets the logits of every image token to the dtype's
minimum (the released Chameleon weights were not meant to write pictures).  Anole checkpoints, loaded by the same
class, do write them, so this family lifts that mask (it empties the list of ids the forward masks, after the
mapping's code tables are built).  On a Chameleon checkpoint the pictures are then whatever those weights give.

Routed LoRA wraps only the decoder layers' linears (`model.layers.*`), never the VQ encoder.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from molora.models.engine.vocab import UnifiedVocab, VocabError
from molora.models.families.family import ModelFamily, config_model_type, register_family
from molora.models.families.hf import SpanTokenizer, load_model_and_processor, read_generation_defaults
from molora.models.families.loading import DeviceMap, LoadedModel, ModelDirError, find_adapters

log = logging.getLogger(__name__)

LORA_TARGETS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
BOI, EOI = "<racm3:break>", "<eoss>"
CODE_PIXELS = 16  # side of one code's square in a code map (512 px / 32 codes in the released checkpoints)


class ChameleonCodes:
    """Pictures -> codes with Chameleon's VQ encoder; codes -> a code map (transformers has no VQ decoder)."""

    decodes_pixels = False

    def __init__(self, vqmodel: Any, processor: Any, grid: tuple[int, int]) -> None:
        self.vq, self.processor = vqmodel, processor
        self.grid = tuple(grid)
        self.codebook_size = int(vqmodel.config.num_embeddings)
        rng = np.random.default_rng(0)  # a fixed colour per code, so the same codes give the same map
        self.palette = rng.integers(0, 256, size=(self.codebook_size, 3), dtype=np.uint8)

    @torch.no_grad()
    def encode(self, images: Image.Image | Sequence[Image.Image]) -> torch.Tensor:
        """Codes [N, rows, cols] of pictures, through Chameleon's own image processor and VQ encoder."""
        images = [images] if isinstance(images, Image.Image) else list(images)
        pixels = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        out = self.vq.encode(pixels.to(self.vq.device, self.vq.dtype), return_dict=True)
        codes = out.image_tokens.long().cpu().reshape(len(images), -1)
        if codes.shape[1] != self.grid[0] * self.grid[1]:
            raise VocabError(f"the VQ encoder gave {codes.shape[1]} codes per picture; the vocabulary expects "
                             f"{self.grid[0]}x{self.grid[1]} (processor image_seq_length)")
        return codes.reshape(len(images), *self.grid)

    def decode(self, codes: torch.Tensor) -> list[Image.Image]:
        """Code maps (NOT pixels: see the module docstring); each carries its codes in info["molora_codes"]."""
        maps = []
        for grid in torch.as_tensor(codes).long().cpu():
            image = Image.fromarray(self.palette[grid.numpy()]).resize(
                (grid.shape[1] * CODE_PIXELS, grid.shape[0] * CODE_PIXELS), Image.NEAREST)
            image.info["molora_codes"] = grid.tolist()
            maps.append(image)
        return maps


def _detect(path: Path) -> bool:
    return config_model_type(path) == "chameleon"


def chameleon_vocab(hf_tokenizer: Any, img2bpe: dict[int, int], grid: tuple[int, int], vocab_size: int
                    ) -> UnifiedVocab:
    """The engine's layout of a Chameleon vocabulary (see the module docstring)."""
    boi, eoi = hf_tokenizer.convert_tokens_to_ids([BOI, EOI])
    if None in (boi, eoi) or hf_tokenizer.unk_token_id in (boi, eoi):
        raise ModelDirError(f"the Chameleon tokenizer lacks {BOI} or {EOI}")
    ids = sorted(img2bpe.values())
    start, codebook = ids[0], len(ids)
    if ids != list(range(start, start + codebook)):
        raise ModelDirError("the Chameleon image tokens are not one range of contiguous ids")
    taken = set(hf_tokenizer.added_tokens_decoder) | set(ids)
    runs, run_start = [], None
    for i in range(vocab_size + 1):
        if i < vocab_size and i not in taken:
            run_start = i if run_start is None else run_start
        elif run_start is not None:
            runs.append((run_start, i - run_start))
            run_start = None
    if not runs:
        raise ModelDirError("the Chameleon vocabulary has no text ids")
    text_start, text_size = max(runs, key=lambda r: r[1])
    eos = hf_tokenizer.eos_token_id
    try:
        return UnifiedVocab(
            vocab_size=vocab_size, text_start=text_start, text_size=text_size, image_start=start, image_size=codebook,
            pad_id=hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else eos,
            bos_id=hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None else eos, eos_id=eos,
            boi_id=boi, eoi_id=eoi, image_grid=grid, special_tokens={BOI: boi, EOI: eoi})
    except VocabError as exc:
        raise ModelDirError(f"the Chameleon vocabulary does not fit the engine's layout: {exc}") from exc


def load_chameleon(path: str | Path, *, adapters_dir: str | Path | None = None,
                   device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                   threads: int | None = None,
                   device_map: DeviceMap | None = None, max_memory: dict[Any, Any] | None = None,
                   offload_folder: str | Path | None = None) -> LoadedModel:
    """Load a Chameleon / Anole directory (model + processor) and the adapters beside it."""
    from transformers import ChameleonForConditionalGeneration, ChameleonProcessor

    path = Path(path)
    processor, lm, device = load_model_and_processor(
        ChameleonForConditionalGeneration, ChameleonProcessor, path, what="Chameleon processor", device=device,
        dtype=dtype, threads=threads, device_map=device_map, max_memory=max_memory,
        offload_folder=offload_folder)
    side = math.isqrt(int(processor.image_seq_length))
    if side * side != int(processor.image_seq_length):
        raise ModelDirError(f"{path}: image_seq_length {processor.image_seq_length} is not a square grid")
    mapping = lm.model.vocabulary_mapping
    img2bpe = dict(mapping.img2bpe)
    _ = mapping.img2bpe_mapping_tensor, mapping.bpe2img_search_tensors  # built from image_tokens before the lift
    mapping.__dict__["image_tokens"] = []  # lift the forward's mask on image-token logits (module docstring)
    vocab = chameleon_vocab(processor.tokenizer, img2bpe, (side, side), int(lm.config.vocab_size))
    table = torch.tensor([img2bpe[c] for c in range(vocab.image_size)], dtype=torch.long)
    codec = ChameleonCodes(lm.model.vqmodel, processor, (side, side))
    if codec.codebook_size != vocab.image_size:
        raise ModelDirError(f"{path}: the VQ has {codec.codebook_size} codes but the vocabulary {vocab.image_size}")
    adapters = find_adapters(Path(adapters_dir) if adapters_dir is not None else path / "adapters")
    log.info("loaded Chameleon %s: vocab %d, grid %s, %d adapters (pictures are codes, not pixels)",
             path, vocab.vocab_size, vocab.image_grid, len(adapters))
    return LoadedModel(path, SpanTokenizer(processor.tokenizer, vocab, table), lm, codec, adapters, None,
                       read_generation_defaults(path), family="chameleon", lora_targets=LORA_TARGETS)


FAMILY = register_family(ModelFamily(
    "chameleon", _detect, load_chameleon,
    description="ChameleonForConditionalGeneration / Anole: text and picture codes (no pixel decoder in transformers)"))
