"""The Gradio app end to end, through gradio_client, on the tiny random model (tests/conftest.py: tiny_assets).

The app is served once per module in a thread on a free localhost port; each gradio_client.Client is its own
browser session. A random model rarely opens an image by itself, so image tests set start_image (the prompt is
followed by <boi>), which makes the first 256 generated tokens an image whatever the weights.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from molora.app.render import BASE_LABEL
from molora.app.server import serve, warm_up
from molora.app.session import SessionState
from molora.app.ui import MoLoRAApp
from molora.models import InterleavedPipeline
from molora.models.engine.best_of import CHECKS
from molora.models.families.shapes.testing import write_tiny_adapter
from molora.routing import LearnedGates
from tests.app_process import free_port, wait_until_served

REPO = Path(__file__).resolve().parents[1]
IMAGE_TOKENS = 274  # 16 rows of 16 codes and a row marker + <eoi> + one more step for <eos> or text


@pytest.fixture(scope="module")
def pipe(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> InterleavedPipeline:
    # our own pipeline, not conftest's shared one: the app loads uploaded adapters into it
    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    # random learned gates over both adapters, so the page offers the "learned" routing mode too
    gates_path = tmp_path_factory.mktemp("gates") / "gates.safetensors"
    LearnedGates.for_model(pipe.routed, ["text_style", "image_style"]).save(gates_path)
    pipe.load_learned_router(gates_path)
    warm_up(pipe)  # what `python app.py` does before serving; later tests then see warm timings
    return pipe


@pytest.fixture(scope="module")
def url(pipe: InterleavedPipeline):
    port = free_port()
    demo = serve(pipe, host="127.0.0.1", port=port, concurrency=2, block=False)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def upload_zip(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT adapter for the tiny model, zipped as a visitor would (folder inside the zip)."""
    root = tmp_path_factory.mktemp("upload")
    folder = write_tiny_adapter(tiny_assets / "model", root / "mine", modality="text", seed=7)
    archive = root / "mine.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(folder / name, f"mine/{name}")
    return archive


def client(url: str) -> Client:
    return Client(url, verbose=False)


def request(prompt: str = "Draw a red circle.", *, text: str = "text_style", image: str = "image_style",
            routing: str = "vocab", start_image: bool = False, seed: int = 0, max_new_tokens: int = 16,
            cfg_scale: float = 3.0, best_of: int = 1) -> dict:
    return dict(prompt=prompt, text_choice=text, image_choice=image, routing=routing, start_image=start_image,
                text_temperature=1.0, text_top_k=0, text_top_p=1.0, image_temperature=1.0, image_top_k=0,
                cfg_scale=cfg_scale, seed=seed, max_new_tokens=max_new_tokens, best_of=best_of)


def generate(c: Client, **kwargs) -> dict:
    """Call the named endpoint; return its outputs in comparable form (pixels, not temp paths)."""
    text, gallery, html_path, document_html, routing_map, stats, drafts = c.predict(**request(**kwargs),
                                                                                    api_name="/generate")
    images = [np.asarray(Image.open(item["image"]).convert("RGB")) for item in gallery]
    tokens = [(t["token"], t["class_or_confidence"]) for t in routing_map["value"]]
    return {"text": text, "images": images, "html": html_path, "doc": document_html, "tokens": tokens,
            "colors": routing_map["color_map"], "stats": stats, "drafts": drafts}


def same(a: dict, b: dict) -> bool:
    return (a["text"] == b["text"] and a["tokens"] == b["tokens"] and len(a["images"]) == len(b["images"])
            and all(np.array_equal(x, y) for x, y in zip(a["images"], b["images"])))


def test_generate_endpoint_returns_text_an_image_and_the_html_document(url):
    out = generate(client(url), start_image=True, max_new_tokens=IMAGE_TOKENS + 4, cfg_scale=1.0)
    assert len(out["images"]) == 1 and out["images"][0].shape == (64, 64, 3)
    assert out["text"].startswith("Draw a red circle.\n[image 1]")  # the prompt, then the image on its own line
    # every generated token is on the routing map, coloured by its adapter: image codes and row markers -> image_style
    image_labels = [label for token, label in out["tokens"] if token == "■"]
    assert len(image_labels) == 272 and set(image_labels) == {"image_style"}  # codes and row markers
    assert set(out["colors"]) >= {"image_style", "text_style", BASE_LABEL}
    html = Path(out["html"]).read_text()
    assert "<html" in html.lower() and "data:image/png;base64," in html
    assert 'class="molora-image"' in out["doc"]
    assert "Hot-set cache" in out["stats"] and "Per-step latency" in out["stats"]


def test_routing_modes_colour_tokens_by_the_adapter_they_used(url):
    c = client(url)
    by_vocab = generate(c, routing="vocab", max_new_tokens=12)
    assert by_vocab["tokens"] and {label for _, label in by_vocab["tokens"]} <= {"text_style", "image_style"}
    # baseline: one adapter for the whole sequence; off: the base model everywhere
    baseline = generate(c, routing="sequence", text="none", image="image_style", max_new_tokens=12)
    assert {label for _, label in baseline["tokens"]} == {"image_style"}
    off = generate(c, routing="none", max_new_tokens=12)
    assert {label for _, label in off["tokens"]} == {BASE_LABEL}
    # learned top-k gates pick among their adapters per text token; image tokens still go to the image adapter
    learned = generate(c, routing="learned", text="none", image="image_style", start_image=True,
                       max_new_tokens=IMAGE_TOKENS + 8, cfg_scale=1.0)
    assert {label for token, label in learned["tokens"] if token == "■"} == {"image_style"}
    # a token's label is its adapter, or with two gated adapters "text_style .50 · image_style .50" (top-k weights)
    named = {part.rsplit(" ", 1)[0] if " · " in label else label
             for _, label in learned["tokens"] for part in label.split(" · ")}
    assert named <= {"text_style", "image_style"}


def test_bad_requests_give_clear_errors(url):
    c = client(url)
    with pytest.raises(AppError, match="unknown adapter 'nope'"):
        generate(c, text="nope")
    with pytest.raises(AppError, match="'sideways' .* not in the list of choices"):
        generate(c, routing="sideways")


def test_eight_concurrent_clients_get_exactly_what_they_get_alone(url, upload_zip):
    specs = [dict(seed=s, text=t, image=i, routing=r, max_new_tokens=20)
             for s, (t, i, r) in enumerate([("text_style", "image_style", "vocab"), ("none", "image_style", "vocab"),
                                            ("text_style", "none", "sequence"), ("none", "none", "none"),
                                            ("mine", "image_style", "vocab"), ("mine", "none", "sequence"),
                                            ("text_style", "image_style", "vocab"), ("none", "image_style", "vocab")])]
    specs[0].update(start_image=True, max_new_tokens=IMAGE_TOKENS, cfg_scale=1.0)

    def run(spec: dict) -> dict:
        c = client(url)  # a fresh session each time; "mine" is uploaded into that session only
        if spec["text"] == "mine":
            c.predict([handle_file(str(upload_zip))], "mine", "text", api_name="/upload_adapter")
        return generate(c, **spec)

    alone = [run(spec) for spec in specs]
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        together = list(pool.map(run, specs))
    for spec, a, b in zip(specs, alone, together):
        assert same(a, b), f"concurrent output differs from the same request alone: {spec}"
    assert len(alone[0]["images"]) == 1
    assert {label for _, label in alone[4]["tokens"]} <= {"mine", "image_style"}
    assert len({a["text"] for a in alone}) > 1  # different seeds/adapters really differ


def test_the_page_config_copies_whole_so_page_loads_stay_cheap(pipe):
    """Gradio deep-copies the page config on every /config request. A part it cannot copy (the State's
    delete_callback, bound to the session registry and its lock) sends it down a piece-by-piece fallback that held
    the GIL ~0.4 s per page load, and eight visitors opening the page at once timed out."""
    app = MoLoRAApp(pipe)
    demo = app.build()
    copied = copy.deepcopy(demo.config)  # raises if any part cannot be copied
    callbacks = [c["props"]["delete_callback"] for c in copied["components"] if "delete_callback" in c["props"]]
    assert callbacks and all(cb.__self__ is app.sessions for cb in callbacks)  # one registry, never a copy
    app.close()


def test_uploaded_adapter_is_private_to_its_session(url, pipe, upload_zip):
    owner, other = client(url), client(url)
    status = owner.predict([handle_file(str(upload_zip))], "mine", "text", api_name="/upload_adapter")
    assert "mine" in status[2]
    assert owner.predict(api_name="/adapters")["uploaded"] == {"mine": "text"}
    assert other.predict(api_name="/adapters")["uploaded"] == {}
    assert "mine" not in pipe.adapters  # registered under a session-qualified internal name only
    assert {label for _, label in generate(owner, text="mine", routing="sequence")["tokens"]} == {"mine"}
    with pytest.raises(AppError, match="unknown adapter 'mine'"):
        generate(other, text="mine")
    internal = next(name for name in pipe.adapters if name.startswith("mine@"))
    with pytest.raises(AppError, match="unknown adapter"):
        generate(other, text=internal)  # guessing the internal name does not work either


@pytest.mark.parametrize("entries, message", [
    ({"../adapter_config.json": b"{}", "adapter_model.safetensors": b"x"}, "path traversal"),
    ({"mine/adapter_config.json": b"{}", "mine/adapter_model.safetensors": b"x", "mine/run.py": b""},
     "unexpected file"),
    ({"mine/adapter_config.json": b'{"peft_type": "LORA"}', "mine/adapter_model.safetensors": b"\x80\x04pickle"},
     "not a safetensors file"),
])
def test_bad_upload_shows_a_clear_error_and_changes_nothing(url, pipe, tmp_path, entries, message):
    c = client(url)
    before_pipe, before_session = dict(pipe.adapters), c.predict(api_name="/adapters")
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    with pytest.raises(AppError, match=f"adapter upload refused: .*{message}"):
        c.predict([handle_file(str(archive))], "bad", "text", api_name="/upload_adapter")
    assert set(pipe.adapters) <= set(before_pipe)  # nothing added (other tests' closed sessions may leave)
    assert c.predict(api_name="/adapters") == before_session


def test_upload_the_model_rejects_changes_nothing(url, pipe, tiny_assets, tmp_path):
    """Well-formed files for the wrong model: the pipeline's loader refuses them; no adapter, no folder is left."""
    c = client(url)
    folder = write_tiny_adapter(tiny_assets / "model", tmp_path / "wrong", modality="image", seed=3)
    config = (folder / "adapter_config.json").read_text().replace("molora/shapes-lm", "someone/else")
    (folder / "adapter_config.json").write_text(config)
    before = dict(pipe.adapters)
    with pytest.raises(AppError, match="adapter upload refused") as refused:
        c.predict([handle_file(str(folder / "adapter_config.json")),
                   handle_file(str(folder / "adapter_model.safetensors"))], "wrong", "image",
                  api_name="/upload_adapter")
    message = str(refused.value)
    assert "'wrong'" in message and "someone/else" in message  # what was wrong, in the visitor's own names
    assert "@" not in message and "molora-" not in message and tempfile.gettempdir() not in message
    assert set(pipe.adapters) <= set(before)
    assert c.predict(api_name="/adapters")["uploaded"] == {}


def test_python_app_py_serves_on_the_port_from_the_environment(tiny_assets):
    port = free_port()
    env = {**os.environ, "MOLORA_MODEL": str(tiny_assets / "model"), "GRADIO_SERVER_PORT": str(port),
           "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "app.py", "--no-warmup"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_served(proc, port, 90, "app.py")
        adapters = client(f"http://127.0.0.1:{port}/").predict(api_name="/adapters")
        assert adapters["builtin"] == {"image_style": "image", "text_style": "text"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_ending_a_session_unloads_its_adapters_and_deletes_its_files(pipe, upload_zip):
    """What gr.State's delete_callback runs when Gradio drops a session's state."""
    state = SessionState()
    state.bind("session-to-end")
    with zipfile.ZipFile(upload_zip) as zf:
        zf.extractall(state.folder())
    folder = state.folder() / "mine"
    internal = pipe.load_adapter(folder, name=state.internal_name("mine"))
    state.uploads["mine"] = internal
    assert internal in pipe.adapters
    workdir = state.folder()
    state.cleanup(pipe)
    assert internal not in pipe.adapters and not workdir.exists() and state.uploads == {}


def test_a_closed_tab_unloads_its_upload_from_the_pipeline_and_the_hot_set_at_once(pipe, upload_zip):
    """Gradio's unload event (the tab closed) ends the session now, not when its state expires an hour later."""
    app = MoLoRAApp(pipe)
    state, tab = app.sessions.new_state(), SimpleNamespace(session_hash="closing-tab")
    app.upload_adapter([str(upload_zip)], "mine", "text", state, tab)
    internal = state.uploads["mine"]
    assert pipe.adapter_infos()[internal].path.parent == state.workdir  # the registry holds its folder
    assert state.extra_adapters(pipe) == {internal: str(pipe.adapter_infos()[internal].path)}
    assert internal not in app.builtin and app.list_adapters(state)["uploaded"] == {"mine": "text"}
    pipe.generate("Draw a red circle.", text_adapter=internal, routing="sequence", seed=0, max_new_tokens=4)
    assert internal in pipe.cache_stats()["slots"]  # the upload holds a hot-set slot
    folder = state.workdir
    app.end_session(tab)  # what demo.unload calls when the tab closes
    assert internal not in pipe.adapters and internal not in pipe.cache_stats()["slots"]
    assert not folder.exists() and state.uploads == {}
    app.close()
    assert not app.sessions.root.exists()


def test_another_session_sees_no_trace_of_an_upload_in_the_cache_panel(url, pipe, upload_zip):
    owner, other = client(url), client(url)
    owner.predict([handle_file(str(upload_zip))], "secret", "text", api_name="/upload_adapter")
    generate(owner, text="secret", routing="sequence")
    internal = next(name for name in pipe.adapters if name.startswith("secret@"))
    slot = pipe.cache_stats()["slots"].index(internal)
    assert "secret" in generate(owner, text="secret", routing="sequence")["stats"]  # the owner sees it
    stats = generate(other, routing="none")["stats"]
    assert "secret" not in stats and "@" not in stats
    assert f"slot {slot}: empty" in stats


def test_the_app_folder_is_removed_at_shutdown(tmp_path):
    """Sessions' files live under one temporary folder of the app, gone when the process ends."""
    code = ("from molora.app.session import SessionRegistry; r = SessionRegistry(None); s = r.new_state(); "
            "r.bind(s, 'x'); (s.folder() / 'doc.html').write_text('x'); print(r.root)")
    root = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert not Path(root.stdout.strip()).exists()


@pytest.mark.parametrize("seed, message", [(-1, "seed must be from 0 to"), (2**31, "seed must be from 0 to"),
                                           (1.5, "seed must be a whole number")])
def test_a_seed_outside_the_one_rule_is_refused_naming_the_field(url, seed, message):
    with pytest.raises(AppError, match=message):
        generate(client(url), seed=seed)


def test_a_new_run_clears_the_previous_download_at_once(url):
    job = client(url).submit(**request(max_new_tokens=8), api_name="/generate")
    job.result(timeout=120)
    first = job.outputs()[0]
    assert first[2] is None and "starting…" in first[5]  # the first update clears the download


def test_api_outputs_are_named(url):
    info = client(url).view_api(return_format="dict", print_info=False)
    returns = [r["label"] for r in info["named_endpoints"]["/generate"]["returns"]]
    assert not any(label.startswith("value_") for label in returns), returns
    assert "Rejected drafts" in returns and "Status, cache and latency" in returns


def test_generation_streams_partial_pages_before_the_final_one(url):
    job = client(url).submit(**request(start_image=True, max_new_tokens=IMAGE_TOKENS, cfg_scale=1.0),
                             api_name="/generate")
    final = job.result(timeout=120)
    outputs = job.outputs()
    assert len(outputs) >= 2 and outputs[-1][5] == final[5]
    partial_stats = [o[5] for o in outputs[:-1]]
    assert "starting…" in partial_stats[0]  # sent at once: it clears the previous run's download
    assert all("generating…" in stats for stats in partial_stats[1:])
    assert "done in" in final[5] and final[2] is not None  # the HTML file only comes with the final page


def test_best_of_streams_candidates_and_keeps_the_one_the_check_passes(tiny_assets, url, monkeypatch):
    with pytest.raises(AppError, match="needs a check"):  # the tiny model names no check: a clear refusal
        generate(client(url), best_of=2)
    monkeypatch.setitem(CHECKS, "second_draw", lambda pipe: lambda docs: [d.meta["seed"] == 6 for d in docs])
    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    pipe.default_config = pipe.default_config.with_overrides(check="second_draw")
    port = free_port()
    demo = serve(pipe, host="127.0.0.1", port=port, block=False)
    try:
        out = generate(client(f"http://127.0.0.1:{port}/"), seed=5, best_of=3)
    finally:
        demo.close()
    assert "kept candidate 2 of 2 drawn" in out["stats"]
    assert "candidate 1: the check did not pass it" in out["drafts"]  # the rejected draft stays visible
    same_seed = pipe.generate("Draw a red circle.", text_adapter="text_style", image_adapter="image_style",
                              seed=6, max_new_tokens=16, text_temperature=1.0, text_top_p=1.0, cfg_scale=3.0)
    assert out["text"] == "Draw a red circle.\n" + same_seed.text.lstrip(" ")  # the kept candidate: seed + 1


def test_per_sequence_mode_says_which_adapter_it_uses_and_that_the_image_picker_is_not_used(url):
    stats = generate(client(url), routing="sequence")["stats"]
    assert "per-sequence: every token uses text_style (the image picker is not used)" in stats
    stats = generate(client(url), routing="sequence", text="none")["stats"]
    assert "per-sequence: every token uses image_style" in stats


def test_concurrent_visitors_share_forward_passes_and_stop_cancels_the_request(pipe, monkeypatch):
    ends: list[str] = []
    real_end = pipe.engine._end
    monkeypatch.setattr(pipe.engine, "_end", lambda job, reason=None, error=None: ends.append(reason) or real_end(
        job, reason, error))
    port = free_port()
    demo = serve(pipe, host="127.0.0.1", port=port, concurrency=8, block=False)
    url = f"http://127.0.0.1:{port}/"
    try:
        steps_before = pipe.engine.steps
        with ThreadPoolExecutor(max_workers=4) as pool:
            outs = list(pool.map(lambda s: generate(client(url), seed=s, max_new_tokens=40, cfg_scale=1.0), range(4)))
        tokens = sum(len(o["tokens"]) for o in outs)
        steps = pipe.engine.steps - steps_before
        assert steps < 0.6 * tokens, f"{steps} engine steps for {tokens} tokens: visitors did not share passes"

        job = client(url).submit(**request(start_image=True, max_new_tokens=1000), api_name="/generate")
        deadline = time.monotonic() + 30
        while pipe.engine.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pipe.engine.stats()["running"] == 1
        time.sleep(0.2)
        ends.clear()
        job.cancel()  # what the Stop button and a closed tab do
        deadline = time.monotonic() + 10
        while pipe.engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pipe.engine.stats()["running"] == 0 and not pipe.cache_stats()["pinned"]
        # Gradio closes the page's generator once its current refresh is out (a fraction of a second); the engine
        # then frees the request at its next step, long before its ~600-token budget would have ended it
        assert ends == ["cancelled"]
    finally:
        demo.close()


def test_a_refusal_is_logged_as_one_line_without_a_traceback(url, capfd, caplog):
    caplog.set_level(logging.INFO, logger="molora.app.ui")
    with pytest.raises(AppError, match="seed must be"):
        generate(client(url), seed=-1)
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err + printed.out  # a visitor's mistake is not a server error
    assert [r.getMessage() for r in caplog.records if "seed must be" in r.getMessage()]


@pytest.mark.parametrize("field, value, message", [
    ("text_temperature", 5.0, "Text temperature must be from 0 to 2, got 5"),
    ("max_new_tokens", 5000, "Max new tokens must be from 1 to 1024, got 5000"),
    ("text_top_k", 2.5, "Text top-k (0 = off) takes whole numbers, got 2.5"),
    ("routing", "sideways", "Routing: Value: 'sideways' (type: <class 'str'>) is not in the list of choices"),
])
def test_an_out_of_range_api_value_is_refused_naming_the_control_in_one_log_line(url, capfd, field, value, message):
    with pytest.raises(AppError, match=re.escape(message)):
        client(url).predict(**{**request(), field: value}, api_name="/generate")
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err + printed.out


def test_a_prompt_that_is_not_text_is_refused_in_the_page_naming_the_bytes(pipe):
    app = MoLoRAApp(pipe)
    try:
        with pytest.raises(gr.Error, match="bytes that are not UTF-8"):
            list(app.generate("Draw a red \udcff\udcfe circle.", "text_style", "image_style", "vocab", False, 1.0, 0,
                              1.0, 1.0, 0, 1.0, 0, 8, 1, app.sessions.new_state(), SimpleNamespace(session_hash="x")))
    finally:
        app.close()


def test_stop_ends_the_page_even_when_the_generation_does_not_see_the_signal(pipe, monkeypatch):
    """On ZeroGPU the generation runs in a worker process that the Stop button's signal does not reach: the page
    stops waiting after a grace period, closes the stream (which cancels the request) and says it stopped."""
    import molora.app.ui as ui
    from molora.models.engine.events import TextDelta

    def deaf_stream(*args, **kwargs):
        while True:  # a generation that never sees the StopSignal
            time.sleep(0.02)
            yield TextDelta(" word", [7], ["text_style"])

    monkeypatch.setattr(ui, "stream_events", deaf_stream)
    monkeypatch.setattr(ui, "STOP_GRACE_SECONDS", 0.5)
    app = MoLoRAApp(pipe)
    tab = SimpleNamespace(session_hash="deaf")
    run = app.generate("x", "text_style", "image_style", "vocab", False, 1.0, 0, 1.0, 1.0, 0, 1.0, 0, 8, 1,
                       app.sessions.new_state(), tab)
    next(run)
    next(run)
    app.stop(tab)
    started = time.monotonic()
    outputs = list(run)
    assert time.monotonic() - started < 10 and "stopped after" in outputs[-1][5]
    app.close()
