"""Pieces shared by the model families that load a transformers checkpoint (models/families/emu3, models/families/chameleon).

    SpanTokenizer     text and image spans <-> ids over a transformers tokenizer (models/families/family.py FamilyTokenizer)
    load_checked      from_pretrained that treats missing weights as an error (transformers only warns); with a
                      device_map, placed over devices by transformers / accelerate
    device_and_dtype  the device (CUDA when there is one) and dtype (bf16 on CUDA, float32 on the CPU)
    read_generation_defaults   the optional generation.json beside the model
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from molora.models.engine.runtime import configure_cpu_threads
from molora.models.engine.vocab import UnifiedVocab, VocabError
from molora.models.families.checkpoint import check_declared_counts, check_finite, read_config
from molora.models.families.loading import (
    DeviceMap,
    ModelDirError,
    Placing,
    check_finite_placed,
    placing,
)
from molora.routing.model import input_device


class SpanTokenizer:
    """Text and image spans in one vocabulary over a transformers tokenizer.

    `img2bpe` [codebook] long maps code c to its token id; the ids must fill vocab's image range (in any order).
    An image span between <boi> and <eoi> is: vocab.image_prefix_ids, each row's codes (+ the shared row marker
    where the vocabulary has one), vocab.image_suffix_ids.
    """

    def __init__(self, hf_tokenizer: Any, vocab: UnifiedVocab, img2bpe: torch.Tensor) -> None:
        self.hf, self.vocab = hf_tokenizer, vocab
        self.img2bpe = img2bpe.long().cpu()
        if sorted(self.img2bpe.tolist()) != list(range(vocab.image_start, vocab.image_start + vocab.image_size)):
            raise VocabError(f"the {len(self.img2bpe)} image-code tokens do not fill the id range "
                             f"[{vocab.image_start}, {vocab.image_start + vocab.image_size})")
        self.bpe2img = torch.empty(vocab.image_size, dtype=torch.long)
        self.bpe2img[self.img2bpe - vocab.image_start] = torch.arange(vocab.image_size)
        if len(vocab.row_end_ids) > 1:
            raise VocabError("SpanTokenizer supports no row marker or one shared marker")

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise VocabError(f"encode_text expects a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False)) if text else []

    def _is_text(self, token_id: int) -> bool:
        return self.vocab.text_start <= token_id < self.vocab.text_start + self.vocab.text_size

    def decode_text(self, ids: Iterable[int] | torch.Tensor) -> str:
        ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        return self.hf.decode([i for i in ids if self._is_text(i)], skip_special_tokens=True)

    def token_piece(self, token_id: int) -> str:
        """`<img:c>` for an image code, the text of a text id, the token's own name for a special."""
        token_id = int(token_id)
        if self.vocab.is_image_code(token_id):
            return f"<img:{int(self.bpe2img[token_id - self.vocab.image_start])}>"
        if self._is_text(token_id):
            return self.hf.decode([token_id])
        return str(self.hf.convert_ids_to_tokens(token_id))

    def image_ids(self, codes: torch.Tensor) -> list[int]:
        """The ids between <boi> and <eoi> of one picture's codes [rows, cols] (or flat, row-major)."""
        v = self.vocab
        rows, cols = v.image_grid
        codes = torch.as_tensor(codes).long().reshape(-1).cpu()
        if codes.numel() != rows * cols or int(codes.min()) < 0 or int(codes.max()) >= v.image_size:
            raise VocabError(f"a picture is {rows}x{cols} codes in [0, {v.image_size}); got {codes.numel()} codes "
                             f"in [{int(codes.min())}, {int(codes.max())}]")
        grid = self.img2bpe[codes].reshape(rows, cols)
        if v.row_end_ids:
            grid = torch.cat([grid, torch.full((rows, 1), v.row_end_ids[0], dtype=torch.long)], dim=1)
        return [*v.image_prefix_ids, *grid.reshape(-1).tolist(), *v.image_suffix_ids]

    def image_span(self, codes: torch.Tensor) -> list[int]:
        return [self.vocab.boi_id, *self.image_ids(codes), self.vocab.eoi_id]

    def codes_from_ids(self, ids: Iterable[int] | torch.Tensor) -> torch.Tensor:
        """LongTensor [rows, cols] of codebook indices from the ids between <boi> and <eoi> (image_ids' layout)."""
        v = self.vocab
        ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        if len(ids) != v.tokens_per_image:
            raise VocabError(f"a picture span holds {v.tokens_per_image} ids, got {len(ids)}")
        head, tail = len(v.image_prefix_ids), len(v.image_suffix_ids)
        if tuple(ids[:head]) != v.image_prefix_ids or tuple(ids[len(ids) - tail:]) != v.image_suffix_ids:
            raise VocabError("a picture span must start with its forced header and end with its forced trailer")
        rows, cols = v.image_grid
        body = torch.tensor(ids[head:len(ids) - tail]).reshape(rows, -1)
        if v.row_end_ids:
            if not bool((body[:, -1] == v.row_end_ids[0]).all()):
                raise VocabError(f"every row of a picture must end with its row marker {v.row_end_ids[0]}")
            body = body[:, :-1]
        if not bool(((body >= v.image_start) & (body < v.image_start + v.image_size)).all()):
            raise VocabError("the rows of a picture must hold image codes only")
        return self.bpe2img[body - v.image_start]


def device_and_dtype(device: torch.device | str | None, dtype: torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def load_checked(cls: Any, path: Path, dtype: torch.dtype, placed: Placing | None = None) -> Any:
    """cls.from_pretrained(path) where any missing weight is an error (transformers leaves them random and only
    warns: e.g. AutoModelForCausalLM on an Emu3ForConditionalGeneration folder loads no weight at all).
    Before loading, a config declaring more layers than the files hold tensors is refused (nothing allocated);
    after, NaN/Inf weights. `placed`: a device_map (+ max_memory, offload folder) for transformers / accelerate."""
    check_declared_counts(path, read_config(path / "config.json", ModelDirError), ModelDirError)
    placement = {} if placed is None else placed.from_pretrained_kwargs()
    try:
        model, info = cls.from_pretrained(str(path), dtype=dtype, use_safetensors=True, output_loading_info=True,
                                          **placement)
    except Exception as exc:  # transformers raises many types on a bad config (ZeroDivisionError, AttributeError, ...)
        raise ModelDirError(f"cannot load {cls.__name__} from {path} ({type(exc).__name__}: {exc})") from exc
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelDirError(f"{path}: {len(missing)} weights of {cls.__name__} are missing from the checkpoint "
                            f"(e.g. {missing[:3]}); it was saved from another class or is incomplete")
    if placed is None:
        check_finite(model, path, ModelDirError)
    else:
        check_finite_placed(model, path, ModelDirError)
    return model


def load_model_and_processor(model_cls: Any, processor_cls: Any, path: Path, *, what: str,
                             device: torch.device | str | None, dtype: torch.dtype | None, threads: int | None,
                             device_map: DeviceMap | None = None, max_memory: dict[Any, Any] | None = None,
                             offload_folder: str | Path | None = None) -> tuple[Any, Any, torch.device]:
    """(processor, model on `device` in eval mode, device) of a family's directory: threads set, the processor
    loaded (any failure a ModelDirError naming `what`), the model through load_checked, and its name for adapter
    checks taken from `molora_base_model` in its config where the checkpoint records one.

    With `device_map` (and `max_memory`, `offload_folder`) transformers and accelerate place the model over
    devices instead (device= as well: PlacementError); the device returned is then its input embedding's."""
    placed = placing(device, device_map, max_memory, offload_folder)
    configure_cpu_threads(threads)
    if placed is None:
        device, dtype = device_and_dtype(device, dtype)
    else:
        dtype = dtype or placed.default_dtype()
    try:
        processor = processor_cls.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types on damaged files (RecursionError, StrictDataclass...)
        raise ModelDirError(f"cannot load the {what} from {path}: {exc}") from exc
    model = load_checked(model_cls, path, dtype, placed)
    if placed is None:
        model = model.to(device)
    else:
        device = input_device(model, torch.device("cpu"))
    model = model.eval().requires_grad_(False)
    model.name_or_path = getattr(model.config, "molora_base_model", None) or model.name_or_path
    return processor, model, device


def tiny_byte_bpe(texts: Iterable[str], specials: Iterable[str], vocab_size: int = 300) -> Any:
    """A byte-level BPE trained on `texts`, `specials` added after it: the tokenizer of the families' tiny test
    models (models/<family>/testing.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(texts), trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(list(specials))
    return tok


def read_generation_defaults(path: Path) -> dict:
    """The optional generation.json beside a model: default GenerationConfig fields."""
    gen = path / "generation.json"
    if not gen.is_file():
        return {}
    return read_config(gen, ModelDirError)


__all__ = ["SpanTokenizer", "device_and_dtype", "load_checked", "read_generation_defaults"]
