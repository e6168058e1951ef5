"""The unified vocabulary: one id space holding specials, text tokens and image codebook ids.

Layout of the embedded model (real checkpoints map their own ranges onto the same object):

    [0, num_special)                      specials: <pad> <bos> <eos> <boi> <eoi> ...
    [text_start, text_start + text_size)  BPE text tokens
    [image_start, image_start + image_size)  image codebook ids (code c has id image_start + c)
    row_end_ids                           row markers after the image codes (the embedded model has one per
                                          row, <row:0>..<row:15>, so each code knows its row; Emu3 has one
                                          shared end-of-line marker)

Routing rule (DESIGN.md §2): a position is routed by the modality of the token it *predicts*.
`<boi>` predicts the first image code and every image code predicts the next one (the last predicts
`<eoi>`, which generation forces anyway), so a lookup table over the *input* id suffices:
`<boi>`, image codes and row markers -> image, everything else -> text.  Being a pure per-token lookup,
prefill and token-by-token decode route identically.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from molora.kernels.errors import MoLoRAError  # the bottom layer: routing/ imports this module (no cycle)
from molora.routing.modality import IMAGE, MODALITY_NAMES, TEXT  # noqa: F401  (routers read the table built here)


class VocabError(MoLoRAError, ValueError):
    """A vocabulary layout that is inconsistent or does not fit a model (a ValueError too)."""


@dataclass(frozen=True)
class UnifiedVocab:
    vocab_size: int
    text_start: int
    text_size: int
    image_start: int
    image_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    boi_id: int
    eoi_id: int
    image_grid: tuple[int, int]  # (rows, cols) of codebook ids in one image span
    # markers after each row of codes: () none; (id,) one shared marker (Emu3's end of line); or one id per row,
    # so that row k ends with row_end_ids[k] and every later code can see which row it is in
    row_end_ids: tuple[int, ...] = ()
    special_tokens: dict[str, int] = field(default_factory=dict)
    # forced ids of every image span after <boi> and after the grid, before <eoi> (Emu3: the size as text
    # "H*W" + <|image token|>, and <|extra_201|> end of frame); () for the embedded model
    image_prefix_ids: tuple[int, ...] = ()
    image_suffix_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_field_types(self)
        object.__setattr__(self, "image_grid", tuple(self.image_grid))
        object.__setattr__(self, "row_end_ids", tuple(int(i) for i in self.row_end_ids))
        object.__setattr__(self, "image_prefix_ids", tuple(int(i) for i in self.image_prefix_ids))
        object.__setattr__(self, "image_suffix_ids", tuple(int(i) for i in self.image_suffix_ids))
        for token_id in (*self.image_prefix_ids, *self.image_suffix_ids):
            if not 0 <= token_id < self.vocab_size or self.is_image_code(token_id) \
                    or token_id in (self.boi_id, self.eoi_id, self.eos_id):
                raise VocabError(f"forced image-span id {token_id} must lie in [0, {self.vocab_size}) outside the "
                                 "image codes, <boi>, <eoi> and <eos>")
        if self.text_start < 0 or self.text_start + self.text_size > self.vocab_size:
            raise VocabError(f"text range [{self.text_start}, {self.text_start + self.text_size}) "
                             f"does not fit vocab_size {self.vocab_size}")
        if self.image_start < 0 or self.image_start + self.image_size > self.vocab_size:
            raise VocabError(f"image range [{self.image_start}, {self.image_start + self.image_size}) "
                             f"does not fit vocab_size {self.vocab_size}")
        text_end, image_end = self.text_start + self.text_size, self.image_start + self.image_size
        if self.text_start < image_end and self.image_start < text_end:
            raise VocabError("text and image id ranges overlap")
        for name in ("pad_id", "bos_id", "eos_id", "boi_id", "eoi_id"):
            token_id = getattr(self, name)
            if not 0 <= token_id < self.vocab_size:
                raise VocabError(f"{name}={token_id} is outside the vocabulary of size {self.vocab_size}")
            if self.is_image_code(token_id):
                raise VocabError(f"{name}={token_id} lies inside the image codebook range")
        rows = self.image_grid[0]
        if len(self.row_end_ids) not in (0, 1, rows):
            raise VocabError(f"row_end_ids holds {len(self.row_end_ids)} ids; expected none, one shared marker or "
                             f"one per row ({rows})")
        specials = {self.pad_id, self.bos_id, self.eos_id, self.boi_id, self.eoi_id}
        for token_id in self.row_end_ids:
            if not 0 <= token_id < self.vocab_size or self.is_image_code(token_id) or token_id in specials \
                    or self.text_start <= token_id < text_end:
                raise VocabError(f"row marker {token_id} must be an id of its own in [0, {self.vocab_size}), "
                                 "outside the text and image ranges and the specials")
        if len(set(self.row_end_ids)) != len(self.row_end_ids):
            raise VocabError(f"row_end_ids repeat an id: {list(self.row_end_ids)}")

    # --- id ranges ---------------------------------------------------------------------------
    @property
    def tokens_per_image(self) -> int:
        """Ids between <boi> and <eoi>: the forced prefix, the grid (and its row markers), the forced suffix."""
        rows, cols = self.image_grid
        return len(self.image_prefix_ids) + rows * (cols + (1 if self.row_end_ids else 0)) + len(self.image_suffix_ids)

    @property
    def image_span_tokens(self) -> int:
        """What one whole image costs in generated tokens: <boi>, the codes (and row markers), <eoi>."""
        return self.tokens_per_image + 2

    def image_span_note(self) -> str:
        """That one number, explained: what the app's slider and progress bar and the API's errors say."""
        rows, cols = self.image_grid
        row_ends = f" and {rows} row ends" if self.row_end_ids else ""
        forced = len(self.image_prefix_ids) + len(self.image_suffix_ids)
        fixed = f", {forced} fixed header and trailer tokens" if forced else ""
        return f"an image is {self.image_span_tokens} tokens: <boi>, {rows * cols} codes{row_ends}{fixed}, <eoi>"

    def row_end_id(self, row: int) -> int:
        """The marker that closes row `row` of an image (the vocabulary must have row markers)."""
        return self.row_end_ids[row % len(self.row_end_ids)]

    @property
    def row_ends(self) -> tuple[int, ...]:
        """The marker closing each image row, row by row (the shared marker repeated); () without markers."""
        return tuple(self.row_end_id(r) for r in range(self.image_grid[0])) if self.row_end_ids else ()

    def is_row_end(self, token_id: int) -> bool:
        return token_id in self.row_end_ids

    def is_image_code(self, token_id: int) -> bool:
        return self.image_start <= token_id < self.image_start + self.image_size

    def modality_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int8[vocab_size]: the modality (TEXT/IMAGE) that a position holding this *input* id routes to."""
        table = torch.full((self.vocab_size,), TEXT, dtype=torch.int8)
        table[self.image_start:self.image_start + self.image_size] = IMAGE
        table[self.boi_id] = IMAGE
        table[list(self.row_end_ids)] = IMAGE
        text_end = self.text_start + self.text_size
        forced = [i for i in (*self.image_prefix_ids, *self.image_suffix_ids) if not self.text_start <= i < text_end]
        table[forced] = IMAGE  # span markers of their own (Emu3's <|image token|>, end of frame); forced digits stay text
        return table.to(device) if device is not None else table

    def with_row_markers(self) -> UnifiedVocab:
        """This layout plus one marker per image row, appended after the last id (`<row:0>`, `<row:1>`, ...)."""
        if self.row_end_ids:
            raise VocabError("this vocabulary already has row markers")
        rows = self.image_grid[0]
        ids = tuple(range(self.vocab_size, self.vocab_size + rows))
        names = {**self.special_tokens, **{f"<row:{k}>": i for k, i in enumerate(ids)}}
        return replace(self, vocab_size=self.vocab_size + rows, row_end_ids=ids, special_tokens=names)

    # --- persistence -------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> UnifiedVocab:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise VocabError(f"{path} is not a readable JSON file: {exc}") from exc
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            raise VocabError(f"{path} must hold a JSON object with the UnifiedVocab fields {sorted(names)}; got "
                             f"{sorted(set(data) - names) if isinstance(data, dict) else type(data).__name__}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING
                         and f.default_factory is MISSING)
        if missing:
            raise VocabError(f"{path} lacks the fields {missing}")
        return cls(**data)


MAX_VOCAB_SIZE = 2 ** 31 - 1  # token ids are int32 on the routing path


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_field_types(vocab: UnifiedVocab) -> None:
    """Every field of the declared type before any arithmetic on it (a vocab.json is user input)."""
    for f in fields(vocab):
        value, kind = getattr(vocab, f.name), str(f.type)
        if kind == "int":
            ok, want = _is_int(value), "a whole number"
        elif kind.startswith("tuple[int"):
            ok = isinstance(value, (list, tuple)) and all(_is_int(i) for i in value)
            want = "a list of whole numbers"
            if f.name == "image_grid":
                ok, want = ok and len(value) == 2 and min(value) >= 1, "[rows, cols], two whole numbers >= 1"
        elif kind.startswith("dict[str, int]"):
            ok = isinstance(value, dict) and all(isinstance(k, str) and _is_int(i) for k, i in value.items())
            want = "an object {token: id}"
        else:
            continue
        if not ok:
            raise VocabError(f"vocabulary field {f.name}={value!r:.80} is not {want}")
    if not 1 <= vocab.vocab_size <= MAX_VOCAB_SIZE:
        raise VocabError(f"vocab_size={vocab.vocab_size} must lie in [1, {MAX_VOCAB_SIZE}]")
