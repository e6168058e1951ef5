"""The layering: molora/kernels <- routing <- models <- app; lower layers never import higher ones, and the engine,
pipeline and app import no model family (families register themselves, models/families/family.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from molora.routing import ModalityMap, SequenceRouter, VocabRangeRouter
from molora.routing.modality import IMAGE, TEXT

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "molora"
FAMILY_PACKAGES = tuple(f"molora.models.families.{name}" for name in ("shapes", "emu3", "chameleon", "janus"))


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
    return sorted((PACKAGE / package).rglob("*.py"))


def _module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports when it is imported: top-level statements, `if TYPE_CHECKING:` blocks
    included (a type checker follows them), imports inside functions left out (they run later)."""
    names: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])

    visit(ast.parse(path.read_text()).body)
    return names & known


def _import_graph() -> dict[str, set[str]]:
    """{module: project modules it imports at module level} over kernels/, routing/, models/ and app/."""
    paths = {}
    for package in ("kernels", "routing", "models", "app"):
        for path in _files(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: _module_level_imports(path, set(paths)) - {name} for name, path in paths.items()}


def test_routing_and_kernels_import_nothing_from_models_or_app():
    for package, forbidden in (("routing", ("models", "app")), ("kernels", ("models", "app", "routing"))):
        for path in _files(package):
            bad = [m for m in _imports(path) if m.startswith("molora.") and m.split(".")[1] in forbidden]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_every_project_import_goes_through_the_molora_namespace():
    """`import kernels` would find Hugging Face's `kernels` distribution in an installed copy (and load our packages
    twice in a checkout), so the project's own modules are always imported as `molora.<package>`."""
    files = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    for path in files:
        bare = [m for m in _imports(path) if m.split(".")[0] in ("kernels", "routing", "models", "app")]
        assert not bare, f"{path.relative_to(ROOT)} imports {bare} outside the molora namespace"


def test_engine_pipeline_and_app_import_no_family():
    """The engine package, the user-facing modules beside it and the app name no family; families/family.py (the
    registry) imports them only by name, on the first lookup."""
    users = [PACKAGE / "models" / n for n in ("pipeline.py", "document.py", "batch.py", "cli.py")]
    paths = _files("models/engine") + users + [PACKAGE / "models" / "families" / "family.py"] + _files("app")
    for path in paths:
        bad = [m for m in _imports(path) if m.startswith(FAMILY_PACKAGES)]
        assert not bad, f"{path.relative_to(ROOT)} imports the model families {bad}"


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    """No path through `graph` ({module: modules it imports}) comes back to where it started."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            assert imported not in path, f"import cycle: {' -> '.join(path[path.index(imported):] + [imported])}"
            if imported not in done:
                visit(imported, [*path, imported])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])


def test_no_import_cycles_at_module_level():
    graph = _import_graph()
    assert "molora.models.engine.events" not in graph["molora.models.document"]  # a document records parts; events do
    _assert_acyclic(graph)


def test_the_seams_between_layers_are_typed():
    """A request carries a routing.Router (or None); the pipeline, best_of and the app stream models.events.Event."""
    from collections.abc import Iterator
    from typing import get_type_hints

    from molora.app.render import RunView
    from molora.models.engine.best_of import stream_best_of
    from molora.models.engine.events import Event
    from molora.models.engine.generation import Request
    from molora.models.pipeline import InterleavedPipeline
    from molora.routing import Router

    assert get_type_hints(Request)["router"] == Router | None
    assert get_type_hints(InterleavedPipeline.make_router)["return"] == Router | None
    for function in (InterleavedPipeline.stream, stream_best_of):
        assert get_type_hints(function)["return"] == Iterator[Event]
    assert get_type_hints(RunView.apply)["event"] == Event


def test_vocab_router_reads_any_modality_table():
    table = torch.tensor([TEXT, TEXT, IMAGE, IMAGE, TEXT])
    router = VocabRangeRouter(ModalityMap(table), "t", "i")
    ids = torch.tensor([[0, 2, 3, 4, 1, 7]])  # 7: past the table (a padded embedding row) counts as text
    slots = router.route(ids, {"t": 0, "i": 1})
    assert slots.tolist() == [[0, 1, 1, 0, 0, 0]]
    assert SequenceRouter("t").route(ids, {"t": 3}).tolist() == [[3] * 6]


def test_modality_map_refuses_other_values():
    import pytest

    from molora.routing.errors import RoutingError

    with pytest.raises(RoutingError):
        ModalityMap(torch.tensor([0, 2]))
    with pytest.raises(RoutingError):
        ModalityMap(torch.tensor([0.0, 1.0]))


def test_the_scripts_import_each_other_without_circles():
    """scripts/*.py may share helpers (train_router's data, eval_molora's scoring) but never in a circle, lazy imports
    inside functions included."""
    scripts = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    graph = {name: {m.split(".")[0] for m in _imports(path)} & set(scripts) - {name} for name, path in scripts.items()}
    _assert_acyclic(graph)
