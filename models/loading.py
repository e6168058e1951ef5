"""Load a model directory (assets/model layout) and the adapters beside it, checking everything first.

    assets/model/vocab.json, tokenizer.json, lm/ (transformers, safetensors), vq/ (diffusers VQModel), README.md
    assets/model/generation.json      optional: default GenerationConfig fields for this model
    assets/adapters/<name>/           adapter_config.json + adapter_model.safetensors (+ molora.json modality)
    assets/router/gates.safetensors   optional: learned-router gates (routing.LearnedGates.save) over adapters

Missing pieces are reported all at once, by path, as a ModelDirError (a MoLoRAError).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from molora.models.checkpoint import check_checkpoint, check_finite, read_config
from molora.models.runtime import configure_cpu_threads
from molora.routing.cache import (
    AdapterInfo,  # the adapter registry's metadata (name, path, modality, description)
)
from molora.routing.errors import MoLoRAError
from molora.routing.model import input_device

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "assets" / "model"
DEFAULT_ADAPTERS_DIR = REPO_ROOT / "assets" / "adapters"
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
    family: str = "shapes"  # models/family.py: the family that loaded it
    lora_targets: Any = None  # the LM linears routed LoRA wraps (regex or name suffixes); None = routing's defaults

    @property
    def vocab(self) -> Any:
        return self.tokenizer.vocab

    @property
    def max_positions(self) -> int:
        config = self.lm.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(getattr(text, "max_position_embeddings", 2048))


def missing_model_files(model_dir: Path) -> list[str]:
    """The required files of a model directory that are not there (empty list = complete)."""
    missing = [str(model_dir / name) for name in ("vocab.json", "tokenizer.json", "lm/config.json",
                                                  "vq/config.json") if not (model_dir / name).is_file()]
    for sub in ("lm", "vq"):
        if (model_dir / sub).is_dir() and not any((model_dir / sub).glob("*.safetensors")):
            missing.append(str(model_dir / sub / "*.safetensors"))
    return missing


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


@contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """transformers' "Loading weights" bar only when `show` (its setting is global: restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not show:
            hf_logging.enable_progress_bar()


def load_model_dir(path: str | Path | None = None, *, adapters_dir: str | Path | None = None,
                   device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                   threads: int | None = None, device_map: DeviceMap | None = None,
                   max_memory: dict[Any, Any] | None = None, offload_folder: str | Path | None = None) -> LoadedModel:
    """Load tokenizer, LM and VQ of a model directory (None = assets/model) and list its adapters.

    `device_map` (with `max_memory`, `offload_folder`) places the LM over devices through transformers and
    accelerate instead of moving it to `device` (both at once: PlacementError); the VQ then goes to the LM's
    input device.

    Also sets torch's CPU thread count (models/runtime.py: `threads`, else $MOLORA_THREADS, else 1; 0 leaves it).

    Checks before loading anything big: the files exist, and the LM's and the VQ's weights fill the models their
    configs describe (models/checkpoint.py: names, dtypes, shapes from the safetensors headers); after: no NaN/Inf
    weight, the LM's vocabulary covers the unified vocabulary and the VQ's grid and codebook match it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from molora.models.image_tokenizer import ImageTokenizer
    from molora.models.tokenizer import UnifiedTokenizer

    placed = placing(device, device_map, max_memory, offload_folder)
    model_dir, adapters_dir = resolve_dirs(path, adapters_dir)
    if not model_dir.is_dir():
        hint = (" (build the embedded model with scripts/build_embedded.sh and copy OUT/model and OUT/adapters "
                "into assets/, or pass a model directory)") if path is None else ""
        raise ModelDirError(f"model directory {model_dir} does not exist{hint}")
    missing = missing_model_files(model_dir)
    if missing:
        raise ModelDirError(f"{model_dir} is not a complete model directory; missing: {', '.join(missing)}")
    configure_cpu_threads(threads)
    if placed is None:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    else:
        dtype = dtype or placed.default_dtype()

    tokenizer = UnifiedTokenizer.load(model_dir)
    vocab = tokenizer.vocab
    lm_dir = model_dir / "lm"
    try:
        lm_config = AutoConfig.from_pretrained(str(lm_dir))
    except Exception as exc:  # transformers raises many types on a bad config (TypeError, ZeroDivisionError, ...)
        raise ModelDirError(f"{lm_dir / 'config.json'} is not a transformers config ({type(exc).__name__}: {exc})") from exc
    # before anything is allocated: the weights fill the model the config describes (no size taken on trust)
    check_checkpoint(lm_dir, read_config(lm_dir / "config.json", ModelDirError),
                     lambda: AutoModelForCausalLM.from_config(lm_config), ModelDirError)
    placement = {} if placed is None else placed.from_pretrained_kwargs()
    try:
        with _progress_bars(log.isEnabledFor(logging.INFO)):  # a library is quiet unless logging asks for more
            lm = AutoModelForCausalLM.from_pretrained(str(lm_dir), use_safetensors=True, dtype=dtype, **placement)
    except Exception as exc:
        raise ModelDirError(f"cannot load the language model from {lm_dir} ({type(exc).__name__}: {exc})") from exc
    if placed is None:
        check_finite(lm, lm_dir, ModelDirError)
        lm = lm.to(device).eval().requires_grad_(False)
    else:
        check_finite_placed(lm, lm_dir, ModelDirError)
        lm = lm.eval().requires_grad_(False)
        device = input_device(lm, torch.device("cpu"))
        log.info("language model placed by device_map: %s", getattr(lm, "hf_device_map", device_map))
    # from_pretrained replaces name_or_path by the directory; adapters name the stable base-model name
    lm.name_or_path = getattr(lm.config, "molora_base_model", None) or lm.name_or_path
    lm_vocab = int(lm.config.get_text_config().vocab_size)
    if lm_vocab < vocab.vocab_size:
        raise ModelDirError(f"{model_dir / 'lm'} has {lm_vocab} token embeddings but vocab.json needs "
                            f"{vocab.vocab_size}; the LM and the tokenizer do not belong together")
    image_tokenizer = ImageTokenizer.from_pretrained(model_dir / "vq", device=device, dtype=torch.float32)
    if tuple(image_tokenizer.grid) != tuple(vocab.image_grid) or image_tokenizer.codebook_size != vocab.image_size:
        raise ModelDirError(f"{model_dir / 'vq'} makes {image_tokenizer.grid} grids of a {image_tokenizer.codebook_size}"
                            f"-code book, but vocab.json expects {tuple(vocab.image_grid)} and {vocab.image_size}")

    defaults: dict = {}
    gen_path = model_dir / "generation.json"
    if gen_path.is_file():
        defaults = read_config(gen_path, ModelDirError)
    adapters = find_adapters(adapters_dir) if adapters_dir is not None else []
    gates = None
    for root in [d for d in (adapters_dir.parent if adapters_dir else None, model_dir) if d is not None]:
        for rel in GATES_CANDIDATES:
            if (root / rel).is_file():
                gates = gates or root / rel
    log.info("loaded %s: vocab %d, %d adapters%s", model_dir, vocab.vocab_size, len(adapters),
             f", learned gates {gates}" if gates else "")
    return LoadedModel(model_dir, tokenizer, lm, image_tokenizer, adapters, gates, defaults)


def adapter_weights_hash(folder: str | Path) -> str:
    """First 16 hex digits of the SHA-256 of an adapter folder's adapter_model.safetensors: what a router's
    config.json records for each adapter its gates were trained on (scripts/train_router.py)."""
    return hashlib.sha256((Path(folder) / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]

