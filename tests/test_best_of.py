"""Best-of-n generation (models/engine/best_of.py) and the shapes world's caption check (models/families/shapes/self_check.py)."""

from __future__ import annotations

import pytest

from molora.models import Document, GenerationConfig, GenerationError, InterleavedPipeline
from molora.models.engine.best_of import (
    CHECKS,
    RESAMPLE_TEMPERATURE,
    candidate_config,
    register_check,
    stream_best_of,
)
from molora.models.engine.events import Finished, ImageDone, Notice, Redraw
from molora.models.families.shapes.self_check import CaptionCheck
from molora.models.families.shapes.world import Obj, Scene, render
from molora.routing import UnknownAdapterError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------- the loop, no model


def test_candidate_configs_redraw_with_the_next_seeds():
    greedy = GenerationConfig(seed=5, best_of=3, check="shapes_caption").with_overrides(image_temperature=0.0)
    first, third = candidate_config(greedy, 0), candidate_config(greedy, 2)
    assert (first.seed, first.image.temperature, first.best_of) == (5, 0.0, 1)
    assert (third.seed, third.image.temperature, third.best_of) == (7, RESAMPLE_TEMPERATURE, 1)
    assert third.text == greedy.text
    sampled = greedy.with_overrides(image_temperature=1.2)
    assert candidate_config(sampled, 1).image.temperature == 1.2  # already sampled pictures keep their temperature


def test_rounds_decode_only_the_prompts_still_failing_and_keep_the_first_pass():
    passes_at = {0: 0, 1: 2, 2: None}  # prompt -> the candidate its check passes (None: never)
    calls = []

    def stream_rows(rows, config):
        calls.append((list(rows), config.seed))
        for i, r in enumerate(rows):
            yield Notice(f"prompt {r}, candidate {config.seed - 10}", row=i)
            yield Finished(Document(meta={"prompt": r, "candidate": config.seed - 10}), row=i)

    def check(documents):
        return [passes_at[d.meta["prompt"]] == d.meta["candidate"] for d in documents]

    config = GenerationConfig(seed=10, best_of=4, check="test")
    events = list(stream_best_of(stream_rows, 3, config, check))
    assert calls == [([0, 1, 2], 10), ([1, 2], 11), ([1, 2], 12), ([2], 13)]
    finished = {e.row: e.document for e in events if isinstance(e, Finished)}
    assert [finished[r].meta["candidate"] for r in range(3)] == [0, 2, 0]  # prompt 2 never passed: candidate 0
    assert [finished[r].meta["best_of"]["verdicts"] for r in range(3)] == [[True], [False, False, True], [False] * 4]
    assert [finished[r].meta["best_of"]["candidate"] for r in range(3)] == [0, 2, 0]
    # events keep their prompt's row in every round; a Redraw opens each later candidate; Finished once a prompt
    assert [(e.row, e.message) for e in events if isinstance(e, Notice)][-1] == (2, "prompt 2, candidate 3")
    assert [(e.row, e.candidate) for e in events if isinstance(e, Redraw)] == [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3)]
    assert [type(e).__name__ for e in events].count("Finished") == 3
    assert events.index(next(e for e in events if isinstance(e, Finished))) < 4  # prompt 0 finishes in round 0


def test_a_check_answering_for_the_wrong_number_of_documents_is_an_error():
    def stream_rows(rows, config):
        return iter([Finished(Document(), row=i) for i in range(len(rows))])

    with pytest.raises(GenerationError, match="verdicts"):
        list(stream_best_of(stream_rows, 2, GenerationConfig(seed=0, best_of=2, check="x"), lambda docs: [True]))


@pytest.mark.parametrize("bad", [0, 17, True, 2.0, "4"])
def test_best_of_must_be_a_small_int(bad):
    with pytest.raises(GenerationError, match="best_of must be an int"):
        GenerationConfig(best_of=bad, check="shapes_caption")


def test_best_of_without_a_check_or_with_an_unknown_one_is_refused(tiny_pipeline):
    with pytest.raises(GenerationError, match="needs a check"):
        tiny_pipeline.generate("a red circle", seed=0, best_of=2)
    with pytest.raises(GenerationError, match="unknown check 'nope'.*shapes_caption"):
        tiny_pipeline.generate("a red circle", seed=0, best_of=2, check="nope")
    with pytest.raises(UnknownAdapterError, match="unknown image_adapter"):  # before the iterator is returned
        tiny_pipeline.stream("a red circle", seed=0, best_of=2, check="shapes_caption", image_adapter="nope")
    with pytest.raises(GenerationError, match="non-empty str"):
        register_check("", lambda pipe: None)


# -------------------------------------------------------------------------------- through the pipeline


def test_pipeline_best_of_returns_the_passing_candidate_reproducibly(tiny_pipeline, monkeypatch):
    """A check that passes only candidate 1 (seed + 1): each prompt gets that document, and its recorded config
    regenerates it exactly with best_of off."""
    monkeypatch.setitem(CHECKS, "second_draw",
                        lambda pipe: lambda docs: [d.meta["seed"] == 21 for d in docs])
    prompts = ["a red circle", "two stars"]
    kwargs = dict(text_adapter=["text_style", None], image_adapter="image_style", max_new_tokens=300)
    chosen = tiny_pipeline.generate(prompts, seed=20, best_of=3, check="second_draw", start_image=True, **kwargs)
    assert [d.meta["best_of"]["verdicts"] for d in chosen] == [[False, True]] * 2
    again = tiny_pipeline.generate(prompts, config=GenerationConfig.from_dict(chosen[0].meta["config"]), **kwargs)
    for doc, redo in zip(chosen, again):
        assert doc.meta["seed"] == 21 and doc.meta["config"]["best_of"] == 1
        assert [r.id for r in doc.routing] == [r.id for r in redo.routing]
    events = list(tiny_pipeline.stream(prompts[0], seed=20, best_of=3, check="second_draw", start_image=True,
                                       text_adapter="text_style", image_adapter="image_style", max_new_tokens=300))
    redraws = [i for i, e in enumerate(events) if isinstance(e, Redraw)]
    assert len(redraws) == 1 and isinstance(events[-1], Finished) and events[-1].document.meta["seed"] == 21
    assert events[redraws[0]].rejected.meta["seed"] == 20  # the Redraw carries the candidate it turned down
    assert any(isinstance(e, ImageDone) for e in events[:redraws[0]])  # candidate 0 streamed before its redraw


# ---------------------------------------------------------------------------- the caption check (embedded)


@pytest.fixture(scope="module")
def embedded():
    return InterleavedPipeline.from_pretrained()


def test_caption_check_passes_the_right_picture_and_fails_a_wrong_one(embedded):
    asked = "Draw a large red circle at the top left."
    right = render(Scene((Obj("circle", "red", "large", "top left"),), background="white"))
    wrong = render(Scene((Obj("square", "blue", "large", "center"),), background="white"))
    documents = [Document(parts=[right], prompt=[asked], meta={"routing": "none"}),
                 Document(parts=[wrong], prompt=[asked], meta={"routing": "none"}),
                 Document(parts=["Arr, a fine day."], prompt=[asked], meta={"routing": "none"})]
    assert CaptionCheck(embedded)(documents) == [True, False, True]  # a document without pictures passes
    # each document records why, for the app's rejected drafts: the wrong picture's caption is quoted
    assert documents[0].meta["check"]["passed"] and documents[0].meta["check"]["reason"] == ""
    rejected = documents[1].meta["check"]
    assert not rejected["passed"] and "picture 1" in rejected["reason"]
    assert rejected["captions"][0].strip() in rejected["reason"]


def test_embedded_model_declares_its_check_and_best_of_runs_end_to_end(embedded):
    assert embedded.default_config.check == "shapes_caption"
    prompts = ["Draw a small red star on the right.", "Show me a yellow triangle in the bottom right corner."]
    docs = embedded.generate(prompts, routing="none", seed=0, best_of=2)
    check = CaptionCheck(embedded)
    for doc in docs:
        verdicts = doc.meta["best_of"]["verdicts"]
        assert 1 <= len(verdicts) <= 2 and doc.images
        assert check([doc]) == [any(verdicts)]  # the passing candidate, or candidate 0 when none passed
