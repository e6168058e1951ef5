"""Shared fixtures: a tiny RANDOM model in the assets layout (model/ + adapters/), built once per session.

    tiny_assets        folder with model/ (vocab.json, tokenizer.json, lm/, vq/) and adapters/{text_style,image_style}
    tiny_model_dir     tiny_assets / "model"
    tiny_pipeline      an InterleavedPipeline over them (CPU, fp32); share it read-only (do not load adapters into it)
    one_torch_thread   runs a test with one torch thread (the tiny model is faster so; the 2-core machine stays responsive)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from molora.models.families.shapes.testing import write_tiny_adapter, write_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny_assets")
    write_tiny_model_dir(root / "model", seed=0)
    write_tiny_adapter(root / "model", root / "adapters" / "text_style", modality="text", seed=1,
                       description="random text-style test adapter")
    write_tiny_adapter(root / "model", root / "adapters" / "image_style", modality="image", seed=2,
                       description="random image-style test adapter")
    return root


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_assets: Path) -> Path:
    return tiny_assets / "model"


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_assets: Path):
    from molora.models import InterleavedPipeline

    return InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
