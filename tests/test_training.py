"""The training scripts run end to end on CPU at tiny sizes and write loadable outputs; adapter masking
applies each LoRA only at the positions vocabulary routing gives it; data is deterministic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from molora.models.engine.vocab import IMAGE, TEXT
from molora.models.families.shapes.data import (
    ExampleSpec,
    Schedule,
    collate,
    encode_examples,
    example_scenes,
    length_batches,
    prompt_length,
    render_batch,
    sample_examples,
    sample_scenes,
)
from molora.models.families.shapes.image_tokenizer import ImageTokenizer
from molora.models.families.shapes.testing import (
    BASE_MODEL_NAME,
    LORA_TARGETS,
    llama_config,
    write_tiny_model_dir,
)
from molora.models.families.shapes.tokenizer import UnifiedTokenizer, build_tiny_tokenizer
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """VQ -> tokenizer -> LM -> adapters, each a few steps at tiny sizes."""
    root = tmp_path_factory.mktemp("emb")
    model = root / "model"
    vq_metrics = load_script("train_vq").main(["--out", str(model / "vq"), "--tiny", "--steps", "3"])
    load_script("train_tokenizer").main(["--out", str(model), "--vq", str(model / "vq"), "--n-examples", "300"])
    lm_metrics = load_script("train_lm").main(["--model-dir", str(model), "--tiny", "--steps", "3"])
    ad_metrics = load_script("train_adapters").main(["--model-dir", str(model), "--out", str(root / "adapters"),
                                                  "--tiny", "--steps", "2"])
    return root, vq_metrics, lm_metrics, ad_metrics


def test_pipeline_writes_loadable_model_dir(trained):
    root, vq_metrics, lm_metrics, ad_metrics = trained
    model = root / "model"
    tok = UnifiedTokenizer.load(model)
    vq = ImageTokenizer.from_pretrained(model / "vq")
    assert vq.codebook_size == tok.vocab.image_size and vq.grid == (16, 16)
    lm = LlamaForCausalLM.from_pretrained(model / "lm", dtype=torch.float32)
    assert lm.config.vocab_size == tok.vocab.vocab_size and lm.config.molora_base_model == BASE_MODEL_NAME
    ids = torch.tensor([[tok.vocab.bos_id, *tok.encode_text("Draw a red circle."), tok.vocab.boi_id]])
    assert lm(ids).logits.shape == (1, ids.shape[1], tok.vocab.vocab_size)
    assert not list(model.rglob("*.bin")) and not list(model.rglob("*.pt"))  # safetensors only
    assert vq_metrics["steps"] == 3 and 0 < vq_metrics["codes_used"] <= vq.codebook_size
    assert lm_metrics["steps"] == 3 and lm_metrics["val_text_loss"] > 0 and lm_metrics["val_image_loss"] > 0
    assert all(v > 0 for k, v in ad_metrics.items() if k.startswith("val_"))


def test_adapters_are_peft_files_with_molora_json(trained):
    from peft import PeftModel

    root = trained[0]
    for name, modality in (("pirate", "text"), ("outline", "image")):
        folder = root / "adapters" / name
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == BASE_MODEL_NAME
        assert set(cfg["target_modules"]) == set(LORA_TARGETS)
        assert json.loads((folder / "molora.json").read_text())["modality"] == modality
        lm = LlamaForCausalLM.from_pretrained(root / "model" / "lm", dtype=torch.float32)
        PeftModel.from_pretrained(lm, folder)  # peft itself reads it back
    assert not (root / "adapters" / "README.md").exists()  # no empty template beside them


def test_lm_resume_continues_from_checkpoint(tmp_path):
    model = write_tiny_model_dir(tmp_path / "m")
    train_lm = load_script("train_lm")
    args = ["--model-dir", str(model), "--tiny", "--ckpt-every", "2"]
    train_lm.main(args + ["--steps", "2"])  # no checkpoint kept at the end of a finished run
    assert not (model / "lm" / "checkpoint.safetensors").exists()
    first = train_lm.main(args + ["--steps", "4"])
    assert first["steps"] == 4


def test_lm_second_stage_trains_in_train_mode(trained, tmp_path, monkeypatch):
    """from_pretrained hands back an eval-mode model; training steps must still run in train mode."""
    root = trained[0]
    model = tmp_path / "model"
    shutil.copytree(root / "model", model)
    train_lm = load_script("train_lm")
    modes, token_losses = [], train_lm.token_losses
    monkeypatch.setattr(train_lm, "token_losses", lambda m, *a: (modes.append(m.training), token_losses(m, *a))[1])
    train_lm.main(["--model-dir", str(model), "--tiny", "--steps", "2", "--init-from", str(root / "model" / "lm")])
    assert modes[:2] == [True, True] and modes[-1] is False  # two steps, then the final validation


def test_lm_targets_only_takes_prompts_out_of_the_loss(trained, tmp_path, monkeypatch):
    """--targets-only: the same batch, with a prefix of some rows (the prompt or given picture) weighted 0."""
    train_lm = load_script("train_lm")
    masks, token_losses = {}, train_lm.token_losses

    def spy(model, ids, mask, amp):
        masks.setdefault(flag, mask.clone())  # the first training batch
        return token_losses(model, ids, mask, amp)

    monkeypatch.setattr(train_lm, "token_losses", spy)
    for flag in (False, True):
        model = tmp_path / f"m{flag}"
        shutil.copytree(trained[0] / "model", model)
        metrics = train_lm.main(["--model-dir", str(model), "--tiny", "--steps", "1"]
                                + (["--targets-only"] if flag else []))
        assert metrics["targets_only"] is flag
    every, targets = masks[False], masks[True]
    assert every.shape == targets.shape and bool((targets <= every).all()) and targets.sum() < every.sum()
    removed = every - targets
    for row in removed:  # what is taken out is a prefix of the sequence
        n = int(row.sum())
        assert bool((row[:n] == 1).all())


def test_lm_second_stage_starts_from_the_first_stages_weights(trained, tmp_path):
    root, _, lm_metrics, _ = trained
    model = tmp_path / "model"
    shutil.copytree(root / "model", model)
    stage1 = tmp_path / "stage1"
    shutil.copytree(model / "lm", stage1)
    train_lm = load_script("train_lm")
    # zero steps: the saved model is stage 1's, so the validation losses are stage 1's
    again = train_lm.main(["--model-dir", str(model), "--tiny", "--steps", "0", "--init-from", str(stage1)])
    assert again["init_from"] == str(stage1) and again["sequences"] == lm_metrics["sequences"]
    assert again["val_image_loss"] == pytest.approx(lm_metrics["val_image_loss"], rel=1e-2)
    other = tmp_path / "other"
    write_tiny_model_dir(other, codebook_size=16)
    with pytest.raises(SystemExit, match="vocab_size"):
        train_lm.main(["--model-dir", str(model), "--tiny", "--steps", "1", "--init-from", str(other / "lm")])


def test_lm_trains_data_parallel_on_the_same_examples(trained, tmp_path):
    """torchrun with two CPU processes (gloo): the ranks' shares are the single run's examples, both ranks take the
    same steps (the script compares their weights at the end), rank 0 saves."""
    root, _, lm_metrics, _ = trained
    model = tmp_path / "model"
    shutil.copytree(root / "model", model)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "scripts" / "train_lm.py"), "--model-dir", str(model), "--tiny",
                           "--steps", "3", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((model / "lm" / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == 3
    assert metrics["sequences"] == lm_metrics["sequences"]
    # the same examples; only which text-to-image prompts lose their text (CFG dropout) is drawn per share
    assert metrics["train_tokens_per_epoch"] == pytest.approx(lm_metrics["train_tokens_per_epoch"], rel=0.02)
    assert LlamaForCausalLM.from_pretrained(model / "lm").num_parameters() == lm_metrics["params"]


def test_routed_lora_mask_applies_only_at_routed_positions():
    train_adapters = load_script("train_adapters")
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    lm = LlamaForCausalLM(llama_config(tok.vocab, hidden_size=32, num_layers=2, num_heads=2,
                                       intermediate_size=64, max_positions=64))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    model = get_peft_model(lm, cfg, adapter_name="pirate")
    model.add_adapter("outline", cfg)
    model.base_model.set_adapter(["pirate", "outline"])
    masker = train_adapters.RoutedLoraMask(model, ["pirate", "outline"])
    table = tok.vocab.modality_table()
    text = tok.encode_text("a red circle")
    img = [tok.vocab.image_start + c for c in (1, 2, 3)]
    ids = torch.tensor([[tok.vocab.bos_id, *text, tok.vocab.boi_id, *img, tok.vocab.eoi_id, *text]])
    modality = {"pirate": TEXT, "outline": IMAGE}

    # capture each adapter's gated delta at the first q_proj
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    seen = {}
    hooks = [q.lora_B[a].register_forward_hook(lambda m, i, o, a=a: seen.__setitem__(a, o.detach()))
             for a in ("pirate", "outline")]
    masker.set(ids, table, {"pirate": torch.tensor([True]), "outline": torch.tensor([True])}, modality)
    with torch.no_grad():
        model(input_ids=ids)
    is_image = (table[ids] == IMAGE)[0]
    assert is_image.tolist() == [False] * (1 + len(text)) + [True] * 4 + [False] * (1 + len(text))
    assert seen["pirate"][0, is_image].abs().max() == 0 and seen["pirate"][0, ~is_image].abs().min() > 0
    assert seen["outline"][0, ~is_image].abs().max() == 0 and seen["outline"][0, is_image].abs().min() > 0

    # an adapter switched off for the sequence contributes nothing anywhere: output == base-only routing
    masker.set(ids, table, {"pirate": torch.tensor([False]), "outline": torch.tensor([False])}, modality)
    with torch.no_grad():
        off = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.allclose(off, base, atol=1e-6)
    for h in hooks:
        h.remove()
    masker.remove()


def test_data_is_deterministic_and_worker_independent():
    a = sample_scenes(30, seed=7, workers=1)
    b = sample_scenes(30, seed=7, workers=2)
    assert a == b and sample_scenes(30, seed=8) != a
    assert (render_batch(a) == render_batch(b, workers=2)).all()
    e1 = sample_examples(20, seed=3, spec=ExampleSpec(looks=(("pirate", "outline", 1.0),)))
    assert e1 == sample_examples(20, seed=3, spec=ExampleSpec(looks=(("pirate", "outline", 1.0),)))
    assert all(s.style == "outline" for s in example_scenes(e1))


def test_sequences_follow_the_contract_formats():
    tok = build_tiny_tokenizer(row_markers=True)
    v = tok.vocab
    examples = sample_examples(40, seed=1)
    codes = torch.randint(0, v.image_size, (len(example_scenes(examples)), 16, 16))
    seqs = encode_examples(examples, tok, codes, seed=0, cfg_dropout=0.5)
    assert len(seqs) == len(examples)
    dropped = 0
    for e, s in zip(examples, seqs):
        assert s[0] == v.bos_id and s[-1] == v.eos_id
        assert s.count(v.boi_id) == s.count(v.eoi_id) == sum(not isinstance(p, str) for p in e.parts)
        if e.kind == "pirate_text":  # text only, never beside a picture
            assert e.register == "pirate" and tok.decode_text(s) == e.parts[0]
            continue
        start = s.index(v.boi_id)
        span = s[start + 1:start + 1 + v.tokens_per_image]
        assert tok.codes_from_ids(span).shape == (16, 16)  # codes, each row closed by its marker
        assert s[start + 1 + v.tokens_per_image] == v.eoi_id
        if e.kind == "i2t":
            assert start == 1 and len(s) > v.tokens_per_image + 4
        if e.kind.startswith("t2i"):
            dropped += start == 1  # CFG stream: <bos> <boi> ...
    assert dropped > 0
    ids, mask = collate(seqs[:3], v.pad_id)
    assert ids.shape == mask.shape and int(mask.sum()) == sum(len(s) for s in seqs[:3])
    context = [prompt_length(e, s, v) for e, s in zip(examples[:3], seqs[:3])]
    _, targets = collate(seqs[:3], v.pad_id, context=context)  # the given prefixes are no targets
    assert int(targets.sum()) == int(mask.sum()) - sum(context)
    assert all(int(targets[i, :c].sum()) == 0 and int(targets[i, c]) == 1 for i, c in enumerate(context))
    batches = length_batches([len(s) for s in seqs], 2000, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(seqs)))


def test_schedule_warms_up_decays_and_stops():
    s = Schedule(steps=100, warmup=10)
    assert s.factor(0) == pytest.approx(0.1) and s.factor(9) > 0.95 and s.factor(9) > s.factor(50)
    assert s.factor(99) == pytest.approx(0.1, abs=1e-3) and s.done(100) and not s.done(99)


def test_build_script_runs_every_stage_at_toy_sizes(tmp_path):
    """scripts/build_embedded.sh (the command the model card records) chains vq -> tok -> lm -> lm2 -> adapters."""
    env = {**os.environ, "TINY": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build_embedded.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model = tmp_path / "model"
    vocab = json.loads((model / "vocab.json").read_text())
    assert len(vocab["row_end_ids"]) == 16 and (model / "vq" / "config.json").is_file()
    lm = json.loads((model / "lm" / "metrics.json").read_text())
    assert lm["init_from"] == str(tmp_path / "lm_stage1") and lm["seed"] == 1 and lm["lr"] == 1e-3
    assert (tmp_path / "lm_stage1" / "model.safetensors").is_file()
    for name in ("pirate", "outline"):
        assert (tmp_path / "adapters" / name / "adapter_model.safetensors").is_file()


def test_adapter_data_reads_given_pictures_of_either_style_as_context():
    train_adapters = load_script("train_adapters")
    tok = build_tiny_tokenizer(row_markers=True)
    spec = ExampleSpec(mix=(("i2t", 1.0), ("t2i_instruction", 1.0)), looks=train_adapters.LOOKS)
    examples = train_adapters.given_pictures_in_either_style(sample_examples(80, seed=2, spec=spec), "s")
    given = [(e.style, e.parts[0].style) for e in examples if e.kind == "i2t"]
    assert {("outline", "filled"), ("outline", "outline"), ("filled", "filled"), ("filled", "outline")} <= set(given)
    assert all(e.parts[1].style == e.style for e in examples if e.kind != "i2t")  # drawn pictures keep the flag
    codes = torch.randint(0, tok.vocab.image_size, (len(example_scenes(examples)), 16, 16))
    seqs = encode_examples(examples, tok, codes, seed=0, cfg_dropout=0.0)
    for e, s in zip(examples, seqs):
        n = prompt_length(e, s, tok.vocab)
        if e.kind == "i2t":  # the picture through <eoi> is context; the caption is the target
            assert s[n - 1] == tok.vocab.eoi_id and tok.decode_text(s[n:]) == e.parts[1]
        else:  # the instruction through <boi>'s position is context; <boi> and the picture are targets
            assert s[n] == tok.vocab.boi_id
