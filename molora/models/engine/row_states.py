"""The per-row decode state of the serving engine, as device tensors of `max_rows` entries written in place.

Each running request owns one row (two with classifier-free guidance: its prompt row and an unconditional
"twin" row `<bos> <boi> codes-so-far`).  For every row the tables hold what the next decode step feeds (token
and position), which adapter slot each modality routes to, and, for prompt rows, the interleaved state machine
(DESIGN.md §7: text until `<boi>`, then exactly one image grid with its row markers, then a forced `<eoi>`) and
the request's own sampling settings.  Rows join and leave at step boundaries; one step samples every prompt
row with pure tensor ops, whatever mix of text rows, image rows and settings the batch holds.

Row positions are the row's own: a request's prompt starts at position 0 of its row whatever the other rows
hold, so a row decodes exactly as it would alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from molora.models.engine.generation import (
    CODE_PHASE,
    ROW_END_PHASE,
    TEXT_PHASE,
    GenerationConfig,
    build_phase_masks,
    span_tables,
)
from molora.models.engine.sampling import guide, sample
from molora.models.engine.vocab import IMAGE, UnifiedVocab

NO_LIMIT = 2 ** 62  # max_images of a request that sets none


class Draw(NamedTuple):
    """What choosing a step's tokens must compute, fixed while the running batch is (a captured step is kept per
    width and Draw): `sampling` some row samples (else each token is its row's argmax of the masked, guided
    logits, with no softmax and no noise: what sample() gives greedy rows); `filters` some sampling row uses
    top-k / top-p; `guided` some row has a CFG twin (else no twin logits are read)."""

    sampling: bool
    filters: bool
    guided: bool

    @classmethod
    def of(cls, configs: list[GenerationConfig]) -> Draw:
        sampling = any(c.text.temperature > 0 or c.image.temperature > 0 for c in configs)
        return cls(sampling, sampling and any(c.text.filters or c.image.filters for c in configs),
                   any(c.uses_cfg for c in configs))


class RowStates:
    """Decode tables for `max_rows` rows of one engine (see the module docstring)."""

    def __init__(self, vocab: UnifiedVocab, max_rows: int, device: torch.device, logits_size: int,
                 max_len: int | None = None) -> None:
        self.vocab, self.max_rows, self.device = vocab, max_rows, device
        # the last position a row may write: a row that has just finished can decode once more before the engine
        # frees it (the engine launches a step before it reads the previous one's tokens), at most here
        self.last_pos = (max_len - 1) if max_len is not None else None
        self.phase_masks = build_phase_masks(vocab, device, logits_size)
        self.modality = vocab.modality_table(device).long()  # input id -> TEXT / IMAGE
        self.feeds_uncond = self.modality == IMAGE  # ids an unconditional twin is fed (image-span inputs)
        self.tokens_per_image = vocab.tokens_per_image
        # phase and mask-table row of each position of an image span (forced prefix, codes, row markers, suffix, <eoi>)
        self.span_phase, self.span_mask = (t.to(device) for t in span_tables(vocab))

        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(max_rows, *shape, dtype=dtype, device=device)

        long, flt, bool_ = torch.long, torch.float32, torch.bool
        # what the next decode step feeds: token, the position it is written at, and (twin rows) whether it is
        # a real token or a scratch write at the row's next free position
        self.feed_ids = torch.full((max_rows,), vocab.pad_id, dtype=long, device=device)
        self.feed_pos = zeros(long)
        self.real = zeros(bool_)
        self.row_slots = torch.full((max_rows, 2), -1, dtype=long, device=device)  # [row, TEXT/IMAGE] -> slot
        # the state machine and settings of prompt rows
        self.in_image, self.image_pos, self.images_done = zeros(bool_), zeros(long), zeros(long)
        self.n_new, self.max_new, self.min_new, self.max_images = zeros(long), zeros(long), zeros(long), zeros(long)
        self.temperature, self.top_k, self.top_p = zeros(flt, 2), zeros(long, 2), torch.ones(
            max_rows, 2, dtype=flt, device=device)
        self.cfg_scale = torch.ones(max_rows, dtype=flt, device=device)
        self.guided = zeros(bool_)
        self.rows = torch.arange(max_rows, device=device)
        self.twin = self.rows.clone()  # the twin row of a guided row (else the row itself)
        self.parent = self.rows.clone()  # the prompt row of a twin row (else the row itself)
        self.prompt = zeros(bool_)  # a running request's prompt row (what a decode step advances)
        self.twin_start = torch.ones(max_rows, dtype=long, device=device)  # where a twin's <boi> goes: its prefix

    # --- rows joining and leaving -------------------------------------------------------------------------
    def start(self, row: int, config: GenerationConfig, *, last_pos: int, open_span: int | None,
              slots: tuple[int, int], twin: int | None = None, twin_last_pos: int = 0,
              twin_prefix: int = 1) -> None:
        """Set up prompt row `row` (and its twin) after their prompts were written up to `last_pos` /
        `twin_last_pos`; `slots` are the (text, image) adapter slots the request holds (-1 = base model);
        `twin_prefix`: the twin's ids before a picture (<bos> and a negative prompt)."""
        rows = [row] if twin is None else [row, twin]
        for r, last in zip(rows, (last_pos, twin_last_pos)):
            self.feed_pos[r] = last  # the first sampled token goes to last + 1 (see `advance`)
            self.real[r] = True
            self.row_slots[r] = torch.tensor(slots, device=self.device)
        self.in_image[row] = open_span is not None
        self.image_pos[row] = open_span or 0
        self.images_done[row] = int(open_span is not None)
        self.n_new[row] = 0
        self.max_new[row] = config.max_new_tokens
        self.min_new[row] = config.min_new_tokens
        self.max_images[row] = NO_LIMIT if config.max_images is None else config.max_images
        modes = (config.text, config.image)
        self.temperature[row] = torch.tensor([m.temperature for m in modes], device=self.device)
        self.top_k[row] = torch.tensor([m.top_k for m in modes], device=self.device)
        self.top_p[row] = torch.tensor([m.top_p for m in modes], device=self.device)
        self.cfg_scale[row] = config.cfg_scale
        self.guided[row] = twin is not None
        self.twin[row] = row if twin is None else twin
        self.prompt[row] = True
        if twin is not None:
            self.twin_start[twin] = twin_prefix
            self.parent[twin] = row

    def clear(self, rows: list[int]) -> None:
        """Free rows: they feed padding at position 0 with no adapter until a new request takes them."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.feed_ids[index] = self.vocab.pad_id
        self.feed_pos[index] = 0
        self.row_slots[index] = -1
        self.guided[index] = False
        self.prompt[index] = False
        self.twin[index] = index
        self.parent[index] = index

    # --- one step --------------------------------------------------------------------------------------------
    def phase(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(phase [n], phase-mask table row [n]) of the next token of prompt rows `rows` (no host sync)."""
        image_pos = self.image_pos[rows].clamp(max=self.tokens_per_image)
        in_image = self.in_image[rows]
        phase = torch.where(in_image, self.span_phase[image_pos], TEXT_PHASE)
        mask_row = torch.where(in_image, self.span_mask[image_pos], TEXT_PHASE)  # a row's end: only its own marker
        return phase, mask_row

    def choose(self, rows: torch.Tensor, logits: torch.Tensor, uncond_logits: torch.Tensor | None,
               noise: torch.Tensor, draw: Draw) -> torch.Tensor:
        """Next token [n] of prompt rows `rows` from their logits [n, V] (twins' logits for guidance, or None
        when no row is guided) and Exp(1) noise [n, V] (read only when `draw.sampling`)."""
        vocab = self.vocab
        phase, mask_row = self.phase(rows)
        allowed = self.phase_masks[mask_row]
        n_new = self.n_new[rows]
        room = self.max_new[rows] - n_new >= self.tokens_per_image + 2  # <boi> + image + <eoi> still fit
        allowed[:, vocab.boi_id] &= room & (self.images_done[rows] < self.max_images[rows])
        allowed[:, vocab.eos_id] &= n_new >= self.min_new[rows]
        scores = logits.float()
        if uncond_logits is not None:
            guided = self.guided[rows] & ((phase == CODE_PHASE) | (phase == ROW_END_PHASE))
            mixed = guide(scores, uncond_logits.float(), self.cfg_scale[rows][:, None])
            scores = torch.where(guided[:, None], mixed, scores)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if not draw.sampling:
            return scores.argmax(dim=-1)
        mode = (phase != TEXT_PHASE).long()[:, None]
        temperature = self.temperature[rows].gather(1, mode).squeeze(1)
        top_k = self.top_k[rows].gather(1, mode).squeeze(1) if draw.filters else None
        top_p = self.top_p[rows].gather(1, mode).squeeze(1) if draw.filters else None
        if top_k is not None and top_p is not None and self.device.type == "cpu" and \
                not bool(((top_k > 0) | (top_p < 1.0)).any()):
            # no row filters in this step's phases (say, text with top_p and every row drawing a picture without):
            # skip filter_logits' sort, which leaves such rows as they are. (The CPU only: this reads the device.)
            top_k = top_p = None
        return sample(scores, temperature, top_k, top_p, noise=noise)

    def decode(self, width: int, logits: torch.Tensor, noise: torch.Tensor, draw: Draw
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step's (tokens [W], done [W]) for rows [0, W) from their logits [W, V] and Exp(1) noise
        [W, V], every running request's prompt row and twin moved past its token. Fixed shapes, whatever the batch
        holds (rows that are neither hold values nobody reads), so the engine captures it with the forward; every
        prompt row's numbers are those of choose / advance over it alone."""
        rows = self.rows[:width]
        tokens = self.choose(rows, logits, logits[self.twin[:width]] if draw.guided else None, noise, draw)
        return tokens, self.advance(width, tokens, self.prompt[:width])

    def advance(self, width: int, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Move the prompt rows marked in `active` [W] (of rows [0, W)) past `tokens` [W] (their next tokens;
        other entries unread) and set their next feeds and their twins'; returns done [W] (<eos> or the row's token
        budget spent; meaningful for active rows). Every other row is left as it is."""
        vocab = self.vocab
        rows = self.rows[:width]
        is_boi = tokens == vocab.boi_id
        in_image = self.in_image[:width]
        image_pos = self.image_pos[:width]
        n_new = self.n_new[:width] + 1
        moved = [
            (self.image_pos, torch.where(is_boi, 0, image_pos + in_image.long())),
            (self.in_image, (in_image | is_boi) & (tokens != vocab.eoi_id)),
            (self.images_done, self.images_done[:width] + is_boi.long()),
            (self.n_new, n_new),
            (self.feed_ids, tokens),
            (self.feed_pos, self._bounded(self.feed_pos[:width] + 1)),
        ]
        # a twin sees only image spans: `<bos>` (+ a negative prompt) then the current span; a new image restarts
        # it right after that prefix
        parent = self.parent[:width]
        twins = (parent != rows) & active[parent]
        token = tokens[parent]
        feeds = self.feeds_uncond[token]
        after = self._bounded(self.feed_pos[:width] + self.real[:width].long())
        twin_pos = torch.where(token == vocab.boi_id, self.twin_start[:width], after)
        twin_ids = torch.where(feeds, token, vocab.pad_id)
        for table, value in moved:  # (the twins' new feeds are read from the tables before any write)
            table[:width] = torch.where(active, value, table[:width])
        self.feed_pos[:width] = torch.where(twins, twin_pos, self.feed_pos[:width])
        self.feed_ids[:width] = torch.where(twins, twin_ids, self.feed_ids[:width])
        self.real[:width] = torch.where(twins, feeds, self.real[:width])
        return (tokens == vocab.eos_id) | (n_new >= self.max_new[:width])

    def tables(self) -> list[torch.Tensor]:
        """The tables a decode step writes (advance), which a capture's warm-up must leave as it found them."""
        return [self.image_pos, self.in_image, self.images_done, self.n_new, self.feed_ids, self.feed_pos, self.real]

    def advance_rows(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """advance for prompt rows `rows` [n] (a prefill's) with their tokens [n]: their done [n]."""
        full = torch.full((self.max_rows,), self.vocab.pad_id, dtype=torch.long, device=self.device)
        full[rows] = tokens
        active = torch.zeros(self.max_rows, dtype=torch.bool, device=self.device)
        active[rows] = True
        return self.advance(self.max_rows, full, active)[rows]

    def _bounded(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions kept inside a row (only a finished row's one extra step could pass its last position)."""
        return positions if self.last_pos is None else positions.clamp_(max=self.last_pos)

    def decode_inputs(self, width: int, columns: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [W, 1], positions [W, 1], additive attention mask [W, 1, 1, L], slots [W]) of rows [0, W):
        each row sees the columns up to the position it writes now, and routes by its slot table."""
        ids, pos, slots = self.decode_feeds(width)
        ids, pos = ids[:, None], pos[:, None]
        mask = torch.where(columns[None, :] <= pos, 0.0, float("-inf")).to(dtype)[:, None, None, :]
        return ids, pos, mask, slots

    def decode_feeds(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [W], positions [W], slots [W]) of rows [0, W): what each row feeds, where, and its adapter slot."""
        ids = self.feed_ids[:width]
        return ids, self.feed_pos[:width], self.row_slots[:width].gather(1, self.modality[ids][:, None]).view(-1)
