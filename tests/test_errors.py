"""One base error class at the bottom layer (kernels/errors.py MoLoRAError) that every project error derives from.

The project's exception classes are found by reading every source file (so a new one cannot be forgotten), then
checked on the imported class object.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from molora.kernels.errors import KernelInputError, MoLoRAError

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "routing", "models", "app", "molora")
BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException)}
EXCEPTION_SUFFIXES = ("Error", "Exception", "Warning", "Exit", "Interrupt")


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _exception_classes(path: Path) -> list[str]:
    """Names of the classes in `path` whose bases look like exception types (built-in or *Error / *Exception)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [_base_name(b) for b in node.bases]
            if any(b in BUILTIN_EXCEPTIONS or b.endswith(EXCEPTION_SUFFIXES) for b in bases):
                found.append(node.name)
    return found


def _project_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    files += sorted((REPO / "scripts").glob("*.py")) + [REPO / "app.py"]
    return [p for p in files if "__pycache__" not in p.parts]


def _import(path: Path):
    rel = path.relative_to(REPO)
    if rel.parts[0] in PACKAGES:
        parts = rel.with_suffix("").parts  # kernels/errors.py is molora.kernels.errors; molora/cli.py is molora.cli
        return importlib.import_module(".".join(parts if parts[0] == "molora" else ("molora", *parts))
                                       .removesuffix(".__init__"))
    # scripts/*.py and app.py are not packages: import them by path (their own sys.path setup runs, main does not)
    name = f"_errors_scan_{rel.with_suffix('').as_posix().replace('/', '_')}"
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


EXCEPTION_DEFS = [(path, name) for path in _project_files() for name in _exception_classes(path)]


def test_the_scan_finds_the_known_error_classes():
    names = {name for _, name in EXCEPTION_DEFS}
    assert {"KernelInputError", "AdapterError", "VocabError", "RouterDataError", "UploadError",
            "ModelDirError"} <= names
    assert ("MoLoRAError" in names) and sum(name == "MoLoRAError" for _, name in EXCEPTION_DEFS) == 1


def test_each_error_class_is_defined_in_one_place():
    where: dict[str, list[str]] = {}
    for path, name in EXCEPTION_DEFS:
        where.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert {n: w for n, w in where.items() if len(w) > 1} == {}


@pytest.mark.parametrize("path, name", EXCEPTION_DEFS,
                         ids=[f"{p.relative_to(REPO)}:{n}" for p, n in EXCEPTION_DEFS])
def test_every_project_error_derives_from_molora_error(path: Path, name: str):
    cls = getattr(_import(path), name)
    assert issubclass(cls, BaseException)
    assert issubclass(cls, MoLoRAError), f"{path.relative_to(REPO)}: {name} must derive from MoLoRAError"


def test_the_base_class_is_defined_once_at_the_bottom_and_reexported():
    import molora.routing as routing

    assert MoLoRAError.__module__ == "molora.kernels.errors"
    assert routing.errors.MoLoRAError is MoLoRAError
    assert routing.MoLoRAError is MoLoRAError


def test_value_error_mixins_stay_for_callers_that_catch_value_error():
    from molora.models.engine.vocab import VocabError
    from molora.routing.errors import UnknownAdapterError

    for cls in (KernelInputError, VocabError):
        assert issubclass(cls, ValueError) and issubclass(cls, MoLoRAError)
    assert issubclass(UnknownAdapterError, KeyError)
    router_data_error = _import(REPO / "scripts" / "train_router.py").RouterDataError
    assert issubclass(router_data_error, ValueError) and issubclass(router_data_error, MoLoRAError)


def test_bad_kernel_input_is_caught_as_the_project_error():
    import torch

    from molora.kernels import routed_lora

    x = torch.zeros(3, 8)
    with pytest.raises(MoLoRAError):
        routed_lora(x, torch.zeros(2, 4, 9), torch.zeros(2, 8, 4), torch.zeros(3, dtype=torch.int32),
                    torch.ones(2))
