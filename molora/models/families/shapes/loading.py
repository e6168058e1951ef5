"""Load the embedded model's directory (the shapes family's layout), checking everything first.

    assets/model/vocab.json, tokenizer.json, lm/ (transformers, safetensors), vq/ (diffusers VQModel), README.md
    assets/model/generation.json      optional: default GenerationConfig fields for this model
    assets/adapters/<name>/           adapter_config.json + adapter_model.safetensors (+ molora.json modality)
    assets/router/gates.safetensors   optional: learned-router gates (routing.LearnedGates.save) over adapters

Missing pieces are reported all at once, by path, as a ModelDirError (a MoLoRAError).  What every family's loader
shares (placement, adapter discovery, the errors) is in models/families/loading.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from molora.models.engine.runtime import configure_cpu_threads
from molora.models.families.checkpoint import check_checkpoint, check_finite, read_config
from molora.models.families.loading import (
    GATES_CANDIDATES,
    DeviceMap,
    LoadedModel,
    ModelDirError,
    check_finite_placed,
    find_adapters,
    placing,
    resolve_dirs,
)
from molora.routing.model import input_device

log = logging.getLogger(__name__)


def missing_model_files(model_dir: Path) -> list[str]:
    """The required files of a model directory that are not there (empty list = complete)."""
    missing = [str(model_dir / name) for name in ("vocab.json", "tokenizer.json", "lm/config.json",
                                                  "vq/config.json") if not (model_dir / name).is_file()]
    for sub in ("lm", "vq"):
        if (model_dir / sub).is_dir() and not any((model_dir / sub).glob("*.safetensors")):
            missing.append(str(model_dir / sub / "*.safetensors"))
    return missing



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

    Also sets torch's CPU thread count (models/engine/runtime.py: `threads`, else $MOLORA_THREADS, else 1; 0 leaves it).

    Checks before loading anything big: the files exist, and the LM's and the VQ's weights fill the models their
    configs describe (models/families/checkpoint.py: names, dtypes, shapes from the safetensors headers); after: no NaN/Inf
    weight, the LM's vocabulary covers the unified vocabulary and the VQ's grid and codebook match it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from molora.models.families.shapes.image_tokenizer import ImageTokenizer
    from molora.models.families.shapes.tokenizer import UnifiedTokenizer

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
