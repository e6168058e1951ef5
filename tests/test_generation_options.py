"""Generation options added for fixed-length workloads (the CPU speed benchmark uses min_new_tokens)."""

import pytest

from molora.models import GenerationConfig
from molora.models.engine.sampling import GenerationError


def test_min_new_tokens_masks_eos_until_reached(tiny_pipeline):
    doc = tiny_pipeline.generate("hello", routing="none", seed=3, min_new_tokens=40, max_new_tokens=40,
                                 max_images=0)
    assert len(doc.routing) == 40
    assert all(r.id != tiny_pipeline.vocab.eos_id for r in doc.routing)


@pytest.mark.parametrize("bad", [-1, 10_000, 1.5, True])
def test_min_new_tokens_is_validated(bad):
    with pytest.raises(GenerationError, match="min_new_tokens"):
        GenerationConfig(max_new_tokens=100, min_new_tokens=bad)
