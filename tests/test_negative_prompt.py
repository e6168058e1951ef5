"""Classifier-free guidance with a negative prompt: the unconditional twin reads `<bos>` + the negative prompt before
each picture (Emu3's recipe), and a new picture restarts the twin right after that prefix."""

from __future__ import annotations

import pytest
import torch

from molora.models.engine.generation import GenerationConfig, Request
from molora.models.engine.row_states import RowStates
from molora.models.engine.sampling import GenerationError

PICTURE = dict(seed=0, start_image=True, cfg_scale=5.0, image_temperature=0.0, max_images=1)


def _codes(doc):
    return [r.id for r in doc.routing if r.modality == "image"]


def test_an_empty_negative_prompt_is_the_plain_unconditional_stream(tiny_pipeline):
    n = tiny_pipeline.vocab.tokens_per_image + 1
    plain = tiny_pipeline.generate("a red circle", max_new_tokens=n, **PICTURE)
    empty = tiny_pipeline.generate("a red circle", max_new_tokens=n, negative_prompt="", **PICTURE)
    assert _codes(plain) == _codes(empty)
    assert empty.meta["config"]["negative_prompt"] == ""


def test_a_negative_prompt_changes_the_guided_picture_and_is_reproducible(tiny_pipeline):
    n = tiny_pipeline.vocab.tokens_per_image + 1
    plain = tiny_pipeline.generate("a red circle", max_new_tokens=n, **PICTURE)
    runs = [tiny_pipeline.generate("a red circle", max_new_tokens=n, negative_prompt="two blue squares", **PICTURE)
            for _ in range(2)]
    assert _codes(runs[0]) == _codes(runs[1])
    assert _codes(runs[0]) != _codes(plain)
    # without guidance a negative prompt changes nothing
    unguided = dict(PICTURE, cfg_scale=1.0)
    assert _codes(tiny_pipeline.generate("a red circle", max_new_tokens=n, **unguided)) == \
        _codes(tiny_pipeline.generate("a red circle", max_new_tokens=n, negative_prompt="blue", **unguided))


def test_a_new_picture_restarts_the_twin_after_its_prefix(tiny_pipeline):
    vocab = tiny_pipeline.vocab
    states = RowStates(vocab, 4, torch.device("cpu"), vocab.vocab_size)
    states.start(0, GenerationConfig(seed=0), last_pos=5, open_span=None, slots=(-1, -1), twin=1,
                 twin_last_pos=3, twin_prefix=4)
    states.advance_rows(torch.tensor([0]), torch.tensor([vocab.boi_id]))
    assert int(states.feed_pos[1]) == 4 and int(states.feed_ids[1]) == vocab.boi_id  # <bos> + 3 ids, then <boi>


def test_bad_negative_prompts_are_refused(tiny_pipeline):
    with pytest.raises(GenerationError, match="negative_prompt must be a str"):
        GenerationConfig(negative_prompt=3)
    with pytest.raises(GenerationError, match="unconditional prompt"):
        tiny_pipeline.engine.submit(Request([tiny_pipeline.vocab.bos_id], None, uncond_prompt=[]),
                                    GenerationConfig(seed=0, max_new_tokens=4))
