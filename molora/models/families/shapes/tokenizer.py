"""UnifiedTokenizer: text <-> unified ids for the embedded model (byte-level BPE + image code ids).

One id space (models/engine/vocab.py): specials `<pad>=0 <bos>=1 <eos>=2 <boi>=3 <eoi>=4`, then the BPE text tokens,
then the image codebook (code c has id `vocab.image_start + c`).  The `tokenizers` model in tokenizer.json holds the
specials and the text tokens, so its ids *are* unified ids; image codes live after it and never pass through BPE.

Byte-level BPE with the full 256-byte alphabet means any Unicode string (emoji, control characters, the empty
string, megabytes of text) encodes, and decodes back to itself.  User text that happens to spell `<boi>` is encoded
as plain text, never as the special token, so a prompt cannot open an image span by typing its name.

    tok = UnifiedTokenizer.train(texts, text_vocab_size=768, image_size=512)
    ids = tok.encode_text("a red circle")          # list[int], text ids only
    tok.decode_text(ids) == "a red circle"
    tok.save("assets/model"); tok = UnifiedTokenizer.load("assets/model")
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from molora.models.engine.vocab import UnifiedVocab, VocabError
from molora.routing.errors import MoLoRAError

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<boi>", "<eoi>")
TOKENIZER_FILE = "tokenizer.json"
VOCAB_FILE = "vocab.json"


class TokenizerError(MoLoRAError):
    """A tokenizer file, vocabulary or id sequence that does not fit the unified id layout."""


def _build_backend(texts: Iterable[str], text_vocab_size: int, min_frequency: int) -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=text_vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # first, so they get ids 0..4
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no input can fail
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


class UnifiedTokenizer:
    """Text and image ids of one model. `vocab` describes the ranges; `backend` is the `tokenizers` BPE."""

    def __init__(self, backend: Tokenizer, vocab: UnifiedVocab) -> None:
        self.backend = backend
        self.vocab = vocab
        self._check()
        # Prompts are text: a literal "<boi>" typed by a user must not become the special token.
        self.backend.encode_special_tokens = True
        # ids are exactly the text's: a tokenizer.json's padding (Fixed 2**33 aborted the process on the first
        # encode) or truncation (silently cut prompts) never applies
        self.backend.no_padding()
        self.backend.no_truncation()

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        *,
        text_vocab_size: int = 768,
        image_size: int = 512,
        image_grid: tuple[int, int] = (16, 16),
        min_frequency: int = 2,
        row_markers: bool = False,
    ) -> UnifiedTokenizer:
        """Train a byte-level BPE on `texts` and lay out the unified vocabulary around it.

        `text_vocab_size` counts the specials and the 256 byte tokens too (so it must be > 261); the
        trainer stops earlier when the corpus has no more merges of `min_frequency`. `row_markers` appends one
        marker id per image row after the codebook (UnifiedVocab.with_row_markers).
        """
        if text_vocab_size < len(SPECIAL_TOKENS) + 256:
            raise TokenizerError(f"text_vocab_size={text_vocab_size} is too small: byte-level BPE needs at least "
                                 f"{len(SPECIAL_TOKENS) + 256} ids (5 specials + 256 bytes)")
        if image_size < 1:
            raise TokenizerError(f"image_size must be >= 1, got {image_size}")
        backend = _build_backend(texts, text_vocab_size, min_frequency)
        n_text_ids = backend.get_vocab_size(with_added_tokens=True)
        ids = {name: backend.token_to_id(name) for name in SPECIAL_TOKENS}
        vocab = UnifiedVocab(
            vocab_size=n_text_ids + image_size,
            text_start=len(SPECIAL_TOKENS),
            text_size=n_text_ids - len(SPECIAL_TOKENS),
            image_start=n_text_ids,
            image_size=image_size,
            pad_id=ids["<pad>"], bos_id=ids["<bos>"], eos_id=ids["<eos>"],
            boi_id=ids["<boi>"], eoi_id=ids["<eoi>"],
            image_grid=tuple(image_grid),
            special_tokens=dict(ids),
        )
        if row_markers:
            vocab = vocab.with_row_markers()
        log.info("trained BPE: %d text ids (+5 specials), %d image ids, vocab %d",
                 vocab.text_size, image_size, vocab.vocab_size)
        return cls(backend, vocab)

    @classmethod
    def load(cls, model_dir: str | Path) -> UnifiedTokenizer:
        """Read `tokenizer.json` and `vocab.json` from a model directory and check that they agree."""
        model_dir = Path(model_dir)
        tok_path, vocab_path = model_dir / TOKENIZER_FILE, model_dir / VOCAB_FILE
        for path in (tok_path, vocab_path):
            if not path.is_file():
                raise TokenizerError(f"{path} is missing: a model directory needs {TOKENIZER_FILE} and {VOCAB_FILE}")
        try:
            backend = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{tok_path} is not a valid tokenizers file: {exc}") from exc
        try:
            vocab = UnifiedVocab.load(vocab_path)
        except (ValueError, TypeError, VocabError) as exc:
            raise TokenizerError(f"{vocab_path} is not a valid UnifiedVocab file: {exc}") from exc
        return cls(backend, vocab)

    def save(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(model_dir / TOKENIZER_FILE))
        self.vocab.save(model_dir / VOCAB_FILE)

    def _check(self) -> None:
        v = self.vocab
        for index, name in enumerate(SPECIAL_TOKENS):
            token_id = self.backend.token_to_id(name)
            if token_id != index or v.special_tokens.get(name, index) != index:
                raise TokenizerError(f"special token {name} must have id {index}, tokenizer has {token_id}")
        if (v.pad_id, v.bos_id, v.eos_id, v.boi_id, v.eoi_id) != (0, 1, 2, 3, 4):
            raise TokenizerError("vocab.json must put <pad> <bos> <eos> <boi> <eoi> at ids 0..4")
        n_text_ids = self.backend.get_vocab_size(with_added_tokens=True)
        if v.text_start != len(SPECIAL_TOKENS) or v.text_start + v.text_size != n_text_ids:
            raise TokenizerError(f"vocab.json text range [{v.text_start}, {v.text_start + v.text_size}) does not "
                                 f"match the {n_text_ids} ids of tokenizer.json")
        if v.image_start < n_text_ids:
            raise TokenizerError(f"image_start={v.image_start} overlaps the {n_text_ids} tokenizer ids")

    # --- text ---------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Text ids of `text` (no <bos>/<eos>). Never fails on a `str`; the empty string gives []."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode_text expects a str, got {type(text).__name__}")
        if not text:
            return []
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        for text in texts:
            if not isinstance(text, str):
                raise TokenizerError(f"encode_batch expects strings, got {type(text).__name__}")
        return [enc.ids for enc in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode_text(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The text of `ids`; specials and image codes are skipped (they are not text).

        Ids outside the vocabulary raise TokenizerError.  A prefix that ends inside a multi-byte character
        decodes that character as U+FFFD; stream by decoding the whole text so far and diffing.
        """
        ids = self._as_id_list(ids)
        text_end = self.vocab.text_start + self.vocab.text_size
        return self.backend.decode([i for i in ids if self.vocab.text_start <= i < text_end],
                                   skip_special_tokens=True)

    def token_piece(self, token_id: int) -> str:
        """A short readable name of one id, for routing maps: the text it decodes to, `<boi>`, or `<img:c>`."""
        (token_id,) = self._as_id_list([token_id])
        if token_id < self.vocab.text_start:
            return SPECIAL_TOKENS[token_id] if token_id < len(SPECIAL_TOKENS) else f"<special:{token_id}>"
        if self.vocab.is_image_code(token_id):
            return f"<img:{token_id - self.vocab.image_start}>"
        if self.vocab.is_row_end(token_id):
            return "<eol>" if len(self.vocab.row_end_ids) == 1 else f"<row:{self.vocab.row_end_ids.index(token_id)}>"
        if token_id >= self.vocab.text_start + self.vocab.text_size:
            return f"<unused:{token_id}>"
        return self.backend.decode([token_id], skip_special_tokens=False)

    # --- image spans --------------------------------------------------------------------------
    def image_ids(self, codes: torch.Tensor) -> list[int]:
        """Unified ids of one image's codes ([rows, cols] or flat), row-major, each row followed by its row
        marker where the vocabulary has them; without <boi>/<eoi>."""
        rows, cols = self.vocab.image_grid
        codes = torch.as_tensor(codes).reshape(-1)
        if codes.numel() != rows * cols:
            raise TokenizerError(f"an image has {rows}x{cols} codes, got {codes.numel()}")
        return self.image_ids_batch(codes.reshape(1, rows, cols))[0]

    def image_ids_batch(self, codes: torch.Tensor) -> list[list[int]]:
        """image_ids of a batch of images' codes [N, rows, cols] (one tensor pass: training data uses it)."""
        v = self.vocab
        codes = torch.as_tensor(codes).long().cpu()
        if codes.dim() != 3 or tuple(codes.shape[1:]) != tuple(v.image_grid):
            raise TokenizerError(f"codes must have shape [N, {v.image_grid[0]}, {v.image_grid[1]}], "
                                 f"got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= v.image_size):
            raise TokenizerError(f"image codes must lie in [0, {v.image_size}), got "
                                 f"[{int(codes.min())}, {int(codes.max())}]")
        ids = codes + v.image_start
        if v.row_end_ids:
            markers = torch.tensor(v.row_ends, dtype=torch.long)
            ids = torch.cat([ids, markers.expand(codes.shape[0], -1)[:, :, None]], dim=2)
        return ids.reshape(codes.shape[0], -1).tolist()

    def image_span(self, codes: torch.Tensor) -> list[int]:
        """`<boi>` + image ids + `<eoi>`."""
        return [self.vocab.boi_id, *self.image_ids(codes), self.vocab.eoi_id]

    def codes_from_ids(self, ids: Iterable[int] | torch.Tensor) -> torch.Tensor:
        """LongTensor [rows, cols] of codebook indices from one image's unified ids, as image_ids lays them out
        (row markers included where the vocabulary has them; no <boi>/<eoi>)."""
        v = self.vocab
        rows, cols = v.image_grid
        ids = torch.tensor(self._as_id_list(ids), dtype=torch.long)
        if ids.numel() != v.tokens_per_image:
            raise TokenizerError(f"an image span holds {v.tokens_per_image} ids ({rows}x{cols} codes"
                                 f"{' and a marker after each row' if v.row_end_ids else ''}), got {ids.numel()}")
        grid = ids.reshape(rows, -1)
        if v.row_end_ids:
            expected = torch.tensor(v.row_ends)
            if not torch.equal(grid[:, -1], expected):
                raise TokenizerError("an image span must end each row with its row marker "
                                     f"{expected.tolist()}, got {grid[:, -1].tolist()}")
            grid = grid[:, :-1]
        if not all(v.is_image_code(int(i)) for i in (grid.min(), grid.max())):
            raise TokenizerError(f"ids of an image must all be image codes [{v.image_start}, "
                                 f"{v.image_start + v.image_size})")
        return grid - v.image_start

    def _as_id_list(self, ids: Iterable[int] | torch.Tensor) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.vocab.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.vocab.vocab_size})")
        return out

    def __len__(self) -> int:
        return self.vocab.vocab_size

    def __repr__(self) -> str:
        v = self.vocab
        return (f"UnifiedTokenizer(vocab_size={v.vocab_size}, text={v.text_size}, "
                f"image={v.image_size} at {v.image_start}, grid={v.image_grid})")


def build_tiny_tokenizer(
    texts: Sequence[str] | None = None,
    *,
    text_vocab_size: int = 300,
    image_size: int = 32,
    image_grid: tuple[int, int] = (16, 16),
    row_markers: bool = False,
) -> UnifiedTokenizer:
    """A small tokenizer for tests: BPE over `texts` (a few shapes-world sentences by default)."""
    if texts is None:
        texts = [
            "a red circle in the top left", "two blue squares on a white background",
            "a green triangle at the center", "three yellow stars in the bottom right",
            "arr, a red circle be floatin' yonder", "draw a purple square in the middle",
        ] * 4
    return UnifiedTokenizer.train(texts, text_vocab_size=text_vocab_size, image_size=image_size,
                                  image_grid=image_grid, min_frequency=1, row_markers=row_markers)
