"""Specialisation vs scale (issue 12): train_lm.py --domain-share mixes the very items the domain adapters and the
router train on into the LM's data, in the asked share of ids, and changes nothing when left at 0; the
orchestration script runs end to end at toy sizes on the CPU and scores both arms alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molora.models.families.shapes.domain_batches import encode_item
from molora.models.families.shapes.domains import DOMAINS, domain_items, mixed_items
from molora.models.families.shapes.testing import write_tiny_model_dir
from molora.models.families.shapes.tokenizer import UnifiedTokenizer
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("scale") / "model")


def lm_dir(model_dir: Path, tmp_path: Path) -> Path:
    """A model folder holding the tiny model's tokenizer and VQ but no LM, for train_lm.py to train into."""
    out = tmp_path / "m"
    out.mkdir()
    for name in ("tokenizer.json", "vocab.json"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    (out / "vq").symlink_to(model_dir / "vq")
    return out


TINY_LM = ["--n-examples", "24", "--n-val", "4", "--tokens-per-batch", "4096", "--hidden", "32", "--heads", "2",
           "--layers", "2", "--intermediate", "64", "--device", "cpu", "--val-every", "0", "--ckpt-every", "0"]


def test_domain_sequences_are_the_adapters_and_routers_own_train_items(model_dir):
    train_lm = load_script("train_lm")
    tok = UnifiedTokenizer.load(model_dir)
    seqs, prompts = train_lm.domain_sequences(tok, 20_000, router_share=0.25, seed=0)
    # the adapters' items come first, domain by domain: a prefix of train_domain_adapters.py's list (--seed 0)
    adapters = [encode_item(tok, it) for it in domain_items(DOMAINS[0], 5, seed="0", split="train", foreign=0.4)]
    assert seqs[:5] == [e.ids for e in adapters] and prompts[:5] == [e.answer_start for e in adapters]
    # the router's mixed requests come last: a prefix of train_router.py's mixed items (--seed 0)
    mixed = [encode_item(tok, it) for it in mixed_items(len(seqs), seed="router0", split="train", domains=DOMAINS)]
    n_mixed = next(k for k in range(len(seqs), 0, -1) if seqs[-k:] == [e.ids for e in mixed[:k]])
    router_ids = sum(len(s) for s in seqs[-5 * n_mixed:])  # the router's data: n items a domain + n mixed
    assert abs(router_ids / sum(len(s) for s in seqs) - 0.25) < 0.05
    total = sum(len(s) for s in seqs)
    assert 0.85 * 20_000 < total < 1.15 * 20_000
    assert all(tok.vocab.bos_id == s[0] and tok.vocab.eos_id == s[-1] and 0 < p < len(s) for s, p in zip(seqs, prompts))


def test_domain_sequences_follow_the_routers_mixed_requests_per_item(model_dir):
    """--domain-router-mixed 3: train_router.py --n-mixed 3x --n-per-domain, the shipped recipe's data."""
    train_lm = load_script("train_lm")
    tok = UnifiedTokenizer.load(model_dir)
    seqs, _ = train_lm.domain_sequences(tok, 20_000, router_share=0.5, seed=0, router_mixed=3.0)
    mixed = [encode_item(tok, it).ids for it in mixed_items(len(seqs), seed="router0", split="train", domains=DOMAINS)]
    n_mixed = next(k for k in range(len(seqs), 0, -1) if seqs[-k:] == mixed[:k])
    n = round(n_mixed / 3)
    assert n > 0 and n_mixed == round(n * 3.0)
    # before the mixed requests: n items of the last domain, train_router.py's own (--seed 0)
    last = [encode_item(tok, it).ids for it in domain_items(DOMAINS[-1], n, seed="router0", split="train")]
    assert seqs[-n_mixed - n:-n_mixed] == last
    router_ids = sum(len(s) for s in seqs[-n_mixed - len(DOMAINS) * n:])
    assert abs(router_ids / sum(len(s) for s in seqs) - 0.5) < 0.05


def test_plan_counts_the_routers_mixed_share_and_the_adapters_batch(model_dir):
    """plan's router ids follow train_router.py's own item list (n a domain + --n-mixed mixed requests), its
    adapter ids the adapters' batch, not the router's."""
    plan = load_script("scale_vs_specialise").main(
        ["plan", "--model-dir", str(model_dir), "--lm-steps", "1", "--adapter-steps", "2", "--router-steps", "3",
         "--n-train", "40", "--adapter-batch-size", "8", "--n-per-domain", "20", "--n-mixed", "60",
         "--tokens-per-batch", "4096", "--fill-examples", "24"])
    tok = UnifiedTokenizer.load(model_dir)
    items = load_script("train_router").shapes_data(tok, list(DOMAINS), 20, "router0", "train", 60)
    assert plan["router_item_mean_ids"] == pytest.approx(sum(len(e.ids) for e in items) / len(items), abs=0.01)
    assert plan["router_ids_est"] == pytest.approx(3 * 32 * plan["router_item_mean_ids"], abs=2)
    for d in DOMAINS:
        assert plan["adapter_ids_est"][d] == pytest.approx(2 * 8 * plan["adapter_item_mean_ids"][d], abs=2)
    assert plan["n_mixed"] == 60 and plan["n_per_domain"] == 20


def test_domain_share_zero_adds_no_domain_items(model_dir, tmp_path):
    train_lm = load_script("train_lm")
    out = lm_dir(model_dir, tmp_path)
    metrics = train_lm.main(["--model-dir", str(out), *TINY_LM, "--steps", "2"])
    assert metrics["domain_ids_seen"] == 0 and "domain_share" not in metrics
    assert metrics["ids_seen"] > 0 and metrics["sequences"] <= 24


def test_domain_share_puts_that_share_of_ids_in_the_lms_data(model_dir, tmp_path):
    train_lm = load_script("train_lm")
    out = lm_dir(model_dir, tmp_path)
    metrics = train_lm.main(["--model-dir", str(out), *TINY_LM, "--steps", "3", "--domain-share", "0.3",
                             "--targets-only"])
    assert abs(metrics["domain_share_actual"] - 0.3) < 0.05
    assert metrics["domain_sequences"] > 0 and metrics["sequences"] > 24
    assert 0 < metrics["domain_ids_seen"] < metrics["ids_seen"]
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--model-dir", str(out), "--domain-share", "1.0"])


def test_the_tiny_study_runs_end_to_end_and_scores_both_arms_alike(model_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "TINY": "1", "DEVICE": "cpu", "BASE": str(model_dir), "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "scripts" / "scale_vs_specialise.sh"), str(run)], check=True, env=env,
                   cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = json.loads((run / "summary.json").read_text())
    plan, budget = summary["plan"], summary["budget"]
    assert plan["big_steps"] > plan["lm_steps"] and 0 < plan["domain_share"] < 1
    assert budget["big_lm"]["steps"] == plan["big_steps"] and budget["arm1_lm"]["steps"] == plan["lm_steps"]
    assert budget["big_lm"]["params"] > budget["arm1_lm"]["params"]
    assert budget["big_lm"]["domain_ids_seen"] > 0
    assert all(a["steps"] == plan["adapter_steps"] for a in budget["arm1_adapters"].values())
    # eval-base on arm 1's LM reproduces eval_molora.py's base row: the 4x is scored as arm 1 is
    check = budget["base_check"]
    assert {k: v for k, v in check["eval_base"].items() if k != "seconds"} == \
        {k: v for k, v in check["eval_molora_base"].items() if k != "seconds"}
    rows = summary["rows"]
    assert any(name.startswith("arm 4x") for name in rows) and any("ours top-2" in name for name in rows)
    assert (run / "table.md").read_text().startswith("| row |")
