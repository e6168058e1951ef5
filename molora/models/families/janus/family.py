"""Janus / Janus-Pro (transformers' JanusForConditionalGeneration + JanusProcessor) as a model family.

A directory written by `model.save_pretrained(d)` and `processor.save_pretrained(d)` (config.json `model_type`
"janus") is recognised by models/families/family.py; its adapters sit in d/adapters (or adapters_dir=).

Janus writes pictures in a separate "generation mode": the image codes are NOT ids of its text vocabulary; a
code is fed back through `generation_embeddings` + `generation_aligner` and the next one comes from
`generation_head`, not `lm_head` (JanusForConditionalGeneration.generate(generation_mode="image")).  This family
gives the engine one vocabulary anyway, with a thin module around the same weights (JanusUnifiedLM):

    ids [0, V)            text ids, embedded by the language model's embed_tokens, scored by lm_head
    ids [V, V + codes)    image codes, embedded by generation_embeddings + generation_aligner, scored by
                          generation_head; logits are the two heads side by side [.., V + codes]
    <boi> / <eoi>         `<begin_of_image>` / `<end_of_image>`; a picture is processor.num_image_tokens codes
                          (a square grid, no row markers), then <eoi> (forced)

In text mode the state machine allows only text ids (lm_head's scores), in image mode only codes
(generation_head's scores), so generation is Janus's own in each mode.  Routing by vocabulary range is then
routing by generation mode: `<begin_of_image>` and the codes (image mode) go to the image adapter, the rest to
the text adapter.  Pictures decode with Janus's VQ-VAE (JanusVQVAE.decode + the processor's postprocess).

Not supported: pictures in the prompt.  Janus reads pictures with its SigLIP encoder (`<image_placeholder>`
tokens, understanding mode), which the engine's token-id interface does not carry; a prompt picture raises.
Classifier-free guidance uses the engine's own unconditional twin (`<bos>` + the picture so far), not Janus's
padded prompt.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from molora.models.engine.vocab import UnifiedVocab, VocabError
from molora.models.families.family import ModelFamily, config_model_type, register_family
from molora.models.families.hf import SpanTokenizer, load_model_and_processor, read_generation_defaults
from molora.models.families.loading import DeviceMap, LoadedModel, ModelDirError, find_adapters

log = logging.getLogger(__name__)

LORA_TARGETS = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
BOI, EOI = "<begin_of_image>", "<end_of_image>"


class JanusUnifiedLM(nn.Module):
    """JanusForConditionalGeneration's weights as one causal LM over text ids + image codes (module docstring).

    Holds the same submodules under the same names (`model`, `lm_head`), so PEFT adapters made on
    JanusForConditionalGeneration name the same modules here.
    """

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.model, self.lm_head = janus.model, janus.lm_head
        self.text_vocab = int(janus.config.get_text_config().vocab_size)
        self.num_codes = int(janus.config.vq_config.num_embeddings)
        # the unified vocabulary's size, where the engine reads it (the KV layout is the text model's, unchanged)
        self.config = copy.deepcopy(janus.config)
        self.config.text_config.vocab_size = self.text_vocab + self.num_codes
        self.name_or_path = janus.name_or_path

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings for text ids, generation embeddings for codes (both computed: no host sync)."""
        is_code = (input_ids >= self.text_vocab)[..., None]
        text = self.model.language_model.get_input_embeddings()(input_ids.clamp(max=self.text_vocab - 1))
        codes = (input_ids - self.text_vocab).clamp(0, self.num_codes - 1)
        image = self.model.generation_aligner(self.model.generation_embeddings(codes))
        # (.to: under a device_map the generation modules may sit on another device than the text embedding)
        return torch.where(is_code, image.to(text.device, text.dtype), text)

    def get_input_embeddings(self) -> nn.Module:
        """The text embedding: where input ids go (a device_map's first device)."""
        return self.model.language_model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model.language_model(inputs_embeds=self.embed(input_ids), attention_mask=attention_mask,
                                        position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        text_logits = self.lm_head(hidden)
        logits = torch.cat([text_logits, self.model.generation_head(hidden).to(text_logits.device)], dim=-1)
        return CausalLMOutputWithPast(logits=logits, cache=out.cache)


class JanusImageCodec:
    """Codes -> pictures with Janus's VQ-VAE; prompt pictures are not supported (module docstring)."""

    def __init__(self, vqmodel: Any, processor: Any, grid: tuple[int, int]) -> None:
        self.vq, self.processor = vqmodel, processor
        self.grid = tuple(grid)
        self.codebook_size = int(vqmodel.config.num_embeddings)

    def encode(self, images: Any) -> torch.Tensor:
        raise VocabError("Janus reads prompt pictures with its SigLIP encoder (understanding mode), which this "
                         "engine does not feed; give Janus text prompts")

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> list[Image.Image]:
        codes = torch.as_tensor(codes).long().to(self.vq.device)
        pixels = self.vq.decode(codes.reshape(codes.shape[0], -1)).float().cpu()
        return list(self.processor.postprocess(list(pixels), return_tensors="PIL.Image.Image")["pixel_values"])


def _detect(path: Path) -> bool:
    return config_model_type(path) == "janus"


def janus_vocab(hf_tokenizer: Any, text_vocab: int, num_codes: int, grid: tuple[int, int]) -> UnifiedVocab:
    """Text ids then the codes appended at [text_vocab, text_vocab + num_codes); specials are the added tokens."""
    boi, eoi = hf_tokenizer.convert_tokens_to_ids([BOI, EOI])
    if None in (boi, eoi) or hf_tokenizer.unk_token_id in (boi, eoi):
        raise ModelDirError(f"the Janus tokenizer lacks {BOI} or {EOI}")
    added = [i for i in hf_tokenizer.added_tokens_decoder if i < text_vocab]
    text_size = min(added) if added else text_vocab
    eos = hf_tokenizer.eos_token_id
    try:
        return UnifiedVocab(
            vocab_size=text_vocab + num_codes, text_start=0, text_size=text_size, image_start=text_vocab,
            image_size=num_codes, pad_id=hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else eos,
            bos_id=hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None else eos, eos_id=eos,
            boi_id=boi, eoi_id=eoi, image_grid=grid, special_tokens={BOI: boi, EOI: eoi})
    except VocabError as exc:
        raise ModelDirError(f"the Janus vocabulary does not fit the engine's layout: {exc}") from exc


def load_janus(path: str | Path, *, adapters_dir: str | Path | None = None, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, threads: int | None = None,
               device_map: DeviceMap | None = None, max_memory: dict[Any, Any] | None = None,
               offload_folder: str | Path | None = None) -> LoadedModel:
    """Load a Janus directory (model + processor) and the adapters beside it."""
    from transformers import JanusForConditionalGeneration, JanusProcessor

    path = Path(path)
    processor, janus, device = load_model_and_processor(
        JanusForConditionalGeneration, JanusProcessor, path, what="Janus processor", device=device, dtype=dtype,
        threads=threads, device_map=device_map, max_memory=max_memory,
        offload_folder=offload_folder)
    lm = JanusUnifiedLM(janus)
    side = math.isqrt(int(processor.num_image_tokens))
    patches = int(janus.config.vq_config.num_patches)
    if side * side != int(processor.num_image_tokens) or side != patches:
        raise ModelDirError(f"{path}: num_image_tokens {processor.num_image_tokens} is not the VQ's "
                            f"{patches}x{patches} grid")
    vocab = janus_vocab(processor.tokenizer, lm.text_vocab, lm.num_codes, (side, side))
    table = torch.arange(vocab.image_start, vocab.image_start + vocab.image_size)
    codec = JanusImageCodec(janus.model.vqmodel, processor, (side, side))
    adapters = find_adapters(Path(adapters_dir) if adapters_dir is not None else path / "adapters")
    log.info("loaded Janus %s: %d text ids + %d codes, grid %s, %d adapters", path, lm.text_vocab, lm.num_codes,
             vocab.image_grid, len(adapters))
    return LoadedModel(path, SpanTokenizer(processor.tokenizer, vocab, table), lm, codec, adapters, None,
                       read_generation_defaults(path), family="janus", lora_targets=LORA_TARGETS)


FAMILY = register_family(ModelFamily(
    "janus", _detect, load_janus,
    description="JanusForConditionalGeneration: text by lm_head, pictures by its generation head, one vocabulary"))
