"""Sampling of next tokens from logits: masks, classifier-free guidance, temperature, top-k, top-p.

Everything works on whole batches with per-row settings held in tensors, so one decode step costs a fixed
number of tensor ops whatever the batch holds (text rows next to image rows) and never syncs with the host.

    probs-free sampling:  token = argmax(probs / Exp(1) noise)   (the "exponential race", as in gpt-fast)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora.routing.errors import MoLoRAError


class GenerationError(MoLoRAError):
    """A generation request that cannot run: bad sampling settings, prompts, adapters or routing mode."""


# Seeds are whole numbers 0 <= seed <= MAX_SEED. The CPU generator (mt19937) keeps only the low 32 bits of a seed,
# so a wider range would make different seeds give the same document (1 and 2**32 + 1); best-of-n re-draws at
# seed + k, which 31 bits keep below 2**32 too (and it is what a browser's number box and most tools handle).
MAX_SEED = 2**31 - 1


def check_seed(seed: object, field: str = "seed") -> int:
    """`seed` as an int if it is a whole number in [0, MAX_SEED]; else GenerationError naming `field` and the range.
    Floats that are whole (3.0, as a UI number box sends) are accepted; bools, fractions and text are not."""
    value = seed
    if isinstance(seed, float) and seed.is_integer():
        value = int(seed)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerationError(f"{field} must be a whole number from 0 to {MAX_SEED}, got {seed!r}")
    if not 0 <= value <= MAX_SEED:
        raise GenerationError(f"{field} must be from 0 to {MAX_SEED}, got {value} (larger seeds would repeat "
                              "smaller ones on the CPU)")
    return value


@dataclass
class SamplingConfig:
    """How one modality's tokens are drawn. temperature 0 = greedy; top_k 0 and top_p 1.0 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        try:
            self.temperature, self.top_k, self.top_p = float(self.temperature), int(self.top_k), float(self.top_p)
        except (TypeError, ValueError) as exc:
            raise GenerationError(f"SamplingConfig needs numbers, got {self!r}") from exc
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise GenerationError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond). scale 1 gives cond."""
    return uncond + scale * (cond - uncond)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    logits [B,V] float (already temperature-scaled, invalid ids already -inf); top_k [B] long (0 = off);
    top_p [B] float (1 = off). One sort serves both filters; the best token always survives, and a row with
    both filters off is returned unchanged (whatever its batch neighbours ask for).
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = rank[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # exclusive cumulative mass: a token is kept while the mass before it is below top_p
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before > top_p[:, None]
    drop &= ((top_k > 0) | (top_p < 1.0))[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    generator: torch.Generator | None = None,
    *,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next tokens [B] from masked logits [B,V] with per-row temperature [B] (0 = greedy) and filters.

    top_k / top_p may be None when no row filters (skips the sort). Greedy rows take the argmax of the
    unscaled logits, so a temperature of 0 is exact, not a division by zero. `noise` [B,V] (Exp(1) draws, e.g.
    one generator per row: the serving engine) replaces the draw from `generator`.
    """
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    if top_k is not None:
        scaled = filter_logits(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    # multinomial without a host sync (torch.multinomial checks its input on the host)
    # (the clamp keeps an exact 0 draw from turning a masked token's 0/0 into a winning NaN)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    drawn = (probs / noise.clamp(min=1e-20)).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, greedy)
