"""Model families (models/families/family.py): a directory is recognised by its files, families register themselves and
their best_of checks, and the pipeline loads whatever family the directory holds."""

from __future__ import annotations

import json

import pytest

from molora.models.engine.best_of import CHECKS
from molora.models.families.family import ModelFamily, detect_family, families, get_family, register_family
from molora.models.families.loading import ModelDirError


def test_the_embedded_model_is_the_shapes_family_and_registers_its_check(tiny_model_dir):
    assert detect_family(tiny_model_dir).name == "shapes"
    assert detect_family(tiny_model_dir.parent).name == "shapes"  # a folder holding model/ + adapters/
    assert detect_family(None).name == "shapes"
    assert "shapes_caption" in CHECKS
    assert "shapes" in families()


def test_a_transformers_config_of_an_unsupported_type_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelDirError, match="'bert'.*supported families: .*shapes"):
        detect_family(tmp_path)
    with pytest.raises(ModelDirError, match="unknown model family 'nope'"):
        get_family("nope")


def test_a_folder_no_family_claims_falls_to_the_embedded_loader_which_names_missing_files(tmp_path):
    from molora.models import InterleavedPipeline

    with pytest.raises(ModelDirError, match="missing: .*vocab.json"):
        InterleavedPipeline.from_pretrained(tmp_path, device="cpu")


def test_a_registered_family_is_detected_and_its_checks_are_registered(tmp_path):
    (tmp_path / "mine.txt").write_text("x")
    family = ModelFamily("mine", lambda p: (p / "mine.txt").is_file(), lambda p, **kw: None,
                         checks={"mine_check": lambda pipe: (lambda docs: [True] * len(docs))})
    register_family(family)
    try:
        assert detect_family(tmp_path) is family
        assert CHECKS["mine_check"](None)([1, 2]) == [True, True]
    finally:
        from molora.models.families import family as module

        module._FAMILIES.pop("mine")
        CHECKS.pop("mine_check")


def test_the_pipeline_records_its_family(tiny_pipeline):
    assert tiny_pipeline.family == "shapes"


def test_an_option_the_family_does_not_take_is_refused_by_name(tiny_model_dir):
    from molora.models import InterleavedPipeline

    with pytest.raises(ModelDirError, match="shapes family takes no option grid"):
        InterleavedPipeline.from_pretrained(tiny_model_dir, device="cpu", grid=(4, 4))
