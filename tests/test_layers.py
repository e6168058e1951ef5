"""The layering: kernels/ <- routing/ <- models/ <- app/; lower layers never import higher ones, and the engine,
pipeline and app import no model family (families register themselves, models/family.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from routing import ModalityMap, SequenceRouter, VocabRangeRouter
from routing.modality import IMAGE, TEXT

ROOT = Path(__file__).resolve().parent.parent
FAMILY_PACKAGES = ("models.shapes", "models.emu3", "models.chameleon", "models.janus")


def _imports(path: Path) -> set[str]:
    """Every module a file imports (at any depth: lazy imports inside functions count too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_routing_and_kernels_import_nothing_from_models_or_app():
    for package, forbidden in (("routing", ("models", "app")), ("kernels", ("models", "app", "routing"))):
        for path in _files(package):
            bad = [m for m in _imports(path) if m.split(".")[0] in forbidden]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_engine_pipeline_and_app_import_no_family():
    paths = [ROOT / "models" / n for n in ("engine.py", "pipeline.py", "row_states.py", "generation.py",
                                           "document.py", "best_of.py", "family.py")] + _files("app")
    for path in paths:
        bad = [m for m in _imports(path) if m.startswith(FAMILY_PACKAGES)]
        assert not bad, f"{path.relative_to(ROOT)} imports the model families {bad}"


def test_vocab_router_reads_any_modality_table():
    table = torch.tensor([TEXT, TEXT, IMAGE, IMAGE, TEXT])
    router = VocabRangeRouter(ModalityMap(table), "t", "i")
    ids = torch.tensor([[0, 2, 3, 4, 1, 7]])  # 7: past the table (a padded embedding row) counts as text
    slots = router.route(ids, {"t": 0, "i": 1})
    assert slots.tolist() == [[0, 1, 1, 0, 0, 0]]
    assert SequenceRouter("t").route(ids, {"t": 3}).tolist() == [[3] * 6]


def test_modality_map_refuses_other_values():
    import pytest

    from routing.errors import RoutingError

    with pytest.raises(RoutingError):
        ModalityMap(torch.tensor([0, 2]))
    with pytest.raises(RoutingError):
        ModalityMap(torch.tensor([0.0, 1.0]))
