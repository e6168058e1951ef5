"""A checkpoint folder checked against the model its config.json describes, before anything is allocated.

`from_pretrained` builds the model its config declares (a config may declare any size), then fills in what the
safetensors files hold, and only warns about the rest, which it leaves random: a renamed key, a config of another
family or a truncated shard list then gives a model of random weights.  Here, first, the model is built on the
meta device (no memory), and every parameter it has is looked up in the safetensors headers (read without reading
a tensor): missing, non-float and mis-shaped weights are refused by name, as is a config that declares more
layers or blocks than the files hold tensors.  After loading, `check_finite` refuses NaN/Inf weights.

Used for the embedded model's LM and VQ (models/families/loading.py, models/families/shapes/image_tokenizer.py); the transformers families
(models/families/hf.py), whose checkpoints may use another key layout than their modules, use
`check_declared_counts` before loading and transformers' own missing-key report after.  `error` is the caller's
project error type (ModelDirError, ImageTokenizerError).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Emu3's config.json carries its whole vocabulary map (~5 MB); no real config comes near this
MAX_CONFIG_BYTES = 64 * 1024 * 1024


def read_headers(folder: Path, error: type[Exception]) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} over every *.safetensors file in `folder`, from the headers alone."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise error(f"{folder} holds no .safetensors weights")
    header: dict[str, tuple[str, list[int]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    header[key] = (part.get_dtype(), part.get_shape())
        except Exception as exc:  # safetensors' own error types: bad header length, offsets, overflowing shapes
            raise error(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}); it may be "
                        "truncated or corrupt - copy or export it again") from exc
    return header


def read_config(path: Path, error: type[Exception]) -> dict:
    """A config.json as a dict: readable, small, a JSON object."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise error(f"{path} is {path.stat().st_size} bytes; a model config is at most a few megabytes")
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise error(f"{path} is not a readable JSON file: {exc}") from exc
    if not isinstance(config, dict):
        raise error(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _declared_counts(config: dict, prefix: str = "") -> list[tuple[str, int]]:
    """(name, count) of every layer / block count a config declares (nested configs included)."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _declared_counts(value, f"{prefix}{key}.")
        elif any(word in key for word in ("layers", "blocks", "block_out_channels", "block_types")):
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((prefix + key, value))
            elif isinstance(value, list):
                found.append((prefix + key, len(value)))
    return found


def check_declared_counts(folder: Path, config: dict, error: type[Exception]) -> dict[str, tuple[str, list[int]]]:
    """Refuse a config that declares more layers or blocks than the checkpoint holds tensors (from_pretrained
    would build them all and initialise the missing ones at random: minutes and gigabytes for a 16 kB file).
    Needs no tensor names, so it also serves checkpoints saved under another key layout.  Returns the headers."""
    header = read_headers(folder, error)
    for name, count in _declared_counts(config):
        if count > len(header):
            raise error(f"{folder / 'config.json'} declares {name}={count}, but the checkpoint holds only "
                        f"{len(header)} tensors; the config does not belong to these weights")
    return header


def check_checkpoint(folder: Path, config: dict, build: Callable[[], nn.Module], error: type[Exception]) -> None:
    """Refuse a checkpoint whose tensors do not fill the model `build()` makes (built on the meta device)."""
    header = check_declared_counts(folder, config, error)
    try:
        with torch.device("meta"):
            model = build()
    except Exception as exc:  # a config transformers / diffusers cannot build: any error type, from deep inside
        raise error(f"{folder / 'config.json'} does not describe a model that can be built "
                    f"({type(exc).__name__}: {exc})") from exc
    expected = dict(model.named_parameters())
    expected.update((n, b) for n, b in model.named_buffers() if _persistent(model, n))
    missing = sorted(n for n in expected if n not in header)
    if missing:
        raise error(f"{folder}: {len(missing)} of the model's {len(expected)} weights are missing from the checkpoint "
                    f"(e.g. {missing[:3]}); it was saved from another model (family, class or size) or renamed")
    for name, tensor in expected.items():
        dtype, shape = header[name]
        if dtype not in FLOAT_DTYPES:
            raise error(f"{folder}: weight '{name}' has dtype {dtype}; model weights must be one of "
                        f"{', '.join(FLOAT_DTYPES)}")
        if list(shape) != list(tensor.shape):
            raise error(f"{folder}: weight '{name}' has shape {list(shape)} but the config makes "
                        f"{list(tensor.shape)}; the config and the weights do not belong together")


def _persistent(model: nn.Module, name: str) -> bool:
    module_name, _, buffer = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer not in getattr(module, "_non_persistent_buffers_set", set())


def check_finite(model: nn.Module, where: Path, error: type[Exception]) -> None:
    """Refuse NaN/Inf in any floating parameter or buffer (a corrupt file or a training that diverged)."""
    bad = [name for name, t in (*model.named_parameters(), *model.named_buffers())
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise error(f"{where}: {len(bad)} weights hold NaN or Inf values (e.g. {bad[:3]}); the checkpoint is "
                    "corrupt or its training diverged")
