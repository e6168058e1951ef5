"""LoRA adapters in the PEFT on-disk format: load, validate, save.

A PEFT LoRA folder is two files anyone can read: `adapter_config.json` (r, lora_alpha, use_rslora,
rank_pattern / alpha_pattern, target_modules, base_model_name_or_path, ...) and `adapter_model.safetensors`
with keys `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].

Only safetensors is read: `.bin` / `.pt` files are pickles, and unpickling runs code, so they are refused.
Everything is validated (format, finite values, matching A/B ranks, ranks agreeing with the config) before an
adapter object exists, so a bad file can never leave half-loaded state behind.  Checks against a particular
model (module names, shapes, r_max) happen when the adapter is added to a `HotSetCache` / `RoutedModel`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from molora.routing.errors import AdapterError

log = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # peft writes ~2 kB; a rank_pattern over every module of a big model stays far below
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")

# PEFT features that change what a LoRA computes beyond y += scale * B A x; we refuse them rather than
# silently computing something else.  Value = the setting under which the feature is off.
_UNSUPPORTED_OFF = {
    "use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "modules_to_save": None,
    "trainable_token_indices": None, "layer_replication": None, "target_parameters": None,
    "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None,
}
# dtypes LoRA A/B may have (safetensors' names): ints, bools, complex and float8/float4 are refused from the file's
# header, before any tensor is read
LORA_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# a scale beyond float32's range becomes Inf in the cache's float32 scale table
_MAX_SCALE = float(torch.finfo(torch.float32).max)


@dataclass
class LoraAdapter:
    """One LoRA adapter: per module (dotted path inside the HF model) A [r, in], B [out, r] and a scale.

    `config` is the PEFT adapter_config dict it came from (kept so a save round-trips the user's settings).
    """

    name: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scales: dict[str, float]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)

    @property
    def rank(self) -> int:
        """The largest rank over modules (what must fit in the cache's r_max)."""
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)

    @property
    def base_model_name_or_path(self) -> str | None:
        return self.config.get("base_model_name_or_path") or None

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def validate(self) -> None:
        """Structural checks that need no model: 2-D float A/B with matching rank, finite values and scales."""
        if not isinstance(self.name, str) or not self.name:
            raise AdapterError(f"adapter name must be a non-empty string, got {self.name!r}")
        if not self.weights:
            raise AdapterError(f"adapter '{self.name}' has no LoRA weights")
        for module, (a, b) in self.weights.items():
            where = f"adapter '{self.name}', module '{module}'"
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                raise AdapterError(f"{where}: A and B must be torch tensors")
            if a.dim() != 2 or b.dim() != 2:
                raise AdapterError(f"{where}: A must be [r, in] and B [out, r]; got {tuple(a.shape)} and "
                                   f"{tuple(b.shape)}")
            if a.shape[0] != b.shape[1] or a.shape[0] == 0:
                raise AdapterError(f"{where}: rank mismatch, A is {tuple(a.shape)} but B is {tuple(b.shape)} "
                                   "(need A [r, in], B [out, r] with r >= 1)")
            for label, t in (("A", a), ("B", b)):
                if t.dtype not in LORA_DTYPES.values():
                    raise AdapterError(f"{where}: lora_{label} has dtype {t.dtype}; LoRA weights must be float16, "
                                       "bfloat16, float32 or float64")
                if not bool(torch.isfinite(t).all()):
                    raise AdapterError(f"{where}: lora_{label} contains NaN or Inf values; the adapter file is "
                                       "corrupt or its training diverged - retrain or re-export it")
            if module not in self.scales:
                raise AdapterError(f"{where}: no scale given")
            scale = self.scales[module]
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                    or abs(scale) > _MAX_SCALE:
                raise AdapterError(f"{where}: scale {scale!r} is not a finite number within float32's range "
                                   "(check lora_alpha and r in adapter_config.json)")
        extra = set(self.scales) - set(self.weights)
        if extra:
            raise AdapterError(f"adapter '{self.name}': scales given for modules without weights: {sorted(extra)}")


def merge_adapters(adapters: list[LoraAdapter], name: str) -> LoraAdapter:
    """One adapter whose delta is exactly the sum of the given adapters' deltas (the "merged" baseline).

    Ranks are concatenated (A stacked on rows, B on columns) and each adapter's scale is folded into its B,
    so every module of the result has scale 1 and rank = the sum of the ranks that target it.
    """
    if len(adapters) < 2:
        raise AdapterError(f"merging needs at least two adapters, got {len(adapters)}")
    modules = sorted({m for adapter in adapters for m in adapter.weights})
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in modules:
        parts = [(adapter.weights[module], adapter.scales[module]) for adapter in adapters if module in adapter.weights]
        a = torch.cat([a for (a, _), _ in parts], dim=0)
        b = torch.cat([b * scale for (_, b), scale in parts], dim=1)
        weights[module] = (a, b)
    bases = {a.base_model_name_or_path for a in adapters} - {None}
    config = {"peft_type": "LORA", "base_model_name_or_path": bases.pop() if len(bases) == 1 else None,
              "merged_from": [a.name for a in adapters]}
    merged = LoraAdapter(name, weights, {m: 1.0 for m in modules}, config)
    merged.validate()
    return merged


# --- base-model names -----------------------------------------------------------------------------------

def same_base_model(a: str | None, b: str | None) -> bool:
    """Whether two base_model_name_or_path strings name the same model.

    Unknown on either side (None / "") counts as a match: nothing to compare.  Otherwise equal after
    normalising separators; or, when at least one side is a filesystem path rather than a hub id
    ("org/name"), the same final path component, so "org/Model-1B" matches a local copy "/data/Model-1B" and
    "assets/model/lm" its absolute path, while hub ids "orgA/Model-1B" and "orgB/Model-1B" stay different.
    """
    if not a or not b:
        return True
    na, nb = (str(s).replace("\\", "/").rstrip("/") for s in (a, b))
    if na == nb:
        return True
    return not (_is_hub_id(na) and _is_hub_id(nb)) and na.rsplit("/", 1)[-1] == nb.rsplit("/", 1)[-1]


def _is_hub_id(name: str) -> bool:
    """'org/name' or 'name' (a model hub id), as opposed to a path such as '/data/x', './x' or 'a/b/c'."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1 and not Path(name).is_dir()


def check_base_model(adapter_base: str | None, model_base: str | None, *, name: str, force: bool) -> None:
    if force or same_base_model(adapter_base, model_base):
        return
    raise AdapterError(f"adapter '{name}' was trained on base model '{adapter_base}' but the model is "
                       f"'{model_base}'; a LoRA only makes sense on its own base model. Pass force=True to "
                       "load it anyway.")


# --- scales from a PEFT config ----------------------------------------------------------------------------

def _pattern_value(config: dict[str, Any], name: str, module: str, default: Any) -> Any:
    """PEFT's rule (peft.utils.other.get_pattern_key): first pattern of config[name] (rank_pattern /
    alpha_pattern) that matches the end of the module path."""
    patterns = config.get(name) or {}
    if not isinstance(patterns, dict):
        raise AdapterError(f"adapter_config.json: {name} must be an object {{module pattern: value}}, got "
                           f"{type(patterns).__name__}")
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise AdapterError(f"adapter_config.json: {name} key {key!r} is not a valid regular expression ({e})") from e
    return default


def peft_scale(config: dict[str, Any], module: str) -> tuple[int, float]:
    """(rank, scale) PEFT gives `module` under `config`: alpha / r, or alpha / sqrt(r) with use_rslora."""
    r = _pattern_value(config, "rank_pattern", module, config.get("r", 8))
    alpha = _pattern_value(config, "alpha_pattern", module, config.get("lora_alpha", 8))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"adapter_config.json gives rank r={r!r} for module '{module}'; need a positive int")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"adapter_config.json gives lora_alpha={alpha!r} for module '{module}'")
    denom = math.sqrt(r) if config.get("use_rslora") else r
    return r, float(alpha) / denom


# --- loading ------------------------------------------------------------------------------------------------

def _refuse_pickles(path: Path) -> None:
    if path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
        raise AdapterError(f"{path} is a pickle file; loading pickles can run arbitrary code, so only "
                           f"safetensors is accepted. Convert it with peft (save_pretrained(..., "
                           "safe_serialization=True)) in an environment you trust.")
    if path.is_dir() and not (path / WEIGHTS_NAME).exists():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(f"{path} holds only pickle weights ({', '.join(pickles)}); loading pickles can run "
                               f"arbitrary code, so only {WEIGHTS_NAME} is accepted. Re-save the adapter with "
                               "peft's save_pretrained(..., safe_serialization=True) in an environment you trust.")


def parse_adapter_config(raw: bytes, where: str) -> dict[str, Any]:
    """The JSON object of an adapter_config.json, checked to be a LoRA config (AdapterError otherwise).

    Shared by the folder loader and by callers that validate uploaded bytes before writing anything.
    """
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise AdapterError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise AdapterError(f"{where} must hold a JSON object")
    if "peft_type" not in config and "model_type" in config:
        raise AdapterError(f"{where} is a model's config (model_type={config['model_type']!r}), not a PEFT adapter "
                           "config; an adapter folder holds the adapter_config.json that peft's save_pretrained writes")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {peft_type}; only LoRA adapters can be routed")
    return config


def _read_config(folder: Path) -> dict[str, Any]:
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_NAME}; a PEFT LoRA folder needs {CONFIG_NAME} and "
                           f"{WEIGHTS_NAME}")
    try:
        if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"{cfg_path} is {cfg_path.stat().st_size} bytes; an adapter config is a few kilobytes")
        config = parse_adapter_config(cfg_path.read_bytes(), str(cfg_path))
    except OSError as e:
        raise AdapterError(f"{cfg_path} cannot be read: {e}") from e
    for key, off in _UNSUPPORTED_OFF.items():
        value = config.get(key, off)
        if value not in (off, None, False, [], {}):
            raise AdapterError(f"{cfg_path}: {key}={value!r} is not supported (only plain LoRA y += scale*B@A@x "
                               f"can be routed); re-train without {key}")
    return config


def _check_header(weights_path: Path, header: dict[str, tuple[str, list[int]]]) -> None:
    """Names, dtypes and ranks (2-D) of every tensor, from the safetensors header alone (nothing read yet)."""
    for key, (dtype, shape) in header.items():
        if _KEY.match(key) is None:
            raise AdapterError(f"{weights_path}: unexpected tensor '{key}'; only lora_A / lora_B weights of "
                               "linear layers are supported (no embedding LoRA, DoRA magnitudes or biases)")
        if dtype not in LORA_DTYPES:
            raise AdapterError(f"{weights_path}: tensor '{key}' has dtype {dtype}; LoRA weights must be one of "
                               f"{', '.join(LORA_DTYPES)} - re-export the adapter in float")
        if len(shape) != 2:
            raise AdapterError(f"{weights_path}: tensor '{key}' has shape {list(shape)}; LoRA weights are 2-D "
                               "(A [r, in], B [out, r])")


def _header_shapes(header: dict[str, tuple[str, list[int]]]) -> dict[str, tuple[list[int], list[int]]]:
    """{module: (A shape, B shape)} of the modules that have both (a missing half is reported later, by name)."""
    parts: dict[str, dict[str, list[int]]] = {}
    for key, (_, shape) in header.items():
        m = _KEY.match(key)
        parts.setdefault(m.group("module"), {})[m.group("which")] = shape
    return {module: (ab["A"], ab["B"]) for module, ab in parts.items() if set(ab) == {"A", "B"}}


def _read_tensors(weights_path: Path, fits: Callable[[dict[str, tuple[list[int], list[int]]]], None] | None = None
                  ) -> dict[str, torch.Tensor]:
    if not weights_path.is_file():
        raise AdapterError(f"{weights_path.parent} has no {WEIGHTS_NAME}")
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            header = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
            _check_header(weights_path, header)
            if fits is not None:  # the caller's model: shapes that do not fit it are refused before any read
                fits(_header_shapes(header))
            return {k: f.get_tensor(k) for k in f.keys()}
    except AdapterError:
        raise
    except Exception as e:  # safetensors raises its own error types (truncated header, bad offsets, ...)
        raise AdapterError(f"{weights_path} is not a readable safetensors file ({type(e).__name__}: {e}); "
                           "it may be truncated or corrupt - copy or export it again") from e


def load_peft_adapter(path: str | Path, *, name: str | None = None, base_model_name_or_path: str | None = None,
                      force: bool = False,
                      fits: Callable[[str, dict[str, tuple[list[int], list[int]]]], None] | None = None
                      ) -> LoraAdapter:
    """Read a LoRA folder written by `peft` (adapter_config.json + adapter_model.safetensors).

    `base_model_name_or_path`: the model it will be used with; a different base model in the adapter's config
    is an error unless `force`.  `name` defaults to the folder name.  `fits(name, {module: (A shape, B shape)})`
    (e.g. HotSetCache.check_shapes) checks the shapes the file's header declares against a model before any
    tensor is read: an adapter for another model is refused without reading its weights.
    """
    folder = Path(path)
    if not folder.exists():
        raise AdapterError(f"adapter path {folder} does not exist")
    _refuse_pickles(folder)
    if folder.is_file():
        if folder.name in (CONFIG_NAME, WEIGHTS_NAME):
            folder = folder.parent
        else:
            raise AdapterError(f"{folder} is a file; pass the adapter folder holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    config = _read_config(folder)
    adapter_name = name or folder.resolve().name
    tensors = _read_tensors(folder / WEIGHTS_NAME, None if fits is None else lambda shapes: fits(adapter_name, shapes))

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{folder / WEIGHTS_NAME}: unexpected tensor '{key}'; only lora_A / lora_B weights of "
                               "linear layers are supported (no embedding LoRA, DoRA magnitudes or biases)")
        slot = parts.setdefault(m.group("module"), {})
        if m.group("which") in slot:
            raise AdapterError(f"{folder / WEIGHTS_NAME}: module '{m.group('module')}' has lora_{m.group('which')} "
                               "twice (a file holding several adapters?); save one adapter per folder")
        slot[m.group("which")] = tensor

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scales: dict[str, float] = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{folder / WEIGHTS_NAME}: module '{module}' has no {missing} weight")
        r_cfg, scale = peft_scale(config, module)
        a, b = ab["A"], ab["B"]
        if a.dim() == 2 and a.shape[0] != r_cfg:
            raise AdapterError(f"{folder}: module '{module}' has rank {a.shape[0]} in the weights but the config "
                               f"(r / rank_pattern) says {r_cfg}; the two files do not belong together")
        weights[module] = (a, b)
        scales[module] = scale
    adapter = LoraAdapter(adapter_name, weights, scales, config)
    adapter.validate()
    check_base_model(adapter.base_model_name_or_path, base_model_name_or_path, name=adapter_name, force=force)
    # debug: the caller may still refuse it (shapes that do not fit the model); the pipeline logs what it accepts
    log.debug("read LoRA '%s' from %s: %d modules, rank %d", adapter_name, folder, len(weights), adapter.rank)
    return adapter


# --- saving ---------------------------------------------------------------------------------------------------

def _mode(values: list[Any]) -> Any:
    return Counter(values).most_common(1)[0][0]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _rank_alpha_config(adapter: LoraAdapter, rslora: bool) -> dict[str, Any] | None:
    """r / lora_alpha / patterns reproducing every module's (rank, scale); None if rslora cannot express it."""
    ranks = {m: a.shape[0] for m, (a, _) in adapter.weights.items()}
    alphas = {m: adapter.scales[m] * (math.sqrt(ranks[m]) if rslora else ranks[m]) for m in ranks}
    r0 = _mode(list(ranks.values()))
    alpha0 = _mode([round(v, 9) for v in alphas.values()])
    rank_pattern = {re.escape(m): r for m, r in ranks.items() if r != r0}
    alpha_pattern = {re.escape(m): a for m, a in alphas.items() if not _close(a, alpha0)}
    if rslora and (rank_pattern or alpha_pattern):
        return None  # peft refuses rslora together with patterns
    alpha0 = int(alpha0) if float(alpha0).is_integer() else alpha0
    return {"r": r0, "lora_alpha": alpha0, "use_rslora": rslora, "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern}


def save_peft_adapter(adapter: LoraAdapter, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Write `adapter` as a PEFT LoRA folder that `peft.PeftModel.from_pretrained` loads back exactly (`dtype`:
    the stored tensors' dtype, e.g. torch.bfloat16 to halve the file; None keeps theirs)."""
    if dtype is not None and dtype not in LORA_DTYPES.values():
        raise AdapterError(f"LoRA weights are stored as one of {sorted(LORA_DTYPES)}, not {dtype}")
    adapter.validate()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in adapter.config.items() if k not in ("layers_to_transform", "layers_pattern",
                                                                    "exclude_modules")}
    ranks = _rank_alpha_config(adapter, bool(config.get("use_rslora", False)))
    if ranks is None:
        ranks = _rank_alpha_config(adapter, False)
    config.update(ranks)
    config.update({
        "peft_type": "LORA",
        "task_type": config.get("task_type") or "CAUSAL_LM",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in adapter.weights}),
        "base_model_name_or_path": adapter.base_model_name_or_path,
        "bias": "none",
        "lora_dropout": float(config.get("lora_dropout", 0.0)),
        # modules named in target_modules but absent from the weights (other layers) must start as no-ops
        "init_lora_weights": True,
        "inference_mode": True,
    })
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in sorted(adapter.weights.items()):
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().to("cpu", dtype).contiguous()
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    log.info("saved LoRA '%s' to %s", adapter.name, folder)
