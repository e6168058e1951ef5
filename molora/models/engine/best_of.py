"""Best-of-n generation: draw candidate documents and keep the first that passes a check.

    docs = pipe.generate(prompts, best_of=4)        # check= comes from the model's generation.json

Candidate 0 is the request exactly as configured (for the embedded model: greedy pictures). Candidate k >= 1
re-draws with seed + k and, when the config's pictures are greedy, image temperature RESAMPLE_TEMPERATURE, so the
candidates differ. A prompt keeps the first candidate its check passes; when none passes it keeps candidate 0, so
best-of-n is never worse than one draw by the check's own measure. Candidates are decoded in rounds: round k
batches candidate k of every prompt still without a passing candidate, so prompts that pass early cost nothing more.
Every candidate streams as it decodes (a Redraw event opens the next one of a prompt); a prompt's Finished event
carries the document kept, with meta["best_of"] = {n, check, candidate, verdicts, seconds}.

A check is a callable  check(documents) -> list[bool]  made for one pipeline by a factory registered in CHECKS
(it may record why in each document's meta["check"] = {"passed": bool, "reason": str}, which the app shows):
    register_check("my_clip_check", lambda pipe: MyCheck(pipe))
    pipe.generate(prompts, best_of=4, check="my_clip_check")
Checks are named (not passed as objects) so a document's recorded config says how it was chosen.
Model families register their own checks (models/families/family.py): the shapes family's "shapes_caption"
(models/families/shapes/self_check.py) has the same model caption each generated picture, and the caption must name exactly
the objects the text before the picture introduced.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from molora.models.document import Document
from molora.models.engine.events import Event, Finished, Redraw
from molora.models.engine.generation import GenerationConfig
from molora.models.engine.sampling import MAX_SEED, GenerationError

RESAMPLE_TEMPERATURE = 0.7  # image temperature of candidates 1.. when the config's is greedy (as in RESULTS.md's runs)

Check = Callable[[Sequence[Document]], list[bool]]
# stream_rows(rows, config) -> the pipeline's events for the prompts at those indices (their rows 0..len(rows)-1)
StreamRows = Callable[[list[int], GenerationConfig], Iterator[Event]]


CHECKS: dict[str, Callable[[Any], Check]] = {}  # filled by register_check (model families register theirs)


def register_check(name: str, factory: Callable[[Any], Check]) -> None:
    """Make `check=name` available: factory(pipeline) -> check(documents) -> list[bool]."""
    if not isinstance(name, str) or not name:
        raise GenerationError(f"a check's name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise GenerationError(f"the factory of check {name!r} must be callable, got {type(factory).__name__}")
    CHECKS[name] = factory


def candidate_config(config: GenerationConfig, k: int) -> GenerationConfig:
    """The config of candidate k: the request itself for k = 0, else a re-draw (seed + k, sampled pictures)."""
    if k == 0:
        return config.with_overrides(best_of=1)
    temperature = config.image.temperature if config.image.temperature > 0 else RESAMPLE_TEMPERATURE
    # wrapped into the seed range (models.sampling.MAX_SEED), so the top seeds have re-draws too
    return config.with_overrides(best_of=1, seed=(config.seed + k) % (MAX_SEED + 1), image_temperature=temperature)


def stream_best_of(stream_rows: StreamRows, n_prompts: int, config: GenerationConfig, check: Check, *,
                   first_round: Iterator[Event] | None = None,
                   stopped: Callable[[], bool] | None = None) -> Iterator[Event]:
    """Events of every candidate as it decodes, then one Finished per prompt carrying the document kept: the first
    of up to config.best_of candidates that `check` passes, else candidate 0. A Redraw opens each later candidate
    of a prompt; a prompt's Finished comes as soon as one of its candidates passes. `first_round`: candidate 0's
    events of every prompt when the caller built them already (to raise on bad arguments before streaming).
    `stopped()` true after a round (the caller's StopSignal): no more candidates; each prompt still pending keeps
    the candidate being drawn when it stopped (what the caller was shown), unchecked."""
    if config.seed is None:
        raise GenerationError("best-of generation needs a resolved seed (candidates use seed + k)")
    t0 = time.perf_counter()
    first: dict[int, Finished] = {}  # candidate 0 of each prompt: kept when no candidate passes
    verdicts: list[list[bool]] = [[] for _ in range(n_prompts)]
    pending = list(range(n_prompts))
    finished: dict[int, Finished] = {}
    for k in range(config.best_of):
        if k > 0:
            yield from (Redraw(k, config.best_of, row=row, rejected=finished[row].document) for row in pending)
        finished = {}
        if k == 0 and first_round is not None:
            events = first_round
        else:
            events = stream_rows(pending, candidate_config(config, k))
        for event in events:
            event = dataclasses.replace(event, row=pending[event.row])
            if isinstance(event, Finished):
                finished[event.row] = event
            else:
                yield event
        if stopped is not None and stopped():
            for row in pending:
                verdicts[row].append(False)
                kept = _kept(finished[row], config, verdicts[row], t0)
                kept.document.meta["best_of"].update(candidate=k, stopped=True)
                yield kept
            return
        passed = check([finished[row].document for row in pending])
        if len(passed) != len(pending):
            raise GenerationError(f"the check gave {len(passed)} verdicts for {len(pending)} documents")
        still = []
        for row, ok in zip(pending, passed):
            verdicts[row].append(bool(ok))
            first.setdefault(row, finished[row])
            if ok:
                yield _kept(finished[row], config, verdicts[row], t0)
            else:
                still.append(row)
        pending = still
        if not pending:
            return
    for row in pending:
        yield _kept(first[row], config, verdicts[row], t0)


def _kept(event: Finished, config: GenerationConfig, verdicts: list[bool], t0: float) -> Finished:
    event.document.meta["best_of"] = {"n": config.best_of, "check": config.check,
                                      "candidate": verdicts.index(True) if True in verdicts else 0,
                                      "verdicts": verdicts, "seconds": round(time.perf_counter() - t0, 3)}
    return event


__all__ = ["CHECKS", "RESAMPLE_TEMPERATURE", "Check", "candidate_config", "register_check",
           "stream_best_of"]
