"""The modality table routers read: which modality (TEXT / IMAGE) a position holding each *input* id routes to.

Routers know nothing of a model family's vocabulary; they ask for its table.  Anything with
`modality_table(device) -> int8 [vocab_size]` will do: a family's vocabulary layout (models.vocab.UnifiedVocab
is one), or a fixed tensor wrapped in `ModalityMap`.

    router = VocabRangeRouter(ModalityMap(table), "pirate", "outline")   # table[id] in {TEXT, IMAGE}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from molora.routing.errors import RoutingError

TEXT = 0
IMAGE = 1
MODALITY_NAMES = ("text", "image")


@runtime_checkable
class ModalityTable(Protocol):
    """What a router needs from a vocabulary: the modality of every input id, as a device tensor."""

    def modality_table(self, device: torch.device | str | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class ModalityMap:
    """A fixed modality table: int [vocab_size] of TEXT / IMAGE values."""

    table: torch.Tensor

    def __post_init__(self) -> None:
        t = self.table
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() == 0 or t.is_floating_point():
            raise RoutingError("a modality table is a non-empty 1-d integer tensor (one TEXT/IMAGE value per id)")
        if bool(((t != TEXT) & (t != IMAGE)).any()):
            raise RoutingError(f"a modality table holds only TEXT ({TEXT}) and IMAGE ({IMAGE}) values")
        object.__setattr__(self, "table", t.to(torch.int8))

    def modality_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.table.to(device) if device is not None else self.table

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModalityMap) and torch.equal(self.table.cpu(), other.table.cpu())

    __hash__ = None  # type: ignore[assignment]


__all__ = ["IMAGE", "MODALITY_NAMES", "TEXT", "ModalityMap", "ModalityTable"]
