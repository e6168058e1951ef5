"""Emu3 (transformers' Emu3ForConditionalGeneration + Emu3VQVAE + Emu3Processor) as a model family.

A directory written by `model.save_pretrained(d)` and `processor.save_pretrained(d)` (config.json `model_type`
"emu3") is recognised by models/families/family.py; its adapters sit in d/adapters (or adapters_dir=).

Vocabulary (mapped onto models.vocab.UnifiedVocab):
    text            [0, first added token): the BPE text ids
    image codes     `<|visual token 000000|>` ... (model.vocabulary_mapping.img2bpe; they must be contiguous ids)
    <boi> / <eoi>   `<|image start|>` / `<|image end|>`
    row markers     `<|extra_200|>`, one shared end-of-line marker after each row of codes
    forced prefix   the picture's size as text "H*W" and `<|image token|>` (image_prefix_ids)
    forced suffix   `<|extra_201|>`, end of frame (image_suffix_ids)
so a picture is  <|image start|> H*W <|image token|> (W codes <|extra_200|>) x H <|extra_201|> <|image end|>,
Emu3's own grammar; the engine forces everything but the codes.  Routing by input id: `<|image start|>`,
`<|image token|>`, codes, end-of-line and end-of-frame go to the image adapter; the size digits are text ids, so
they go to the text adapter (they are forced: whatever adapter predicts them, nothing changes).

The picture size (`grid`, in codes) is not saved by save_pretrained: pass grid=(rows, cols) to from_pretrained,
else it comes from the processor's image_area and ratio 1:1 (the real checkpoints' default: 90x90 codes, 720 px).
Decoding: `vqmodel.decode(codes)` gives CLIP-normalised pixels; Emu3Processor.postprocess makes the PIL images.

Routed LoRA wraps only the language model's linears (`model.text_model.layers.*`): the VQ-VAE has its own
q_proj / k_proj / v_proj, which a suffix match would catch.
"""

from __future__ import annotations

import logging
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

# the language model's linears, never the VQ-VAE's (PEFT's regex convention: a full match of the module name)
LORA_TARGETS = r"model\.text_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
EOL, EOF = "<|extra_200|>", "<|extra_201|>"
BOI, EOI, IMAGE_WRAPPER = "<|image start|>", "<|image end|>", "<|image token|>"
DOWNSAMPLE = 8  # Emu3Processor.downsample_ratio: pixels per code along each side


class Emu3ImageCodec:
    """Pictures <-> VQ codes with Emu3's own VQ-VAE (models/families/family.py ImageCodec)."""

    def __init__(self, vqmodel: Any, processor: Any, grid: tuple[int, int]) -> None:
        self.vq, self.processor = vqmodel, processor
        self.grid = tuple(grid)
        self.codebook_size = int(vqmodel.config.codebook_size)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels of the pictures of this grid."""
        return self.grid[1] * DOWNSAMPLE, self.grid[0] * DOWNSAMPLE

    @torch.no_grad()
    def encode(self, images: Image.Image | Sequence[Image.Image]) -> torch.Tensor:
        """Codes [N, rows, cols]: each picture resized to the grid's size, normalised as Emu3's image processor
        does, then quantised by the VQ-VAE."""
        images = [images] if isinstance(images, Image.Image) else list(images)
        ip = self.processor.image_processor
        mean = torch.tensor(ip.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(ip.image_std).view(1, 3, 1, 1)
        pixels = torch.stack([torch.from_numpy(np.asarray(im.convert("RGB").resize(self.size, Image.BICUBIC),
                                                          dtype=np.float32)).permute(2, 0, 1) / 255.0
                              for im in images])
        pixels = ((pixels - mean) / std).to(self.vq.device, self.vq.dtype)
        sizes = torch.tensor([[self.size[1], self.size[0]]] * len(images))
        out = self.vq.encode(pixels, sizes, return_dict=True)
        return torch.stack([t.long().cpu() for t in out.image_tokens])

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> list[Image.Image]:
        """PIL pictures of codes [N, rows, cols] (the VQ-VAE's pixels are CLIP-normalised: the processor's
        postprocess undoes that)."""
        pixels = self.vq.decode(torch.as_tensor(codes).long().to(self.vq.device))
        return list(self.processor.postprocess(pixels.float().cpu(), return_tensors="PIL.Image.Image")["pixel_values"])


def _detect(path: Path) -> bool:
    return config_model_type(path) == "emu3"


def emu3_vocab(hf_tokenizer: Any, vocabulary_mapping: Any, grid: tuple[int, int], vocab_size: int) -> UnifiedVocab:
    """The engine's layout of an Emu3 vocabulary (see the module docstring); a layout the engine cannot serve
    (visual tokens that are not contiguous ids, missing markers) raises ModelDirError."""
    ids = hf_tokenizer.convert_tokens_to_ids
    named = {name: ids(name) for name in (BOI, EOI, IMAGE_WRAPPER, EOL, EOF)}
    unknown = [n for n, i in named.items() if i is None or i == hf_tokenizer.unk_token_id]
    if unknown:
        raise ModelDirError(f"the Emu3 tokenizer lacks the tokens {unknown}")
    img2bpe = vocabulary_mapping.img2bpe
    codebook = len(img2bpe)
    start = min(img2bpe.values())
    if sorted(img2bpe.values()) != list(range(start, start + codebook)) or sorted(img2bpe) != list(range(codebook)):
        raise ModelDirError("the Emu3 visual tokens are not one range of contiguous ids; the engine masks and "
                            "routes image codes as one id range")
    added = [i for i in hf_tokenizer.added_tokens_decoder if i < start]
    text_size = min(added) if added else start
    rows, cols = grid
    header = hf_tokenizer.encode(f"{rows}*{cols}", add_special_tokens=False) + [named[IMAGE_WRAPPER]]
    eos = hf_tokenizer.eos_token_id
    pad = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else eos
    bos = hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None else eos
    try:
        return UnifiedVocab(
            vocab_size=max(vocab_size, start + codebook), text_start=0, text_size=text_size, image_start=start,
            image_size=codebook, pad_id=pad, bos_id=bos, eos_id=eos, boi_id=named[BOI], eoi_id=named[EOI],
            image_grid=(rows, cols), row_end_ids=(named[EOL],), image_prefix_ids=tuple(header),
            image_suffix_ids=(named[EOF],), special_tokens={n: i for n, i in named.items()})
    except VocabError as exc:
        raise ModelDirError(f"the Emu3 vocabulary does not fit the engine's layout: {exc}") from exc


def default_grid(processor: Any, image_area: int | None = None, ratio: str = "1:1") -> tuple[int, int]:
    """Picture size in codes (rows, cols) for a pixel area (default: the processor's image_area) and a
    width:height ratio, as Emu3Processor computes it for generation."""
    try:
        return tuple(processor.calculate_generate_size(ratio, image_area or processor.image_area, DOWNSAMPLE))
    except (ValueError, ZeroDivisionError) as exc:
        raise ModelDirError(f"ratio must be 'W:H' with positive whole numbers, got {ratio!r}") from exc


def load_emu3(path: str | Path, *, adapters_dir: str | Path | None = None, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None, grid: tuple[int, int] | None = None, image_area: int | None = None,
              ratio: str = "1:1", threads: int | None = None,
              device_map: DeviceMap | None = None, max_memory: dict[Any, Any] | None = None,
              offload_folder: str | Path | None = None) -> LoadedModel:
    """Load an Emu3 directory (model + processor) and the adapters beside it; missing LM weights are an error.
    The pictures it writes are `grid` (rows, cols) codes, else sized from `image_area` pixels (default: the
    processor's) at `ratio` width:height, as Emu3Processor does."""
    from transformers import Emu3ForConditionalGeneration, Emu3Processor

    path = Path(path)
    processor, lm, device = load_model_and_processor(
        Emu3ForConditionalGeneration, Emu3Processor, path, what="Emu3 processor (tokenizer + image processor)",
        device=device, dtype=dtype, threads=threads, device_map=device_map, max_memory=max_memory,
        offload_folder=offload_folder)
    mapping = lm.model.vocabulary_mapping
    grid = tuple(int(g) for g in (grid or default_grid(processor, image_area, ratio)))
    if len(grid) != 2 or min(grid) < 1:
        raise ModelDirError(f"grid must be (rows, cols) of codes, both >= 1; got {grid}")
    vocab = emu3_vocab(processor.tokenizer, mapping, grid, int(lm.config.get_text_config().vocab_size))
    img2bpe = torch.tensor([mapping.img2bpe[c] for c in range(vocab.image_size)], dtype=torch.long)
    vq = lm.model.vqmodel.float()  # decode in float32 whatever the LM's dtype
    codec = Emu3ImageCodec(vq, processor, grid)
    if codec.codebook_size != vocab.image_size:
        raise ModelDirError(f"{path}: the VQ-VAE has {codec.codebook_size} codes but the vocabulary "
                            f"{vocab.image_size} visual tokens")
    adapters_path = Path(adapters_dir) if adapters_dir is not None else path / "adapters"
    defaults = read_generation_defaults(path)
    adapters = find_adapters(adapters_path)
    log.info("loaded Emu3 %s: vocab %d, grid %s, %d adapters", path, vocab.vocab_size, grid, len(adapters))
    return LoadedModel(path, SpanTokenizer(processor.tokenizer, vocab, img2bpe), lm, codec, adapters, None, defaults,
                       family="emu3", lora_targets=LORA_TARGETS)


FAMILY = register_family(ModelFamily(
    "emu3", _detect, load_emu3,
    description="Emu3ForConditionalGeneration: text and pictures as tokens, pictures decoded by its VQ-VAE"))
