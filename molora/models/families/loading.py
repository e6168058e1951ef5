"""What every model family's loader shares: where the shipped assets are, placement over devices, the adapter
folders beside a model, and the errors (ModelDirError, PlacementError: MoLoRAErrors).

    <model dir>/../adapters/<name>/    adapter_config.json + adapter_model.safetensors (+ molora.json modality)
    <model dir>/../router/gates.safetensors   optional: learned-router gates over those adapters

The embedded model's own directory layout and loader: models/families/shapes/loading.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from molora.routing.cache import (
    AdapterInfo,  # the adapter registry's metadata (name, path, modality, description)
)
from molora.routing.errors import MoLoRAError

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # molora/
# the shipped assets: molora/assets in an installed copy (pyproject.toml maps them there), <checkout>/assets in a
# source checkout (the repository's top level, where the device tool and the Space see them)
ASSETS_DIR = next((d for d in (PACKAGE_DIR / "assets", PACKAGE_DIR.parent / "assets") if d.is_dir()),
                  PACKAGE_DIR.parent / "assets")
DEFAULT_MODEL_DIR = ASSETS_DIR / "model"
DEFAULT_ADAPTERS_DIR = ASSETS_DIR / "adapters"
GATES_CANDIDATES = ("router/gates.safetensors", "gates.safetensors")
MODALITIES = ("text", "image", "any")


class ModelDirError(MoLoRAError):
    """A model or adapter directory that is missing files or whose pieces do not fit together."""


class PlacementError(MoLoRAError):
    """Where to put a model was asked in ways that cannot hold together (device= with device_map=, max_memory=
    without device_map=, a device_map for a loader that cannot take one)."""


DeviceMap = str | dict[str, Any]


@dataclass
class Placing:
    """How to place a model that does not fit one device: transformers' / accelerate's device_map ("auto",
    "balanced", "sequential", or {module name: device}), max_memory ({device: bytes or "10GiB"}) and the folder
    for weights a device_map sends to "disk"."""

    device_map: DeviceMap
    max_memory: dict[Any, Any] | None = None
    offload_folder: str | Path | None = None

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            kwargs["offload_folder"] = str(self.offload_folder)
        return kwargs

    def default_dtype(self) -> torch.dtype:
        """bf16 when the map may put layers on a GPU, float32 when everything stays on the CPU (or disk)."""
        values = list(self.device_map.values()) if isinstance(self.device_map, dict) else [self.device_map]
        for value in values:
            if isinstance(value, int) or (isinstance(value, torch.device) and value.type == "cuda"):
                return torch.bfloat16
            if isinstance(value, str) and (value.startswith("cuda") or value in ("auto", "balanced",
                                                                                  "balanced_low_0", "sequential")):
                if value.startswith("cuda") or torch.cuda.is_available():
                    return torch.bfloat16
        return torch.float32


def placing(device: Any = None, device_map: DeviceMap | None = None, max_memory: dict[Any, Any] | None = None,
            offload_folder: str | Path | None = None) -> Placing | None:
    """The Placing a loader was asked for (None: one device, `device`); contradictory requests raise
    PlacementError before anything is loaded."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise PlacementError("max_memory= and offload_folder= place a model over devices and need device_map= "
                                 "(e.g. device_map=\"auto\"); without it, pass device= alone")
        return None
    if device is not None:
        raise PlacementError(f"pass device= ({device!r}) or device_map= ({device_map!r}), not both: device_map "
                             "already says where every layer goes (device_map={\"\": \"cuda:0\"} puts all on one)")
    if not isinstance(device_map, (str, dict)) or (isinstance(device_map, dict) and not device_map):
        raise PlacementError(f"device_map must be \"auto\", \"balanced\", \"balanced_low_0\", \"sequential\" or a "
                             f"non-empty {{module name: device}} dict; got {device_map!r}")
    if max_memory is not None and not isinstance(max_memory, dict):
        raise PlacementError(f"max_memory must be a {{device: size}} dict (e.g. {{0: \"20GiB\", \"cpu\": \"60GiB\"}}); "
                             f"got {max_memory!r}")
    return Placing(device_map, max_memory, offload_folder)


def check_finite_placed(model: torch.nn.Module, where: Path, error: type[Exception]) -> None:
    """check_finite for a model dispatched by accelerate: weights it offloaded (on "meta" in the module) are read
    from the offload map of the hook that streams them in."""
    bad = []
    for module_name, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if t.device.type == "meta":
                t = _offloaded_tensor(module, name)
                if t is None:
                    continue
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{module_name}.{name}" if module_name else name)
    if bad:
        raise error(f"{where}: {len(bad)} weights hold NaN or Inf values (e.g. {bad[:3]}); the checkpoint is "
                    "corrupt or its training diverged")


def _offloaded_tensor(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        weights = getattr(h, "weights_map", None)
        if weights is not None:
            try:
                return weights[name]
            except KeyError:
                return None
    return None


@dataclass
class LoadedModel:
    path: Path
    tokenizer: Any  # models.tokenizer.UnifiedTokenizer
    lm: torch.nn.Module  # transformers causal LM
    image_tokenizer: Any  # models.image_tokenizer.ImageTokenizer
    adapters: list[AdapterInfo] = field(default_factory=list)
    gates_path: Path | None = None
    generation_defaults: dict = field(default_factory=dict)
    family: str = "shapes"  # models/families/family.py: the family that loaded it
    lora_targets: Any = None  # the LM linears routed LoRA wraps (regex or name suffixes); None = routing's defaults

    @property
    def vocab(self) -> Any:
        return self.tokenizer.vocab

    @property
    def max_positions(self) -> int:
        config = self.lm.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(getattr(text, "max_position_embeddings", 2048))


def read_adapter_info(path: str | Path, name: str | None = None) -> AdapterInfo:
    """Name and modality of an adapter folder (molora.json is optional; a bad one is an error)."""
    path = Path(path)
    info = AdapterInfo(name or path.resolve().name, path)
    meta_path = path / "molora.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ModelDirError(f"{meta_path} is not valid JSON: {exc}") from exc
        modality = meta.get("modality", "any") if isinstance(meta, dict) else None
        if modality not in MODALITIES:
            raise ModelDirError(f"{meta_path}: modality must be one of {MODALITIES}, got {modality!r}")
        info.modality = modality
        info.description = str(meta.get("description", ""))
    return info


def find_adapters(adapters_dir: Path) -> list[AdapterInfo]:
    """Every adapter folder (holding adapter_config.json) directly under `adapters_dir`, sorted by name."""
    if not adapters_dir.is_dir():
        return []
    return [read_adapter_info(p) for p in sorted(adapters_dir.iterdir())
            if p.is_dir() and (p / "adapter_config.json").is_file()]


def adapter_rank(path: Path) -> int:
    """Largest LoRA rank in an adapter folder's weights (rows of its lora_A tensors, from the safetensors header),
    for sizing the hot set.  The config's r / rank_pattern are not trusted here: rank_pattern {"q_proj": 2**28}
    sized 128 GB of slots before the loader could refuse the adapter.  A rank counts only with a non-empty A, whose
    bytes the file must hold, so a declared rank is bounded by the file's size."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt", device="cpu") as f:
            shapes = [f.get_slice(k).get_shape() for k in f.keys() if ".lora_A" in k]
        return max((s[0] for s in shapes if len(s) == 2 and min(s) > 0), default=0)
    except Exception:  # safetensors' own error types
        return 0  # the adapter loader reports the real problem


def resolve_dirs(path: str | Path | None, adapters_dir: str | Path | None) -> tuple[Path, Path | None]:
    """(model_dir, adapters_dir). `path` may be a model dir or a folder holding model/ (+ adapters/)."""
    if path is None:
        model_dir = DEFAULT_MODEL_DIR
    else:
        model_dir = Path(path)
        if not model_dir.exists():
            raise ModelDirError(f"model path {model_dir} does not exist")
        if not (model_dir / "vocab.json").is_file() and (model_dir / "model" / "vocab.json").is_file():
            model_dir = model_dir / "model"
    if adapters_dir is not None:
        return model_dir, Path(adapters_dir)
    for candidate in (model_dir / "adapters", model_dir.parent / "adapters"):
        if candidate.is_dir():
            return model_dir, candidate
    return model_dir, None


def adapter_weights_hash(folder: str | Path) -> str:
    """First 16 hex digits of the SHA-256 of an adapter folder's adapter_model.safetensors: what a router's
    config.json records for each adapter its gates were trained on (scripts/train_router.py)."""
    return hashlib.sha256((Path(folder) / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]

