"""scripts/eval_molora.py's seeded held-out items, its intervals and its fair-baseline hook (issue 29), on a tiny
random model with two random domain adapters (seconds on one CPU thread)."""

from __future__ import annotations

import json

import pytest
import torch

from molora.models.families.shapes.domain_batches import make_batch
from molora.models.families.shapes.errors import ShapesError
from molora.models.families.shapes.eval_seeds import check_seeds, is_selection_seed
from molora.models.families.shapes.stats import recovery, recovery_interval, wilson_interval
from molora.models.families.shapes.testing import write_tiny_adapter, write_tiny_model_dir
from molora.routing import LabelRouter
from tests.script_loader import load_script

ADAPTERS = ["count", "spatial"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("molora_eval")
    model = write_tiny_model_dir(root / "model")
    for seed, name in enumerate(ADAPTERS, start=1):
        write_tiny_adapter(model, root / "adapters" / name, modality="text", seed=seed)
    ev = load_script("eval_molora")
    routed, tok = load_script("train_router").load_routed(model, root / "adapters", ADAPTERS)
    routed.eval()
    return root, ev, routed, tok


# --- seeds -------------------------------------------------------------------------------------------------

def test_two_seeds_draw_different_items_and_the_same_seed_the_same(tiny):
    _, ev, _, tok = tiny
    a = ev.eval_items(tok, ADAPTERS, 6, "1", 8)
    again = ev.eval_items(tok, ADAPTERS, 6, "1", 8)
    other = ev.eval_items(tok, ADAPTERS, 6, "2", 8)
    assert [e.ids for e in a] == [e.ids for e in again]
    assert len(a) == len(other) == 2 * 6 + 8 and sum(e.kind == "mixed" for e in a) == 8
    assert not {tuple(e.ids) for e in a} & {tuple(e.ids) for e in other}
    pooled, seeds = ev.seeded_items(tok, ADAPTERS, ["1", "2"], 6, 8)
    assert [e.ids for e in pooled] == [e.ids for e in a + other] and seeds == ["1"] * 20 + ["2"] * 20


def test_selection_seeds_are_flagged_and_refused_beside_test_seeds(tiny):
    _, ev, _, _ = tiny
    assert all(is_selection_seed(s) for s in ("eval", "eval-first", "val0", "router-val0", "ad-val3", "probe-val"))
    assert not any(is_selection_seed(s) for s in ("1", "987654", "evaluation", "test"))
    assert check_seeds([1, 2, 3]) == (["1", "2", "3"], True)
    assert check_seeds(["eval"]) == (["eval"], False)
    with pytest.raises(ShapesError, match="partly not held out"):
        check_seeds(["1", "router-val0"])
    with pytest.raises(ShapesError, match="twice"):
        check_seeds(["1", "1"])
    assert ev.parse_args(["--seed", "4", "5", "--n-mixed", "7"]).held_out
    assert not ev.parse_args([]).held_out  # the default is the validation seed, reported as NOT HELD OUT
    with pytest.raises(SystemExit):
        ev.parse_args(["--seed", "1", "eval"])


# --- intervals ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, n, lo, hi", [  # by hand from the formula, z = 1.959964
    (0, 10, 0.0, 0.277533), (5, 10, 0.236593, 0.763407), (10, 10, 0.722467, 1.0), (37, 100, 0.281824, 0.467795)])
def test_wilson_interval_matches_the_formula_and_scipy(k, n, lo, hi):
    from scipy.stats import binomtest
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-6)
    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert got == pytest.approx((ref.low, ref.high), abs=1e-9)


def test_wilson_interval_of_nothing_is_everything_and_bad_counts_are_refused():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_recovery_interval_is_a_reproducible_paired_bootstrap_around_the_point():
    rng = torch.Generator().manual_seed(0)
    oracle = (torch.rand(400, generator=rng) < 0.5).tolist()
    router = [o and bool(torch.rand(1, generator=rng) < 0.8) for o in oracle]  # solves ~80% of the oracle's
    base = [False] * 400
    point = recovery(sum(router) / 400, 0.0, sum(oracle) / 400)
    lo, hi = recovery_interval(router, base, oracle)
    assert lo < point < hi and 0.7 < lo and hi < 0.9
    assert recovery_interval(router, base, oracle) == (lo, hi)  # fixed seed
    assert recovery_interval(router, base, oracle, seed=1) != (lo, hi)
    assert recovery_interval(oracle, base, oracle) == (1.0, 1.0)  # paired: the same items, so exactly 1
    assert recovery(0.3, 0.2, 0.2) is None and recovery_interval(base, base, base) is None


# --- rows --------------------------------------------------------------------------------------------------

def test_fair_hook_reproduces_the_single_adapter_row_item_for_item(tiny):
    root, ev, routed, tok = tiny
    from peft import PeftModel
    encoded = ev.eval_items(tok, ADAPTERS, 4, "1", 6)
    pad = tok.vocab.pad_id
    single = ev.score(lambda b: routed(b.ids, routers=LabelRouter(["count"], torch.where(b.labels >= 0, 0, -1)),
                                       use_cache=False), encoded, pad, ADAPTERS, 8, "cpu")
    model = PeftModel.from_pretrained(ev.fresh_lm(root / "model", "cpu"), str(root / "adapters" / "count"))
    fair = ev.AnswerOnly(model)
    assert ev.score(fair.logits, encoded, pad, ADAPTERS, 8, "cpu") == single
    batch = make_batch(encoded, list(range(len(encoded))), pad, ADAPTERS)
    ours = routed(batch.ids, routers=LabelRouter(["count"], torch.where(batch.labels >= 0, 0, -1)), use_cache=False)
    ours = ours if isinstance(ours, torch.Tensor) else ours.logits
    with torch.no_grad():
        theirs, everywhere = fair.logits(batch), fair.everywhere(batch)
    valid = batch.valid
    assert torch.allclose(theirs[valid], ours[valid], atol=1e-5)  # every position, prompt and answer
    prompt = valid & (batch.labels < 0)
    assert not torch.allclose(everywhere[prompt], theirs[prompt], atol=1e-3)  # peft's own way touches the prompt


def test_pair_routing_with_each_spans_true_domain_is_the_per_span_oracle(tiny):
    _, ev, _, tok = tiny
    encoded = ev.eval_items(tok, ADAPTERS, 2, "3", 6)
    batch = make_batch(encoded, list(range(len(encoded))), tok.vocab.pad_id, ADAPTERS)
    for b, e in enumerate(encoded):
        domains = list(dict.fromkeys(e.span_domain))  # one (single-domain item) or two, in answer order
        first, second = ADAPTERS.index(domains[0]), ADAPTERS.index(domains[-1])
        labels = ev.pair_labels(make_batch(encoded, [b], tok.vocab.pad_id, ADAPTERS), encoded, first, second)
        assert torch.equal(labels[0], batch.labels[b, :len(e)])


def test_pooled_report_prints_absolute_accuracies_first_with_intervals(tiny, tmp_path, capsys):
    root, ev, _, _ = tiny
    out = tmp_path / "eval.json"
    results = ev.main(["--model-dir", str(root / "model"), "--adapters-dir", str(root / "adapters"),
                       "--adapters", *ADAPTERS, "--rows", "base", "oracle_span", "any_pair", "fair_check",
                       "--seed", "1", "2", "--n-per-domain", "3", "--n-mixed", "4", "--json", str(out)])
    text = capsys.readouterr().out
    assert text.index("Absolute accuracy") < text.index("Recovery of the per-span oracle") < text.index("outright, per seed")
    assert "NOT HELD OUT" not in text
    rows = results["rows"]
    ci95 = results["ci95"]
    assert ci95["any_pair"]["mixed"][4] == 8 and "count" not in rows["any_pair"]  # mixed requests only
    assert "all" not in rows["any_pair"] and ci95["base"]["single_domain"][4] == 12
    assert ci95["base"]["mixed"][:3] == [0.0, 0.0, pytest.approx(wilson_interval(0, 8)[1], abs=1e-4)]
    assert set(results["by_seed"]) == {"1", "2"} and "single:count" in rows  # fair_check runs the single rows
    assert results["fair_check"] == {a: {"same": 20, "n": 20} for a in ADAPTERS}
    assert "hook (AnswerOnly) check" in text
    assert rows["any_pair"]["mixed"] >= max(rows[r]["mixed"] for r in ("oracle_span", "single:count"))
    assert json.loads(out.read_text())["setup"]["seeds"] == ["1", "2"]
    with pytest.raises(SystemExit, match="other items"):  # merging rows of other items into that file is refused
        ev.main(["--model-dir", str(root / "model"), "--adapters-dir", str(root / "adapters"), "--adapters",
                 *ADAPTERS, "--rows", "base", "--seed", "3", "--n", "2", "--json", str(out)])


# --- image styles ------------------------------------------------------------------------------------------

def test_image_style_requests_are_drawn_from_the_seed():
    from molora.models.families.shapes.styles import style_items
    ev = load_script("eval_image_styles")
    one, firsts = ev.requests(["1"], 6)
    assert ev.requests(["1"], 6) == (one, firsts)
    other, _ = ev.requests(["2"], 6)
    assert not {it.prompt for it in one} & {it.prompt for it in other}
    assert all(f.style != it.style for f, it in zip(firsts, one))  # the first picture is in another style
    assert ev.requests(["eval"], 6)[1] == style_items(7, seed="eval-first", split="heldout")[1:]  # as before
    pooled, pooled_firsts = ev.requests(["1", "2"], 6)
    assert pooled == one + other and pooled_firsts[:6] == firsts
    same, others = ev.requests(["1"], 6, shift=2)  # the other order: the first picture in the third style
    assert same == one and all(o.style not in (it.style, f.style) for o, f, it in zip(others, firsts, one))


def test_second_pictures_count_extra_objects_and_the_first_pictures_object_drawn_again():
    from molora.models.families.shapes import world
    from molora.models.families.shapes.analyse import analyse_image
    ev = load_script("eval_image_styles")
    items, firsts = ev.requests(["1"], 6)
    item, first = items[0], firsts[0]
    assert {(o.shape, o.cell) for o in item.drawn.objects}.isdisjoint({(o.shape, o.cell) for o in first.drawn.objects})
    alone = analyse_image(world.render(item.drawn))
    assert ev.carried_over(alone, item, first) == (False, False)
    both = world.Scene(item.drawn.objects + first.drawn.objects, background=item.drawn.background,
                       style=item.drawn.style)
    assert ev.carried_over(analyse_image(world.render(both)), item, first) == (True, True)
    # the report's table of them, per asked style
    row = {"style": 1.0, "content": 1.0, "adapter": 1.0,
           **{f"style_{s}": 1.0 for s in ("outline", "filled", "negative")},
           "ci95": {"style": ev.rate([True] * 3), "content": ev.rate([True] * 3), "adapter": ev.rate([True] * 3),
                    "extra_objects": ev.rate([True, False, False]), "first_object_again": ev.rate([True, True, False]),
                    **{f"{k}_{s}": ev.rate([s == "filled"]) for k in ("extra_objects", "first_object_again")
                       for s in ("outline", "filled", "negative")}},
           "style_hits": "111"}
    text = ev.report({"rows": {"one picture": {"oracle": row}, "second picture": {"oracle": row}},
                      "setup": {"n": 3, "seeds": ["1"], "held_out": True}})
    assert "| oracle | 0.333 / 0.667 | 0.000 / 0.000 | 1.000 / 1.000 | 0.000 / 0.000 |" in text


def test_image_style_report_gives_wilson_intervals_per_seed_and_flags_the_validation_seed():
    ev = load_script("eval_image_styles")
    hits = [True] * 5 + [False] * 5 + [True] * 10
    row = {"style": 0.75, "content": 0.75, "adapter": 1.0,
           **{f"style_{s}": 0.75 for s in ("outline", "filled", "negative")},
           "ci95": {"style": ev.rate(hits), "content": ev.rate(hits), "adapter": ev.rate([True] * 20)},
           "style_hits": "".join("10"[not h] for h in hits)}
    assert row["ci95"]["style"]["ci95"] == pytest.approx(wilson_interval(15, 20), abs=1e-4)
    results = {"rows": {"one picture": {"learned image gates": row}, "second picture": {"learned image gates": row}},
               "setup": {"n": 10, "seeds": ["1", "2"], "held_out": True}}
    text = ev.report(results)
    lo, hi = wilson_interval(15, 20)
    assert f"0.750 ({lo:.3f}–{hi:.3f})" in text and "| learned image gates | 0.500 / 0.500 | 1.000 / 1.000 |" in text
    alo, ahi = wilson_interval(20, 20)
    assert f"| 1.000 ({alo:.3f}–{ahi:.3f}) |" in text  # the asked style's adapter drew every picture
    results["rows"]["second picture, other order"] = {"learned image gates": row}  # pooled with the trained order
    text = ev.report(results)
    plo, phi = wilson_interval(30, 40)
    assert f"| 0.750 ({plo:.3f}–{phi:.3f}) |" in text and "0.500 / 0.500 / 0.500" in text  # per seed, three kinds
    results["setup"].update(seeds=["eval"], held_out=False)
    assert ev.report(results).startswith("NOT HELD OUT")
    with pytest.raises(SystemExit):
        ev.main(["--seed", "1", "val0"])
