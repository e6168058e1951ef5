"""One seed rule (models.sampling.check_seed): whole numbers 0 .. MAX_SEED, a clear error naming the field otherwise."""

from __future__ import annotations

import pytest
import torch

from molora.models.cli import main as cli_main
from molora.models.engine.sampling import MAX_SEED, GenerationError, check_seed


@pytest.mark.parametrize("seed", [0, 1, 12345, MAX_SEED, 7.0])
def test_whole_numbers_in_range_are_accepted(seed):
    assert check_seed(seed) == int(seed) and isinstance(check_seed(seed), int)


@pytest.mark.parametrize("seed, message", [
    (-1, "seed must be from 0 to 2147483647, got -1"),
    (MAX_SEED + 1, "got 2147483648"),
    (2**64, "got 18446744073709551616"),  # was a raw OverflowError from torch
    (1.5, "whole number"), (True, "whole number"), ("3", "whole number"), (None, "whole number"),
])
def test_everything_else_is_refused_naming_the_field(seed, message):
    with pytest.raises(GenerationError, match=message):
        check_seed(seed)
    with pytest.raises(GenerationError, match="^--seed must"):
        check_seed(seed, "--seed")


def test_the_range_stays_below_where_cpu_seeds_collide():
    """The CPU generator keeps 32 bits of a seed: 1 and 2**32 + 1 draw alike. So the range stops at 2**31 - 1
    (best-of's seed + k stays below 2**32 too), and 2**32 + 1 is refused rather than silently equal to 1."""
    def draw(seed: int) -> torch.Tensor:
        return torch.rand(4, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(2**32 + 1))
    with pytest.raises(GenerationError):
        check_seed(2**32 + 1)


def test_the_cli_refuses_a_bad_seed_with_its_message(capsys):
    assert cli_main(["Draw a red circle.", "--seed", "-1", "--out", "unused.html"]) == 2
    assert "--seed must be from 0 to" in capsys.readouterr().err


def test_best_of_redraws_stay_in_the_seed_range():
    from molora.models.engine.best_of import candidate_config
    from molora.models.engine.generation import GenerationConfig

    config = GenerationConfig(seed=MAX_SEED, best_of=3, check="shapes_caption")
    assert [candidate_config(config, k).seed for k in range(3)] == [MAX_SEED, 0, 1]


@pytest.mark.parametrize("seed", [-1, 2**31, 2**32 + 1, 2**64])
def test_the_api_takes_the_same_seed_rule(seed, tiny_pipeline):
    from molora.models.engine.generation import GenerationConfig

    with pytest.raises(GenerationError, match="seed must be"):
        GenerationConfig(seed=seed)
    with pytest.raises(GenerationError, match="seed must be"):
        tiny_pipeline.generate("x", seed=seed, max_new_tokens=2)
