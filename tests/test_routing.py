"""RoutedModel behaviour: base equality, routers, prefill == decode, mixed routers per row, per-thread routing,
and the learned (MoLoRA) router: forward, losses, gradients, gate save/load."""

from __future__ import annotations

import copy
import math
import threading
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from molora.kernels.reference import routed_lora_topk_reference
from molora.models.engine.vocab import IMAGE, UnifiedVocab
from molora.routing import (
    LearnedGates,
    LearnedRouter,
    LoraAdapter,
    RoutedLoRALinear,
    RoutingError,
    SequenceRouter,
    UnknownAdapterError,
    VocabRangeRouter,
    attach_routed_lora,
)
from molora.routing.context import current_routing

VOCAB = UnifiedVocab(vocab_size=64, text_start=5, text_size=27, image_start=32, image_size=32, pad_id=0, bos_id=1,
                     eos_id=2, boi_id=3, eoi_id=4, image_grid=(2, 2))
IDS = torch.tensor([[1, 7, 9, 3, 33, 40, 57, 63, 4, 8, 30, 2],
                    [1, 3, 32, 35, 36, 50, 4, 11, 12, 13, 14, 2],
                    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def random_adapter(model, name: str, rank: int, seed: int, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
                   scale: float = 2.0) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=gen) * 0.3
            b = torch.randn(module.out_features, rank, generator=gen) * 0.3
            weights[module_name] = (a, b)
    return LoraAdapter(name, weights, {m: scale for m in weights})


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    reference = copy.deepcopy(base)
    routed = attach_routed_lora(base, num_slots=3, r_max=8)
    routed.add_adapter(random_adapter(reference, "T", 4, 1))
    routed.add_adapter(random_adapter(reference, "I", 8, 2, targets=("q_proj", "k_proj", "gate_proj", "down_proj")))
    routed.add_adapter(random_adapter(reference, "D", 2, 3))
    return routed, reference


def decode_token_by_token(routed, ids, router):
    cache = DynamicCache()
    logits, names = [], []
    for t in range(ids.shape[1]):
        out = routed(ids[:, t:t + 1], routers=router, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1])
        names.append(out.routing.adapter_names(0)[0])
    return torch.stack(logits, dim=1), names


# --- attaching / base equality ------------------------------------------------------------------------------

def test_attach_wraps_every_target_linear_sharing_weights(setup):
    routed, reference = setup
    layers = [m for m in routed.model.modules() if isinstance(m, RoutedLoRALinear)]
    assert len(layers) == 2 * 7 and routed.num_blocks == 2
    assert {layer.block for layer in layers} == {0, 1}
    assert routed.model.state_dict().keys() == reference.state_dict().keys()  # still saves as the base model
    q = routed.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, torch.nn.Linear) and q.lora_A.shape == (3, 8, 32)


def test_no_routing_or_all_empty_slots_equals_base_exactly(setup):
    routed, reference = setup
    with torch.no_grad():
        want = reference(input_ids=IDS).logits
        assert torch.equal(routed(IDS).logits, want)
        assert torch.equal(routed(IDS, routers=SequenceRouter(None)).logits, want)
        assert torch.equal(routed(IDS, routers=[None, None, None]).logits, want)
        text_only = IDS[2:]  # no image ids: an image-only router leaves every slot at -1
        out = routed(text_only, routers=VocabRangeRouter(VOCAB, None, "I"))
        assert out.routing.adapter_names(0) == [None] * text_only.shape[1]
        assert torch.equal(out.logits, reference(input_ids=text_only).logits)


def test_deepcopy_gives_an_independent_routed_model(setup):
    routed, _ = setup
    twin = copy.deepcopy(routed)
    assert twin.cache.layers["model.layers.0.self_attn.q_proj"] is twin.model.model.layers[0].self_attn.q_proj
    twin.remove_adapter("D")
    assert "D" in routed.adapter_names and "D" not in twin.adapter_names
    with torch.no_grad():
        assert torch.equal(twin(IDS, routers=SequenceRouter("T")).logits, routed(IDS, routers=SequenceRouter("T")).logits)


def test_attach_rejects_bad_targets_and_double_attach():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(RoutingError, match="q_proj"):
        attach_routed_lora(model, target_modules=("nonexistent",))
    with pytest.raises(RoutingError):
        attach_routed_lora(model, num_slots=0)
    attach_routed_lora(model, target_modules=("q_proj",), num_slots=1, r_max=2)
    with pytest.raises(RoutingError, match="already"):
        attach_routed_lora(model)


# --- vocabulary routing ----------------------------------------------------------------------------------------

def test_vocab_router_follows_the_predicts_rule(setup):
    routed, _ = setup
    router = VocabRangeRouter(VOCAB, "T", "I")
    with torch.no_grad():
        out = routed(IDS, routers=router)
    table = VOCAB.modality_table()
    for b in range(IDS.shape[0]):
        want = ["I" if table[i] == IMAGE else "T" for i in IDS[b].tolist()]
        assert out.routing.adapter_names(b) == want
    # <boi> predicts the first code -> image; <eoi> predicts text -> text
    assert out.routing.adapter_names(0)[3] == "I" and out.routing.adapter_names(0)[8] == "T"


def test_vocab_router_prefill_equals_token_by_token_decode(setup):
    routed, _ = setup
    router = VocabRangeRouter(VOCAB, "T", "I")
    ids = IDS[:1]
    with torch.no_grad():
        prefill = routed(ids, routers=router)
        decoded, names = decode_token_by_token(routed, ids, router)
    assert names == prefill.routing.adapter_names(0)
    assert rel_err(decoded, prefill.logits) <= 1e-5


def test_ids_outside_the_vocab_layout_route_as_text(setup):
    router = VocabRangeRouter(VOCAB, "T", "I")
    slots = router.route(torch.tensor([[3, 40, 70, -5]]), {"T": 0, "I": 1})
    assert slots.tolist() == [[1, 1, 0, 0]]


# --- mixed routers per row, unknown names ------------------------------------------------------------------

def test_batch_mixes_routers_per_row(setup):
    routed, reference = setup
    routers = [VocabRangeRouter(VOCAB, "T", "I"), SequenceRouter("T"), None]
    with torch.no_grad():
        mixed = routed(IDS, routers=routers)
        for row, router in enumerate(routers):
            alone = routed(IDS[row:row + 1], routers=router)
            assert rel_err(mixed.logits[row:row + 1], alone.logits) <= 1e-5
            assert mixed.routing.adapter_names(row) == alone.routing.adapter_names(0)
        assert rel_err(mixed.logits[2:], reference(input_ids=IDS[2:]).logits) <= 1e-5
    assert mixed.routing.adapter_names(1) == ["T"] * IDS.shape[1]
    assert mixed.routing.adapter_names(2) == [None] * IDS.shape[1]


def test_router_count_must_match_batch_and_unknown_names_are_clear(setup):
    routed, _ = setup
    before = routed.cache.stats()
    with pytest.raises(RoutingError, match="3"):
        routed(IDS, routers=[SequenceRouter("T")])
    with pytest.raises(UnknownAdapterError, match=r"nope.*loaded: D, I, T"):
        routed(IDS, routers=SequenceRouter("nope"))
    with pytest.raises(RoutingError):
        routed(IDS, routers="T")
    after = routed.cache.stats()
    assert after["pinned"] == {} and after["slots"] == before["slots"]


def test_routing_is_released_when_the_forward_raises(setup):
    routed, _ = setup
    with pytest.raises(Exception):  # noqa: B017 - any HF error; what matters is the cleanup
        routed(torch.tensor([[1, 2, 99]]), routers=SequenceRouter("T"))
    assert routed.cache.stats()["pinned"] == {}
    q = routed.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q(torch.ones(1, 32)), torch.nn.functional.linear(torch.ones(1, 32), q.weight))


# --- threads -------------------------------------------------------------------------------------------------

def test_two_threads_never_see_each_others_routing(setup):
    routed, _ = setup
    ids = IDS[:1]
    with torch.no_grad():
        want_t = routed(ids, routers=SequenceRouter("T")).logits
        want_i = routed(ids, routers=SequenceRouter("I")).logits
    paused, resume = threading.Event(), threading.Event()
    layer = routed.model.model.layers[1].mlp.down_proj

    def pause_once(module, args, output):
        if threading.current_thread().name == "slow" and not paused.is_set():
            paused.set()
            resume.wait(timeout=30)

    handle = layer.register_forward_hook(pause_once)
    results = {}

    def run(name, router):
        with torch.no_grad():
            results[name] = routed(ids, routers=router).logits

    slow = threading.Thread(target=run, args=("T", SequenceRouter("T")), name="slow")
    try:
        slow.start()
        assert paused.wait(timeout=30)  # thread "slow" is inside its forward, routing T set in its context
        run("I", SequenceRouter("I"))  # a whole forward with routing I in this thread meanwhile
        resume.set()
        slow.join(timeout=30)
    finally:
        handle.remove()
        resume.set()
    assert torch.equal(results["I"], want_i) and torch.equal(results["T"], want_t)


# --- learned router (MoLoRA) ---------------------------------------------------------------------------------

def _mixture_adapter(routed, names, weights, name):
    """One adapter equal to sum_i w_i * scale_i * B_i A_i (rank-concatenation), to check top-k mixing."""
    modules = set().union(*(routed.adapter(n).weights for n in names))
    out = {}
    for module in modules:
        layer = routed.cache.layers[module]
        a_parts, b_parts = [], []
        for n, w in zip(names, weights):
            ad = routed.adapter(n)
            if module in ad.weights:
                a, b = ad.weights[module]
                a_parts.append(a.clone())
                b_parts.append(b.clone() * (w * ad.scales[module]))
        if not a_parts:
            a_parts, b_parts = [torch.zeros(1, layer.in_features)], [torch.zeros(layer.out_features, 1)]
        out[module] = (torch.cat(a_parts), torch.cat(b_parts, dim=1))
    return LoraAdapter(name, out, {m: 1.0 for m in out})


def test_learned_router_single_expert_equals_sequence_routing(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T"])
    with torch.no_grad():
        learned = routed(IDS, routers=LearnedRouter(gates, top_k=1))
        seq = routed(IDS, routers=SequenceRouter("T"))
    assert rel_err(learned.logits, seq.logits) <= 1e-5
    assert learned.routing.slots.shape == (3, IDS.shape[1], 1)
    assert learned.routing.adapter_names(0) == ["T"] * IDS.shape[1]
    assert sorted(learned.decisions) == [0, 1]


def test_learned_router_top2_mixes_with_softmax_weights(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T", "D"])
    with torch.no_grad():
        for g in gates.gates:
            g.weight.zero_()  # equal logits -> softmax over the 2 kept = 0.5 / 0.5
    mixture = _mixture_adapter(routed, ["T", "D"], [0.5, 0.5], "mix")
    routed.add_adapter(mixture)
    try:
        with torch.no_grad():
            learned = routed(IDS, routers=LearnedRouter(gates, top_k=2), aux_losses=True)
            want = routed(IDS, routers=SequenceRouter("mix"))
            assert routed(IDS, routers=LearnedRouter(gates, top_k=2)).z_loss is None  # inference: no aux losses
        assert rel_err(learned.logits, want.logits) <= 1e-5
        assert torch.allclose(learned.routing.weights, torch.full_like(learned.routing.weights, 0.5))
        assert float(learned.load_balance_loss) == pytest.approx(1.0, abs=1e-6)  # uniform routing
        assert float(learned.z_loss) == pytest.approx(math.log(2) ** 2, abs=1e-5)
    finally:
        routed.remove_adapter("mix")


def test_hierarchical_learned_router_sends_image_positions_to_the_image_adapter(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T"])
    with torch.no_grad():
        learned = routed(IDS, routers=LearnedRouter(gates, top_k=1, vocab=VOCAB, image_adapter="I"))
        vocab = routed(IDS, routers=VocabRangeRouter(VOCAB, "T", "I"))
    assert rel_err(learned.logits, vocab.logits) <= 1e-5
    for b in range(3):
        assert learned.routing.adapter_names(b) == vocab.routing.adapter_names(b)


def test_learned_routing_prefill_equals_decode_and_blocks_decide_separately(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T", "I", "D"])
    with torch.no_grad():
        gates.gates[0].weight.normal_(0, 3.0, generator=torch.Generator().manual_seed(0))
        gates.gates[1].weight.normal_(0, 3.0, generator=torch.Generator().manual_seed(1))
    router = LearnedRouter(gates, top_k=2)
    ids = IDS[:1]
    with torch.no_grad():
        prefill = routed(ids, routers=router)
        decoded, _ = decode_token_by_token(routed, ids, router)
    assert rel_err(decoded, prefill.logits) <= 1e-5
    top0 = prefill.decisions[0][0].topk
    top1 = prefill.decisions[1][0].topk
    assert top0.shape == top1.shape == (ids.shape[1], 2) and not torch.equal(top0, top1)


def test_mixed_learned_and_static_rows(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T", "D"])
    learned = LearnedRouter(gates, top_k=2)
    routers = [learned, SequenceRouter("I"), None]
    with torch.no_grad():
        mixed = routed(IDS, routers=routers)
        for row, router in enumerate(routers):
            alone = routed(IDS[row:row + 1], routers=router)
            assert rel_err(mixed.logits[row:row + 1], alone.logits) <= 1e-5
    assert mixed.routing.adapter_names(1) == ["I"] * IDS.shape[1]
    assert mixed.routing.adapter_names(2) == [None] * IDS.shape[1]


def test_gates_train_through_the_routed_model_with_base_and_adapters_frozen(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T", "I", "D"])
    for p in routed.parameters():
        p.requires_grad_(False)
    try:
        out = routed(IDS, routers=LearnedRouter(gates, top_k=2), labels=IDS)
        loss = out.loss + 0.01 * out.load_balance_loss + 0.001 * out.z_loss
        loss.backward()
    finally:
        for p in routed.parameters():
            p.requires_grad_(True)
    assert all(g.weight.grad is not None and float(g.weight.grad.abs().sum()) > 0 for g in gates.gates)
    assert all(p.grad is None for p in routed.parameters())


def test_gate_weights_save_and_load(setup, tmp_path):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T", "D"])
    gates.save(tmp_path / "gates.safetensors")
    loaded = LearnedGates.load(tmp_path / "gates.safetensors")
    assert loaded.adapters == ["T", "D"] and loaded.num_blocks == 2
    for a, b in zip(gates.gates, loaded.gates):
        assert torch.equal(a.weight, b.weight)
    with torch.no_grad():
        x = routed(IDS, routers=LearnedRouter(gates)).logits
        y = routed(IDS, routers=LearnedRouter(loaded)).logits
    assert torch.equal(x, y)
    (tmp_path / "gates.pt").write_bytes(b"pickle")
    with pytest.raises(RoutingError, match="safetensors"):
        LearnedGates.load(tmp_path / "gates.pt")
    data = (tmp_path / "gates.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(RoutingError, match="not a gate file"):
        LearnedGates.load(tmp_path / "cut.safetensors")


def test_learned_router_rejects_bad_settings(setup):
    routed, _ = setup
    gates = LearnedGates.for_model(routed, ["T", "D"])
    with pytest.raises(RoutingError, match="top_k"):
        LearnedRouter(gates, top_k=3)
    with pytest.raises(RoutingError, match="vocab"):
        LearnedRouter(gates, image_adapter="I")
    wrong = LearnedGates(16, ["T"], 2)
    with pytest.raises(RoutingError, match="hidden size"):
        routed(IDS, routers=LearnedRouter(wrong, top_k=1))
    assert routed.cache.stats()["pinned"] == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_routed_model_matches_cpu(setup, dtype):
    """The routed model on the GPU (Triton kernels): in fp32 it equals the same model on the CPU (torch path) up to
    the two devices' different rounding of the base model alone; in bf16 every routed layer is held to exact math
    on its own input (the logits of this random model amplify rounding chaotically: see below)."""
    routed, _ = setup
    with torch.no_grad():
        cpu = copy.deepcopy(routed).to(dtype)
        want = cpu(IDS, routers=VocabRangeRouter(VOCAB, "T", "I")).logits.float()
        base_want = cpu(IDS, routers=None).logits.float()
        gpu = copy.deepcopy(routed).to("cuda", dtype)
        calls = []
        hooks = [m.register_forward_hook(lambda m, args, y: calls.append((m, args[0], y, current_routing())))
                 for m in gpu.model.modules() if isinstance(m, RoutedLoRALinear)]
        got = gpu(IDS.cuda(), routers=VocabRangeRouter(VOCAB, "T", "I")).logits.float().cpu()
        for hook in hooks:
            hook.remove()
        base_got = gpu(IDS.cuda(), routers=None).logits.float().cpu()
    rounding = rel_err(base_got, base_want)
    print(f"{dtype}: routed GPU vs CPU {rel_err(got, want):.2e}, base GPU vs CPU {rounding:.2e}")
    if dtype == torch.float32:
        assert rel_err(got, want) <= max(1e-4, 3 * rounding)
        return
    # bf16: each device rounds base + delta its own way (the GPU's q/k/v at these 36 tokens in one GEMM, elsewhere
    # the base GEMM onto the bf16 delta), and this random two-layer model amplifies rounding chaotically (on the
    # interpreter, 16 random inputs: a 0.4-0.8% difference at layer 0's q/k/v gave 3-33% at the logits, either path
    # ahead in turn). So every routed layer is held to bf16 accuracy on its own input: its output against float32 /
    # float64 math on the same (bf16) input, weights and adapters.
    assert len(calls) == 2 * 7
    for layer, x, y, routing in calls:
        slots, weights = routing.kernel_slots(layer.route_key)
        x2 = x.reshape(-1, layer.in_features).double()
        ref = x2 @ layer.weight.double().t() + routed_lora_topk_reference(
            x2, layer.lora_A.double(), layer.lora_B.double(), slots,
            weights if weights is not None else torch.ones(slots.shape, device=x.device), layer.lora_scale.double())
        assert rel_err(y.reshape(ref.shape).double(), ref) <= 1e-2, layer.name


def test_kv_cache_argument_follows_the_installed_transformers(setup):
    """Callers pass past_key_values=; transformers >= 5.2x wants `cache` (the old name warns, then goes away)."""
    routed, _ = setup
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated", category=FutureWarning)
        first = routed(IDS[:, :3], routers=VocabRangeRouter(VOCAB, "T", "I"), past_key_values=DynamicCache(),
                       use_cache=True)
        nxt = routed(IDS[:, 3:4], routers=VocabRangeRouter(VOCAB, "T", "I"), past_key_values=first.past_key_values,
                     use_cache=True)
    assert first.past_key_values.get_seq_length() == 4 and nxt.logits.shape[1] == 1


def test_routing_metadata_is_built_once_per_forward_and_only_for_paths_that_read_it(setup, monkeypatch):
    import molora.routing.context as context

    routed, _ = setup
    calls = []
    real = context.build_routing_meta
    monkeypatch.setattr(context, "build_routing_meta", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        routed(IDS[:, :4], routers=VocabRangeRouter(VOCAB, "T", "I"))  # decode-sized: the dense CPU form reads
        assert calls == [1]                                            # its selection matrix, built once
        long_ids = torch.randint(0, 64, (2, 20))
        routed(long_ids, routers=VocabRangeRouter(VOCAB, "T", "I"))  # 40 rows: the grouped loop, every layer
    assert calls == [1, 1]


# --- learned gates with a routing state (context decays) ---------------------------------------------------

def _context_gates(routed, seed: int = 0) -> LearnedGates:
    gates = LearnedGates.for_model(routed, ["T", "I", "D"], base_expert=True, context_decays=(0.5, 0.9))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in gates.gates:
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen) * 3.0)
    return gates


def test_routing_state_is_the_masked_moving_average_in_one_pass_and_step_by_step():
    from molora.routing.routers import STATE_CHUNK, routing_state
    gen = torch.Generator().manual_seed(0)
    t = STATE_CHUNK + 37  # crosses a chunk boundary
    e = torch.randn(2, t, 5, generator=gen)
    updates = torch.rand(2, t, generator=gen) > 0.3
    full = routing_state(e, updates, (0.5, 0.9))
    ref, expected = torch.zeros(2, 2, 5), []
    for i in range(t):
        for j, lam in enumerate((0.5, 0.9)):
            ref[:, j] = torch.where(updates[:, i, None], lam * ref[:, j] + (1 - lam) * e[:, i], ref[:, j])
        expected.append(ref.clone())
    assert torch.allclose(full, torch.stack(expected, dim=1), atol=1e-5)
    state, steps = None, []
    for i in range(t):
        step = routing_state(e[:, i:i + 1], updates[:, i:i + 1], (0.5, 0.9), state)
        state = step[:, -1]
        steps.append(step)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_context_gates_prefill_equals_decode_when_the_state_is_carried(setup):
    routed, _ = setup
    router = LearnedRouter(_context_gates(routed), top_k=2, vocab=VOCAB)
    ids = IDS[2:3]  # text only
    with torch.no_grad():
        prefill = routed(ids, routers=router)
        cache, state, carried, fresh = DynamicCache(), None, [], []
        for t in range(ids.shape[1]):
            with routed.routing_scope(ids[:, t:t + 1], router) as plan:
                plan.learned[0].state_in = state  # what a serving engine keeps per row between steps
                out = routed.run(ids[:, t:t + 1], plan, past_key_values=cache, use_cache=True)
                state = plan.learned[0].state_out
            cache = out.past_key_values
            carried.append(out.logits[:, -1])
            fresh.append(routed(ids[:, :t + 1], routers=router).logits[:, -1])
    assert rel_err(torch.stack(carried, dim=1), prefill.logits) <= 1e-5
    assert rel_err(torch.stack(fresh, dim=1), prefill.logits) <= 1e-5
    # the state matters: decoding the last token without it routes differently
    with torch.no_grad():
        alone = routed(ids[:, -1:], routers=router)
    assert not torch.equal(alone.decisions[0][0].topk, prefill.decisions[0][0].topk[-1:])


def test_context_gates_save_load_and_format_versions(setup, tmp_path):
    import json

    from safetensors.torch import save_file
    routed, _ = setup
    gates = _context_gates(routed)
    assert gates.gates[0].weight.shape == (4, 32 * 3)
    gates.save(tmp_path / "g.safetensors")
    loaded = LearnedGates.load(tmp_path / "g.safetensors")
    assert loaded.context_decays == (0.5, 0.9) and loaded.base_expert
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(gates.gates, loaded.gates))
    assert loaded.with_adapters(["T", "I", "D", "new"]).context_decays == (0.5, 0.9)
    with torch.no_grad():
        x = routed(IDS, routers=LearnedRouter(gates, vocab=VOCAB)).logits
        y = routed(IDS, routers=LearnedRouter(loaded, vocab=VOCAB)).logits
    assert torch.equal(x, y)
    meta = {"adapters": json.dumps(["T", "D"]), "d_model": "32", "num_blocks": "2", "format": "molora-gates"}
    tensors = {f"gates.{i}.weight": torch.zeros(2, 32) for i in range(2)}
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata=meta)  # written before format versions
    assert LearnedGates.load(tmp_path / "v1.safetensors").context_decays == ()
    save_file(tensors, str(tmp_path / "v9.safetensors"), metadata={**meta, "version": "9"})
    with pytest.raises(RoutingError, match="version 9"):
        LearnedGates.load(tmp_path / "v9.safetensors")
    save_file(tensors, str(tmp_path / "short.safetensors"), metadata={**meta, "context_decays": "[0.5]"})
    with pytest.raises(RoutingError, match="expected a float tensor"):
        LearnedGates.load(tmp_path / "short.safetensors")
    with pytest.raises(RoutingError, match="context_decays"):
        LearnedGates(32, ["T"], 2, context_decays=(1.0,))
