"""Interleaved text-and-image decoding over one unified vocabulary (read top to bottom, like gpt-fast).

A sequence is text until the model emits `<boi>`; then exactly `vocab.tokens_per_image` image tokens follow
(codebook ids, plus a forced row marker after each row where the vocabulary has `row_end_ids`), then `<eoi>` is
forced and the sequence is text again; a sequence may hold several images and ends at `<eos>`.  The state machine
lives in small per-row tensors and only *masks logits*: an invalid id can never be sampled, nothing is
repaired afterwards.

Classifier-free guidance (image spans only) runs an unconditional stream `<bos> <boi> codes-so-far` for every
row *in the same batch* as the conditional rows: rows [0, B) are the prompts, rows [B, 2B) their unconditional
twins.  An unconditional row keeps its `<bos>` in the KV cache for the whole run; when its twin opens a new
image, the row masks out everything after that `<bos>` and restarts at position 1, so each step is still ONE
forward with one token per row.

Batching: prompts are left-padded (attention mask + explicit position ids); each row has its own router
(passed as a list to RoutedModel.forward) and finishes on its own; finished rows feed masked padding.

    decoder = InterleavedDecoder(routed_model, vocab, device="cpu")
    for step in decoder.generate([Request(prompt_ids, router)], GenerationConfig(seed=0)):
        step.tokens[0], step.adapters[0]      # the token of row 0 and the adapter that produced it
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from models.sampling import GenerationError, SamplingConfig, guide, sample
from models.vocab import IMAGE, UnifiedVocab

log = logging.getLogger(__name__)

# phases: what the NEXT token of a row may be
TEXT_PHASE, CODE_PHASE, ROW_END_PHASE, EOI_PHASE, DONE_PHASE = range(5)
ROW_MARKER_MASKS = 5  # mask table rows 5 + r: the end of image row r allows only row r's own marker
NO_TOKEN = -1  # Step.tokens entry of a row that had already finished
MAX_BEST_OF = 16


@dataclass
class GenerationConfig:
    """Settings of one generate call. Separate SamplingConfigs for text spans and image spans.

    cfg_scale: classifier-free guidance for image tokens (1.0 = off; the unconditional stream is then skipped).
    seed: None draws a fresh seed (recorded in the Document, so any output can be reproduced).
    max_images: cap on images generated per sequence (None = no cap, 0 = text only).
    start_image: append `<boi>` to the prompt, so the continuation starts with an image (text -> image).
    min_new_tokens: `<eos>` is masked until this many tokens were generated (as in transformers' generate).
    best_of: draw up to this many candidate documents and keep the first that passes `check` (models/best_of.py;
        1 = off). Candidate 0 is this config's own sample.
    check: the name of a registered check (models.best_of.CHECKS), e.g. "shapes_caption" for the embedded model.
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
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise GenerationError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_images is not None and (not isinstance(self.max_images, int) or self.max_images < 0):
            raise GenerationError(f"max_images must be None or an int >= 0, got {self.max_images!r}")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) \
                or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise GenerationError(f"min_new_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                                  f"got {self.min_new_tokens!r}")
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or not 1 <= self.best_of <= MAX_BEST_OF:
            raise GenerationError(f"best_of must be an int in [1, {MAX_BEST_OF}], got {self.best_of!r}")
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
    router: Any = None


@dataclass
class Step:
    """One decode step of the whole batch, on the host.

    tokens[b]: the token row b generated (NO_TOKEN once the row has finished).
    adapters[b]: the adapter active at the position that produced it (None = base model).
    """

    index: int
    tokens: list[int]
    adapters: list[str | None]
    ms: float


def build_phase_masks(vocab: UnifiedVocab, device: torch.device | str, width: int | None = None) -> torch.Tensor:
    """bool [5 + marker rows, width]: the ids allowed next in each phase (width = the LM's logits, >= vocab_size;
    ids past the vocabulary, e.g. padded embedding rows, are never allowed), then, where the vocabulary has row
    markers, one table row per image row allowing that row's marker. Built once, indexed each step."""
    row_ends = vocab.row_ends
    masks = torch.zeros(ROW_MARKER_MASKS + len(row_ends), width or vocab.vocab_size, dtype=torch.bool)
    masks[TEXT_PHASE, vocab.text_start:vocab.text_start + vocab.text_size] = True
    masks[TEXT_PHASE, vocab.eos_id] = True
    masks[TEXT_PHASE, vocab.boi_id] = True
    masks[CODE_PHASE, vocab.image_start:vocab.image_start + vocab.image_size] = True
    masks[ROW_END_PHASE, list(vocab.row_end_ids)] = True  # any marker; the loop picks the row's own table row
    masks[ROW_MARKER_MASKS + torch.arange(len(row_ends)), list(row_ends)] = True
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


def producing_slots(routing: Any, rows: int) -> torch.Tensor | None:
    """Slot [rows] active at the last position of each of the first `rows` sequences (top-1 for top-k routing)."""
    if routing is None or getattr(routing, "slots", None) is None:
        return None
    slots = routing.slots[:rows, -1]
    if slots.dim() == 2:  # top-k: the slot with the largest weight
        weights = getattr(routing, "weights", None)
        if weights is not None:
            best = weights[:rows, -1].argmax(dim=-1, keepdim=True)
            slots = slots.gather(1, best).squeeze(1)
        else:
            slots = slots[:, 0]
    return slots.long()


class InterleavedDecoder:
    """The decode loop of one model: owns the mask tables, runs batches of Requests, yields Steps.

    Stateless between calls (every generate() builds its own cache, masks and generator), so several
    threads may run generate() at once on one decoder.
    """

    def __init__(self, model: Any, vocab: UnifiedVocab, *, device: torch.device | str,
                 max_positions: int | None = None, logits_size: int | None = None) -> None:
        self.model = model
        self.vocab = vocab
        self.device = torch.device(device)
        self.max_positions = max_positions
        self.phase_masks = build_phase_masks(vocab, self.device, logits_size)
        # ids that belong to an image span as *inputs*: they are fed to the unconditional stream too
        self.feeds_uncond = vocab.modality_table(self.device) == IMAGE
        cols = vocab.image_grid[1]
        self.tokens_per_image = vocab.tokens_per_image
        self.row_period = cols + 1 if vocab.row_end_ids else 0

    # --- the steps ---------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                routers: Any) -> tuple[torch.Tensor, Any, Any]:
        """Run the prompts; returns (last-position logits [R,V], KV cache, routing)."""
        out = self.model(ids, routers=routers, attention_mask=attention_mask, position_ids=positions,
                         past_key_values=None, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.past_key_values, out.routing

    def decode_one_token(self, ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                         cache: Any, routers: Any) -> tuple[torch.Tensor, Any, Any]:
        """Feed one token per row; returns (logits [R,V], KV cache, routing)."""
        out = self.model(ids[:, None], routers=routers, attention_mask=attention_mask,
                         position_ids=positions[:, None], past_key_values=cache, use_cache=True)
        return out.logits[:, -1], out.past_key_values, out.routing

    def phase(self, in_image: torch.Tensor, image_pos: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        """Phase [B] of the next token from the per-row state (pure tensor ops, no host sync)."""
        phase = torch.where(image_pos >= self.tokens_per_image, EOI_PHASE, CODE_PHASE)
        if self.row_period:
            row_end = (image_pos % self.row_period) == self.row_period - 1
            phase = torch.where(row_end & (phase == CODE_PHASE), ROW_END_PHASE, phase)
        phase = torch.where(in_image, phase, TEXT_PHASE)
        return torch.where(finished, DONE_PHASE, phase)

    # --- the loop ----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], config: GenerationConfig) -> Iterator[Step]:
        """Decode all requests together; yields one Step per generated position until every row is done."""
        vocab, device = self.vocab, self.device
        B = len(requests)
        if B == 0:
            raise GenerationError("generate needs at least one prompt")
        prompts = [list(r.prompt_ids) for r in requests]
        for ids in prompts:
            if not ids:
                raise GenerationError("a prompt must hold at least <bos>")
            if min(ids) < 0 or max(ids) >= vocab.vocab_size:
                raise GenerationError(f"prompt ids must lie in [0, {vocab.vocab_size})")
        P, max_new = max(map(len, prompts)), config.max_new_tokens
        if self.max_positions is not None and P + max_new > self.max_positions:
            raise GenerationError(f"prompt of {P} tokens + max_new_tokens={max_new} exceeds the model's "
                                  f"{self.max_positions} positions")
        open_spans = [open_image_span(ids, vocab) for ids in prompts]
        for done in open_spans:
            if done is not None and done > self.tokens_per_image:
                raise GenerationError(f"a prompt's open image span already holds {done} tokens, more than "
                                      f"the {self.tokens_per_image} of one image")

        use_cfg = config.uses_cfg
        R = 2 * B if use_cfg else B
        total = P + max_new
        # host-side layout of the prefill (one transfer each)
        ids = torch.full((R, P), vocab.pad_id, dtype=torch.long)
        positions = torch.zeros((R, P), dtype=torch.long)
        attn = torch.zeros((R, total), dtype=torch.bool)
        for b, prompt in enumerate(prompts):
            n = len(prompt)
            ids[b, P - n:] = torch.tensor(prompt)
            positions[b, P - n:] = torch.arange(n)
            attn[b, P - n:P] = True
        unc_bos_col = torch.zeros(B, dtype=torch.long)
        unc_next = torch.ones(B, dtype=torch.long)
        if use_cfg:
            for b, done in enumerate(open_spans):
                tail = [] if done is None else prompts[b][len(prompts[b]) - done - 1:]
                unc = [vocab.bos_id, *tail]
                n = len(unc)
                ids[B + b, P - n:] = torch.tensor(unc)
                positions[B + b, P - n:] = torch.arange(n)
                attn[B + b, P - n:P] = True
                unc_bos_col[b], unc_next[b] = P - n, n
        ids, positions, attn = ids.to(device), positions.to(device), attn.to(device)
        unc_bos_col, unc_next = unc_bos_col.to(device), unc_next.to(device)
        col_index = torch.arange(total, device=device)

        # per-row state machine
        in_image = torch.tensor([d is not None for d in open_spans], device=device)
        image_pos = torch.tensor([d or 0 for d in open_spans], device=device)
        images_done = in_image.long()
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        next_pos = torch.tensor([len(p) for p in prompts], device=device)

        # sampling settings per modality, indexed by "is this row in an image span"
        modes = (config.text, config.image)
        temperature = torch.tensor([m.temperature for m in modes], device=device)
        filters = any(m.filters for m in modes)
        top_k = torch.tensor([m.top_k for m in modes], device=device) if filters else None
        top_p = torch.tensor([m.top_p for m in modes], device=device) if filters else None
        seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2 ** 63)
        generator = torch.Generator(device=device).manual_seed(seed)

        routers = self._batch_routers([r.router for r in requests], use_cfg)
        alive = [True] * B
        t_start = time.perf_counter()
        logits, cache, routing = self.prefill(ids, attn[:, :P], positions, routers)
        for step in range(max_new):
            phase = self.phase(in_image, image_pos, finished)
            mask_row = phase
            if self.row_period:  # where image row r ends, only row r's marker
                mask_row = torch.where(phase == ROW_END_PHASE, ROW_MARKER_MASKS + image_pos // self.row_period, phase)
            allowed = self.phase_masks[mask_row]
            if max_new - step < self.tokens_per_image + 2:  # no room left for <boi> + image + <eoi>
                allowed[:, vocab.boi_id] = False
            elif config.max_images is not None:
                allowed[:, vocab.boi_id] &= images_done < config.max_images
            if step < config.min_new_tokens:
                allowed[:, vocab.eos_id] = False
            scores = logits[:B].float()
            if use_cfg:
                guided = (phase == CODE_PHASE) | (phase == ROW_END_PHASE)
                scores = torch.where(guided[:, None], guide(scores, logits[B:].float(), config.cfg_scale), scores)
            scores = scores.masked_fill(~allowed, float("-inf"))
            mode = (phase != TEXT_PHASE).long()
            token = sample(scores, temperature[mode], None if top_k is None else top_k[mode],
                           None if top_p is None else top_p[mode], generator)

            # advance the state machine
            is_boi = token == vocab.boi_id
            image_pos = torch.where(is_boi, 0, image_pos + in_image.long())
            in_image = (in_image | is_boi) & (token != vocab.eoi_id)
            images_done = images_done + is_boi.long()
            finished = finished | (token == vocab.eos_id)

            # one host transfer per step: the tokens (streaming needs them) and the producing adapters
            slots = producing_slots(routing, B)
            host = torch.cat([token, slots if slots is not None else torch.full_like(token, -1)]).tolist()
            names = getattr(routing, "slot_names", None) or {}
            tokens = [host[b] if alive[b] else NO_TOKEN for b in range(B)]
            adapters = [names.get(host[B + b]) if alive[b] else None for b in range(B)]
            now = time.perf_counter()
            yield Step(step, tokens, adapters, (now - t_start) * 1000.0)
            t_start = now
            alive = [a and t != vocab.eos_id for a, t in zip(alive, tokens)]
            if not any(alive) or step == max_new - 1:
                break

            # feed the sampled tokens: conditional rows, then their unconditional twins
            col = P + step
            live = ~finished
            attn[:B, col] = live
            feed = torch.where(live, token, vocab.pad_id)
            pos = next_pos
            next_pos = next_pos + 1
            if use_cfg:
                unc_on = self.feeds_uncond[token] & live
                # a new image: forget the previous span, keep <bos>
                keep = (col_index[None, :col] <= unc_bos_col[:, None]) | ~is_boi[:, None]
                attn[B:, :col] &= keep
                attn[B:, col] = unc_on
                unc_pos = torch.where(is_boi, 1, unc_next)
                unc_next = unc_pos + 1
                feed = torch.cat([feed, torch.where(unc_on, token, vocab.pad_id)])
                pos = torch.cat([pos, unc_pos])
            logits, cache, routing = self.decode_one_token(feed, attn[:, :col + 1], pos, cache, routers)

    def _batch_routers(self, routers: list[Any], use_cfg: bool) -> Any:
        """What RoutedModel.forward gets: None when no row routes, the router itself when every row shares one
        (cheapest: no per-row grouping), else one per row; unconditional twins use their row's router."""
        if all(r is None for r in routers):
            return None
        if all(r is routers[0] for r in routers):
            return routers[0]
        return routers + routers if use_cfg else routers
