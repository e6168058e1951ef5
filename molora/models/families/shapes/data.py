"""Training data for the embedded model, drawn from the shapes world, and small training utilities.

Everything is seeded: chunk i of a data set is drawn from `random.Random(f"{seed}:{i}")`, so the same command
gives the same data on any machine, with any number of worker processes.

Images: `render_batch` -> uint8 [N,64,64,3].  Sequences (CONTRACTS.md "Sequence formats"), built from unified ids:
    text->image:  <bos> {instruction or caption} <boi> {256 codes} <eoi> <eos>     (text dropped 10%: CFG)
    image->text:  <bos> <boi> {256 codes} <eoi> {caption} <eos>
    interleaved:  <bos> {text} <boi> ... <eoi> {text} ... <eos>
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from molora.models.families.shapes import world

log = logging.getLogger(__name__)

CHUNK = 2000  # scenes per seeded chunk: the unit of parallel work


# ------------------------------------------------------------------------------------------ scenes


@dataclass(frozen=True)
class SceneSpec:
    """What to draw: split, the styles to cycle through, and whether backgrounds are random."""
    split: str = "train"
    styles: tuple[str, ...] = ("filled",)


def _chunk_scenes(args: tuple[str, int, int, SceneSpec]) -> list[world.Scene]:
    seed, index, n, spec = args
    rng = random.Random(f"{seed}:{spec.split}:{index}")
    return [world.sample_scene(rng, spec.split, style=rng.choice(spec.styles)) for _ in range(n)]


def _parallel(fn: Callable, jobs: list, workers: int) -> list:
    if workers <= 1 or len(jobs) <= 1:
        return [fn(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, jobs))


def sample_scenes(n: int, *, seed: int | str, spec: SceneSpec = SceneSpec(), workers: int = 1) -> list[world.Scene]:
    """`n` scenes, identical for the same (n, seed, spec) whatever `workers` is."""
    jobs = [(str(seed), i, min(CHUNK, n - i * CHUNK), spec) for i in range((n + CHUNK - 1) // CHUNK)]
    return [s for chunk in _parallel(_chunk_scenes, jobs, workers) for s in chunk]


def _render_chunk(scenes: list[world.Scene]) -> np.ndarray:
    return np.stack([world.render_array(s) for s in scenes]) if scenes else np.zeros((0, 64, 64, 3), np.uint8)


def render_batch(scenes: Sequence[world.Scene], *, workers: int = 1) -> np.ndarray:
    """uint8 [N, 64, 64, 3] renders of `scenes`."""
    chunks = [list(scenes[i:i + CHUNK]) for i in range(0, len(scenes), CHUNK)]
    return np.concatenate(_parallel(_render_chunk, chunks, workers)) if chunks else _render_chunk([])


def images_to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [N,H,W,3] -> float [N,3,H,W] in [-1, 1] (the VQ's pixel range)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB of images in [-1, 1] (quantised to 8 bits first, as a PNG would be)."""
    to8 = lambda t: ((t.float().clamp(-1, 1) + 1) * 127.5).round()  # noqa: E731
    mse = (to8(x) - to8(y)).pow(2).flatten(1).mean(1).clamp_min(1e-3)
    return 10 * torch.log10(255.0 ** 2 / mse)


# ------------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict) -> None:
    """Model + AdamW state + `meta` (step, ...) in ONE safetensors file (no pickle), written atomically."""
    path = Path(path)
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for pid, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"opt.{pid}.{key}"] = torch.as_tensor(value).contiguous().cpu()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})
    tmp.replace(path)


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore what save_checkpoint wrote into `model` and `optimizer`; returns meta."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
    tensors = load_file(str(path))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    opt = optimizer.state_dict()
    device = next(model.parameters()).device
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value if name == "step" else value.to(device)
    opt["state"] = state
    optimizer.load_state_dict(opt)
    return meta


def cycle_batches(n: int, batch_size: int, *, seed: int, generator_device: str = "cpu") -> Iterator[torch.Tensor]:
    """Endless seeded random permutations of range(n), cut into batches of indices."""
    gen = torch.Generator(device=generator_device).manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):
            yield perm[i:i + batch_size]


# ------------------------------------------------------------------------------------- text and sequences

KINDS = ("t2i_instruction", "t2i_caption", "i2t", "doc", "pirate_text")
# The base model writes plain text about pictures only.  It still reads (and can write) every word of the
# world: 5% of its sequences are text-only pirate sentences, "<bos> text <eos>", never next to a picture.
# Without them the output rows of pirate-only tokens ("Arr", "matey") are never trained as targets, and a LoRA on
# the linear layers alone cannot lift them: the first pirate adapter reached only p~0.01 on "Arr" after <eoi>.
BASE_MIX = {"t2i_instruction": 0.38, "t2i_caption": 0.14, "i2t": 0.29, "doc": 0.14, "pirate_text": 0.05}
# The adapters learn styles of pictures and of text about pictures: no text-only sequences.
ADAPTER_MIX = {"t2i_instruction": 0.40, "t2i_caption": 0.15, "i2t": 0.30, "doc": 0.15}


@dataclass(frozen=True)
class Example:
    """One training sequence before tokenisation: text parts and scenes, in order."""
    kind: str
    parts: tuple  # of str | world.Scene
    register: str = "plain"
    style: str = "filled"


def make_example(rng: random.Random, kind: str, *, split: str = "train", register: str = "plain",
                 style: str = "filled") -> Example:
    from molora.models.families.shapes import text

    if kind == "doc":
        return Example(kind, tuple(text.document(rng, split, register=register, style=style)), register, style)
    if kind == "pirate_text":  # text only: a pirate caption, or the text of a pirate document
        if rng.random() < 0.5:
            line = text.caption(world.sample_scene(rng, split), rng, "pirate")
        else:
            line = " ".join(p for p in text.document(rng, split, register="pirate") if isinstance(p, str))
        return Example(kind, (line,), "pirate", style)
    scene = world.sample_scene(rng, split, style=style)
    if kind == "t2i_instruction":  # instructions are always plain (the world has no pirate instructions)
        parts: tuple = (text.instruction(scene, rng), scene)
    elif kind == "t2i_caption":
        parts = (text.caption(scene, rng, register), scene)
    elif kind == "i2t":
        parts = (scene, text.caption(scene, rng, register))
    else:
        raise ValueError(f"unknown example kind {kind!r}; expected one of {KINDS}")
    return Example(kind, parts, register, style)


@dataclass(frozen=True)
class ExampleSpec:
    """A mixture: kind weights, and the (register, style, weight) combinations to draw from."""
    mix: tuple[tuple[str, float], ...] = tuple(BASE_MIX.items())
    looks: tuple[tuple[str, str, float], ...] = (("plain", "filled", 1.0),)
    split: str = "train"


def _chunk_examples(args: tuple[str, int, int, ExampleSpec]) -> list[Example]:
    seed, index, n, spec = args
    rng = random.Random(f"{seed}:ex:{index}")
    kinds, kind_w = zip(*spec.mix)
    looks, look_w = [(r, s) for r, s, _ in spec.looks], [w for *_, w in spec.looks]
    out = []
    for _ in range(n):
        register, style = rng.choices(looks, look_w)[0]
        out.append(make_example(rng, rng.choices(kinds, kind_w)[0], split=spec.split, register=register,
                                style=style))
    return out


def sample_examples(n: int, *, seed: int | str, spec: ExampleSpec = ExampleSpec(),
                    workers: int = 1) -> list[Example]:
    jobs = [(str(seed), i, min(CHUNK, n - i * CHUNK), spec) for i in range((n + CHUNK - 1) // CHUNK)]
    return [e for chunk in _parallel(_chunk_examples, jobs, workers) for e in chunk]


def text_corpus(n_scenes: int, *, seed: int | str, workers: int = 1) -> list[str]:
    """Every kind of text the world writes (captions in both registers, instructions, documents)."""
    spec = ExampleSpec(mix=tuple((k, 1.0) for k in KINDS if k != "pirate_text"),
                       looks=(("plain", "filled", 1.0), ("pirate", "filled", 1.0)))
    examples = sample_examples(n_scenes, seed=seed, spec=spec, workers=workers)
    return [p for e in examples for p in e.parts if isinstance(p, str)]


def example_scenes(examples: Sequence[Example]) -> list[world.Scene]:
    return [p for e in examples for p in e.parts if isinstance(p, world.Scene)]


def prompt_length(example: Example, seq: Sequence[int], vocab) -> int:
    """Leading ids of an encoded example that are context, not targets: a text->image example's text up to <boi>,
    an image->text example's picture through <eoi> (both are what the user gives); nothing for the other kinds."""
    if example.kind.startswith("t2i"):
        return seq.index(vocab.boi_id)
    if example.kind == "i2t":
        return seq.index(vocab.eoi_id) + 1
    return 0


def encode_examples(examples: Sequence[Example], tokenizer, codes: torch.Tensor, *, seed: int,
                    cfg_dropout: float = 0.1, max_len: int = 1024) -> list[list[int]]:
    """Unified-id sequences. `codes` [n_scenes, rows, cols] are the VQ codes of example_scenes(examples),
    in order.  Text-to-image examples lose their text 10% of the time (the CFG unconditional stream);
    sequences longer than max_len are dropped (the world's longest document is ~850 ids)."""
    rng = random.Random(f"{seed}:cfg")
    vocab = tokenizer.vocab
    image_ids = iter(tokenizer.image_ids_batch(codes))
    texts = [p for e in examples for p in e.parts if isinstance(p, str)]
    text_ids = iter(tokenizer.encode_batch(texts))
    out, dropped = [], 0
    for e in examples:
        seq = [vocab.bos_id]
        drop_text = e.kind.startswith("t2i") and rng.random() < cfg_dropout
        for p in e.parts:
            if isinstance(p, str):
                ids = next(text_ids)
                if not drop_text:
                    seq.extend(ids)
            else:
                seq.append(vocab.boi_id)
                seq.extend(next(image_ids))
                seq.append(vocab.eoi_id)
        seq.append(vocab.eos_id)
        if len(seq) <= max_len:
            out.append(seq)
        else:
            dropped += 1
    if dropped:
        log.warning("dropped %d sequences longer than %d ids", dropped, max_len)
    return out


def length_batches(lengths: Sequence[int], tokens_per_batch: int, *, seed: int, epoch: int) -> list[list[int]]:
    """Batches of sequence indices of similar length (little padding), at most tokens_per_batch padded
    tokens each, in a seeded random order that changes every epoch."""
    rng = random.Random(f"{seed}:batches:{epoch}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(seqs: Sequence[Sequence[int]], pad_id: int, context: Sequence[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B,T] and a target mask [B,T]: 1 on real ids, 0 on padding and, with `context`,
    on each sequence's first context[i] ids (its prompt_length: given, not to be learnt as targets)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, context[i] if context is not None else 0:len(s)] = 1
    return ids, mask


class Schedule:
    """Warmup then cosine decay to 10%, over `steps` or `max_minutes` of training, whichever ends first.

    The time limit keeps a run inside a fixed device lease while still annealing the learning rate; metrics
    record the steps actually taken, and `--steps N` with no time limit reproduces a run exactly.
    """

    def __init__(self, steps: int, warmup: int, max_minutes: float = 0.0) -> None:
        import time

        self.steps, self.warmup, self.max_seconds = steps, max(1, warmup), 60.0 * max_minutes
        self._clock = time.monotonic
        self.start = self._clock()

    def progress(self, step: int) -> float:
        p = step / max(1, self.steps)
        if self.max_seconds:
            p = max(p, (self._clock() - self.start) / self.max_seconds)
        return min(1.0, p)

    def factor(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * self.progress(step))))

    def done(self, step: int) -> bool:
        return step >= self.steps or (self.max_seconds > 0 and self._clock() - self.start >= self.max_seconds)
