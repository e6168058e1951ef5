"""ShapesEval: the analyser and parser read ground truth exactly (and survive mild noise), every category
has 200+ distinct held-out prompts, and the runner scores a perfect fake pipeline ~1 and a wrong one ~0."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from PIL import Image, ImageFilter

from molora.models.engine.sampling import GenerationError
from molora.models.families.shapes import ShapesError
from molora.models.families.shapes.eval import (
    CATEGORIES,
    analyse_image,
    build_prompts,
    document_consistency,
    match_objects,
    parse_caption,
    results_markdown,
    run_shapes_eval,
    score_image_to_text,
    score_interleaved,
    score_text_to_image,
)
from molora.models.families.shapes.parse import ParsedObj
from molora.models.families.shapes.text import caption, describe_objects, document, instruction
from molora.models.families.shapes.world import (
    CELLS,
    COLOURS,
    STYLES,
    Obj,
    Scene,
    is_heldout_scene,
    render,
    sample_object,
    sample_scene,
)


def _key(o):
    return (o.shape, o.colour, o.size, o.cell)


def _reads_exactly(scene: Scene, img: Image.Image) -> bool:
    r = analyse_image(img)
    return (sorted(map(_key, r.objects)) == sorted(map(_key, scene.objects))
            and r.background == scene.background and r.style == scene.style)


def _noisy(img: Image.Image, seed: int, blur: float = 0.7, sigma: float = 8.0) -> Image.Image:
    arr = np.asarray(img.filter(ImageFilter.GaussianBlur(blur))).astype(float)
    arr += np.random.default_rng(seed).normal(0.0, sigma, arr.shape)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


@pytest.mark.parametrize("style", STYLES)
def test_analyser_reads_ground_truth_renders_exactly(style):
    rng = random.Random(100 + STYLES.index(style))
    scenes = [sample_scene(rng, rng.choice(("train", "heldout")), style=style) for _ in range(300)]
    accuracy = np.mean([_reads_exactly(s, render(s)) for s in scenes])
    assert accuracy >= 0.99, accuracy


@pytest.mark.parametrize("style", STYLES)
def test_analyser_survives_mild_blur_and_noise(style):
    rng = random.Random(200 + STYLES.index(style))
    scenes = [sample_scene(rng, rng.choice(("train", "heldout")), style=style) for _ in range(300)]
    accuracy = np.mean([_reads_exactly(s, _noisy(render(s), i)) for i, s in enumerate(scenes)])
    assert accuracy >= 0.99, accuracy


def test_analyser_ignores_specks_and_reads_colour_jitter():
    scene = Scene((Obj("star", "blue", "small", "center"), Obj("circle", "orange", "large", "top left")),
                  background="cream")
    arr = np.asarray(render(scene)).astype(int)
    arr[2:4, 44:46] = (215, 40, 40)  # a 4-px red speck in the top right cell
    arr[60, 5] = (40, 160, 60)
    arr = arr + np.random.default_rng(0).integers(-20, 21, arr.shape)  # per-pixel colour jitter
    reading = analyse_image(Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)))
    assert sorted(map(_key, reading.objects)) == sorted(map(_key, scene.objects))


def test_analyser_rejects_non_images():
    with pytest.raises(ShapesError, match="PIL image"):
        analyse_image("not an image")


@pytest.mark.parametrize("register", ("plain", "pirate"))
def test_parser_reads_ground_truth_captions_exactly(register):
    rng = random.Random(300 + len(register))
    ok = []
    for _ in range(300):
        scene = sample_scene(rng, rng.choice(("train", "heldout")))
        sizes = rng.random() < 0.5
        parsed = parse_caption(caption(scene, rng, register, sizes=sizes))
        expected = Counter((o.shape, o.colour, o.size if sizes else None, o.cell) for o in scene.objects)
        ok.append(Counter(map(_key, parsed.objects)) == expected and parsed.register == register
                  and parsed.background in (None, scene.background) and score_image_to_text(scene, parsed))
    assert np.mean(ok) >= 0.99, np.mean(ok)


def test_parser_reads_instructions_counts_and_totals():
    p = parse_caption("Draw three small red stars, one at the top, one in the middle and one on the left.")
    assert [_key(o) for o in p.objects] == [("star", "red", "small", c) for c in ("top", "center", "left")]
    p = parse_caption("Please draw two blue squares and an orange circle on a sky background.")
    assert Counter(_key(o) for o in p.objects) == Counter({("square", "blue", None, None): 2,
                                                           ("circle", "orange", None, None): 1})
    assert p.background == "sky" and p.register == "plain"
    p = parse_caption("Arr, now there be four shapes, matey.")
    assert p.total == 4 and p.register == "pirate" and not p.objects
    rng = random.Random(5)
    for _ in range(200):  # instructions name exactly the scene's objects
        scene = sample_scene(rng)
        parsed = parse_caption(instruction(scene, rng))
        assert match_objects(list(parsed.objects), scene.objects)


def test_match_objects_needs_a_one_to_one_pairing():
    a, b = Obj("star", "red", "small", "top"), Obj("circle", "blue", "large", "left")
    assert match_objects([ParsedObj("star", None, None, None), ParsedObj("circle", "blue", None, "left")], [b, a])
    assert not match_objects([ParsedObj("star", None, None, None)] * 2, [a, b])
    assert not match_objects([ParsedObj("star", "red", None, None)], [a, b])  # one object too many


def test_interleaved_consistency_on_ground_truth_documents():
    rng = random.Random(400)
    for _ in range(100):
        register = rng.choice(("plain", "pirate"))
        parts = document(rng, "heldout", register, rng.choice(STYLES))
        rendered = [render(p) if isinstance(p, Scene) else p for p in parts]
        assert score_interleaved(rendered)
        # a picture that drops an object is caught
        pictures = [i for i, p in enumerate(parts) if isinstance(p, Scene)]
        last = parts[pictures[-1]]
        rendered[pictures[-1]] = render(Scene(last.objects[:-1], last.background, last.style))
        assert document_consistency(rendered)[-1] is False


def test_every_category_has_200_distinct_heldout_prompts_from_fixed_seeds():
    for category in CATEGORIES:
        prompts = build_prompts(category, 200, seed=0)
        keys = {p.scene.sorted() if category == "image_to_text" else p.text for p in prompts}
        assert len(keys) == 200, category
        assert all(is_heldout_scene(p.scene) for p in prompts), category
        again = build_prompts(category, 200, seed=0)
        assert [p.text for p in again] == [p.text for p in prompts] and \
            [p.scene for p in again] == [p.scene for p in prompts]
        for p in prompts[:50]:  # the target is exactly what the instruction names, and the render meets it
            if p.text is not None and category != "interleaved":
                assert match_objects(list(parse_caption(p.text).objects), p.scene.objects)
                assert score_text_to_image(p, render(p.scene))
    with pytest.raises(ShapesError, match="category"):
        build_prompts("aesthetics")


# -------------------------------------------------------------------------------- runner with fake pipes


@dataclass
class FakeDoc:
    parts: list


@dataclass
class FakePipeline:
    """Answers from the ground truth: renders the scene an instruction names, captions an image from a
    lookup of the eval's own renders, continues a document by adding a shape. `wrong_colour` repaints every
    object; styles follow the adapters the way per-token routing would apply them."""

    adapters: dict = field(default_factory=lambda: {"pirate": "text", "outline": "image"})
    wrong_colour: bool = False
    echo: bool = True  # whether a document's parts start with the prompt text
    calls: list = field(default_factory=list)

    def __post_init__(self):
        self._scenes = {}
        for category in CATEGORIES:
            for p in build_prompts(category, 20, seed=0):
                if category == "image_to_text":
                    self._scenes[p.image().tobytes()] = p.scene

    def _scene_from_text(self, text: str, style: str) -> Scene:
        objs, free = [], list(CELLS)
        for o in parse_caption(text).objects:
            cell = o.cell or next(c for c in free if c not in {x.cell for x in objs})
            objs.append(Obj(o.shape, o.colour or "red", o.size or "large", cell))
        return Scene(tuple(objs), background=parse_caption(text).background or "white", style=style)

    def _paint(self, scene: Scene) -> Image.Image:
        if self.wrong_colour:
            scene = Scene(tuple(Obj(o.shape, COLOURS[(COLOURS.index(o.colour) + 1) % len(COLOURS)], o.size, o.cell)
                                for o in scene.objects), scene.background, scene.style)
        return render(scene)

    def generate(self, prompts, *, text_adapter=None, image_adapter=None, routing="vocab", seed=0, **settings):
        self.calls.append((text_adapter, image_adapter, routing))
        text_styled = text_adapter is not None and routing in ("vocab", "sequence")
        image_styled = image_adapter is not None or (routing == "sequence" and text_adapter == "merged")
        text_styled = text_styled and (routing == "vocab" or text_adapter in ("pirate", "merged"))
        style, register = ("outline" if image_styled else "filled"), ("pirate" if text_styled else "plain")
        rng = random.Random(seed)
        docs = []
        for prompt in prompts:
            if isinstance(prompt, list):  # image -> text
                scene = self._scenes[prompt[0].tobytes()]
                docs.append(FakeDoc([caption(scene, rng, register)]))
            elif prompt.startswith(("First", "We start", "Here is", "At first")):  # a document opening
                scene = self._scene_from_text(prompt, style)
                free = [c for c in CELLS if c not in {o.cell for o in scene.objects}]
                new = sample_object(rng, "train", free)
                more = Scene(scene.objects + (new,), scene.background, style)
                add = ("Then " if register == "plain" else "Arr, then ") + describe_objects([new], rng) + " joins:"
                parts = [self._paint(scene), add, self._paint(more)]
                docs.append(FakeDoc([prompt] + parts if self.echo else parts))
            else:  # text -> image
                docs.append(FakeDoc([self._paint(self._scene_from_text(prompt, style))]))
        return docs


def test_runner_scores_a_ground_truth_pipeline_near_one():
    pipe = FakePipeline(adapters={"pirate": "text", "outline": "image", "merged": "merged"})
    results, table = run_shapes_eval(pipe, n_per_category=20, batch_size=8, progress=False)
    assert set(results["conditions"]) == {"base", "image_lora", "text_lora", "vocab_both", "seq_text",
                                          "seq_image", "merged"}
    for name, res in results["conditions"].items():
        s = res["summary"]
        assert s["text_to_image"] >= 0.99 and s["image_to_text"] >= 0.99 and s["interleaved"] >= 0.99, name
        assert all(c["content"] >= 0.99 for c in res["categories"].values()), (name, res["categories"])
        if name != "base":
            assert s["style_ok"] >= 0.99 and s["style_and_content"] >= 0.99, (name, s)
    assert results["conditions"]["base"]["summary"]["outline_rate"] == 0.0
    assert results["conditions"]["vocab_both"]["summary"]["outline_rate"] == 1.0
    assert results["conditions"]["vocab_both"]["summary"]["pirate_rate"] == 1.0
    assert results["conditions"]["seq_text"]["summary"]["outline_rate"] == 0.0  # one adapter per sequence
    assert ("pirate", "outline", "vocab") in pipe.calls and ("pirate", None, "sequence") in pipe.calls
    assert "| vocab_both |" in table and "pirate, outline (vocab)" in table


def test_runner_scores_wrong_colours_near_zero_and_skips_missing_adapters():
    pipe = FakePipeline(adapters={"pirate": "text"}, wrong_colour=True)
    results, table = run_shapes_eval(pipe, n_per_category=20, batch_size=16, progress=False,
                                     categories=["colour", "colour_attribution", "position"])
    assert set(results["conditions"]) == {"base", "text_lora", "seq_text"}
    assert set(results["skipped"]) == {"image_lora", "vocab_both", "seq_image", "merged"}
    base = results["conditions"]["base"]["categories"]
    assert base["colour"]["content"] <= 0.01 and base["colour_attribution"]["content"] <= 0.01
    assert "skipped" in results_markdown(results)


def test_runner_reads_documents_with_or_without_the_prompt_echoed():
    for echo in (True, False):
        results, _ = run_shapes_eval(FakePipeline(echo=echo), n_per_category=10, progress=False,
                                     conditions=["base", "vocab_both"], categories=["interleaved"])
        base, both = (results["conditions"][c]["summary"] for c in ("base", "vocab_both"))
        assert base["interleaved"] == both["interleaved"] == 1.0
        assert base["pirate_rate"] == 0.0 and both["pirate_rate"] == 1.0 and both["outline_rate"] == 1.0


def test_runner_reports_each_category_as_it_finishes():
    seen = []
    run_shapes_eval(FakePipeline(), n_per_category=4, progress=False, conditions=["base", "vocab_both"],
                    categories=["colour", "image_to_text"],
                    on_result=lambda res, table: seen.append(
                        [(name, list(r["categories"])) for name, r in res["conditions"].items()]))
    assert seen == [  # the results so far, each time
        [("base", ["colour"])],
        [("base", ["colour", "image_to_text"])],
        [("base", ["colour", "image_to_text"]), ("vocab_both", ["colour"])],
        [("base", ["colour", "image_to_text"]), ("vocab_both", ["colour", "image_to_text"])],
    ]


def test_runner_asks_for_one_picture_in_text_to_image_prompts():
    calls = []

    class Recording(FakePipeline):
        def generate(self, prompts, **kwargs):
            calls.append(kwargs.get("max_images"))
            return super().generate(prompts, **kwargs)

    run_shapes_eval(Recording(), n_per_category=2, progress=False, conditions=["base"],
                    categories=["colour", "image_to_text", "interleaved"])
    assert calls == [1, None, None]


def test_runner_rejects_bad_arguments():
    pipe = FakePipeline()
    with pytest.raises(ShapesError, match="categories"):
        run_shapes_eval(pipe, n_per_category=2, categories=["beauty"], progress=False)
    with pytest.raises(ShapesError, match="conditions"):
        run_shapes_eval(pipe, n_per_category=2, conditions=["lucky"], progress=False)


def test_cli_passes_generation_settings_and_rejects_malformed_ones(tiny_assets, tmp_path, capsys):
    from molora.models.families.shapes.eval import main

    out = tmp_path / "r.json"
    assert main(["--model", str(tiny_assets / "model"), "--n", "1", "--conditions", "base", "--categories",
                 "single_object", "--device", "cpu", "--set", "cfg_scale=2.0", "--set", "image_temperature=0",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["generation_overrides"] == {"cfg_scale": 2.0, "image_temperature": 0}
    assert "cfg_scale=2.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_assets / "model"), "--set", "cfg_scale"])
    with pytest.raises(GenerationError, match="unknown generation setting"):
        main(["--model", str(tiny_assets / "model"), "--n", "1", "--conditions", "base", "--categories",
              "single_object", "--device", "cpu", "--set", "cfg=2"])


def test_merge_joins_runs_split_by_condition_and_refuses_mismatches(tmp_path, capsys):
    from molora.models.families.shapes.eval import main, merge_results

    def run(conditions, **kw):
        return run_shapes_eval(FakePipeline(), n_per_category=4, progress=False, conditions=conditions,
                               categories=["colour", "image_to_text"], **kw)[0]

    whole = run(["base", "vocab_both", "seq_text"])
    split = [run(["seq_text", "vocab_both"]), run(["base"])]
    merged = merge_results(split)
    assert list(merged["conditions"]) == ["base", "vocab_both", "seq_text"]  # the eval's order, not the files'
    for name, res in whole["conditions"].items():
        assert merged["conditions"][name]["categories"] == res["categories"]
    paths = []
    for i, part in enumerate(split):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    out_md, out_json = tmp_path / "all.md", tmp_path / "all.json"
    assert main(["--merge", *map(str, paths), "--out", str(out_md), "--json", str(out_json)]) == 0
    assert out_md.read_text() == results_markdown(merged) and "| base |" in capsys.readouterr().out
    assert list(json.loads(out_json.read_text())["conditions"]) == ["base", "vocab_both", "seq_text"]

    with pytest.raises(ShapesError, match="more than one"):
        merge_results([split[1], split[1]])
    with pytest.raises(ShapesError, match="n_per_category"):
        merge_results([split[1], {**split[0], "n_per_category": 200}])
    with pytest.raises(ShapesError, match="different categories"):
        merge_results([split[1], run_shapes_eval(FakePipeline(), n_per_category=4, progress=False,
                                                 conditions=["seq_text"], categories=["colour"])[0]])
    with pytest.raises(ShapesError, match="not a ShapesEval results"):
        merge_results([split[0], {"rows": []}])
    with pytest.raises(ShapesError, match="nothing to merge"):
        merge_results([])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["--merge", str(paths[0]), str(tmp_path / "bad.json")])
    assert "cannot read" in capsys.readouterr().err


def test_a_table_written_before_the_run_ends_says_it_is_partial():
    from molora.models.families.shapes.eval import is_partial

    tables = []
    results, final = run_shapes_eval(FakePipeline(), n_per_category=4, progress=False, conditions=["base"],
                                     categories=["colour", "image_to_text"],
                                     on_result=lambda res, table: tables.append(table))
    assert tables[0].startswith("**Partial results: 1 of 2 (condition, category) sets scored**")
    assert "Partial" not in tables[-1] and "Partial" not in final and not is_partial(results)


def test_the_run_says_how_many_documents_and_estimates_the_time_after_its_first_batch(caplog):
    with caplog.at_level("INFO", logger="molora.models.families.shapes.eval"):
        run_shapes_eval(FakePipeline(), n_per_category=4, batch_size=2, progress=True, conditions=["base"],
                        categories=["colour", "image_to_text"])
    said = caplog.text
    assert "ShapesEval: 8 documents (1 conditions x 2 categories x 4 prompts)" in said
    assert "s a document so far, so about" in said and "for all 8" in said
