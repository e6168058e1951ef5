"""InterleavedPipeline: the Python API that writes documents of text and images with routed LoRA adapters.

    >>> from molora.models import InterleavedPipeline
    >>> pipe = InterleavedPipeline.from_pretrained()             # assets/model + every adapter in assets/adapters
    >>> doc = pipe.generate("a red circle in the top left", seed=0, start_image=True,
    ...                     text_adapter="pirate", image_adapter="outline", routing="vocab")
    >>> doc.save_html("out/circle.html")
    >>> for event in pipe.stream("two blue squares", seed=1):   # TextDelta, ImageStarted, ImageDone, ...
    ...     print(type(event).__name__)
    >>> doc = pipe.generate("a blue diamond at the bottom", seed=0, best_of=4)   # the model checks its pictures

Routing modes (DESIGN.md §2):
    "vocab"     per token by vocabulary range: text positions -> text_adapter, <boi>, image codes and row markers
                -> image_adapter
    "sequence"  the baseline: one adapter for the whole sequence (text_adapter if given, else image_adapter)
    "none"      the base model
    "learned"   MoLoRA top-k gates over the adapters they were trained on (text positions); image positions ->
                image_adapter, or with no image_adapter and image gates loaded, the image adapter (or the base)
                the image gates pick per picture from the words. Needs learned gates (loaded from assets/router/
                or with load_learned_router).

Every call, from any thread, goes through the pipeline's serving engine (models/engine/core.py): concurrent calls
share forward passes, each request keeps its own sampling settings and random generator, and its adapters stay
pinned in the hot set from admission to its last token.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from molora.models.document import Document
from molora.models.engine.best_of import candidate_config, stream_best_of
from molora.models.engine.budget import document_events
from molora.models.engine.builder import DocumentBuilder
from molora.models.engine.core import Engine, EngineConfig
from molora.models.engine.events import Event, Finished
from molora.models.engine.generation import GenerationConfig, Request, StopSignal, check_text, open_image_span
from molora.models.engine.sampling import GenerationError
from molora.models.families.family import load_family_model, make_check
from molora.models.families.loading import (
    AdapterInfo,
    LoadedModel,
    ModelDirError,
    adapter_rank,
    adapter_weights_hash,
    read_adapter_info,
)
from molora.routing import (
    AdapterError,
    LearnedGates,
    LearnedRouter,
    Router,
    SequenceRouter,
    UnknownAdapterError,
    VocabRangeRouter,
    attach_routed_lora,
    merge_adapters,
)

log = logging.getLogger(__name__)

ROUTING_MODES = ("vocab", "sequence", "none", "learned")
Prompt = str | Image.Image | Sequence[str | Image.Image]


class InterleavedPipeline:
    """A unified text-and-image LM with routed LoRA adapters, its tokenizers and the interleaved decoder."""

    def __init__(self, loaded: LoadedModel, *, num_slots: int | None = None, r_max: int | None = None,
                 learned_top_k: int = 2, engine: EngineConfig | None = None) -> None:
        self.path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.vocab = loaded.vocab
        self.image_tokenizer = loaded.image_tokenizer
        self.max_positions = loaded.max_positions
        ranks = [adapter_rank(a.path) for a in loaded.adapters]
        targets = {} if loaded.lora_targets is None else {"target_modules": loaded.lora_targets}
        self.family = loaded.family
        self.routed = attach_routed_lora(loaded.lm, num_slots=num_slots or max(4, min(8, len(loaded.adapters))),
                                         r_max=r_max or max([16, *ranks]), **targets)
        self.device = self.routed.device
        self._lock = threading.RLock()
        for info in loaded.adapters:
            self._add(info, info.name)
        self.gates: LearnedGates | None = None
        self.image_gates: LearnedGates | None = None  # learned mode: pictures routed among the image adapters
        self.learned_top_k = learned_top_k
        if loaded.gates_path is not None:
            self.load_learned_router(loaded.gates_path)
        logits_size = int(loaded.lm.config.get_text_config().vocab_size)
        self.engine = Engine(self.routed, self.vocab, device=self.device, logits_size=logits_size,
                             config=engine, max_positions=self.max_positions)
        self.max_positions = self.engine.max_len
        try:
            self.default_config = GenerationConfig.from_dict(loaded.generation_defaults)
        except (GenerationError, TypeError) as exc:
            raise ModelDirError(f"{self.path / 'generation.json'} does not describe a GenerationConfig: {exc}") from exc

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, adapters_dir: str | Path | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                        num_slots: int | None = None, r_max: int | None = None,
                        engine: EngineConfig | None = None, family: str | None = None,
                        device_map: str | dict[str, Any] | None = None, max_memory: dict[Any, Any] | None = None,
                        offload_folder: str | Path | None = None, **family_options: Any) -> InterleavedPipeline:
        """Load a model directory (None = the repo's assets/model) and every adapter beside it.

        The model family is recognised from the directory (models/families/family.py: a transformers config.json's
        `model_type`, e.g. "emu3", or the embedded model's own files), or named by `family`; `family_options` go
        to its loader (Emu3: grid=(rows, cols) of the pictures it writes).
        For the embedded model, `path` may be a model directory (vocab.json, tokenizer.json, lm/, vq/) or a folder
        holding model/ and adapters/. Adapters come from `adapters_dir`, else <path>/adapters, else the sibling
        adapters/ folder. `engine` sets the serving engine's rows and positions (models/engine/core.py EngineConfig).
        Raises ModelDirError (a MoLoRAError) naming every missing file.

        A model larger than one GPU: `device_map="auto"` (or {module name: device}), optionally `max_memory`
        ({0: "70GiB", 1: "70GiB", "cpu": "200GiB"}) and `offload_folder` (for layers sent to "disk"), instead of
        `device` (both: PlacementError). transformers / accelerate place the layers; each routed layer's adapter
        slots then live on its device, the engine keeps each layer's KV cache there and runs eagerly (CUDA
        graphs only on one device); inputs go to the first device.
        """
        loaded = load_family_model(path, family=family, adapters_dir=adapters_dir, device=device, dtype=dtype,
                                   device_map=device_map, max_memory=max_memory, offload_folder=offload_folder,
                                   **family_options)
        return cls(loaded, num_slots=num_slots, r_max=r_max, engine=engine)

    # --- adapters ---------------------------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, str]:
        """{name: modality} of every loaded adapter ("text", "image", or "any" without molora.json)."""
        return {name: info.modality for name, info in self.adapter_infos().items()}

    def adapter_infos(self) -> dict[str, AdapterInfo]:
        """{name: AdapterInfo (modality, description, folder)} from the one adapter registry: the hot-set cache,
        which holds every loaded adapter's weights and these facts beside them."""
        return self.routed.cache.infos()

    def load_adapter(self, path: str | Path, name: str | None = None, *, force: bool = False) -> str:
        """Load a PEFT LoRA folder (+ optional molora.json); returns its name. Bad files raise, nothing changes."""
        info = read_adapter_info(path, name)
        return self._add(info, name, force=force)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter. Unknown names raise UnknownAdapterError; an adapter in use by a running request
        (or named by the learned gates) raises AdapterError and stays loaded."""
        with self._lock:
            if name not in self.routed.cache:
                raise UnknownAdapterError(f"no adapter named {name!r} is loaded "
                                          f"(loaded: {', '.join(self.adapters) or 'none'})")
            if any(g is not None and name in g.adapters for g in (self.gates, self.image_gates)):
                raise AdapterError(f"adapter {name!r} is routed by the loaded learned gates; it cannot be removed")
            self.routed.remove_adapter(name)

    def _add(self, info: AdapterInfo, name: str | None, *, force: bool = False) -> str:
        return self.routed.load_adapter(info.path, name=name, force=force, info=info)

    def merge_adapters(self, names: Sequence[str], name: str | None = None) -> str:
        """Add an adapter that is the exact sum of `names` (modality "merged") and return its name.

        This is the "merged adapter" baseline: routed per sequence it applies every style to every token,
        where vocabulary routing gives each adapter only the tokens of its modality. Its rank is the sum of the
        ranks merged, which must fit the cache's r_max. Merging the same names again returns the same adapter.
        """
        names = list(names)
        with self._lock:
            loaded = self.adapters
            unknown = [n for n in names if n not in loaded]
            if unknown:
                raise UnknownAdapterError(f"cannot merge unknown adapters {unknown}; loaded adapters: "
                                          f"{', '.join(loaded) or 'none'}")
            name = name or "+".join(names)
            if name in loaded:
                if loaded[name] == "merged":
                    return name
                raise AdapterError(f"an adapter named {name!r} is already loaded; pick another name for the merge")
            merged = merge_adapters([self.routed.adapter(n) for n in names], name)
            self.routed.add_adapter(merged, info=AdapterInfo(name, None, "merged", f"sum of {', '.join(names)}"))
            return name

    def load_learned_router(self, path: str | Path, *, top_k: int | None = None, image_gates: bool = True) -> None:
        """Load learned gates (routing.LearnedGates.save); their adapters must be loaded already. A config.json
        beside the gates (scripts/train_router.py writes one) gives the default top_k and the hash of every
        adapter the gates were trained on: gates trained on other weights are refused. Its "image_gates" section
        (scripts/train_image_router.py) names image gates beside them, which then route pictures among the image
        adapters in learned mode (`image_gates=False`: the text gates alone, as a script that trains new image gates
        over new image adapters loads them). Nothing changes on error."""
        path = Path(path)
        config = read_router_config(path.parent / "config.json")
        gates = self._checked_gates(path, config.get("adapter_sha256_16", {}), "text")
        picture_gates = None
        if image_gates and "image_gates" in config:
            section = config["image_gates"]
            picture_gates = self._checked_gates(path.parent / str(section.get("file", "image_gates.safetensors")),
                                                section.get("adapter_sha256_16", {}), "image")
        with self._lock:
            self.gates, self.image_gates = gates, picture_gates
            if top_k is not None or "top_k" in config:
                self.learned_top_k = int(top_k if top_k is not None else config["top_k"])

    def _checked_gates(self, path: Path, trained_on: dict[str, str], modality: str) -> LearnedGates:
        """Gates from `path`, refused unless their adapters are loaded (image gates: as image adapters), they fit
        this model, and every adapter has the weights they were trained on (`trained_on`: name -> hash)."""
        gates = LearnedGates.load(path, device=self.device)
        missing = [n for n in gates.adapters if n not in self.adapters]
        if missing:
            raise UnknownAdapterError(f"learned gates {path} route over adapters {missing} that are not loaded "
                                      f"(loaded: {', '.join(self.adapters) or 'none'})")
        wrong = [n for n in gates.adapters if modality == "image" and self.adapters[n] != "image"]
        if wrong:
            raise AdapterError(f"image gates {path} route over {wrong}, which are not image adapters here")
        if (gates.d_model, gates.num_blocks) != (self.routed.hidden_size, self.routed.num_blocks):
            raise ModelDirError(f"learned gates {path} are sized for hidden size {gates.d_model} and {gates.num_blocks} "
                                f"blocks, but this model has {self.routed.hidden_size} and {self.routed.num_blocks}; "
                                "they were trained for another model (train a router for this one: "
                                "scripts/train_router.py)")
        for name, expected in trained_on.items():
            info = self.adapter_infos().get(name)  # merged adapters have no folder (path None)
            if info is None or info.path is None or not (info.path / "adapter_model.safetensors").is_file():
                continue
            loaded = adapter_weights_hash(info.path)
            if loaded != expected:
                raise AdapterError(f"learned gates {path} were trained on adapter {name!r} with weights {expected}, "
                                   f"but the loaded {name!r} has weights {loaded}; load the adapters the router was "
                                   "trained on, or train a router over these (scripts/train_router.py)")
        return gates

    def cache_stats(self) -> dict:
        """Hot-set adapter cache counters: hits, misses, evictions, bytes_copied, slots, ..."""
        return self.routed.cache.stats()

    # --- routing and prompts ----------------------------------------------------------------------
    def make_router(self, routing: str, text_adapter: str | None, image_adapter: str | None) -> Router | None:
        """The router of one request (None = base model). Unknown names raise, listing the loaded adapters."""
        if routing not in ROUTING_MODES:
            raise GenerationError(f"unknown routing mode {routing!r}; choose one of {', '.join(ROUTING_MODES)}")
        loaded = self.adapters
        for role, name in (("text_adapter", text_adapter), ("image_adapter", image_adapter)):
            if name is not None and name not in loaded:
                raise UnknownAdapterError(f"unknown {role} {name!r}; loaded adapters: "
                                          f"{', '.join(f'{n} ({m})' for n, m in loaded.items()) or 'none'}")
        if routing == "none":
            return None
        if routing == "sequence":
            adapter = text_adapter if text_adapter is not None else image_adapter
            return None if adapter is None else SequenceRouter(adapter)
        if routing == "learned":
            if self.gates is None:
                raise GenerationError("routing='learned' needs learned gates; none are loaded (ship "
                                      "assets/router/gates.safetensors or call load_learned_router(path))")
            top_k = max(1, min(self.learned_top_k, self.gates.num_experts))
            if image_adapter is None and self.image_gates is not None:  # the words pick each picture's adapter
                return LearnedRouter(self.gates, top_k=top_k, vocab=self.vocab, image_gates=self.image_gates)
            return LearnedRouter(self.gates, top_k=top_k, vocab=self.vocab, image_adapter=image_adapter)
        if text_adapter is None and image_adapter is None:
            return None
        return VocabRangeRouter(self.vocab, text_adapter, image_adapter)

    def encode_prompt(self, prompt: Prompt, config: GenerationConfig, max_new_tokens: int
                      ) -> tuple[list[int], list[str | Image.Image], list[str]]:
        """(unified ids starting with <bos>, prompt parts, notices). Truncates from the left to leave room for
        `max_new_tokens` (at most half the model's positions), never cutting an image span."""
        if isinstance(prompt, (str, Image.Image)):
            parts = [prompt]
        elif isinstance(prompt, (list, tuple)):
            parts = list(prompt)
        else:
            parts = None
        if parts is None or not all(isinstance(p, (str, Image.Image)) for p in parts):
            raise GenerationError("a prompt is a str, a PIL image, or a list of them; got "
                                  f"{type(prompt).__name__}")
        v = self.vocab
        ids = [v.bos_id]
        for number, part in enumerate(parts):
            if isinstance(part, str):
                ids += self.tokenizer.encode_text(check_text(part, "the prompt" if len(parts) == 1
                                                             else f"part {number + 1} of the prompt"))
            else:
                ids += self.tokenizer.image_span(self.image_tokenizer.encode(part)[0])
        if config.start_image:
            ids.append(v.boi_id)
        notices = []
        limit = self.max_positions - min(max_new_tokens, self.max_positions // 2)
        if len(ids) > limit:
            kept = truncate_prompt(ids, limit, v)
            notices.append(f"the prompt has {len(ids)} tokens; only its last {len(kept) - 1} were kept to fit the "
                           f"model's {self.max_positions} positions with {max_new_tokens} new tokens")
            log.warning(notices[-1])
            ids = kept
        return ids, parts, notices

    def decode_image(self, ids: Sequence[int]) -> Image.Image:
        """A finished picture's ids (its codes, and row markers where the family has them) as an image, through the
        family's image decode (a family without a pixel decoder gives what its decode makes, e.g. a code map)."""
        return self.image_tokenizer.decode(self.tokenizer.codes_from_ids(ids)[None])[0]

    # --- generation -------------------------------------------------------------------------------
    def resolve_config(self, config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
        config = (config or self.default_config).with_overrides(**overrides)
        if config.seed is None:
            config = config.with_overrides(seed=random.SystemRandom().randrange(2 ** 31))
        return config

    def stream(self, prompt: Prompt | list[Prompt], *, text_adapter: str | None | Sequence[str | None] = None,
               image_adapter: str | None | Sequence[str | None] = None, routing: str = "vocab",
               config: GenerationConfig | None = None, stop: StopSignal | None = None,
               **overrides: Any) -> Iterator[Event]:
        """Generate and yield events as they happen (models/engine/events.py); the last event of each prompt is
        Finished(document). A list of prompts decodes as one batch; events carry their prompt's `row`.
        Bad arguments raise here, before the iterator is returned; closing the iterator stops decoding.
        `stop` (a StopSignal): its stop() ends the generation early, and each prompt still gets its Finished
        event, with the document so far and finish_reason "stopped".
        With best_of > 1 every candidate streams, a Redraw event opens a prompt's next candidate, and Finished
        carries the document kept (models/engine/best_of.py).

        >>> for event in pipe.stream("a green triangle", seed=0, max_new_tokens=300):
        ...     pass
        """
        prompts, _ = split_prompts(prompt)
        config = self.resolve_config(config, overrides)
        text_adapters = _per_prompt(text_adapter, len(prompts), "text_adapter")
        image_adapters = _per_prompt(image_adapter, len(prompts), "image_adapter")

        def stream_rows(rows: list[int], row_config: GenerationConfig) -> Iterator[Event]:
            return self._stream_rows([prompts[r] for r in rows], [text_adapters[r] for r in rows],
                                     [image_adapters[r] for r in rows], routing, row_config, stop)

        if config.best_of == 1:
            return stream_rows(list(range(len(prompts))), config)
        check = make_check(config.check, self)
        first_round = stream_rows(list(range(len(prompts))), candidate_config(config, 0))  # checks the arguments
        return stream_best_of(stream_rows, len(prompts), config, check, first_round=first_round,
                              stopped=None if stop is None else stop.is_set)

    def _stream_rows(self, prompts: list[Prompt], text_adapters: list[str | None], image_adapters: list[str | None],
                     routing: str, config: GenerationConfig, stop: StopSignal | None = None) -> Iterator[Event]:
        """One batch's events (a generator); bad arguments raise before it is returned."""
        if config.start_image and config.max_new_tokens < self.vocab.tokens_per_image + 1:
            raise GenerationError(f"start_image needs max_new_tokens >= {self.vocab.tokens_per_image + 1}: "
                                  f"{self.vocab.image_span_note()}, and the prompt already holds its <boi>; got "
                                  f"{config.max_new_tokens}")
        routers = [self.make_router(routing, t, i) for t, i in zip(text_adapters, image_adapters)]

        encoded = [self.encode_prompt(p, config, config.max_new_tokens) for p in prompts]
        longest = max(len(ids) for ids, _, _ in encoded)
        max_new = min(config.max_new_tokens, self.max_positions - longest)
        shared_notices = []
        if max_new < config.max_new_tokens:
            shared_notices.append(f"max_new_tokens lowered from {config.max_new_tokens} to {max_new} to fit the "
                                  f"model's {self.max_positions} positions")
            log.debug(shared_notices[-1])  # the document keeps the notice; a library is quiet unless asked
        # The engine masks <boi> once a picture no longer fits its budget, and the model then writes its next-best
        # words in the picture's place: word salad ("comes aboard:At added aboard:First"). So the engine gets room
        # for one more picture than the caller's budget, and the pipeline holds the caller's budget itself: a
        # picture the budget cannot hold ends the document cleanly before its <boi> (engine/budget.py). Where the
        # model's positions leave no such room, the last tokens are "blind" (a wish for a picture is not seen
        # there), and the document ends at the first sentence end among them.
        extra, blind_from = 0, None
        if config.max_images != 0:
            span = self.vocab.image_span_tokens
            extra = min(span, self.max_positions - longest - max_new)
            if extra < span:
                blind_from = max_new + extra - span + 1
        run_config = config.with_overrides(max_new_tokens=max_new + extra)

        builders = []
        for row, ((ids, parts, notices), t, i) in enumerate(zip(encoded, text_adapters, image_adapters)):
            meta = {"model": str(self.path), "routing": routing, "text_adapter": t, "image_adapter": i,
                    "config": config.to_dict(), "seed": config.seed, "prompt_tokens": len(ids)}
            builders.append(DocumentBuilder(self.tokenizer, self.decode_image, row=row, prompt=parts,
                                            meta=meta, notices=notices + shared_notices,
                                            image_open=open_image_span(ids, self.vocab) is not None))
        uncond = None
        if config.negative_prompt is not None and config.uses_cfg:
            uncond = [self.vocab.bos_id, *self.tokenizer.encode_text(config.negative_prompt)]
        requests = [Request(ids, router, uncond) for (ids, _, _), router in zip(encoded, routers)]
        return self._events(requests, builders, run_config, (max_new, blind_from), stop)

    def _events(self, requests: list[Request], builders: list[DocumentBuilder], config: GenerationConfig,
                budget: tuple[int, int | None], stop: StopSignal | None) -> Iterator[Event]:
        """The engine's tokens as events (a generator: closing it early cancels the requests, e.g. a closed tab;
        their rows and adapters are free within one engine step). `budget`: (the caller's max_new_tokens, which
        the pipeline enforces, as the engine's may be larger; the first token the engine generates blind to a
        picture, or None)."""
        sink: queue.Queue = queue.Queue()
        # bad requests raise here, before any event and with none queued; the rest start together
        handles = self.engine.submit_all(requests, [config] * len(requests), sink)
        if stop is not None:
            stop.attach(handles)
        return document_events(sink, handles, builders, budget, stop, self.vocab, self.max_positions)


    def generate(self, prompt: Prompt | list[Prompt], *, text_adapter: str | None | Sequence[str | None] = None,
                 image_adapter: str | None | Sequence[str | None] = None, routing: str = "vocab",
                 config: GenerationConfig | None = None, stop: StopSignal | None = None,
                 **overrides: Any) -> Document | list[Document]:
        """Generate a Document (a list of Documents for a list of prompts, decoded together in one batch).

        Keyword overrides change the config: seed=, max_new_tokens=, cfg_scale=, temperature= (both modalities),
        text_temperature=, image_top_k=, ..., max_images=, start_image=, best_of= (with check=; models/engine/best_of.py:
        the first of n candidates that passes the check is returned). A prompt is a str, a PIL image or a list
        mixing them (images are VQ-encoded into <boi> codes <eoi>, so image -> text works).
        `text_adapter` / `image_adapter` may be lists (one per prompt) to route each row differently.
        max_new_tokens is held exactly; where the model begins a picture the rest of it cannot hold, the document
        ends cleanly before that picture, with a notice (never the model's next-best words in its place).
        `stop` (a StopSignal): stop() from another thread ends it early with the document so far.

        >>> doc = pipe.generate("a blue star", seed=0, start_image=True, image_adapter="outline")
        >>> doc.images[0].size
        (64, 64)
        """
        documents: dict[int, Document] = {}
        for event in self.stream(prompt, text_adapter=text_adapter, image_adapter=image_adapter, routing=routing,
                                 config=config, stop=stop, **overrides):
            if isinstance(event, Finished):
                documents[event.row] = event.document
        ordered = [documents[row] for row in sorted(documents)]
        return ordered if split_prompts(prompt)[1] else ordered[0]


def read_router_config(path: Path) -> dict:
    """A router's config.json as a dict ({} when there is none); a file that is not a JSON object is an error."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise ModelDirError(f"{path} is not a router config (JSON): {exc}") from exc
    if not isinstance(config, dict):
        raise ModelDirError(f"{path} is not a router config: expected a JSON object")
    top_k = config.get("top_k", 1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ModelDirError(f"{path}: top_k must be a whole number >= 1, got {top_k!r}")
    sections = [("", config)]
    if "image_gates" in config:
        image = config["image_gates"]
        if not isinstance(image, dict):
            raise ModelDirError(f"{path}: image_gates must be an object {{file, adapter_sha256_16}}, got {image!r:.80}")
        name = image.get("file", "image_gates.safetensors")
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise ModelDirError(f"{path}: image_gates.file must name a .safetensors file beside the gates, got "
                                f"{name!r:.80}")
        sections.append(("image_gates.", image))
    for where, section in sections:
        hashes = section.get("adapter_sha256_16", {})
        if not isinstance(hashes, dict) or not all(isinstance(h, str) for h in hashes.values()):
            raise ModelDirError(f"{path}: {where}adapter_sha256_16 must be an object {{adapter name: weights hash}}, "
                                f"got {hashes!r:.80}")
    return config


def truncate_prompt(ids: list[int], limit: int, vocab: Any) -> list[int]:
    """<bos> + the last limit-1 ids, moved forward past a partial image span so no span is cut."""
    tail = ids[len(ids) - (limit - 1):]
    for i, token in enumerate(tail):
        if token == vocab.boi_id:
            break
        if token == vocab.eoi_id:  # the tail starts inside an image: drop its remains
            tail = tail[i + 1:]
            break
    else:  # no marker at all: plain text, or the inside of one image span (then nothing usable is left)
        if any(vocab.is_image_code(t) or vocab.is_row_end(t) for t in tail):
            tail = []
    return [vocab.bos_id, *tail]


def split_prompts(prompt: Any) -> tuple[list[Any], bool]:
    """(prompts, batched). A str, a PIL image or a tuple is ONE prompt; a list holding a PIL image is one mixed
    prompt (["describe this:", image]); any other list is a batch of prompts (each a str, image, list or tuple)."""
    if isinstance(prompt, list):
        if not prompt:
            raise GenerationError("got an empty list of prompts; pass at least one prompt (\"\" is a valid prompt)")
        if any(isinstance(p, Image.Image) for p in prompt):
            return [prompt], False
        return list(prompt), True
    return [prompt], False


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise GenerationError(f"{name} has {len(value)} entries for {n} prompts; give one per prompt or one name")
        return list(value)
    return [value] * n


__all__ = ["InterleavedPipeline", "ROUTING_MODES", "truncate_prompt", "split_prompts"]
