"""The Python API: InterleavedPipeline, Document round trips, events, bad inputs, threads and the CLI."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time

import numpy as np
import pytest
from PIL import Image

from molora.models import Document, GenerationConfig, GenerationError, InterleavedPipeline, ModelDirError
from molora.models.document import DocumentError
from molora.models.engine.events import (
    Finished,
    ImageDone,
    ImageProgress,
    ImageStarted,
    Notice,
    StepTiming,
    TextDelta,
)
from molora.models.pipeline import split_prompts, truncate_prompt
from molora.routing import AdapterError, MoLoRAError, UnknownAdapterError

FAST = dict(max_new_tokens=280, seed=0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def image_doc(tiny_pipeline):
    return tiny_pipeline.generate("a red circle ✨", start_image=True, text_adapter="text_style",
                                  image_adapter="image_style", **FAST)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_from_pretrained_loads_model_and_adapters(tiny_pipeline):
    assert tiny_pipeline.adapters == {"image_style": "image", "text_style": "text"}
    stats = tiny_pipeline.cache_stats()
    assert {"hits", "misses", "evictions", "bytes_copied", "slots"} <= set(stats)


def test_text_to_image_document(image_doc, tiny_pipeline):
    assert len(image_doc.images) == 1 and image_doc.images[0].size == (64, 64)
    image_records = [r for r in image_doc.routing if r.modality == "image"]
    assert len(image_records) == tiny_pipeline.vocab.tokens_per_image
    assert {r.adapter for r in image_records} == {"image_style"}
    assert image_doc.meta["seed"] == 0 and image_doc.meta["routing"] == "vocab"
    assert image_doc.meta["finish_reason"] in ("eos", "length")


def test_the_pipeline_decodes_each_finished_picture_through_the_family_image_decode(tiny_pipeline, monkeypatch):
    """The document only records parts: a picture's codes reach the family's ImageCodec.decode once, from the
    pipeline (InterleavedPipeline.decode_image), and the document holds the image that decode made."""
    calls = []
    decode = tiny_pipeline.image_tokenizer.decode
    monkeypatch.setattr(tiny_pipeline.image_tokenizer, "decode", lambda codes: calls.append(codes) or decode(codes))
    doc = tiny_pipeline.generate("a red circle", start_image=True, image_adapter="image_style", **FAST)
    ids = [r.id for r in doc.routing if r.modality == "image"]
    assert len(calls) == 1 and calls[0].tolist() == [tiny_pipeline.tokenizer.codes_from_ids(ids).tolist()]
    assert np.array_equal(pixels(doc.images[0]), pixels(tiny_pipeline.decode_image(ids)))


def test_html_round_trip_preserves_text_images_and_routing(image_doc, tiny_pipeline, tmp_path):
    doc = tiny_pipeline.generate(["a caption for", image_doc.images[0], "this: "], max_images=0,
                                 text_adapter="text_style", **FAST)
    doc.parts.insert(0, image_doc.images[0])  # a document with images and text, in order
    for original in (image_doc, doc):
        path = original.save_html(tmp_path / "doc.html")
        loaded = Document.load(path)
        assert [type(p) for p in loaded.parts] == [type(p) for p in original.parts]
        for a, b in zip(loaded.parts + loaded.prompt, original.parts + original.prompt):
            if isinstance(a, str):
                assert a == b
            else:
                assert np.array_equal(pixels(a), pixels(b))
        assert loaded.routing == original.routing
        assert loaded.meta == original.meta and loaded.notices == original.notices
        page = path.read_text(encoding="utf-8")
        assert "data:image/png;base64," in page and "http" not in page.split("<script")[0].split("<style>")[0]


def test_markdown_round_trip(image_doc, tmp_path):
    md = image_doc.save_markdown(tmp_path / "md")
    assert md.read_text().count("![image") == len(image_doc.images)
    assert (tmp_path / "md" / "image_0.png").is_file()
    for source in (tmp_path / "md", md, tmp_path / "md" / "document.json"):
        loaded = Document.load(source)
        assert loaded.text == image_doc.text and loaded.routing == image_doc.routing
        assert np.array_equal(pixels(loaded.images[0]), pixels(image_doc.images[0]))


def test_html_colours_tokens_by_adapter(tiny_pipeline, tmp_path):
    doc = tiny_pipeline.generate("two blue squares", max_images=0, text_adapter="text_style", max_new_tokens=30,
                                 seed=1, text_temperature=1.0)
    page = doc.save_html(tmp_path / "c.html").read_text(encoding="utf-8")
    colour = doc.adapter_colors()["text_style"]
    coloured = page.count(f'style="background:{colour}" title=')  # token spans (the legend has no title)
    assert coloured == sum(1 for r in doc.routing if r.modality == "text" and r.piece)
    plain = doc.save_html(tmp_path / "p.html", color_tokens=False).read_text(encoding="utf-8")
    assert f"background:{colour}" not in plain
    assert Document.load(tmp_path / "p.html").text == doc.text


def test_load_rejects_foreign_files(tmp_path):
    (tmp_path / "x.html").write_text("<html>hello</html>")
    with pytest.raises(DocumentError, match="no embedded"):
        Document.load(tmp_path / "x.html")
    with pytest.raises(DocumentError, match="does not exist"):
        Document.load(tmp_path / "missing.html")


def test_stream_events_add_up_to_the_document(tiny_pipeline):
    events = list(tiny_pipeline.stream("a green triangle", start_image=True, image_adapter="image_style",
                                       text_temperature=1.0, **FAST))
    assert isinstance(events[-1], Finished)
    doc = events[-1].document
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == doc.text
    started = [e for e in events if isinstance(e, ImageStarted)]
    done = [e for e in events if isinstance(e, ImageDone)]
    assert len(started) == len(done) == len(doc.images) == 1
    assert np.array_equal(pixels(done[0].image), pixels(doc.images[0]))
    assert len(done[0].adapters) == tiny_pipeline.vocab.tokens_per_image + 1  # codes + <eoi>
    progress = [e.done for e in events if isinstance(e, ImageProgress)]
    assert progress == list(range(17, 273, 17))  # one event per row: 16 codes and the row marker
    timings = [e for e in events if isinstance(e, StepTiming)]
    assert len(timings) == len(doc.routing) and all(t.ms > 0 for t in timings)


def test_same_seed_reproduces_the_document(tiny_pipeline):
    kw = dict(start_image=True, text_temperature=1.0, image_temperature=1.0, max_new_tokens=300)
    a = tiny_pipeline.generate("a star", seed=7, **kw)
    b = tiny_pipeline.generate("a star", seed=7, **kw)
    c = tiny_pipeline.generate("a star", seed=8, **kw)
    assert [r.id for r in a.routing] == [r.id for r in b.routing] != [r.id for r in c.routing]
    assert np.array_equal(pixels(a.images[0]), pixels(b.images[0]))


def test_unseeded_calls_record_their_seed(tiny_pipeline):
    doc = tiny_pipeline.generate("hello", max_new_tokens=10, text_temperature=1.0)
    again = tiny_pipeline.generate("hello", max_new_tokens=10, text_temperature=1.0, seed=doc.meta["seed"])
    assert [r.id for r in doc.routing] == [r.id for r in again.routing]


def test_batch_of_prompts_gives_one_document_each(tiny_pipeline):
    prompts = ["a red circle", "", "三つの星 🌟"]
    docs = tiny_pipeline.generate(prompts, text_adapter=["text_style", None, "text_style"], max_images=0,
                                  max_new_tokens=20, seed=0, temperature=0.0)
    assert isinstance(docs, list) and len(docs) == 3
    for prompt, doc in zip(prompts, docs):
        alone = tiny_pipeline.generate(prompt, text_adapter=doc.meta["text_adapter"], max_images=0,
                                       max_new_tokens=20, seed=0, temperature=0.0)
        assert [r.id for r in doc.routing] == [r.id for r in alone.routing]
    assert {r.adapter for r in docs[1].routing} == {None}


def test_image_to_text_prompt(tiny_pipeline, image_doc):
    ids, parts, _ = tiny_pipeline.encode_prompt([image_doc.images[0], "caption:"], GenerationConfig(), 100)
    v = tiny_pipeline.vocab
    assert ids[:2] == [v.bos_id, v.boi_id] and ids[2 + v.tokens_per_image] == v.eoi_id
    doc = tiny_pipeline.generate([image_doc.images[0], "caption:"], max_new_tokens=20, max_images=0, seed=0)
    assert len(doc.prompt) == 2 and doc.images == []


@pytest.mark.parametrize("prompt", ["", "مرحبا 👋🏽 \x00\t\n ̈a", "<boi><eoi><eos>", "\ud7ff\U0010ffff"])
def test_any_unicode_prompt_works(tiny_pipeline, prompt):
    doc = tiny_pipeline.generate(prompt, max_new_tokens=15, seed=0, max_images=0)
    assert doc.prompt == [prompt]
    ids, _, _ = tiny_pipeline.encode_prompt(prompt, GenerationConfig(), 15)
    assert tiny_pipeline.vocab.boi_id not in ids  # typed special names stay text


def test_long_prompt_is_truncated_with_a_notice(tiny_pipeline, caplog):
    long = "a red circle in the top left " * 400
    with caplog.at_level("WARNING"):
        events = list(tiny_pipeline.stream(long, max_new_tokens=40, seed=0, max_images=0))
    notices = [e for e in events if isinstance(e, Notice)]
    doc = events[-1].document
    assert notices and "kept" in notices[0].message
    assert any("kept" in n for n in doc.notices) and "kept" in caplog.text
    assert doc.meta["prompt_tokens"] <= tiny_pipeline.max_positions - 40


def test_truncation_never_cuts_an_image_span(tiny_pipeline):
    v = tiny_pipeline.vocab
    span = [v.boi_id, *([v.image_start] * v.tokens_per_image), v.eoi_id]
    ids = [v.bos_id, *([10] * 50), *span, *([11] * 20)]
    kept = truncate_prompt(ids, 100, v)  # the cut falls inside the span: it is dropped whole
    assert kept == [v.bos_id, *([11] * 20)]
    kept = truncate_prompt(ids, 300, v)
    assert kept[0] == v.bos_id and kept[-(len(span) + 20):] == span + [11] * 20


def test_unknown_adapter_error_lists_loaded_ones(tiny_pipeline):
    with pytest.raises(UnknownAdapterError, match=r"nope.*image_style \(image\), text_style \(text\)"):
        tiny_pipeline.generate("x", text_adapter="nope", max_new_tokens=5)
    with pytest.raises(GenerationError, match="routing mode"):
        tiny_pipeline.generate("x", routing="magic", max_new_tokens=5)
    with pytest.raises(GenerationError, match="learned"):
        tiny_pipeline.generate("x", routing="learned", max_new_tokens=5)
    with pytest.raises(GenerationError, match="valid settings"):
        tiny_pipeline.generate("x", temprature=0.5)
    with pytest.raises(GenerationError, match="start_image needs"):
        tiny_pipeline.generate("x", start_image=True, max_new_tokens=10)
    with pytest.raises(GenerationError, match="prompt"):
        tiny_pipeline.generate([3.5], max_new_tokens=5)
    with pytest.raises(GenerationError, match="empty list"):
        tiny_pipeline.generate([], max_new_tokens=5)


def test_sequence_and_none_routing(tiny_pipeline):
    seq = tiny_pipeline.generate("a star", routing="sequence", text_adapter="text_style", image_adapter="image_style",
                                 start_image=True, **FAST)
    assert {r.adapter for r in seq.routing} == {"text_style"}
    base = tiny_pipeline.generate("a star", routing="none", text_adapter="text_style", start_image=True, **FAST)
    assert {r.adapter for r in base.routing} == {None}


def test_the_pipeline_lists_the_hot_set_caches_registry(tiny_assets):
    """One adapter registry: what the pipeline lists is what the cache holds, with the folder's molora.json facts;
    an adapter added to the routed model directly is listed too, and a removed one leaves both at once."""
    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    infos = pipe.adapter_infos()
    assert list(infos) == pipe.routed.cache.names == list(pipe.adapters)
    assert infos["text_style"].path == tiny_assets / "adapters" / "text_style"
    assert infos["text_style"].modality == "text"
    merged = pipe.merge_adapters(["text_style", "image_style"])
    assert pipe.adapter_infos()[merged].path is None and pipe.adapters[merged] == "merged"
    pipe.routed.add_adapter(dataclasses.replace(pipe.routed.adapter("text_style"), name="direct"))
    assert pipe.adapters["direct"] == "any"
    for name in (merged, "direct"):
        pipe.remove_adapter(name)
    assert list(pipe.adapters) == pipe.routed.cache.names == ["image_style", "text_style"]


def test_load_adapter_validates_and_changes_nothing_on_error(tiny_assets, tmp_path):
    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    before = pipe.adapters
    bad = tmp_path / "bad"
    shutil.copytree(tiny_assets / "adapters" / "text_style", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(AdapterError):
        pipe.load_adapter(bad)
    (bad / "molora.json").write_text('{"modality": "sound"}')
    with pytest.raises(MoLoRAError, match="modality"):
        pipe.load_adapter(bad)
    assert pipe.adapters == before
    name = pipe.load_adapter(tiny_assets / "adapters" / "image_style", name="image_copy")
    assert name == "image_copy" and pipe.adapters["image_copy"] == "image"
    with pytest.raises(AdapterError, match="already loaded"):
        pipe.load_adapter(tiny_assets / "adapters" / "image_style", name="image_copy")
    doc = pipe.generate("x", image_adapter="image_copy", start_image=True, **FAST)
    assert {r.adapter for r in doc.routing if r.modality == "image"} == {"image_copy"}
    events = pipe.stream("x", image_adapter="image_copy", start_image=True, **FAST)
    next(events)
    next(events)  # the request runs: its adapter is pinned until it ends, so removal is refused
    with pytest.raises(AdapterError, match="in use"):
        pipe.remove_adapter("image_copy")
    events.close()  # cancelled: the pin is released at the engine's next step boundary
    deadline = time.monotonic() + 10
    while "image_copy" in pipe.cache_stats()["pinned"] and time.monotonic() < deadline:
        time.sleep(0.01)
    pipe.remove_adapter("image_copy")
    assert "image_copy" not in pipe.adapters
    with pytest.raises(UnknownAdapterError, match="image_copy"):
        pipe.remove_adapter("image_copy")
    assert pipe.generate("y", image_adapter="image_style", start_image=True, **FAST).images


def test_missing_model_files_are_named(tiny_assets, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(tiny_assets / "model", broken)
    (broken / "tokenizer.json").unlink()
    shutil.rmtree(broken / "vq")
    with pytest.raises(ModelDirError, match=r"tokenizer\.json.*vq/config\.json"):
        InterleavedPipeline.from_pretrained(broken)
    with pytest.raises(ModelDirError, match="does not exist"):
        InterleavedPipeline.from_pretrained(tmp_path / "nowhere")


def test_threads_generate_at_once_with_their_own_state(tiny_pipeline):
    jobs = [("a red circle", "text_style", 1), ("two squares", None, 2), ("a star", "text_style", 3)]
    expected = [tiny_pipeline.generate(p, text_adapter=a, seed=s, max_new_tokens=40, max_images=0,
                                       text_temperature=1.0) for p, a, s in jobs]
    results: dict[int, Document] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            p, a, s = jobs[i]
            results[i] = tiny_pipeline.generate(p, text_adapter=a, seed=s, max_new_tokens=40, max_images=0,
                                                text_temperature=1.0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, doc in enumerate(expected):
        assert [r.id for r in results[i].routing] == [r.id for r in doc.routing]
        assert [r.adapter for r in results[i].routing] == [r.adapter for r in doc.routing]


def test_split_prompts_rules(image_doc):
    img = image_doc.images[0]
    assert split_prompts("a") == (["a"], False)
    assert split_prompts(["a", "b"]) == (["a", "b"], True)
    assert split_prompts(["describe", img]) == ([["describe", img]], False)
    assert split_prompts([("describe", img), "b"]) == ([("describe", img), "b"], True)


def test_cli_writes_html_and_markdown(tiny_assets, tmp_path, image_doc):
    from molora.models.cli import main

    image_path = tmp_path / "in.png"
    image_doc.images[0].save(image_path)
    out = tmp_path / "cli" / "doc.html"
    code = main(["a red circle", "--model", str(tiny_assets / "model"), "--out", str(out), "--markdown",
                 str(tmp_path / "cli_md"), "--seed", "0", "--max-new-tokens", "20", "--max-images", "0",
                 "--text-adapter", "text_style", "--image", str(image_path), "--threads", "0"])
    assert code == 0 and out.is_file() and (tmp_path / "cli_md" / "document.md").is_file()
    assert isinstance(Document.load(out).prompt[0], Image.Image)
    assert main(["x", "--model", str(tiny_assets / "model"), "--out", str(out), "--text-adapter", "zzz"]) == 2


def test_learned_routing_uses_the_gates_for_text_and_the_image_adapter_for_images(tiny_assets, tmp_path):
    from molora.routing import LearnedGates

    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    with pytest.raises(UnknownAdapterError, match="not loaded"):
        gates = LearnedGates.for_model(pipe.routed, ["text_style", "other"])
        gates.save(tmp_path / "bad.safetensors")
        pipe.load_learned_router(tmp_path / "bad.safetensors")
    gates = LearnedGates.for_model(pipe.routed, ["text_style", "image_style"], init_std=1.0)
    gates.save(tmp_path / "gates.safetensors")
    pipe.load_learned_router(tmp_path / "gates.safetensors", top_k=1)
    doc = pipe.generate("a star", routing="learned", image_adapter="image_style", start_image=True,
                        text_temperature=1.0, **FAST)
    image = [r.adapter for r in doc.routing if r.modality == "image"]
    assert set(image) == {"image_style"} and len(image) == pipe.vocab.tokens_per_image
    text = [r.adapter for r in doc.routing[len(image) + 1:]]  # produced at <eoi> and text positions: gated
    assert set(text) <= {"text_style", "image_style"}


def test_stream_checks_arguments_eagerly_and_stops_when_closed(tiny_pipeline):
    with pytest.raises(UnknownAdapterError):
        tiny_pipeline.stream("x", image_adapter="nope")  # raises before any iteration
    events = tiny_pipeline.stream("a circle", start_image=True, **FAST)
    first = [next(events) for _ in range(5)]
    events.close()
    assert any(isinstance(e, ImageStarted) for e in first)
    assert tiny_pipeline.routed.cache.stats()["pinned"] == {}  # nothing left pinned by the stopped request


def test_model_dir_generation_json_sets_the_defaults(tiny_assets, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_assets / "model", model)
    (model / "generation.json").write_text('{"cfg_scale": 1.5, "image": {"temperature": 0.0}, "max_new_tokens": 300}')
    pipe = InterleavedPipeline.from_pretrained(model, adapters_dir=tiny_assets / "adapters")
    assert pipe.default_config.cfg_scale == 1.5 and pipe.default_config.image.temperature == 0.0
    assert set(pipe.adapters) == {"text_style", "image_style"}
    doc = pipe.generate("x", seed=0, start_image=True)
    assert doc.meta["config"]["cfg_scale"] == 1.5 and doc.meta["config"]["max_new_tokens"] == 300
    (model / "generation.json").write_text('{"cfg": 2}')
    with pytest.raises(ModelDirError, match=r"generation\.json.*unknown GenerationConfig fields"):
        InterleavedPipeline.from_pretrained(model)


def test_router_config_sets_top_k_and_refuses_gates_trained_on_other_adapter_weights(tiny_assets, tmp_path):
    from molora.models.families.loading import adapter_weights_hash
    from molora.routing import LearnedGates

    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    folder = tmp_path / "router"
    folder.mkdir()
    LearnedGates.for_model(pipe.routed, ["text_style", "image_style"]).save(folder / "gates.safetensors")
    real = {n: adapter_weights_hash(tiny_assets / "adapters" / n) for n in ("text_style", "image_style")}
    (folder / "config.json").write_text(json.dumps({"top_k": 1, "adapter_sha256_16": {**real,
                                                                                       "text_style": "0" * 16}}))
    with pytest.raises(AdapterError, match="trained on adapter 'text_style'"):
        pipe.load_learned_router(folder / "gates.safetensors")
    assert pipe.gates is None and pipe.learned_top_k == 2  # nothing changed
    (folder / "config.json").write_text(json.dumps({"top_k": 1, "adapter_sha256_16": real}))
    pipe.load_learned_router(folder / "gates.safetensors")
    assert pipe.gates is not None and pipe.learned_top_k == 1


def test_cli_names_a_router_file_and_refuses_a_missing_one(tiny_assets, tmp_path, capsys):
    from molora.models.cli import main as cli_main

    code = cli_main(["x", "--model", str(tiny_assets / "model"), "--routing", "learned", "--router",
                     str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "doc.html"), "--device", "cpu"])
    assert code == 2 and "nope.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "doc.html").exists()
