"""Best-of-n generation: draw candidate documents and keep the first that passes a check.

    docs = pipe.generate(prompts, best_of=4)        # check= comes from the model's generation.json

Candidate 0 is the request exactly as configured (for the embedded model: greedy pictures). Candidate k >= 1
re-draws with seed + k and, when the config's pictures are greedy, image temperature RESAMPLE_TEMPERATURE, so the
candidates differ. A prompt keeps the first candidate its check passes; when none passes it keeps candidate 0, so
best-of-n is never worse than one draw by the check's own measure. Candidates are decoded in rounds: round k
batches candidate k of every prompt still without a passing candidate, so prompts that pass early cost nothing more.

A check is a callable  check(documents) -> list[bool]  made for one pipeline by a factory registered in CHECKS:
    register_check("my_clip_check", lambda pipe: MyCheck(pipe))
    pipe.generate(prompts, best_of=4, check="my_clip_check")
Checks are named (not passed as objects) so a document's recorded config says how it was chosen.
Built in: "shapes_caption" (models/shapes/self_check.py): the same model captions each generated picture, and the
caption must name exactly the objects the text before the picture introduced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from models.document import Document
from models.generation import GenerationConfig
from models.sampling import GenerationError

RESAMPLE_TEMPERATURE = 0.7  # image temperature of candidates 1.. when the config's is greedy (measured: RESULTS.md)

Check = Callable[[Sequence[Document]], list[bool]]
# generate(rows, config) -> one Document per row: the pipeline decoding the prompts at those indices
GenerateRows = Callable[[list[int], GenerationConfig], list[Document]]


def _shapes_caption(pipe: Any) -> Check:
    from models.shapes.self_check import CaptionCheck  # the shapes world's parser, loaded only when asked for

    return CaptionCheck(pipe)


CHECKS: dict[str, Callable[[Any], Check]] = {"shapes_caption": _shapes_caption}


def register_check(name: str, factory: Callable[[Any], Check]) -> None:
    """Make `check=name` available: factory(pipeline) -> check(documents) -> list[bool]."""
    if not isinstance(name, str) or not name:
        raise GenerationError(f"a check's name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise GenerationError(f"the factory of check {name!r} must be callable, got {type(factory).__name__}")
    CHECKS[name] = factory


def make_check(name: str, pipe: Any) -> Check:
    if name not in CHECKS:
        raise GenerationError(f"unknown check {name!r}; registered checks: {', '.join(sorted(CHECKS))} "
                              "(add one with models.best_of.register_check)")
    return CHECKS[name](pipe)


def candidate_config(config: GenerationConfig, k: int) -> GenerationConfig:
    """The config of candidate k: the request itself for k = 0, else a re-draw (seed + k, sampled pictures)."""
    if k == 0:
        return config.with_overrides(best_of=1)
    temperature = config.image.temperature if config.image.temperature > 0 else RESAMPLE_TEMPERATURE
    return config.with_overrides(best_of=1, seed=config.seed + k, image_temperature=temperature)


def generate_best_of(generate_rows: GenerateRows, n_prompts: int, config: GenerationConfig, check: Check
                     ) -> list[Document]:
    """One Document per prompt, each the first of up to config.best_of candidates that `check` passes."""
    if config.seed is None:
        raise GenerationError("best-of generation needs a resolved seed (candidates use seed + k)")
    t0 = time.perf_counter()
    chosen: list[Document | None] = [None] * n_prompts
    verdicts: list[list[bool]] = [[] for _ in range(n_prompts)]
    pending = list(range(n_prompts))
    for k in range(config.best_of):
        documents = generate_rows(pending, candidate_config(config, k))
        passed = check(documents)
        if len(documents) != len(pending) or len(passed) != len(pending):
            raise GenerationError(f"best-of round {k}: {len(documents)} documents and {len(passed)} verdicts "
                                  f"for {len(pending)} prompts")
        still = []
        for row, document, ok in zip(pending, documents, passed):
            verdicts[row].append(bool(ok))
            if k == 0:
                chosen[row] = document  # kept when no candidate passes
            if ok:
                chosen[row] = document
            else:
                still.append(row)
        pending = still
        if not pending:
            break
    seconds = round(time.perf_counter() - t0, 3)
    for row, document in enumerate(chosen):
        picked = verdicts[row].index(True) if True in verdicts[row] else 0
        document.meta["best_of"] = {"n": config.best_of, "check": config.check, "candidate": picked,
                                    "verdicts": verdicts[row], "seconds": seconds}
    return chosen


__all__ = ["CHECKS", "RESAMPLE_TEMPERATURE", "Check", "candidate_config", "generate_best_of", "make_check",
           "register_check"]
