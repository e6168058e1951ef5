"""What a generation request is: its settings (GenerationConfig), its prompt and router (Request), and the
grammar of interleaved text-and-image sequences over one unified vocabulary.

A sequence is text until the model emits `<boi>`; then exactly `vocab.tokens_per_image` image tokens follow
(codebook ids, plus a forced row marker after each row where the vocabulary has `row_end_ids`), then `<eoi>` is
forced and the sequence is text again; a sequence may hold several images and ends at `<eos>`.  The grammar
only *masks logits* (the phase-mask table built here, indexed per row by models/engine/row_states.py): an invalid id
can never be sampled, nothing is repaired afterwards.  Decoding itself is the serving engine's
(models/engine/core.py).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from molora.models.engine.sampling import GenerationError, SamplingConfig, check_seed
from molora.models.engine.vocab import UnifiedVocab
from molora.routing.routers import Router

# a lone UTF-16 surrogate: never text. U+DC80..U+DCFF are what Python makes of bytes that are not UTF-8 (a shell's
# $'\xff' in sys.argv, a file read with errors="surrogateescape"); the others come from JSON such as "\ud800"
_SURROGATE = re.compile("[\ud800-\udfff]")

# phases: what the NEXT token of a row may be
TEXT_PHASE, CODE_PHASE, ROW_END_PHASE, EOI_PHASE, DONE_PHASE = range(5)
ROW_MARKER_MASKS = 5  # mask table rows 5 + r: the end of image row r allows only row r's own marker
MAX_BEST_OF = 16


class PromptTextError(GenerationError):
    """Text (a prompt, a negative prompt) that holds characters no tokenizer can encode: bytes that are not UTF-8
    or lone UTF-16 surrogates."""


def check_text(text: str, what: str = "the prompt") -> str:
    """`text` unchanged if it is encodable text; else PromptTextError naming the bad characters and where they are.

    A shell passes bytes that are not UTF-8 (`$'\\xff'`) to Python as lone surrogates (U+DC80..U+DCFF); JSON can
    carry any lone surrogate ("\\ud800"). The tokenizers refuse both with a TypeError that names neither."""
    bad = [(m.start(), m.group()) for m in _SURROGATE.finditer(text)]
    if not bad:
        return text
    first = bad[0][0]
    escaped = [ord(c) for _, c in bad if 0xDC80 <= ord(c) <= 0xDCFF]
    if len(escaped) == len(bad):
        found = ("bytes that are not UTF-8 (" if len(bad) > 1 else "a byte that is not UTF-8 (") + " ".join(f"0x{c - 0xDC00:02x}" for c in escaped[:8]) + \
                (" ..." if len(escaped) > 8 else "") + ")"
    else:
        found = ("lone UTF-16 surrogates (" if len(bad) > 1 else "a lone UTF-16 surrogate (") + " ".join(f"U+{ord(c):04X}" for _, c in bad[:8]) + \
                (" ..." if len(bad) > 8 else "") + ")"
    count = f"{len(bad)} characters that are" if len(bad) > 1 else "a character that is"
    raise PromptTextError(f"{what} holds {count} not text: {found}, the first at character {first + 1}; send UTF-8 "
                          "text (save the file or set the terminal to UTF-8, or remove those bytes)")


@dataclass
class GenerationConfig:
    """Settings of one generate call. Separate SamplingConfigs for text spans and image spans.

    cfg_scale: classifier-free guidance for image tokens (1.0 = off; the unconditional stream is then skipped).
    seed: None draws a fresh seed (recorded in the Document, so any output can be reproduced).
    max_images: cap on images generated per sequence (None = no cap, 0 = text only).
    start_image: append `<boi>` to the prompt, so the continuation starts with an image (text -> image).
    min_new_tokens: `<eos>` is masked until this many tokens were generated (as in transformers' generate).
    best_of: draw up to this many candidate documents and keep the first that passes `check` (models/engine/best_of.py;
        1 = off). Candidate 0 is this config's own sample.
    check: the name of a registered check (models.best_of.CHECKS), e.g. "shapes_caption" for the embedded model.
    negative_prompt: text the unconditional stream of classifier-free guidance reads before each picture (None:
        `<bos>` alone), e.g. Emu3's "lowres, bad anatomy, ..." negative prompt.
    """

    max_new_tokens: int = 512
    text: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.7, top_p=0.9))
    image: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0))
    cfg_scale: float = 3.0
    seed: int | None = None
    max_images: int | None = None
    start_image: bool = False
    min_new_tokens: int = 0
    best_of: int = 1
    check: str | None = None
    negative_prompt: str | None = None

    # keyword shortcuts accepted by with_overrides: "temperature" sets both modalities, "text_top_k" one
    _SAMPLING_KEYS = ("temperature", "top_k", "top_p")

    def __post_init__(self) -> None:
        for name in ("text", "image"):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, SamplingConfig(**value))
            elif not isinstance(value, SamplingConfig):
                raise GenerationError(f"GenerationConfig.{name} must be a SamplingConfig, got {type(value).__name__}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        try:
            self.cfg_scale = float(self.cfg_scale)
        except (TypeError, ValueError) as exc:
            raise GenerationError(f"cfg_scale must be a number, got {self.cfg_scale!r}") from exc
        if not abs(self.cfg_scale) < float("inf"):
            raise GenerationError(f"cfg_scale must be finite, got {self.cfg_scale}")
        if self.seed is not None:
            self.seed = check_seed(self.seed)
        if self.max_images is not None and (not isinstance(self.max_images, int) or self.max_images < 0):
            raise GenerationError(f"max_images must be None or an int >= 0, got {self.max_images!r}")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) \
                or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise GenerationError(f"min_new_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                                  f"got {self.min_new_tokens!r}")
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or not 1 <= self.best_of <= MAX_BEST_OF:
            raise GenerationError(f"best_of must be an int in [1, {MAX_BEST_OF}], got {self.best_of!r}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise GenerationError(f"negative_prompt must be a str or None, got {type(self.negative_prompt).__name__}")
        if self.negative_prompt is not None:
            check_text(self.negative_prompt, "negative_prompt")
        if self.check is not None and not isinstance(self.check, str):
            raise GenerationError(f"check must be the name of a registered check or None, got {self.check!r}")
        if self.best_of > 1 and self.check is None:
            raise GenerationError(f"best_of={self.best_of} needs a check that says which candidate to keep; set "
                                  "check= to a registered name (the embedded model's generation.json sets "
                                  "'shapes_caption')")

    @property
    def uses_cfg(self) -> bool:
        return self.cfg_scale != 1.0 and self.max_images != 0

    def with_overrides(self, **overrides: Any) -> GenerationConfig:
        """A copy with fields replaced. Also accepts temperature/top_k/top_p (both modalities) and
        text_temperature, image_top_p, ... (one modality). Unknown keys raise GenerationError."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        text, image = asdict(self.text), asdict(self.image)
        for key, value in overrides.items():
            if key in data:
                data[key] = value
            elif key in self._SAMPLING_KEYS:
                text[key] = image[key] = value
            elif key.startswith(("text_", "image_")) and key.split("_", 1)[1] in self._SAMPLING_KEYS:
                modality, name = key.split("_", 1)
                (text if modality == "text" else image)[name] = value
            else:
                valid = sorted([*data, *self._SAMPLING_KEYS,
                                *(f"{m}_{k}" for m in ("text", "image") for k in self._SAMPLING_KEYS)])
                raise GenerationError(f"unknown generation setting {key!r}; valid settings: {', '.join(valid)}")
        if "text" not in overrides:
            data["text"] = SamplingConfig(**text)
        if "image" not in overrides:
            data["image"] = SamplingConfig(**image)
        return GenerationConfig(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GenerationConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise GenerationError(f"unknown GenerationConfig fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


@dataclass
class Request:
    """One sequence to continue: unified prompt ids (starting with <bos>) and its router (None = base model)."""

    prompt_ids: list[int]
    router: Router | None = None
    uncond_prompt: list[int] | None = None  # ids the CFG twin starts from (<bos> + a negative prompt); None: <bos>


class StopSignal:
    """Ends a generation early, from any thread: `pipe.stream(..., stop=signal)` then `signal.stop()` (a UI's Stop
    button). Every document still being written finishes at the engine's next step with finish_reason "stopped"
    and keeps what it has (text, finished pictures, routing); a picture being drawn is left out, with a notice.
    Unlike closing the stream, the caller still gets each row's Finished event. One signal may serve several
    streams (best-of rounds); once stopped it stays stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._stopped = False
        self._stopped_at: float | None = None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._stopped_at = self._stopped_at or time.monotonic()
            handles, self._handles = self._handles, []
        for handle in handles:
            handle.cancel()

    def is_set(self) -> bool:
        return self._stopped

    def stopped_for(self, seconds: float) -> bool:
        """Whether stop() was called at least `seconds` ago."""
        return self._stopped_at is not None and time.monotonic() - self._stopped_at >= seconds

    def attach(self, handles: Sequence[Any]) -> None:
        """Requests (engine RequestHandles) this signal cancels; cancelled at once if it was stopped already."""
        with self._lock:
            if not self._stopped:
                self._handles = [h for h in self._handles if not h.finished] + list(handles)
                return
        for handle in handles:
            handle.cancel()


def span_tables(vocab: UnifiedVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """(phase, mask-table row) [tokens_per_image + 1] of the token at each position p of an image span (p tokens
    after <boi>): the forced prefix, then per row the codes and the row's marker, then the forced suffix, and at
    p = tokens_per_image the forced <eoi>. A forced id has a mask-table row of its own (build_phase_masks) and the
    marker phase (one allowed id)."""
    rows, cols = vocab.image_grid
    prefix, suffix = vocab.image_prefix_ids, vocab.image_suffix_ids
    forced_row = ROW_MARKER_MASKS + len(vocab.row_ends)  # the first table row of the forced ids
    phase, mask = [], []
    for j in range(len(prefix)):
        phase.append(ROW_END_PHASE)
        mask.append(forced_row + j)
    for r in range(rows):
        phase += [CODE_PHASE] * cols
        mask += [CODE_PHASE] * cols
        if vocab.row_end_ids:
            phase.append(ROW_END_PHASE)
            mask.append(ROW_MARKER_MASKS + r)
    for j in range(len(suffix)):
        phase.append(ROW_END_PHASE)
        mask.append(forced_row + len(prefix) + j)
    phase.append(EOI_PHASE)
    mask.append(EOI_PHASE)
    return torch.tensor(phase, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def build_phase_masks(vocab: UnifiedVocab, device: torch.device | str, width: int | None = None) -> torch.Tensor:
    """bool [5 + marker rows + forced ids, width]: the ids allowed next in each phase (width = the LM's logits,
    >= vocab_size; ids past the vocabulary, e.g. padded embedding rows, are never allowed), then, where the
    vocabulary has row markers, one table row per image row allowing that row's marker, then one row per forced
    id of an image span's prefix and suffix (span_tables indexes them). Built once, indexed each step."""
    row_ends = vocab.row_ends
    forced = (*vocab.image_prefix_ids, *vocab.image_suffix_ids)
    masks = torch.zeros(ROW_MARKER_MASKS + len(row_ends) + len(forced), width or vocab.vocab_size, dtype=torch.bool)
    masks[TEXT_PHASE, vocab.text_start:vocab.text_start + vocab.text_size] = True
    masks[TEXT_PHASE, vocab.eos_id] = True
    masks[TEXT_PHASE, vocab.boi_id] = True
    masks[CODE_PHASE, vocab.image_start:vocab.image_start + vocab.image_size] = True
    masks[ROW_END_PHASE, list(vocab.row_end_ids)] = True  # any marker; the loop picks the row's own table row
    masks[ROW_MARKER_MASKS + torch.arange(len(row_ends)), list(row_ends)] = True
    masks[ROW_MARKER_MASKS + len(row_ends) + torch.arange(len(forced)), list(forced)] = True
    masks[EOI_PHASE, vocab.eoi_id] = True
    masks[DONE_PHASE, vocab.pad_id] = True
    return masks.to(device)


def open_image_span(prompt_ids: Sequence[int], vocab: UnifiedVocab) -> int | None:
    """Tokens already emitted inside an image span the prompt leaves open (after its last <boi>), else None."""
    ids = list(prompt_ids)
    last_boi = max((i for i, t in enumerate(ids) if t == vocab.boi_id), default=-1)
    last_eoi = max((i for i, t in enumerate(ids) if t == vocab.eoi_id), default=-1)
    if last_boi <= last_eoi:
        return None
    return len(ids) - last_boi - 1
