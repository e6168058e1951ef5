"""The Gradio page: prompt and controls on the left, the streamed document and its routing on the right.

One `InterleavedPipeline` is shared by every visitor; everything a visitor owns (uploaded adapters, documents) lives
in their `SessionState` (gr.State), so concurrent sessions never see each other's adapters or outputs. Every
visitor's generation is a request to the pipeline's serving engine (models/engine/core.py): concurrent visitors share
forward passes, and a request waits in the engine's queue while rows or hot-set slots are taken. Stop ends it and
shows the document so far (mapped and downloadable); closing the tab cancels it. Either way its row and adapters
are free within one engine step.

Named API endpoints (each gradio_client.Client is one session):
    /generate(prompt, text_choice, image_choice, routing, start_image, text_temperature, text_top_k, text_top_p,
              image_temperature, image_top_k, cfg_scale, seed, max_new_tokens)
        -> (text with "[image k]" markers, gallery [{"image": png path}], document .html path, document view HTML,
            routing map {"value": [{"token", "class_or_confidence": adapter}], "color_map"}, stats HTML)
    /upload_adapter(files, name, modality) -> (text picker, image picker, status, this session's adapters)
    /adapters() -> {"builtin": {name: modality}, "uploaded": {name: modality}}
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
from gradio import processing_utils
from gradio.utils import get_upload_folder

from molora.app.controls import (
    ROUTING_TIPS_JS,
    CheckedSlider,
    latest_of_each_name,
    public_document,
    quiet_refusals,
    user_error,
)
from molora.app.render import BASE_LABEL, RunView, color_map
from molora.app.session import NONE_CHOICE, SessionRegistry, SessionState
from molora.app.streaming import in_background
from molora.app.uploads import (
    CONFIG_NAME,
    MAX_ZIP_BYTES,
    WEIGHTS_NAME,
    UploadError,
    check_adapter_name,
    remove_folder,
    validate_upload,
)
from molora.models import GenerationConfig, SamplingConfig
from molora.models.engine.events import Event
from molora.models.engine.generation import StopSignal, check_text
from molora.models.engine.sampling import MAX_SEED, check_seed
from molora.routing.errors import MoLoRAError

log = logging.getLogger(__name__)

# Generations the page hands to the engine at once. They share its forward passes (a CPU engine decodes 16 rows,
# a guided request takes two); the engine queues whatever does not fit, so this only bounds the threads that wait.
DEFAULT_CONCURRENCY = 8
AUTO_MODALITY = "auto"  # the upload's "Use for" default: the modality its molora.json names
MAX_PROMPT_CHARS = 2000
MAX_NEW_TOKENS = 1024
MAX_BEST_OF_UI = 8  # each candidate costs a whole document (and its captions) on a shared CPU
REFRESH_SECONDS = 0.2  # the page is refreshed at most this often while tokens stream
STOP_GRACE_SECONDS = 5.0  # Stop not answered by a Finished within this: the page stops waiting for it
ROUTING_REFRESH_SECONDS = 1.0  # ... and the routing map (hundreds of tokens, re-sent whole) at most this often

# (prompt, start with an image, seed): story openings in the shapes world's own phrasing (models/families/shapes/text.py), each
# with a seed under which the shipped model continues it in both styles at once (pirate text, outlined pictures) and
# every picture shows what the text before it introduced (tests/test_app_examples.py checks exactly that).
EXAMPLES: list[tuple[str, bool, int]] = [
    ("At first there is a yellow star at the bottom right:", False, 0),
    ("First, a red circle at the top left:", False, 1),
    ("We start with a blue square on the left:", False, 2),
    ("Here is a green triangle in the center:", False, 3),
    ("Here is a purple diamond at the top:", False, 1),
]

# (prompt, seed): two questions of two domains in one request, for the learned router (shown when the model ships
# gates). The shipped router answers both right at the page's defaults, switching domain adapter between the two
# answer spans (tests/test_app_examples.py checks the answers and that two domain adapters appear).
LEARNED_EXAMPLES: list[tuple[str, int]] = [
    ('A large orange triangle on the right, a large orange triangle at the left, a small brown circle at the top '
     'and a small orange triangle in the top left corner. How many circles are there? What is right of the brown '
     'circle? A:', 0),
    ('A small red star at the bottom, a large red star on the right, a small green triangle at the bottom right '
     'and a small blue diamond at the top right. How many green shapes are there? What is left of the blue '
     'diamond? A:', 0),
    ('A small yellow square at the top, a small blue diamond at the bottom and a small brown diamond at the right. '
     'What size is the yellow square? How many shapes are not blue? A:', 0),
]

# (prompt, seed): a picture whose style the words ask for, for the learned router's image gates (shown when the
# router ships them): "outlined" / "hollow" -> the outline LoRA, "negative" / "inverted" -> the negative LoRA
# (the shape in its colour's complement), "filled" / "solid" -> the filled LoRA. Held-out requests of
# models/families/shapes/styles.py; tests/test_app_examples.py checks each picture's content and style as a click
# draws it (the shipped model drew the earlier "solid small purple star" as a triangle).
LEARNED_PICTURE_EXAMPLES: list[tuple[str, int]] = [
    ("Here is a hollow large blue diamond at the bottom:", 0),
    ("Here is a filled small red circle in the top left corner:", 0),
    ("Here is an inverted small orange triangle at the right:", 0),
]

# The pickers start on the shipped model's style adapters (its domain adapters, also "text", are for the learned
# router): the examples above show these two at work in one document.
DEFAULT_ADAPTERS = {"text": "pirate", "image": "outline"}

def default_adapter(adapters: dict[str, str], modality: str) -> str | None:
    """The adapter a picker (and the warm-up) starts on: the shipped style adapter of that modality where loaded
    (the examples are chosen for it), else the first adapter of the modality, else None."""
    preferred = DEFAULT_ADAPTERS.get(modality)
    if adapters.get(preferred) == modality:
        return preferred
    return next((name for name, mod in adapters.items() if mod == modality), None)


ROUTING_CHOICES = [
    ("vocabulary: text tokens -> text adapter, image tokens -> image adapter", "vocab"),
    ("per-sequence baseline: one adapter for everything", "sequence"),
    ("off: base model only", "none"),
]
LEARNED_CHOICE = ("learned router (top-k gate over domain adapters)", "learned")

CSS = """
.molora-doc { font-size: 1.05rem; line-height: 1.6; white-space: pre-wrap; min-height: 4rem; }
.molora-prompt { opacity: 0.6; }
.molora-figure { display: block; margin: 0.5rem 0; width: fit-content; text-align: center; }
.molora-figure figcaption { font-size: 0.8rem; opacity: 0.7; }
.molora-drawing progress { width: 192px; height: 1rem; }
.molora-slot { display: inline-block; margin: 0 0.25rem; padding: 0 0.4rem; border-radius: 0.3rem; color: #111; }
.molora-status { font-weight: 600; margin-bottom: 0.4rem; }
.molora-cache, .molora-latency { margin: 0.3rem 0; }
.molora-spark { display: block; margin-top: 0.2rem; }
#routing-map .token-container .token { padding: 0 2px; margin: 0; }
#routing-map .textfield { line-height: 1.5; }
.molora-draft { margin: 0.4rem 0; padding: 0.3rem 0.5rem; border-left: 3px solid #fb7185; opacity: 0.85; }
.molora-draft-image { margin: 0.2rem 0.3rem 0 0; }
.molora-draft-text { white-space: pre-wrap; font-size: 0.85rem; margin: 0.2rem 0 0; }
"""

try:  # on a Hugging Face ZeroGPU Space the GPU is attached only inside functions decorated with spaces.GPU
    import spaces

    gpu = spaces.GPU
except ImportError:
    def gpu(fn):
        return fn


# Pipelines by id: the GPU function gets a small picklable key rather than the pipeline itself (ZeroGPU pickles
# arguments into its worker; the worker finds the pipeline in this module, inherited from the main process).
_PIPELINES: dict[int, object] = {}
# The Stop button's signals by session (a small key crosses into the GPU function, as for the pipeline).
_STOPS: dict[str, StopSignal] = {}


@gpu
def stream_events(pipe_key: int, prompt: str, text_adapter: str | None, image_adapter: str | None, routing: str,
                  config: GenerationConfig, extra_adapters: dict[str, str], stop_key: str | None = None
                  ) -> Iterator[Event]:
    """Run one generation; loads the session's uploads first if this process has not seen them (ZeroGPU workers)."""
    pipe = _PIPELINES[pipe_key]
    for name, folder in extra_adapters.items():
        if name not in pipe.adapters:
            pipe.load_adapter(folder, name=name)
    yield from pipe.stream(prompt, text_adapter=text_adapter, image_adapter=image_adapter, routing=routing,
                           config=config, stop=_STOPS.get(stop_key))


class MoLoRAApp:
    """Handlers bound to one shared pipeline; `build()` lays them out as a gr.Blocks."""

    def __init__(self, pipe, *, examples: list[tuple[str, bool, int]] | None = None) -> None:
        self.pipe = pipe
        self.pipe_key = id(pipe)
        _PIPELINES[self.pipe_key] = pipe
        self.sessions = SessionRegistry(pipe)  # every session's uploads and files, under one temporary folder
        self.examples = examples if examples is not None else EXAMPLES
        self.defaults: GenerationConfig = getattr(pipe, "default_config", None) or GenerationConfig()
        self.codebook_size = int(pipe.vocab.image_size)
        self.image_tokens = int(pipe.vocab.image_span_tokens)  # <boi> + codes and row ends + <eoi>
        self.image_note = pipe.vocab.image_span_note()

    # --- helpers --------------------------------------------------------------------------------
    @property
    def builtin(self) -> dict[str, str]:
        """{name: modality} of the shared adapters: the pipeline's adapter registry without the sessions' private
        uploads (loaded from folders inside the app's temporary folder, app/session.py)."""
        root = self.sessions.root
        return {name: info.modality for name, info in self.pipe.adapter_infos().items()
                if info.path is None or not Path(info.path).is_relative_to(root)}

    def routing_choices(self) -> list[tuple[str, str]]:
        has_router = getattr(self.pipe, "gates", None) is not None
        return ROUTING_CHOICES + ([LEARNED_CHOICE] if has_router else [])

    def default_adapter(self, modality: str) -> str:
        return default_adapter(self.builtin, modality) or NONE_CHOICE

    def _labeller(self, state: SessionState):
        uploads = state.display_names()

        def label_of(name: str | None) -> str:
            if name is None:
                return BASE_LABEL
            return uploads.get(name, name)
        return label_of

    # --- examples -------------------------------------------------------------------------------
    # Each row: (prompt, routing, start with an image, seed, max new tokens), what a click puts in the page.
    def example_rows(self) -> list[list]:
        budget = min(self.defaults.max_new_tokens, MAX_NEW_TOKENS)
        return [[text, "vocab", start, seed, budget] for text, start, seed in self.examples]

    def learned_example_rows(self) -> list[list]:
        budget = min(self.defaults.max_new_tokens, MAX_NEW_TOKENS)
        return [[text, "learned", False, seed, budget] for text, seed in LEARNED_EXAMPLES]

    def picture_example_rows(self) -> list[list]:
        """A picture-style request is answered by its picture alone: the budget holds the picture's codes, row
        ends and <eoi> (its <boi> ends the prompt), so no text follows (the domain adapters the learned text
        gates route among write no story, only fragments such as "Then a small.")."""
        picture = int(self.pipe.vocab.tokens_per_image) + 1
        return [[text, "learned", True, seed, picture] for text, seed in LEARNED_PICTURE_EXAMPLES]

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str, text_choice: str, image_choice: str, routing: str, start_image: bool,
                 text_temperature: float, text_top_k: int, text_top_p: float, image_temperature: float,
                 image_top_k: int, cfg_scale: float, seed: int, max_new_tokens: int, best_of: int,
                 state: SessionState, request: gr.Request) -> Iterator[tuple]:
        """Stream one document: yields (text, images, html file, document view, routing map, stats, rejected
        drafts) updates. The first update clears the previous run's download."""
        try:
            self.sessions.bind(state, request.session_hash)
            prompt = check_text(prompt or "")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise user_error(f"the prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
            if routing not in {value for _, value in self.routing_choices()}:
                raise user_error(f"unknown routing mode {routing!r}; choose one of "
                                 f"{', '.join(value for _, value in self.routing_choices())}")
            text_adapter, text_label = state.resolve(text_choice, self.builtin)
            image_adapter, image_label = state.resolve(image_choice, self.builtin)
            if routing == "learned" and getattr(self.pipe, "image_gates", None) is not None:
                image_adapter = None  # the learned image gates pick each picture's adapter from the words
            config = GenerationConfig(
                max_new_tokens=int(max(1, min(int(max_new_tokens), MAX_NEW_TOKENS))),
                text=SamplingConfig(temperature=text_temperature, top_k=int(text_top_k), top_p=text_top_p),
                image=SamplingConfig(temperature=image_temperature, top_k=int(image_top_k)),
                cfg_scale=float(cfg_scale), seed=check_seed(seed), start_image=bool(start_image),
                best_of=int(max(1, min(int(best_of), MAX_BEST_OF_UI))), check=self.defaults.check)
            view = RunView(label_of=self._labeller(state), prompt=prompt, image_tokens=self.image_tokens)
            colors = color_map(text_label, image_label, [*self.builtin, *state.display_names().values()])
            note = routing_note(routing, text_label, image_label)
            started = time.perf_counter()
            self.pipe.make_router(routing, text_adapter, image_adapter)  # checks the names before anything runs
            stop_key = request.session_hash
            signal = _STOPS[stop_key] = StopSignal()  # the Stop button's (a new run replaces the last one's)
            run = functools.partial(stream_events, self.pipe_key, prompt, text_adapter, image_adapter, routing,
                                    config, state.extra_adapters(self.pipe), stop_key)
            sent: dict = {}
            yield self._outputs(view, colors, f"starting…{note}", state, None, sent)  # clears the old download
            try:
                for batch in in_background(run, REFRESH_SECONDS):
                    if signal.stopped_for(STOP_GRACE_SECONDS):
                        break  # the generation did not see the signal (a ZeroGPU worker): closing it cancels it
                    changed = [view.apply(event) for event in batch]
                    if any(changed) and view.document is None:
                        status = f"generating… {time.perf_counter() - started:.1f} s{note}"
                        if signal.is_set():
                            status = f"stopping…{note}"
                        elif view.candidate:
                            status += (f" · candidate {view.candidate + 1} of {view.best_of}: the model's caption "
                                       "of the last one did not match the text")
                        yield self._outputs(view, colors, status, state, None, sent)
            finally:
                if _STOPS.get(stop_key) is signal:
                    del _STOPS[stop_key]
            if view.document is None and signal.is_set():
                status = f"stopped after {len(view.tokens)} tokens{note}"
                yield self._outputs(view, colors, status, state, None)
                return
            if view.document is None:
                raise user_error("generation ended without a document; see the server log")
            path = self._save_document(view.document, state)
            seconds = f"{time.perf_counter() - started:.1f} s"
            steps = view.document.meta.get("timing", {}).get("steps", len(view.tokens))
            if view.finish_reason == "stopped":
                status = f"stopped after {steps} tokens ({seconds}): the document so far{note}"
            else:
                status = f"done in {seconds} · {len(view.tokens)} tokens{note}"
            if view.finish_reason == "length":
                status += " · stopped at the token limit"
            status += best_of_status(view.document.meta.get("best_of"))
            yield self._outputs(view, colors, status, state, path)
        except MoLoRAError as err:
            raise user_error(str(err)) from err

    def _outputs(self, view: RunView, colors: dict[str, str], status: str, state: SessionState,
                 path: str | None, sent: dict | None = None) -> tuple:
        """Values for (text, images, file, document, routing map, stats, rejected drafts). With `sent` (what the
        page already shows), unchanged outputs are gr.skip(): while an image is drawn only its progress bar and the
        stats move. Re-sending the 256-token routing map on every refresh is what made a 258-token image take 10 s
        instead of 0.8 s (numbers in `in_background`)."""
        keys = {"text": view.text, "images": len(view.images), "file": path, "document": view.document_html(),
                "routing": (len(view.tokens), view.document is not None), "drafts": len(view.rejected)}
        fresh = {name: sent is None or name not in sent or sent[name] != key for name, key in keys.items()}
        now = time.perf_counter()
        if sent is not None and fresh["routing"] and "routing" in sent \
                and now - sent.get("routing_at", 0.0) < ROUTING_REFRESH_SECONDS:
            fresh["routing"] = False  # the map streams, but at most this often: it is the largest output
            keys["routing"] = sent["routing"]
        if sent is not None:
            if fresh["routing"]:
                sent["routing_at"] = now
            sent.update(keys)
        skip = gr.skip()
        routing_map = (gr.HighlightedText(value=view.routing_map(), color_map=view.routing_colors(colors))
                       if fresh["routing"] else skip)
        cache = state.visible_cache(self.pipe.cache_stats(), self.builtin)
        return (view.text if fresh["text"] else skip, self._cached_images(view, state) if fresh["images"] else skip,
                path if fresh["file"] else skip, keys["document"] if fresh["document"] else skip, routing_map,
                view.stats_html(cache, colors, status) + (view.routing_tips_html() if fresh["routing"] else ""),
                view.rejected_html() if fresh["drafts"] else skip)

    def _save_document(self, document, state: SessionState) -> str:
        """The download: Document.save_html (the same file the Python API writes) of the document as the visitor
        may see it (`public_document`: their names for adapters, no server paths), placed in Gradio's cache as
        the session's file, which replaces the session's previous download and goes when the session ends."""
        folder = Path(state.folder()) / f"doc-{time.time_ns()}"
        folder.mkdir()
        path = folder / "molora-document.html"
        public_document(document, state.display_names(), Path(str(self.pipe.path)).name).save_html(path)
        cached = processing_utils.save_file_to_cache(path, cache_dir=get_upload_folder())
        shutil.rmtree(folder, ignore_errors=True)  # one copy is enough: the cache's, which the page links to
        previous, state.download = state.download, cached
        if previous is not None and previous != cached:
            self.sessions.untrack(state.session_id, previous)
        return self.sessions.track(state.session_id, cached)

    def _cached_images(self, view: RunView, state: SessionState) -> list[str]:
        """The gallery's pictures as files of Gradio's cache registered with the session (handed over as PIL
        images, Gradio would write copies nobody deletes)."""
        cache = get_upload_folder()
        return [self.sessions.track(state.session_id, processing_utils.save_pil_to_cache(image, cache, format="png"))
                for image in view.images]

    def _track_upload(self, session_hash: str | None, path: str) -> None:
        """Register an uploaded file with the session if it is Gradio's copy (a file elsewhere is not ours)."""
        if Path(path).resolve().is_relative_to(Path(get_upload_folder()).resolve()):
            self.sessions.track(session_hash, path)

    def track_uploads(self, files: list[str] | None, request: gr.Request) -> Any:
        """An upload reached Gradio's cache: register its files with the session (deleted when it ends) and list
        each file name once (adding a file again, say after a refused upload, replaces the earlier copy)."""
        for file in files or []:
            self._track_upload(request.session_hash, file)
        once = latest_of_each_name(files)
        return gr.skip() if once == files else once  # unchanged: the list is not re-rendered

    # --- adapters -------------------------------------------------------------------------------
    def upload_adapter(self, files, name: str, modality: str, state: SessionState, request: gr.Request):
        """Validate and load an uploaded adapter for this session only; on any error nothing changes."""
        try:
            self.sessions.bind(state, request.session_hash)
            if modality not in (AUTO_MODALITY, "text", "image"):
                raise UploadError(f"modality must be {AUTO_MODALITY!r}, 'text' or 'image', got {modality!r}")
            files = files if isinstance(files, list) else [files] if files else []
            paths = [f if isinstance(f, str) else getattr(f, "path", None) or f.name for f in files]
            for path in paths:  # Gradio's copies of the upload: deleted when the session ends
                self._track_upload(request.session_hash, path)
            upload = validate_upload(paths)
            how = "as you chose"
            if modality == AUTO_MODALITY:
                modality = (upload.metadata or {}).get("modality")
                how = "as its molora.json says"
                if modality not in ("text", "image"):  # no molora.json, or one that says "any"
                    modality, how = "text", ("as text: it has no molora.json naming text or image (choose image "
                                             "under \"Use for\" and load it again for pictures)")
            display = check_adapter_name(name or upload.suggested_name or "uploaded")
            state.check_new_name(display, self.builtin)
            folder = upload.write(state.folder())
            # our own metadata file (uploads may not carry one): it tells the pipeline which picker it belongs to
            description = (upload.metadata or {}).get("description") or "uploaded by a visitor"
            (folder / "molora.json").write_text(json.dumps({"modality": modality, "description": str(description)}))
            internal = state.internal_name(display)
            try:
                internal = self.pipe.load_adapter(folder, name=internal)
            except Exception as err:
                remove_folder(folder)
                if isinstance(err, MoLoRAError):
                    raise UploadError(public_message(str(err), self.sessions.root, internal, display)) from err
                # the loader validates first, so this is unexpected: the server log gets the traceback
                log.exception("loading an uploaded adapter failed")
                raise user_error(f"adapter upload refused: the files could not be loaded ({type(err).__name__})",
                                 duration=None) from err
            state.uploads[display] = internal
            log.info("a session loaded its uploaded adapter %r (%s)", display, modality)
        except MoLoRAError as err:
            # the toast stays until closed: a refusal is something to read, not to miss
            raise user_error(f"adapter upload refused: {err}", duration=None) from err
        text_update, image_update = self._picker_updates(state)
        if modality == "text":
            text_update = gr.Dropdown(choices=state.choices("text", self.builtin), value=display)
        else:
            image_update = gr.Dropdown(choices=state.choices("image", self.builtin), value=display)
        gr.Info(f"adapter {display!r} loaded for {modality} tokens; it is visible only in this session")
        return (state, text_update, image_update,
                f"Loaded **{display}** ({modality}, {how}); private to this session.",
                self.list_adapters(state))

    def _picker_updates(self, state: SessionState) -> tuple:
        return (gr.Dropdown(choices=state.choices("text", self.builtin)),
                gr.Dropdown(choices=state.choices("image", self.builtin)))

    def stop(self, request: gr.Request) -> None:
        """The Stop button: the session's generation ends at the engine's next step and keeps what it has (the
        page then shows "stopped after N tokens", the partial document, its routing map and its download)."""
        signal = _STOPS.get(request.session_hash)
        if signal is not None:
            signal.stop()

    def end_session(self, request: gr.Request) -> None:
        """The visitor closed the tab: their uploads leave the pipeline and the hot set, their files the disk."""
        self.sessions.end(request.session_hash)

    def close(self) -> None:
        """End every session and remove the app's temporary folder (at shutdown)."""
        self.sessions.close_all()

    def list_adapters(self, state: SessionState) -> dict:
        """What this session may pick: built-in adapters (shared) and its own uploads."""
        loaded = self.pipe.adapters
        return {"builtin": self.builtin,
                "uploaded": {name: loaded[internal] for name, internal in state.uploads.items() if internal in loaded}}

    # --- layout ---------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        # no telemetry: the demo runs offline (CI, air-gapped machines) as well as on a Space
        with gr.Blocks(title="MoLoRA: per-token LoRA routing", analytics_enabled=False) as demo:
            state = gr.State(self.sessions.new_state(), delete_callback=self.sessions.forget)
            gr.Markdown(
                "# MoLoRA: per-token LoRA routing for text + image generation\n"
                "One model writes text and images as tokens of one vocabulary. With **vocabulary routing** every "
                "text token goes through the text adapter and every image token through the image adapter, in the "
                "same forward pass. The routing map below colours each generated token by the adapter it used.")
            with gr.Row():
                with gr.Column(scale=2):
                    prompt = gr.Textbox(label="Prompt", lines=3, value=self.examples[0][0] if self.examples else "",
                                        elem_id="prompt")
                    with gr.Row():
                        text_adapter = gr.Dropdown(state.value.choices("text", self.builtin),
                                                   value=self.default_adapter("text"), label="Text adapter",
                                                   info=PICKER_HINTS["vocab"][0],
                                                   allow_custom_value=True, elem_id="text-adapter")
                        image_adapter = gr.Dropdown(state.value.choices("image", self.builtin),
                                                    value=self.default_adapter("image"), label="Image adapter",
                                                    info=PICKER_HINTS["vocab"][1],
                                                    allow_custom_value=True, elem_id="image-adapter")
                    routing = quiet_refusals(gr.Radio(self.routing_choices(), value="vocab", label="Routing"))
                    with gr.Row():
                        start_image = gr.Checkbox(False, label="Start with an image",
                                                  info="text -> image: the prompt is followed by <boi>",
                                                  elem_id="start-image")
                        best_of = CheckedSlider(1, MAX_BEST_OF_UI, value=1, step=1, label="Best of",
                                            info="re-draw until the model's captions of its pictures match "
                                                 "the text",
                                            visible=self.defaults.check is not None, elem_id="best-of")
                    d = self.defaults
                    with gr.Accordion("Sampling", open=False):
                        with gr.Row():
                            text_temperature = CheckedSlider(0.0, 2.0, value=d.text.temperature, step=0.05,
                                                         label="Text temperature")
                            text_top_k = CheckedSlider(0, 200, value=d.text.top_k, step=1, label="Text top-k (0 = off)")
                            text_top_p = CheckedSlider(0.05, 1.0, value=d.text.top_p, step=0.05,
                                                   label="Text top-p (1 = off)")
                        with gr.Row():
                            image_temperature = CheckedSlider(0.0, 2.0, value=d.image.temperature, step=0.05,
                                                          label="Image temperature")
                            image_top_k = CheckedSlider(0, self.codebook_size, value=min(d.image.top_k, self.codebook_size),
                                                    step=1, label="Image top-k (0 = off)")
                        with gr.Row():
                            cfg_scale = CheckedSlider(1.0, 10.0, value=d.cfg_scale, step=0.5, label="Image CFG scale")
                            # the range is checked by check_seed (the API's rule), whose refusal names the field
                            # no precision: Gradio would round 1.5 to 2 without a word; check_seed refuses it
                            seed = gr.Number(self.examples[0][2] if self.examples else 0, label="Seed",
                                             info=f"0 to {MAX_SEED}, a whole number")
                        max_new_tokens = CheckedSlider(1, MAX_NEW_TOKENS, value=min(d.max_new_tokens, MAX_NEW_TOKENS),
                                                   step=1, label="Max new tokens", info=self.image_note,
                                                   elem_id="max-new-tokens")
                    with gr.Row():
                        run = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    # every example sets each control it depends on (routing, budget too), so clicking one after
                    # another never inherits the last one's settings
                    example_inputs = [prompt, routing, start_image, seed, max_new_tokens]
                    gr.Examples(self.example_rows(), inputs=example_inputs, label="Example prompts")
                    if any(value == "learned" for _, value in self.routing_choices()):
                        gr.Examples(self.learned_example_rows(), inputs=example_inputs,
                                    label="Mixed questions for the learned router (one domain adapter per answer)")
                        if getattr(self.pipe, "image_gates", None) is not None:
                            gr.Examples(self.picture_example_rows(), inputs=example_inputs,
                                        label="Picture styles for the learned router (the words pick the image adapter)")
                    with gr.Accordion("Upload your own adapter (private to this session)", open=False):
                        gr.Markdown(
                            "A zipped PEFT LoRA folder, or its `adapter_config.json` and "
                            f"`adapter_model.safetensors`; at most {MAX_ZIP_BYTES // 2**20} MB. It is checked, "
                            "loaded for this browser session only, and removed when the session ends.")
                        upload_files = gr.File(label="Adapter files", file_count="multiple",
                                               file_types=[".zip", ".json", ".safetensors"], type="filepath",
                                               elem_id="upload-files")
                        with gr.Row():
                            upload_name = gr.Textbox(label="Name", placeholder="my-adapter", max_lines=1)
                            upload_modality = quiet_refusals(gr.Radio(
                                [("as its molora.json says", AUTO_MODALITY), "text", "image"],
                                value=AUTO_MODALITY, label="Use for", elem_id="upload-modality"))
                        upload_button = gr.Button("Load adapter")
                        upload_status = gr.Markdown(label="Upload status")
                with gr.Column(scale=3):
                    document = gr.HTML(label="Document", elem_id="document",
                                       value='<div class="molora-doc molora-empty">Press Generate.</div>')
                    drafts = gr.HTML(label="Rejected drafts", elem_id="rejected-drafts")
                    routing_map = gr.HighlightedText(label="Routing map: each generated token, coloured by the "
                                                     "adapter it used (learned routing: its top-2 and their "
                                                     "weights)", show_legend=True, show_inline_category=False,
                                                     combine_adjacent=False, elem_id="routing-map")
                    stats = gr.HTML(label="Status, cache and latency", elem_id="stats")
                    html_file = gr.File(label="Download the document (HTML, images inside)", elem_id="html-file",
                                        height=110)
                    with gr.Accordion("Plain text and images", open=False):
                        text_out = gr.Textbox(label="Text", lines=4, elem_id="text-out")
                        images = gr.Gallery(label="Images", format="png", columns=4, height="auto",
                                            elem_id="images")
                    adapters_json = gr.JSON(label="Adapters", visible=False)

            run.click(self.generate,
                      inputs=[prompt, text_adapter, image_adapter, routing, start_image, text_temperature,
                              text_top_k, text_top_p, image_temperature, image_top_k, cfg_scale, seed,
                              max_new_tokens, best_of, state],
                      outputs=[text_out, images, html_file, document, routing_map, stats, drafts],
                      api_name="generate", show_progress="minimal")
            # Stop ends the session's generation through its StopSignal: the engine frees the request's row, KV
            # space and adapter pins within one step, and the run's last update shows the document so far. (A
            # closed tab cancels the generator instead: app/streaming.py then closes the pipeline's stream.)
            stop.click(self.stop, api_visibility="private", queue=False)
            routing.change(picker_hints, inputs=[routing], outputs=[text_adapter, image_adapter],
                           api_visibility="private", show_progress="hidden", queue=False)
            # adding a file again (say after a refused upload) replaces the earlier copy instead of listing it twice
            upload_files.upload(self.track_uploads, inputs=[upload_files], outputs=[upload_files],
                                api_visibility="private", show_progress="hidden", queue=False)
            upload_button.click(self.upload_adapter,
                                inputs=[upload_files, upload_name, upload_modality, state],
                                outputs=[state, text_adapter, image_adapter, upload_status, adapters_json],
                                api_name="upload_adapter", show_progress_on=[upload_status])
            demo.load(self.list_adapters, inputs=[state], outputs=[adapters_json], api_name="adapters")
            demo.unload(self.end_session)
        return demo


def public_message(message: str, private_root: Path, internal: str, display: str) -> str:
    """A loader's error as the visitor may read it: paths under the app's temporary folder become the file's own
    name (or "the upload"), and the session-qualified internal name becomes the visitor's name for the adapter."""
    def shorten(match: re.Match) -> str:
        name = Path(match.group(0)).name
        return name if name in (CONFIG_NAME, WEIGHTS_NAME) else "the upload"

    for root in dict.fromkeys((str(private_root), str(Path(private_root).resolve()))):
        message = re.sub(re.escape(root) + r"[^\s'\":,;]*", shorten, message)
    return message.replace(internal, display)


def routing_note(routing: str, text_label: str | None, image_label: str | None) -> str:
    """The status line's note on what the routing mode does with the pickers (empty for vocabulary routing)."""
    if routing == "sequence":
        used = text_label if text_label is not None else image_label
        if used is None:
            return " · per-sequence: no adapter picked, so the base model"
        ignored = " (the image picker is not used)" if text_label is not None and image_label is not None else ""
        return f" · per-sequence: every token uses {used}{ignored}"
    if routing == "none":
        return " · routing off: the base model, the pickers are not used"
    return ""


# what the (text, image) adapter pickers do under each routing mode, shown under them
PICKER_HINTS = {
    "vocab": ("used for text tokens", "used for image tokens"),
    "sequence": ("per-sequence: used for every token", "per-sequence: used only when the text adapter is none"),
    "none": ("not used: routing is off", "not used: routing is off"),
    "learned": ("not used: the learned gates pick among the domain adapters",
                "not used when the router has image gates (the words pick each picture's style); else used"),
}


def picker_hints(routing: str) -> tuple:
    """Updates of the two pickers' hints for the chosen routing mode (an event handler's return value)."""
    text_hint, image_hint = PICKER_HINTS.get(routing, ("", ""))
    return gr.Dropdown(info=text_hint), gr.Dropdown(info=image_hint)


def best_of_status(best_of: dict | None) -> str:
    """The status line's note on a best-of-n run (models/engine/best_of.py records it in the document's meta)."""
    if not best_of or best_of["n"] == 1:
        return ""
    drawn = len(best_of["verdicts"])
    if any(best_of["verdicts"]):
        return f" · kept candidate {best_of['candidate'] + 1} of {drawn} drawn (its captions match the text)"
    return f" · none of {drawn} candidates passed the caption check: kept the first"


def build_demo(pipe, *, examples: list[tuple[str, bool, int]] | None = None) -> gr.Blocks:
    """The app's gr.Blocks over a loaded pipeline (queue not yet configured; see app.py / `launch`)."""
    return MoLoRAApp(pipe, examples=examples).build()


def launch_kwargs() -> dict:
    """Arguments every launch shares (Gradio 6 takes theme, CSS and head at launch)."""
    return {"css": CSS, "theme": gr.themes.Soft(), "max_file_size": MAX_ZIP_BYTES, "head": ROUTING_TIPS_JS}
