"""Domain adapters trained through the routed path, the router trained over them, saved, loaded and refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from molora.models.families.shapes.domain_batches import encode_item, exact_matches, make_batch
from molora.models.families.shapes.domains import domain_items, mixed_items
from molora.models.families.shapes.loading import load_model_dir
from molora.models.families.shapes.testing import write_tiny_model_dir
from molora.routing import LabelRouter, LearnedGates, LearnedRouter, RoutingError, SequenceRouter
from molora.routing.adapters import load_peft_adapter
from molora.routing.errors import AdapterError, UnknownAdapterError
from tests.script_loader import load_script


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("molora")
    model = write_tiny_model_dir(root / "model")
    adapters = root / "adapters"
    metrics = load_script("train_domain_adapters").main(
        ["--model-dir", str(model), "--out", str(adapters), "--domains", "count", "spatial", "--steps", "3",
         "--n-train", "48", "--n-val", "8", "--batch-size", "8", "--rank", "4", "--alpha", "8"])
    router = load_script("train_router").main(
        ["--model-dir", str(model), "--adapters-dir", str(adapters), "--adapters", "count", "spatial",
         "--out", str(root / "router"), "--steps", "2", "--n-per-domain", "8", "--n-val", "4", "--batch-size", "8"])
    return root, model, adapters, metrics, router


def test_domain_adapters_are_peft_files_that_peft_and_the_routed_model_apply_alike(trained):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from molora.models.families.shapes.testing import set_base_model_name
    from molora.routing import attach_routed_lora
    root, model, adapters, metrics, _ = trained
    assert set(metrics) == {"count", "spatial"} and metrics["count"]["steps"] == 3
    assert json.loads((adapters / "domain_metrics.json").read_text())["spatial"]["val_items"] == 8
    meta = json.loads((adapters / "count" / "molora.json").read_text())
    assert meta["modality"] == "text" and meta["domain"] == "count"
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 2]])
    lm = set_base_model_name(LlamaForCausalLM.from_pretrained(model / "lm", dtype=torch.float32)).eval()
    peft_model = PeftModel.from_pretrained(lm, str(adapters / "count"))
    assert any(float(p.abs().sum()) > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)  # it trained
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    lm2 = set_base_model_name(LlamaForCausalLM.from_pretrained(model / "lm", dtype=torch.float32)).eval()
    routed = attach_routed_lora(lm2, num_slots=2, r_max=4)
    routed.load_adapter(adapters / "count")
    with torch.no_grad():
        got = routed(ids, routers=SequenceRouter("count")).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_router_trains_only_the_gates_and_writes_gates_and_config(trained):
    root, _, adapters, _, config = trained
    saved = json.loads((root / "router" / "config.json").read_text())
    assert saved["adapters"] == ["count", "spatial"] and saved["top_k"] == 2 and saved["steps"] == 2
    assert set(saved["loss"]) == {"next_token", "load_balance", "z", "label", "label_start_weight"}
    assert {"top1", "top2"} <= set(saved["val"]) and "agreement_per_block" in saved["val"]["top2"]
    for name, digest in saved["adapter_sha256_16"].items():  # adapters untouched by router training
        data = (adapters / name / "adapter_model.safetensors").read_bytes()
        assert hashlib.sha256(data).hexdigest()[:16] == digest
    gates = LearnedGates.load(root / "router" / "gates.safetensors")
    assert gates.adapters == ["count", "spatial"] and gates.num_blocks == 2


def test_from_pretrained_loads_the_router_beside_the_adapters_and_generates_with_it(trained):
    from molora.models.pipeline import InterleavedPipeline
    root, model, _, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(root)
    assert pipe.gates is not None and pipe.gates.adapters == ["count", "spatial"]
    doc = pipe.generate("A red circle on the left. How many circles are there? A:", routing="learned",
                        max_new_tokens=4, max_images=0)
    assert doc is not None


def test_gates_over_adapters_that_are_not_loaded_are_refused_and_nothing_changes(trained, tmp_path):
    from molora.models.pipeline import InterleavedPipeline
    root, model, adapters, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(model, adapters_dir=adapters)
    before = pipe.gates
    other = LearnedGates(pipe.routed.hidden_size, ["count", "poetry"], pipe.routed.num_blocks)
    other.save(tmp_path / "gates.safetensors")
    with pytest.raises(UnknownAdapterError, match="poetry"):
        pipe.load_learned_router(tmp_path / "gates.safetensors")
    assert pipe.gates is before
    with pytest.raises(RoutingError, match="not a gate file"):
        LearnedGates.load(tmp_path / "missing.safetensors")


def test_router_data_jsonl_bad_lines_name_the_line(trained, tmp_path):
    root, model, adapters, _, _ = trained
    train_router = load_script("train_router")
    tok = load_model_dir(model, adapters_dir=adapters).tokenizer
    good = tmp_path / "ok.jsonl"
    good.write_text('{"text": "a red circle"}\n{"prompt": "How many?", "answer": " two.", "domain": "count"}\n')
    records = train_router.read_jsonl(good, tok, ["count", "spatial"])
    assert len(records) == 2 and records[1].span_domain[0] == "count" and records[0].answer_start == 1
    for body, match in (('{"text": 3}\n', "ok.jsonl:1"), ('{"text": "x"}\nnot json\n', "ok.jsonl:2"),
                        ('{"text": "x", "domain": "poetry"}\n', "poetry"), ("\n", "no records")):
        good.write_text(body)
        with pytest.raises(train_router.RouterDataError, match=match):
            train_router.read_jsonl(good, tok, ["count", "spatial"])
    with pytest.raises(train_router.RouterDataError, match="not shapes question domains"):
        train_router.shapes_data(tok, ["pirate"], 2, "s", "train")


def test_router_trains_from_a_users_jsonl(trained, tmp_path):
    root, model, adapters, _, _ = trained
    data = tmp_path / "mine.jsonl"
    items = domain_items("count", 6, seed=0) + domain_items("spatial", 6, seed=0)
    data.write_text("".join(json.dumps({"prompt": i.prompt, "answer": i.answer, "domain": i.kind}) + "\n"
                            for i in items))
    config = load_script("train_router").main(
        ["--model-dir", str(model), "--adapters-dir", str(adapters), "--adapters", "count", "spatial",
         "--out", str(tmp_path / "r"), "--data", str(data), "--steps", "2", "--batch-size", "4",
         "--label-coef", "0.5"])
    assert config["train_records"] == 11 and config["val_records"] == 1 and config["loss"]["label"] == 0.5
    assert (tmp_path / "r" / "gates.safetensors").is_file()


def test_span_starts_mark_where_the_gate_must_switch_and_weigh_the_label_loss(trained):
    """The first answer position of a mixed request and the first prediction of its second span are span starts;
    `start_weight` scales only their share of the label loss."""
    _, model, _, _, _ = trained
    train_router = load_script("train_router")
    tok = load_model_dir(model).tokenizer
    e = encode_item(tok, mixed_items(1, seed="s", split="train", domains=["count", "spatial"])[0])
    batch = make_batch([e], [0], tok.vocab.pad_id, ["count", "spatial"])
    starts = train_router.span_starts(batch)[0].nonzero().flatten().tolist()
    second = e.answer_start - 1 + list(e.span_index).index(1)
    assert starts == [e.answer_start - 1, second]
    logits = torch.randn(batch.ids.numel(), 3)
    decisions = {0: [type("D", (), {"logits": logits})()]}
    plain = train_router.label_loss(decisions, batch, 2)
    assert torch.allclose(plain, train_router.label_loss(decisions, batch, 2, start_weight=1.0))
    starts_only = logits.clone()
    keep = train_router.answer_positions(batch).reshape(-1) & ~train_router.span_starts(batch).reshape(-1)
    starts_only[keep] = 0.0  # change only non-start answer positions: a huge start weight hides the change
    heavy = [train_router.label_loss({0: [type("D", (), {"logits": x})()]}, batch, 2, start_weight=1e6)
             for x in (logits, starts_only)]
    assert not torch.allclose(plain, heavy[0]) and torch.allclose(heavy[0], heavy[1], atol=1e-3)


def test_picture_requests_are_context_throughout_and_teach_the_base_expert(trained):
    """--picture-requests: the words before a picture (<bos>, a styled request, <boi>) with no answer: no target,
    every position context, so the label loss sends each of them to the base expert and the next-token loss
    takes nothing from them."""
    _, model, _, _, _ = trained
    train_router = load_script("train_router")
    tok = load_model_dir(model).tokenizer
    requests = train_router.picture_requests(tok, 4, "s")
    assert len(requests) == 4 and all(r.ids[-1] == tok.vocab.boi_id and r.kind == "picture request" for r in requests)
    assert [r.ids for r in requests] == [r.ids for r in train_router.picture_requests(tok, 4, "s")]  # seeded
    question = encode_item(tok, mixed_items(1, seed="s", split="train", domains=["count", "spatial"])[0])
    batch = make_batch([requests[0], question], [0, 1], tok.vocab.pad_id, ["count", "spatial"])
    assert not batch.target[0].any() and (batch.labels[0] == -1).all()
    assert train_router.context_positions(batch)[0].sum() == len(requests[0])
    to_base = torch.full((batch.ids.numel(), 3), -5.0)
    to_base[:, 2] = 5.0  # every position's gate picks the base expert (index 2)
    to_count = to_base.clone()
    to_count[: batch.ids.shape[1]] = torch.tensor([5.0, -5.0, -5.0])  # the picture request's positions pick count
    losses = [train_router.label_loss({0: [type("D", (), {"logits": x})()]}, batch, 2) for x in (to_base, to_count)]
    assert losses[1] > losses[0] + 1.0


def test_start_weight_must_be_positive(capsys):
    train_router = load_script("train_router")
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            train_router.parse_args(["--out", "r", "--start-weight", bad])
        assert "--start-weight must be > 0" in capsys.readouterr().err


def test_label_router_routes_each_position_to_its_label_and_checks_shapes(trained):
    root, model, adapters, _, _ = trained
    train_router = load_script("train_router")
    routed, tok = train_router.load_routed(model, adapters, ["count", "spatial"])
    items = [encode_item(tok, it) for it in mixed_items(4, seed=0, domains=["count", "spatial"])]
    batch = make_batch(items, range(4), tok.vocab.pad_id, ["count", "spatial"])
    with torch.no_grad():
        out = routed(batch.ids, routers=LabelRouter(["count", "spatial"], batch.labels))
    names = {0: "count", 1: "spatial", -1: None}
    for b in range(4):
        assert out.routing.adapter_names(b) == [names[int(x)] for x in batch.labels[b]]
    whole, spans = exact_matches(out.logits, batch, items)
    assert len(whole) == 4 and all(len(s) == 2 for s in spans)
    with pytest.raises(RoutingError, match="one label per input position"):
        routed(batch.ids[:, :3], routers=LabelRouter(["count", "spatial"], batch.labels))


def test_learned_routing_is_hierarchical_in_one_pass(trained):
    root, model, adapters, _, _ = trained
    train_router = load_script("train_router")
    routed, tok = train_router.load_routed(model, adapters, ["count", "spatial"])
    gates = LearnedGates.for_model(routed, ["count"])
    vocab = tok.vocab
    ids = torch.tensor([[vocab.bos_id, 40, 41, vocab.boi_id, vocab.image_start, vocab.image_start + 1, 42]])
    router = LearnedRouter(gates, top_k=1, vocab=vocab, image_adapter="spatial")
    with torch.no_grad():
        out = routed(ids, routers=router)
    assert out.routing.adapter_names(0) == ["count", "count", "count", "spatial", "spatial", "spatial", "count"]


def test_gates_with_a_new_adapter_keep_the_old_rows_and_start_the_new_one_at_zero():
    gates = LearnedGates(8, ["a", "b"], 3)
    grown = gates.with_adapters(["a", "new", "b"])
    assert grown.adapters == ["a", "new", "b"]
    for old, new in zip(gates.gates, grown.gates):
        assert torch.equal(new.weight[0], old.weight[0]) and torch.equal(new.weight[2], old.weight[1])
        assert not new.weight[1].any()
    with pytest.raises(RoutingError, match="missing"):
        gates.with_adapters(["a"])


def test_domain_adapters_act_only_on_their_own_answer_span(trained):
    """The composition contract: an adapter trained apart changes nothing before its own span, so any adapter
    meets the prompt as the base model wrote it (scripts/train_domain_adapters.py)."""
    root, model, adapters, _, _ = trained
    train_domain = load_script("train_domain_adapters")
    routed, tok = load_script("train_router").load_routed(model, adapters, ["count", "spatial"])
    items = [encode_item(tok, it) for it in mixed_items(3, seed=1, domains=["count", "spatial"])]
    batch = make_batch(items, range(3), tok.vocab.pad_id, ["count"])
    with torch.no_grad():
        base = routed(batch.ids).logits
        own = routed(batch.ids, routers=train_domain.own_span_router("count", batch)).logits
    for b, e in enumerate(items):
        first_count = e.answer_start - 1 + e.span_domain.index("count")  # the position predicting its first id
        assert torch.equal(own[b, :first_count], base[b, :first_count])
        assert not torch.allclose(own[b, first_count], base[b, first_count])
    assert json.loads((adapters / "count" / "molora.json").read_text())["context"].startswith("base")


def test_base_expert_routes_to_no_adapter_and_survives_save_and_load(trained, tmp_path):
    root, model, adapters, _, _ = trained
    routed, tok = load_script("train_router").load_routed(model, adapters, ["count", "spatial"])
    gates = LearnedGates.for_model(routed, ["count", "spatial"], base_expert=True)
    assert gates.num_experts == 3 and gates.experts == ["count", "spatial", None]
    assert gates.expert_slots({"count": 0, "spatial": 1}, "cpu").tolist() == [0, 1, -1]
    ids = torch.tensor([[tok.vocab.bos_id, 40, 41, 42, 43]])
    fixed = torch.tensor([[0.0, 0.0, 9.0]] * 3 + [[9.0, 0.0, 0.0]] * 2)  # base for 3 positions, then count
    gates.logits = lambda block, hidden: fixed.to(hidden.device)
    with torch.no_grad():
        out = routed(ids, routers=LearnedRouter(gates, top_k=1))
        base = routed(ids).logits
    del gates.logits
    assert out.routing.adapter_names(0) == [None, None, None, "count", "count"]
    assert torch.equal(out.logits[0, :3], base[0, :3]) and not torch.allclose(out.logits[0, 3:], base[0, 3:])
    gates.save(tmp_path / "g.safetensors")
    again = LearnedGates.load(tmp_path / "g.safetensors")
    assert again.base_expert and again.experts == gates.experts
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(again.gates, gates.gates))
    grown = gates.with_adapters(["count", "spatial", "new"])
    assert grown.experts == ["count", "spatial", "new", None]
    assert torch.equal(grown.gates[0].weight[3], gates.gates[0].weight[2]) and not grown.gates[0].weight[2].any()


def test_load_balance_leaves_the_base_expert_out():
    from molora.routing.context import BlockDecision
    from molora.routing.routers import load_balance_loss
    logits = torch.tensor([[0.0, 0.0, 5.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    topk = logits.topk(1, dim=-1).indices
    mask = torch.ones(4, dtype=torch.bool)
    balanced = load_balance_loss(BlockDecision(logits, topk, mask, base_expert=True))
    assert torch.isclose(balanced, torch.tensor(1.0), atol=1e-5)  # the two adapters share evenly: 1
    assert load_balance_loss(BlockDecision(logits, topk, mask)) > 1.1  # base counted as an expert: unbalanced


def test_learned_generation_reports_each_tokens_top_two_adapters_and_weights(trained):
    from molora.models.pipeline import InterleavedPipeline
    root, _, _, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(root)
    doc = pipe.generate("A red circle on the left. How many circles are there? A:", routing="learned",
                        max_new_tokens=6, max_images=0, seed=0)
    text = [r for r in doc.routing if r.modality == "text"]
    assert text and all(1 <= len(r.mix) <= 2 for r in text) and any(len(r.mix) == 2 for r in text)
    for r in text:  # the weight each adapter got, averaged over blocks (what a block gave the base expert is left out)
        names = [n for n, _ in r.mix]
        assert set(names) <= {"count", "spatial"} and all(0.0 < w <= 1.0 for _, w in r.mix)
        assert r.adapter == names[0]  # the top-1 is the adapter the token is reported under
    static = pipe.generate("A red circle", routing="vocab", max_new_tokens=4, max_images=0, seed=0)
    assert all(r.mix == () for r in static.routing)


def test_image_gates_route_each_picture_in_one_pass_text_gates_the_rest(trained):
    """Hierarchical learned routing: the vocabulary decides the modality, the text gates route text positions and
    the image gates pick each picture's adapter (here: the first picture 'spatial', the second the base)."""
    root, model, adapters, _, _ = trained
    routed, tok = load_script("train_router").load_routed(model, adapters, ["count", "spatial"])
    v = tok.vocab
    text_gates = LearnedGates.for_model(routed, ["count"])
    image_gates = LearnedGates.for_model(routed, ["spatial"], base_expert=True)
    ids = torch.tensor([[v.bos_id, 40, v.boi_id, v.image_start, v.image_start + 1, 41, v.boi_id, v.image_start + 2]])
    picture = torch.tensor([0, 0, 1, 1, 1, 0, 2, 2])  # which picture each position belongs to (0: text)
    first = (picture == 1).float()[:, None]  # the gates score every position; only image positions are taken
    image_gates.logits = lambda block, hidden: torch.cat([first * 9.0, (1 - first) * 9.0], dim=1)
    router = LearnedRouter(text_gates, top_k=1, vocab=v, image_gates=image_gates)
    assert router.adapters() == ["count", "spatial"]
    with torch.no_grad():
        out = routed(ids, routers=router)
    names = out.routing.adapter_names(0)
    assert [names[t] for t in range(8) if picture[t] == 0] == ["count"] * 3
    assert [names[t] for t in range(8) if picture[t] == 1] == ["spatial"] * 3
    assert [names[t] for t in range(8) if picture[t] == 2] == [None, None]
    with pytest.raises(RoutingError, match="not both"):
        LearnedRouter(text_gates, top_k=1, vocab=v, image_adapter="spatial", image_gates=image_gates)
    with pytest.raises(RoutingError, match="needs a vocab"):
        LearnedRouter(text_gates, top_k=1, image_gates=image_gates)


def test_image_gates_load_beside_the_text_gates_and_bad_ones_change_nothing(trained, tmp_path):
    import shutil

    from molora.models.pipeline import InterleavedPipeline
    root, model, adapters, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(model, adapters_dir=adapters)
    text_gates = LearnedGates(pipe.routed.hidden_size, ["count", "spatial"], pipe.routed.num_blocks)
    router_dir = tmp_path / "router"
    router_dir.mkdir()
    text_gates.save(router_dir / "gates.safetensors")
    # image gates over a text adapter: refused, nothing changes
    LearnedGates(pipe.routed.hidden_size, ["count"], pipe.routed.num_blocks, base_expert=True).save(
        router_dir / "image_gates.safetensors")
    (router_dir / "config.json").write_text(json.dumps({"top_k": 1, "image_gates": {"file": "image_gates.safetensors"}}))
    before = (pipe.gates, pipe.image_gates, pipe.learned_top_k)
    with pytest.raises(AdapterError, match="not image adapters"):
        pipe.load_learned_router(router_dir / "gates.safetensors")
    assert (pipe.gates, pipe.image_gates, pipe.learned_top_k) == before
    # a missing image gate file: refused too
    (router_dir / "image_gates.safetensors").unlink()
    with pytest.raises(RoutingError):
        pipe.load_learned_router(router_dir / "gates.safetensors")
    assert (pipe.gates, pipe.image_gates) == before[:2]
    shutil.rmtree(router_dir)


def test_image_gates_decide_once_per_picture_in_the_engine_and_in_one_pass(trained):
    """A picture's positions all take the decision made at its first position: in one pass (anchored) and
    token by token through the engine (kept per row across decode steps)."""
    from molora.models.pipeline import InterleavedPipeline
    from molora.routing.routers import picture_anchor
    image = torch.tensor([[False, True, True, False, True, True, True]])
    assert picture_anchor(image).tolist() == [0, 1, 1, 3, 4, 4, 4]
    root, model, adapters, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(root)
    torch.manual_seed(3)
    gates = LearnedGates.for_model(pipe.routed, ["spatial"], base_expert=True, init_std=1.0)  # varies by position
    pipe.image_gates = gates
    docs = pipe.generate(["A red circle", "A blue square", "Two green stars"], routing="learned", max_images=1,
                         max_new_tokens=pipe.vocab.image_span_tokens + 1, start_image=True, seed=0)
    seen = set()
    for doc in docs:
        picture = [r.adapter for r in doc.routing if r.modality == "image"]
        assert picture and len(set(picture)) == 1, picture  # one decision for the whole picture
        seen |= set(picture)
        ids = torch.tensor([[pipe.vocab.bos_id, *[r.id for r in doc.routing if r.part is not None]]])
        with torch.no_grad():  # the same picture in one pass: the same decision everywhere
            out = pipe.routed(ids, routers=pipe.make_router("learned", None, None))
        image_names = [n for n, r in zip(out.routing.adapter_names(0)[1:], doc.routing) if r.modality == "image"]
        assert len(set(image_names)) == 1


def test_gates_with_a_routing_state_decode_through_the_engine_as_in_one_pass(trained):
    """The engine carries each row's routing state from step to step: every generated token is routed and chosen
    exactly as one pass over the whole sequence routes and scores it (without the carried state, decode steps
    would restart the moving averages at each token)."""
    from molora.models.pipeline import InterleavedPipeline
    root, _, _, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(root)
    torch.manual_seed(5)
    pipe.gates = LearnedGates.for_model(pipe.routed, ["count", "spatial"], base_expert=True,
                                        context_decays=(0.5, 0.9), init_std=1.0)  # decisions vary with the state
    prompts = ["A red circle on the left. How many circles are there? A:", "Two blue squares. What is left? A:"]
    docs = pipe.generate(prompts, routing="learned", max_new_tokens=8, max_images=0, seed=0, text_temperature=0)
    router = pipe.make_router("learned", None, None)
    for prompt, doc in zip(prompts, docs):
        config = pipe.default_config.with_overrides(max_new_tokens=8)
        prompt_ids = pipe.encode_prompt(prompt, config, 8)[0]
        new = [r.id for r in doc.routing]
        with torch.no_grad():
            out = pipe.routed(torch.tensor([prompt_ids + new]), routers=router)
        start = len(prompt_ids) - 1  # the position that predicted the first new token
        names = out.routing.adapter_names(0)[start:start + len(new)]
        assert [r.adapter for r in doc.routing] == names
        v = pipe.vocab  # outside a picture (and with max_images=0) generation allows text ids and <eos> only
        allowed = torch.full((v.vocab_size,), -torch.inf)
        allowed[v.text_start:v.text_start + v.text_size] = 0.0
        allowed[v.eos_id] = 0.0
        assert (out.logits[0, start:start + len(new)] + allowed).argmax(-1).tolist() == new
    assert len({r.adapter for doc in docs for r in doc.routing}) >= 2


def test_decoding_with_a_transformers_kv_cache_carries_the_routing_state_on_the_router(trained):
    """RoutedModel.forward with past_key_values: token by token with one router object routes as one pass does;
    a new router object cannot continue a cached sequence (it holds no state): a clear error."""
    from transformers import DynamicCache

    from molora.models.pipeline import InterleavedPipeline
    from molora.routing.errors import RoutingError
    root, _, _, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(root)
    torch.manual_seed(6)
    gates = LearnedGates.for_model(pipe.routed, ["count", "spatial"], base_expert=True, context_decays=(0.5, 0.9),
                                   init_std=1.0)
    ids = torch.tensor([[pipe.vocab.bos_id, *range(40, 52)], [pipe.vocab.bos_id, *range(60, 72)]])
    with torch.no_grad():
        whole = pipe.routed(ids, routers=LearnedRouter(gates, top_k=2, vocab=pipe.vocab))
        router = LearnedRouter(gates, top_k=2, vocab=pipe.vocab)
        cache = DynamicCache()
        out = pipe.routed(ids[:, :5], routers=router, past_key_values=cache, use_cache=True)
        names = [list(out.routing.adapter_names(r)) for r in range(2)]
        for t in range(5, ids.shape[1]):
            out = pipe.routed(ids[:, t:t + 1], routers=router, past_key_values=cache, use_cache=True)
            for r in range(2):
                names[r] += out.routing.adapter_names(r)
            assert torch.allclose(out.logits[:, -1], whole.logits[:, t], atol=1e-4)
        assert names == [list(whole.routing.adapter_names(r)) for r in range(2)]
        with pytest.raises(RoutingError, match="same LearnedRouter object"):
            pipe.routed(ids[:, -1:], routers=LearnedRouter(gates, top_k=2, vocab=pipe.vocab), past_key_values=cache,
                        use_cache=True)


def _reads_the_words(direction: torch.Tensor):
    """Hand-set image-gate logits that read the routing state only: expert 0 where the shortest-decay average
    (the last few text positions) holds much of `direction` (a word's embedding), else the base expert."""
    def logits(block, hidden, state=None):
        assert state is not None  # image gates with decays are given their routing state
        share = (state[:, 0] * direction).sum(-1, keepdim=True) / direction.pow(2).sum()
        return torch.cat([share - 0.3, torch.zeros_like(share)], dim=1) * 50.0
    return logits


def test_image_gates_read_a_state_of_the_words_so_a_second_picture_follows_its_own_sentence(trained):
    """Image gates with context decays read a routing state updated by the TEXT positions: at a picture's first
    position the short decay holds the sentence just written, not the picture before it. In one pass, a second
    picture's decision follows the word before it; a state updated by the image positions (the rule before) would
    hold the first picture instead."""
    from molora.routing.routers import LearnedGroup, routing_state
    root, model, adapters, _, _ = trained
    routed, tok = load_script("train_router").load_routed(model, adapters, ["count", "spatial"])
    v = tok.vocab
    text_gates = LearnedGates.for_model(routed, ["count"])
    image_gates = LearnedGates.for_model(routed, ["spatial"], base_expert=True, context_decays=(0.5, 0.97))
    asks, other = 40, 41  # the 'style word' asking for the adapter, and a neutral word
    image_gates.logits = _reads_the_words(routed.model.get_input_embeddings().weight[asks].detach().float())
    codes = [v.image_start, v.image_start + 1, v.image_start + 2]
    # doc A: asks, picture 1, other, picture 2     doc B: other, picture 1, asks, picture 2
    doc_a = [v.bos_id, asks, v.boi_id, *codes, v.eoi_id, other, v.boi_id, *codes]
    doc_b = [v.bos_id, other, v.boi_id, *codes, v.eoi_id, asks, v.boi_id, *codes]
    ids = torch.tensor([doc_a, doc_b])
    router = LearnedRouter(text_gates, top_k=1, vocab=v, image_gates=image_gates)
    with torch.no_grad():
        out = routed(ids, routers=router)
    first, second = slice(2, 6), slice(8, 12)
    names = [out.routing.adapter_names(r) for r in range(2)]
    assert list(names[0][first]) == ["spatial"] * 4 and list(names[0][second]) == [None] * 4
    assert list(names[1][first]) == [None] * 4 and list(names[1][second]) == ["spatial"] * 4
    # the image gates' state is updated by the (non-pad) text positions, not by the pictures they route
    groups = LearnedGroup.for_router(router, None, ids, {"count": 0, "spatial": 1}, "cpu")
    text = router.gated(ids)
    assert groups[0].updates is None and torch.equal(groups[1].updates, text)
    # updated by its own (image) positions, the state at the second <boi> still holds picture 1's codes: the
    # second picture's short-decay state would be the same in both documents' second pictures
    emb = routed.model.get_input_embeddings().weight[ids].detach()
    own = routing_state(emb, ~text, (0.5, 0.97))[:, 8, 0]
    words = routing_state(emb, text, (0.5, 0.97))[:, 8, 0]
    assert torch.allclose(own[0], own[1]) and not torch.allclose(words[0], words[1])


def test_image_gates_with_a_routing_state_decode_through_the_engine_as_in_one_pass(trained):
    """Image gates with a routing state (and text gates with as many other decays): the engine keeps one state per
    gate set and row across decode steps, so each generated picture takes the decision one pass over the whole
    document gives it, and the text positions route as in that pass too."""
    from molora.models.pipeline import InterleavedPipeline
    root, _, _, _, _ = trained
    pipe = InterleavedPipeline.from_pretrained(root)
    torch.manual_seed(7)
    pipe.gates = LearnedGates.for_model(pipe.routed, ["count", "spatial"], base_expert=True,
                                        context_decays=(0.6, 0.9), init_std=1.0)
    pipe.image_gates = LearnedGates.for_model(pipe.routed, ["spatial"], base_expert=True,
                                              context_decays=(0.5, 0.97), init_std=1.0)  # as many as the text gates
    prompts = ["A red circle. Then a blue square:", "Two green stars", "A small square at the top left:"]
    docs = pipe.generate(prompts, routing="learned", max_images=2, seed=0, text_temperature=0,
                         max_new_tokens=2 * pipe.vocab.image_span_tokens + 12, start_image=True)
    router = pipe.make_router("learned", None, None)
    assert router.image_gates is pipe.image_gates
    seen = set()
    for prompt, doc in zip(prompts, docs):
        config = pipe.default_config.with_overrides(max_new_tokens=8, start_image=True)
        prompt_ids = pipe.encode_prompt(prompt, config, 8)[0]  # ends with <boi>: the first picture's decision
        new = [r.id for r in doc.routing]
        assert any(r.modality == "image" for r in doc.routing)
        with torch.no_grad():
            out = pipe.routed(torch.tensor([prompt_ids + new]), routers=router)
        start = len(prompt_ids) - 1
        names = list(out.routing.adapter_names(0)[start:start + len(new)])
        assert [r.adapter for r in doc.routing] == names
        seen |= {r.adapter for r in doc.routing if r.modality == "image"}
    assert seen  # pictures were routed by the image gates


def test_init_from_with_train_new_only_keeps_the_loaded_context_decays_and_old_rows(trained, tmp_path):
    root, model, adapters, _, _ = trained
    shape = LearnedGates.load(root / "router" / "gates.safetensors")
    old = LearnedGates(shape.d_model, ["count"], shape.num_blocks, base_expert=True, context_decays=(0.6, 0.9))
    old.save(tmp_path / "old.safetensors")
    train_router = load_script("train_router")
    config = train_router.main(
        ["--model-dir", str(model), "--adapters-dir", str(adapters), "--adapters", "count", "spatial",
         "--out", str(tmp_path / "r"), "--steps", "2", "--n-per-domain", "8", "--n-val", "4", "--batch-size", "8",
         "--label-coef", "1.0", "--lr", "0.1", "--init-from", str(tmp_path / "old.safetensors"), "--train-new-only",
         "--context-decays"])  # the flag says none: the loaded gates' decays win
    grown = LearnedGates.load(tmp_path / "r" / "gates.safetensors")
    assert grown.context_decays == (0.6, 0.9) and config["context_decays"] == [0.6, 0.9]
    assert grown.experts == ["count", "spatial", None]
    for before, after in zip(old.gates, grown.gates):
        assert torch.equal(after.weight[0], before.weight[0]) and torch.equal(after.weight[2], before.weight[1])
        assert after.weight[1].any()  # the new row trained from zero
    with pytest.raises(SystemExit, match="needs --init-from"):
        train_router.main(["--out", str(tmp_path / "x"), "--train-new-only"])


def test_image_adapter_trains_on_its_pictures_only_and_loads_as_an_image_adapter(tmp_path):
    """scripts/train_image_adapter.py: a PEFT folder of modality "image" that the pipeline loads as one, trained
    through the routed path with the adapter on the picture's positions and the base model on the words."""
    script = load_script("train_image_adapter")
    model = write_tiny_model_dir(tmp_path / "model")
    metrics = script.main(["--model-dir", str(model), "--out", str(tmp_path / "adapters"), "--style", "negative",
                           "--steps", "2", "--n-train", "8", "--n-val", "4", "--batch-size", "4"])
    folder = tmp_path / "adapters" / "negative"
    assert json.loads((folder / "molora.json").read_text())["modality"] == "image"
    assert json.loads((folder / "metrics.json").read_text())["steps"] == metrics["steps"] == 2
    assert set(metrics["val_adapter"]) == {"picture_loss", "picture_code_accuracy"}
    assert metrics["val_adapter"]["picture_loss"] != metrics["val_base"]["picture_loss"]  # it trained
    loaded = load_model_dir(model, adapters_dir=tmp_path / "adapters")
    assert [(a.name, a.modality) for a in loaded.adapters] == [("negative", "image")]
    stored = load_peft_adapter(folder)  # trained in float32, stored as bfloat16 (--save-dtype)
    assert {t.dtype for pair in stored.weights.values() for t in pair} == {torch.bfloat16}
    picture = torch.tensor([[False, False, True, True]])
    router = script.picture_router("negative", picture)
    assert router.labels.tolist() == [[-1, -1, 0, 0]]


def test_image_training_puts_first_pictures_of_both_other_styles_before_a_second_one():
    """scripts/train_image_router.py first_requests (the image gates' and image LoRAs' second pictures): seeded,
    a `second` share of the items, each first request in another style, both other styles for every asked style
    (the shipped gates of 2026-12-06 saw one order each and followed the order, not the words, in the other)."""
    from molora.models.families.shapes.styles import style_items
    script = load_script("train_image_router")
    items = style_items(300, seed=0, split="train")
    firsts = script.first_requests(items, seed=0, split="train", second=0.75)
    assert firsts == script.first_requests(items, seed=0, split="train", second=0.75)
    assert firsts != script.first_requests(items, seed=1, split="train", second=0.75)
    used = [(it.style, f.style) for it, f in zip(items, firsts) if f is not None]
    assert 0.65 < len(used) / len(items) < 0.85 and all(a != b for a, b in used)
    assert {pair for pair in used} == {(a, b) for a in ("outline", "filled", "negative")
                                       for b in ("outline", "filled", "negative") if a != b}
    assert script.first_requests(items, seed=0, split="train", second=0.0) == [None] * len(items)


def test_image_adapter_refuses_a_style_it_does_not_know():
    with pytest.raises(SystemExit):
        load_script("train_image_adapter").parse_args(["--out", "/tmp/x", "--style", "striped"])
