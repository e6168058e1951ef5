"""Domain items (models/families/shapes/domains.py) as token ids, batches, and exact-match scoring from one forward pass.

An item is encoded piece by piece so span boundaries are token boundaries:
    [<bos>] + ids(prompt) + ids(span 1) + ... + ids(span n) + [<eos>]
The loss and the score cover the answer ids and the <eos>; the prompt is context.

Greedy decoding reproduces the answer exactly iff, at every answer position, the argmax of the logits given the
right prefix is the right id (<eos> included). So `exact_matches` scores greedy exact match from ONE
teacher-forced forward pass per batch, for any causal routing (static, per-span oracle, learned gates decided on
the block input), without a decode loop.

Routing labels: position t predicts id t+1, so it is labelled with the domain of the span id t+1 belongs to.
Positions that predict prompt ids are context: no domain (None, label -1), read by every adapter as the base
model wrote them. That is how domain adapters are trained (scripts/train_domain_adapters.py: an adapter acts only
on the positions that predict its own span), so adapters trained apart meet the same context when composed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .domains import Item


@dataclass(frozen=True)
class EncodedItem:
    ids: list[int]
    answer_start: int  # index of the first answer id (ids before it are the prompt, <bos> included)
    span_domain: list[str]  # per id from answer_start on: the domain of the span the id belongs to (<eos>: last)
    kind: str
    span_index: tuple[int, ...] = ()  # per id from answer_start on: which span (0, 1, ...) it belongs to

    def __len__(self) -> int:
        return len(self.ids)

    def position_domains(self) -> list[str | None]:
        """Domain label of every position (what it predicts): None where it predicts a prompt id (context); an item
        without an answer (a picture request: the words before a picture) is context throughout."""
        if not self.span_domain:
            return [None] * len(self.ids)
        labels: list[str | None] = [None] * (self.answer_start - 1) + list(self.span_domain)
        return labels + [self.span_domain[-1]]  # the <eos> position predicts nothing; keep its span's label


def encode_item(tokenizer, item: Item) -> EncodedItem:
    vocab = tokenizer.vocab
    ids = [vocab.bos_id, *tokenizer.encode_text(item.prompt)]
    start = len(ids)
    domains: list[str] = []
    which: list[int] = []
    for k, span in enumerate(item.spans):
        piece = tokenizer.encode_text(span.text)
        ids += piece
        domains += [span.domain] * len(piece)
        which += [k] * len(piece)
    ids.append(vocab.eos_id)
    domains.append(item.spans[-1].domain)
    which.append(len(item.spans) - 1)
    return EncodedItem(ids, start, domains, item.kind, tuple(which))


def encode_prompt_answer(tokenizer, prompt: str, answer: str | None, domain: str | None = None) -> EncodedItem:
    """A user's text: loss on `answer` (and <eos>) after `prompt`, or on the whole text when answer is None."""
    vocab = tokenizer.vocab
    head = [vocab.bos_id, *tokenizer.encode_text(prompt)] if answer is not None else [vocab.bos_id]
    body = tokenizer.encode_text(answer if answer is not None else prompt)
    label = domain or ""
    return EncodedItem(head + body + [vocab.eos_id], len(head), [label] * (len(body) + 1), label or "text")


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] right-padded
    target: torch.Tensor  # [B, T] bool: ids[:, t] is a scored target (answer or <eos>)
    labels: torch.Tensor  # [B, T] long: domain index of each position (what it predicts); -1 = context / padding
    rows: list[int]  # indices of the items in this batch
    valid: torch.Tensor  # [B, T] bool: a real position (not padding)


def make_batch(encoded: Sequence[EncodedItem], rows: Sequence[int], pad_id: int, domains: Sequence[str],
               device: torch.device | str = "cpu", *, only: str | None = None) -> Batch:
    """`only`: score (and train on) the ids of spans of that domain only; other spans are context."""
    index = {d: i for i, d in enumerate(domains)}
    width = max(len(encoded[r]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    labels = torch.full((len(rows), width), -1, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        e = encoded[r]
        ids[b, :len(e)] = torch.tensor(e.ids)
        if only is None:
            target[b, e.answer_start:len(e)] = True
        else:
            target[b, e.answer_start:len(e)] = torch.tensor([d == only for d in e.span_domain])
        labels[b, :len(e)] = torch.tensor([index.get(d, -1) for d in e.position_domains()])
        valid[b, :len(e)] = True
    return Batch(ids.to(device), target.to(device), labels.to(device), list(rows), valid.to(device))


def batches(encoded: Sequence[EncodedItem], batch_size: int, *, order: Sequence[int] | None = None
            ) -> list[list[int]]:
    """Rows in groups of `batch_size`, sorted by length within the given order's chunks (little padding)."""
    order = list(range(len(encoded))) if order is None else list(order)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def answer_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer ids and <eos> of the batch."""
    mask = batch.target[:, 1:]
    flat = logits[:, :-1][mask].float()
    return torch.nn.functional.cross_entropy(flat, batch.ids[:, 1:][mask])


@torch.no_grad()
def exact_matches(logits: torch.Tensor, batch: Batch, encoded: Sequence[EncodedItem]
                  ) -> tuple[list[bool], list[list[bool]]]:
    """Per item: greedy decoding reproduces the whole answer; and per span (span ends at its last id)."""
    ok = (logits[:, :-1].argmax(-1) == batch.ids[:, 1:]) | ~batch.target[:, 1:]
    whole, spans = [], []
    for b, r in enumerate(batch.rows):
        e = encoded[r]
        row = ok[b, e.answer_start - 1:len(e) - 1].tolist()  # predictions of ids answer_start .. end
        whole.append(all(row))
        which = e.span_index or (0,) * len(row)
        per = [True] * (max(which) + 1)
        for k, g in zip(which, row):
            per[k] = per[k] and g
        spans.append(per)
    return whole, spans
