"""Model families: what the engine needs from a kind of model, and how a directory is recognised as one.

The engine, the pipeline and the app know no family by name.  A family is a package that registers itself
(`register_family`) with:

    detect(path) -> bool       does this directory hold one of my models? (a transformers config.json
                               `model_type`, or the family's own files)
    load(path, ...) -> LoadedModel
                               the LM (a transformers model; placed over devices when the loader takes
                               device_map / max_memory / offload_folder, as the built-in ones do), and for it:
        tokenizer              FamilyTokenizer: the vocabulary layout (models.vocab.UnifiedVocab: text range,
                               image-code range, image start/end, row/line markers, grid, forced image header
                               and trailer) whose modality_table() the routers read, and prompt formatting
                               (encode_text, image_span) and read-back (decode_text, token_piece, codes_from_ids)
        image_tokenizer        ImageCodec: encode(images) -> codes [N, rows, cols], decode(codes) -> PIL images
                               (a family without a pixel decoder says so: decode raises, documents keep codes)
        lora_targets           the LM's linear layers that routed LoRA may wrap (a regex or name suffixes)
    checks                     best_of checks the family registers: {name: factory(pipeline) -> check(docs)}

Built-in families (imported lazily, on the first lookup): the embedded shapes world (models/families/shapes/family.py),
Emu3 (models/families/emu3/), Chameleon / Anole (models/families/chameleon/) and Janus (models/families/janus/).  A third-party family calls
register_family on import.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image

from molora.models.engine.best_of import CHECKS, Check, register_check
from molora.models.engine.sampling import GenerationError
from molora.models.engine.vocab import UnifiedVocab
from molora.models.families.loading import (
    DEFAULT_MODEL_DIR,
    DeviceMap,
    LoadedModel,
    ModelDirError,
    PlacementError,
    placing,
)

log = logging.getLogger(__name__)

BUILTIN_FAMILIES = ("molora.models.families.shapes.family", "molora.models.families.emu3.family", "molora.models.families.chameleon.family",
                    "molora.models.families.janus.family")
DEFAULT_FAMILY = "shapes"


@runtime_checkable
class FamilyTokenizer(Protocol):
    """Text and image spans <-> ids in ONE vocabulary (models/families/shapes/tokenizer.py UnifiedTokenizer is the shapes one)."""

    vocab: UnifiedVocab

    def encode_text(self, text: str) -> list[int]: ...

    def decode_text(self, ids: Iterable[int] | torch.Tensor) -> str: ...

    def token_piece(self, token_id: int) -> str: ...

    def image_span(self, codes: torch.Tensor) -> list[int]: ...

    def codes_from_ids(self, ids: Iterable[int] | torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ImageCodec(Protocol):
    """Pictures <-> codebook indices of the family's image tokenizer (a VQ model)."""

    grid: tuple[int, int]
    codebook_size: int

    def encode(self, images: Any) -> torch.Tensor: ...

    def decode(self, codes: torch.Tensor) -> list[Image.Image]: ...


@dataclass
class ModelFamily:
    """One kind of model the pipeline can serve (see the module docstring)."""

    name: str
    detect: Callable[[Path], bool]
    load: Callable[..., LoadedModel]  # load(path, *, adapters_dir, device, dtype, **options)
    checks: dict[str, Callable[[Any], Check]] = field(default_factory=dict)
    description: str = ""


_FAMILIES: dict[str, ModelFamily] = {}
_builtins_loaded = False


def register_family(family: ModelFamily) -> ModelFamily:
    """Make a family known (registering it again replaces it) and register its best_of checks."""
    if not isinstance(family, ModelFamily) or not family.name:
        raise ModelDirError(f"register_family takes a named ModelFamily, got {family!r}")
    _FAMILIES[family.name] = family
    for name, factory in family.checks.items():
        register_check(name, factory)
    return family


def load_builtin_families() -> None:
    """Import the built-in family packages once (each registers itself)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    for module in BUILTIN_FAMILIES:
        importlib.import_module(module)
    _builtins_loaded = True


def make_check(name: str, pipe: Any) -> Check:
    """The check registered as `name`, made for `pipe` (the built-in families register theirs on first lookup)."""
    load_builtin_families()
    if name not in CHECKS:
        raise GenerationError(f"unknown check {name!r}; registered checks: {', '.join(sorted(CHECKS))} "
                              "(add one with molora.models.engine.best_of.register_check)")
    return CHECKS[name](pipe)


def families() -> dict[str, ModelFamily]:
    load_builtin_families()
    return dict(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    known = families()
    if name not in known:
        raise ModelDirError(f"unknown model family {name!r}; known families: {', '.join(known)}")
    return known[name]


def config_model_type(path: Path) -> str | None:
    """The `model_type` of a transformers config.json in `path` (None when there is none or it is unreadable)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deep
        return None
    value = data.get("model_type") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def detect_family(path: str | Path | None) -> ModelFamily:
    """The family of the model in `path` (None = the embedded model: shapes). A directory no family claims is
    the shapes family's to load when it is not a transformers model (its loader names the missing files);
    a transformers config of an unsupported model_type is an error naming the supported ones."""
    known = families()
    if path is None:
        return known[DEFAULT_FAMILY]
    path = Path(path)
    for family in known.values():
        if family.detect(path):
            return family
    model_type = config_model_type(path) if path.is_dir() else None
    if model_type is not None:
        raise ModelDirError(f"{path} holds a transformers model of type {model_type!r}, which no model family "
                            f"supports; supported families: {', '.join(known)}")
    return known[DEFAULT_FAMILY]


def load_family_model(path: str | Path | None = None, *, family: str | None = None,
                      adapters_dir: str | Path | None = None, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, device_map: DeviceMap | None = None,
                      max_memory: dict[Any, Any] | None = None, offload_folder: str | Path | None = None,
                      **options: Any) -> LoadedModel:
    """Recognise the family of `path` (or take `family` by name) and load its model; `options` go to the
    family's loader (e.g. Emu3's grid=(rows, cols) of generated pictures).

    `device_map` ("auto" or {module name: device}, with `max_memory` and `offload_folder`) places a model larger
    than one device through transformers / accelerate; with `device` as well it is a PlacementError, raised
    before anything is read. Every built-in family takes it; a loader that does not is refused by name."""
    placed = placing(device, device_map, max_memory, offload_folder)
    chosen = get_family(family) if family is not None else detect_family(path)
    params = inspect.signature(chosen.load).parameters
    if placed is not None:
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if not takes_any and "device_map" not in params:
            raise PlacementError(f"the {chosen.name} family's loader takes no device_map; load it on one device "
                                 "with device=")
        options["device_map"] = device_map
        if max_memory is not None:
            options["max_memory"] = max_memory
        if offload_folder is not None:
            options["offload_folder"] = offload_folder
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ModelDirError(f"the {chosen.name} family takes no option {', '.join(unknown)} (its loader takes "
                                f"{', '.join(n for n in params if n != 'path')})")
    log.info("loading %s as a %s model", path or DEFAULT_MODEL_DIR, chosen.name)
    loaded = chosen.load(path, adapters_dir=adapters_dir, device=device, dtype=dtype, **options)
    loaded.family = chosen.name
    return loaded


__all__ = ["BUILTIN_FAMILIES", "FamilyTokenizer", "ImageCodec", "ModelFamily", "detect_family", "families",
           "get_family", "load_builtin_families", "make_check", "load_family_model", "register_family"]
