"""Projection groups (routing/lora.py): q/k/v and gate/up share one routed-LoRA call per forward, with results
equal to computing each projection on its own, through model moves and inputs that turn out not to be shared."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import molora.routing.lora as lora_mod
from molora.kernels.reference import routed_lora_reference, routed_lora_topk_reference
from molora.routing import LoraAdapter, RoutedLoRALinear, SequenceRouter, attach_routed_lora
from molora.routing.context import CallRouting, reset_routing, set_routing
from molora.routing.lora import ProjectionGroup, group_projections

IDS = torch.tensor([[1, 7, 9, 3, 33, 40, 57, 63, 4, 8, 30, 2], [1, 3, 32, 35, 36, 50, 4, 11, 12, 13, 14, 2]])


def _run_layers(layers, xs, routing: CallRouting, grad: bool = False) -> list[torch.Tensor]:
    """Each layer called on its input under `routing` (gradients recorded only with grad)."""
    token = set_routing(routing)
    try:
        with torch.set_grad_enabled(grad):
            return [layer(x) for layer, x in zip(layers, xs)]
    finally:
        reset_routing(token)


def _adapter(model, name: str, rank: int, seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {n: (torch.randn(rank, m.in_features, generator=gen) * 0.3,
                   torch.randn(m.out_features, rank, generator=gen) * 0.3)
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    return LoraAdapter(name, weights, {m: 1.5 for m in weights})


def _routed(seed: int = 0):
    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    reference = copy.deepcopy(base)
    routed = attach_routed_lora(base, num_slots=3, r_max=8)
    routed.add_adapter(_adapter(reference, "T", 4, 1))
    routed.add_adapter(_adapter(reference, "D", 8, 2))
    return routed


def _groups(routed) -> set[ProjectionGroup]:
    return {m.group for m in routed.model.modules() if isinstance(m, RoutedLoRALinear)}


def test_attach_groups_qkv_and_gate_up_with_buffers_as_views_of_one_stack():
    routed = _routed()
    attn = routed.model.model.layers[0].self_attn
    mlp = routed.model.model.layers[0].mlp
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group
    assert mlp.gate_proj.group is mlp.up_proj.group
    assert len(attn.o_proj.group) == 1 and len(mlp.down_proj.group) == 1
    group = attn.q_proj.group
    assert group.bounds == (0, 32, 48, 64)  # q 32, k and v 16 (two KV heads of 8)
    for p, layer in enumerate(group.members):
        assert layer.lora_A.data_ptr() == group.A[p].data_ptr()
        assert layer.lora_B.data_ptr() == group.B[:, group.bounds[p]:].data_ptr()
        assert layer.lora_scale.data_ptr() == group.scale[p].data_ptr()
    assert attn.v_proj.lora_A.shape == (3, 8, 32) and attn.v_proj.lora_B.shape == (3, 16, 8)


def test_group_weights_share_one_storage_and_the_model_saves_and_reloads(tmp_path):
    """q/k/v's (and gate/up's) weight Parameters are row views of one [O, in] tensor (one GEMM for the base
    outputs; no second copy of the weights), and the model still saves and reloads as the plain base model."""
    routed = _routed()
    attn = routed.model.model.layers[0].self_attn
    group = attn.q_proj.group
    assert group.weight.shape == (64, 32)
    for p, layer in enumerate(group.members):
        assert layer.weight.data_ptr() == group.weight[group.bounds[p]].data_ptr()
    assert attn.o_proj.group.weight is attn.o_proj.weight  # a group of one keeps its own Parameter
    with torch.no_grad():
        want = routed(IDS, routers=SequenceRouter("T")).logits
        base = routed(IDS, routers=None).logits
    routed.model.save_pretrained(tmp_path / "lm")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "lm").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, base)
        again = attach_routed_lora(reloaded, num_slots=3, r_max=8)
        for name in ("T", "D"):
            again.add_adapter(routed.cache.adapter(name))
        assert torch.allclose(again(IDS, routers=SequenceRouter("T")).logits, want, atol=1e-6)


def test_cpu_group_call_reads_only_the_slots_present(monkeypatch):
    """The CPU's group form (kernels/torch_ops.py routed_linear_torch_slots) visits only the slots some token
    chose (test_group_layer_matches_base_plus_reference_delta checks its outputs)."""
    routed = _routed()
    visited = []
    real = lora_mod.routed_linear_torch_slots
    monkeypatch.setattr(lora_mod, "routed_linear_torch_slots",
                        lambda *a, **k: visited.append(tuple(s for s, _ in a[3])) or real(*a, **k))
    with torch.no_grad():
        routed(IDS, routers=[SequenceRouter("D"), None])
    assert set(visited) == {(routed.cache.slot_of("D"),)}


def test_one_kernel_call_per_group_and_same_logits_as_each_projection_alone(monkeypatch):
    routed = _routed()
    calls = []
    real = lora_mod.routed_lora_group_forward
    monkeypatch.setattr(lora_mod, "routed_lora_group_forward", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    real_linear = lora_mod.routed_linear_torch_slots  # the CPU's form: base outputs and deltas in one group call
    monkeypatch.setattr(lora_mod, "routed_linear_torch_slots",
                        lambda *a, **k: calls.append(len(a[4])) or real_linear(*a, **k))
    router = [SequenceRouter("T"), SequenceRouter("D")]
    with torch.no_grad():
        shared = routed(IDS, routers=router).logits
        assert sorted(calls) == [1, 1, 1, 1, 2, 2, 3, 3]  # per block: q/k/v, gate/up, o, down
        for group in _groups(routed):
            group.shares_input = False
        calls.clear()
        apart = routed(IDS, routers=router).logits
    assert calls == [1] * 14
    assert torch.allclose(shared, apart, atol=1e-5, rtol=1e-5)


def test_group_layer_matches_base_plus_reference_delta():
    layers = [RoutedLoRALinear(torch.nn.Linear(24, o, bias=bias), 3, 8, name=f"blk.{n}")
              for n, o, bias in (("q_proj", 24, True), ("k_proj", 12, False), ("v_proj", 12, True))]
    group_projections(layers)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in layers:
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen))
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen))
            layer.lora_scale.copy_(torch.rand(3, generator=gen))
    x = torch.randn(2, 5, 24, generator=gen)
    slots = torch.tensor([0, 1, 2, -1, 1, 0, 0, 2, -1, 1])
    ys = _run_layers(layers, [x] * len(layers), CallRouting(2, 5, slots, 3))
    for layer, y in zip(layers, ys):
        want = F.linear(x, layer.weight, layer.bias).reshape(10, -1) + routed_lora_reference(
            x.reshape(10, 24), layer.lora_A, layer.lora_B, slots, layer.lora_scale)
        assert y.shape == (2, 5, layer.out_features)
        assert torch.allclose(y.reshape(10, -1), want, atol=1e-5, rtol=1e-5)


def test_members_called_on_different_inputs_stop_sharing_and_stay_correct():
    layers = [RoutedLoRALinear(torch.nn.Linear(16, 16, bias=False), 2, 4, name=f"blk.{n}") for n in ("gate_proj", "up_proj")]
    group_projections(layers)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.lora_A.normal_()
            layer.lora_B.normal_()
            layer.lora_scale.fill_(1.0 + i)
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    slots = torch.tensor([0, 1, -1])
    y_gate, y_up = _run_layers(layers, [x1, x2], CallRouting(1, 3, slots, 2))
    assert layers[0].group.shares_input is False
    for layer, x, y in ((layers[0], x1, y_gate), (layers[1], x2, y_up)):
        want = F.linear(x, layer.weight) + routed_lora_reference(x, layer.lora_A, layer.lora_B, slots, layer.lora_scale)
        assert torch.allclose(y, want, atol=1e-5, rtol=1e-5)


def test_model_moved_after_attach_restacks_and_keeps_adapters():
    routed = _routed()
    router = SequenceRouter("D")
    with torch.no_grad():
        before = routed(IDS, routers=router).logits.double()
        routed.model.to(torch.float64)  # every buffer becomes a separate float64 copy
        q = routed.model.model.layers[0].self_attn.q_proj
        assert q.lora_A.data_ptr() != q.group.A[0].data_ptr()
        after = routed(IDS, routers=router).logits
        assert q.group.A.dtype == torch.float64 and q.lora_A.data_ptr() == q.group.A[0].data_ptr()
    assert after.dtype == torch.float64
    assert torch.allclose(after, before, atol=1e-4, rtol=1e-4)


def test_training_through_a_group_takes_the_autograd_path():
    routed = _routed()
    q = routed.model.model.layers[0].self_attn.q_proj
    q.lora_A.requires_grad_(True)
    out = routed(IDS, routers=SequenceRouter("T")).logits
    out.square().mean().backward()
    assert q.lora_A.grad is not None and q.lora_A.grad.abs().sum() > 0


def test_group_with_weights_of_different_strides_keeps_the_group_call(monkeypatch):
    """The one-GEMM path reads every member's weight with one set of strides: a member whose weight is stored
    transposed sends the group to the group call (correct outputs, no error), wherever fuses_base would say yes."""
    calls = []
    monkeypatch.setattr(lora_mod, "fuses_base", lambda *a: True)
    monkeypatch.setattr(lora_mod, "stacked_linear_group", lambda *a, **kw: calls.append(1))
    gen = torch.Generator().manual_seed(3)
    layers = []
    for nm, o in (("q_proj", 24), ("k_proj", 8), ("v_proj", 8)):
        base = torch.nn.Linear(16, o, bias=False)
        if nm == "k_proj":  # same values, stored as the transpose of a [16, 8] tensor
            base.weight = torch.nn.Parameter(base.weight.detach().t().contiguous().t())
        layers.append(RoutedLoRALinear(base, 2, 4, name=f"blk.{nm}", block=0))
    group_projections(layers)
    with torch.no_grad():
        for layer in layers:
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen))
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen))
            layer.lora_scale.fill_(0.5)
        x = torch.randn(1, 20, 16, generator=gen)
        slots = torch.randint(-1, 2, (20,), generator=gen)
        ys = _run_layers(layers, [x] * 3, CallRouting(1, 20, slots, 2))
    assert calls == []
    for layer, y in zip(layers, ys):
        want = F.linear(x, layer.weight) + routed_lora_reference(x[0], layer.lora_A, layer.lora_B, slots,
                                                                 layer.lora_scale)
        assert torch.allclose(y, want, atol=1e-5), layer.name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_group_matches_cpu():
    routed = _routed()
    router = [SequenceRouter("T"), SequenceRouter("D")]
    with torch.no_grad():
        want = routed(IDS, routers=router).logits
        routed.model.to("cuda")
        got = routed(IDS.cuda(), routers=router).logits.cpu()
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(1, 0), (1, 2), (5, 1), (16, 2), (64, 0), (200, 2)])  # k = 0: static routing
def test_cuda_eager_group_outputs_match_base_plus_reference_and_capture(n, k, monkeypatch):
    """On CUDA, N <= 16 (eager decode): the members' GEMMs into one buffer and the kept launcher adding the deltas
    (direct launches after the first call); 17..256 tokens: one GEMM for the group with the deltas inside
    (kernels/triton_linear.py). Then a plain torch.cuda.graph capture replayed with new slot values."""
    import molora.kernels.dispatch as dispatch
    linear_calls = []
    real_linear = lora_mod.stacked_linear_group
    monkeypatch.setattr(lora_mod, "stacked_linear_group", lambda *a, **kw: linear_calls.append(1) or real_linear(*a, **kw))
    gen = torch.Generator().manual_seed(10 * n + k)
    layers = [RoutedLoRALinear(torch.nn.Linear(256, o, bias=bias), 4, 16, name=f"blk.{nm}", block=0)
              for nm, o, bias in (("q_proj", 256, True), ("k_proj", 64, False), ("v_proj", 64, True))]
    group = group_projections(layers)[0]
    _fill_slots(layers, gen, 16)
    for layer in layers:
        layer.to("cuda", torch.bfloat16)
    x = torch.randn(1, n, 256, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.randint(-1, 4, (n, max(k, 1)), generator=gen).cuda()
    weights = torch.rand(n, max(k, 1), generator=gen).cuda()
    eager = n <= dispatch.EAGER_MAX_TOKENS
    assert (dispatch.choose_group_path(x.view(n, 256), max(k, 1), True, 4, 16, 3) == "fused") == eager
    assert dispatch.fuses_base(x.view(n, 256), 4, 16, 3) != eager

    def forward():
        routing = CallRouting(1, n, slots[:, 0], 4, k=max(k, 1))
        if k:  # learned routing's form: [N, k] slots and weights for the block
            routing.learned = [None]
            routing.block_slots = {0: (slots, weights)}
        token = set_routing(routing)
        try:
            return [layer(x) for layer in layers]
        finally:
            reset_routing(token)

    def errors(ys):
        out = []
        for layer, y in zip(layers, ys):
            want = F.linear(x, layer.weight, layer.bias).double().reshape(n, -1) + routed_lora_topk_reference(
                x.view(n, 256), layer.lora_A, layer.lora_B, slots, weights if k else torch.ones_like(weights),
                layer.lora_scale).double()
            err = ((y.double().reshape(n, -1) - want).abs().max() / want.abs().max()).item()
            if not (y.shape == (1, n, layer.out_features) and err <= 2e-2):
                out.append(f"{layer.name}: err {err:.2e} shape {tuple(y.shape)}")
        return out
    with torch.no_grad():
        for _ in range(3):  # the first call compiles, the next ones take the kept launcher's direct launch
            assert errors(forward()) == []
            slots.copy_(torch.randint(-1, 4, slots.shape, generator=gen).cuda())
        if eager:
            assert group._launches[None]._direct
        else:
            assert len(linear_calls) == 3 and not group._launches  # one call per group forward
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = forward()
        slots.copy_(torch.randint(-1, 4, slots.shape, generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert errors(captured) == []

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("names", [("o_proj",), ("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj")])
def test_cuda_captured_decode_calls_run_every_group_as_one_gemm_with_the_decode_tiles(names, monkeypatch):
    """A captured decode step (graph mode, 1..32 tokens, a row tile of 32 above 16) runs every routed group, one
    projection, two or three, as one GEMM with the deltas inside at the decode tiles (kernels/triton_linear.py
    DECODE_TILES, WIDE_DECODE_TILES); each member's output equals its base linear plus the reference delta,
    replayed with new slot values."""
    from molora.kernels.graphs import capture_graph

    linear_calls = []
    real_linear = lora_mod.stacked_linear_group
    monkeypatch.setattr(lora_mod, "stacked_linear_group", lambda *a, **kw: linear_calls.append(1) or real_linear(*a, **kw))
    gen = torch.Generator().manual_seed(len(names))
    widths = {"o_proj": 320, "gate_proj": 512, "up_proj": 512, "q_proj": 256, "k_proj": 64, "v_proj": 64}
    layers = [RoutedLoRALinear(torch.nn.Linear(384, widths[nm], bias=False), 4, 16, name=f"blk.{nm}", block=0)
              for nm in names]
    group_projections(layers)
    _fill_slots(layers, gen, 16)
    for layer in layers:
        layer.to("cuda", torch.bfloat16)
    for n in (1, 2, 16, 17, 32):
        x = torch.randn(1, n, 384, generator=gen).to("cuda", torch.bfloat16)
        slots = torch.randint(-1, 4, (n, 1), generator=gen).cuda()

        def forward(n=n, x=x, slots=slots):
            token = set_routing(CallRouting(1, n, slots[:, 0], 4))
            try:
                return [layer(x) for layer in layers]
            finally:
                reset_routing(token)
        linear_calls.clear()
        with torch.no_grad():
            graph, outputs = capture_graph(forward, warmup=2)
            slots.copy_(torch.randint(-1, 4, slots.shape, generator=gen).cuda())
            graph.replay()
            torch.cuda.synchronize()
        assert len(linear_calls) == 3  # two warm-up calls and the capture, one GEMM each
        for layer, y in zip(layers, outputs):
            want = F.linear(x, layer.weight).double().reshape(n, -1) + routed_lora_reference(
                x.view(n, 384), layer.lora_A, layer.lora_B, slots[:, 0], layer.lora_scale).double()
            err = ((y.double().reshape(n, -1) - want).abs().max() / want.abs().max()).item()
            assert y.shape == (1, n, layer.out_features) and err <= 2e-2, (layer.name, n, err)


def _fill_slots(layers, gen, a_div: float) -> None:
    """Random adapters in every slot of the layers: A ~ N(0, 1) / a_div, B ~ N(0, 1), scales in [0.5, 1.5)."""
    with torch.no_grad():
        for layer in layers:
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) / a_div)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen))
            layer.lora_scale.copy_(torch.rand(layer.num_slots, generator=gen) + 0.5)


def _group_errors(layers, xs, slots, dtype, tol, grad=False) -> list[str]:
    """Run the layers on inputs xs under one static routing (slots for 2x3 tokens); their outputs' problems."""
    ys = _run_layers(layers, xs, CallRouting(2, 3, slots, 3), grad)
    errors = []
    for layer, x, y in zip(layers, xs, ys):
        with torch.no_grad():
            want = F.linear(x, layer.weight, layer.bias).double().reshape(6, -1) + routed_lora_reference(
                x.reshape(6, 24), layer.lora_A, layer.lora_B, slots, layer.lora_scale).double()
        err = ((y.detach().double().reshape(6, -1) - want).abs().max() / want.abs().max()).item()
        if not (y.shape == (2, 3, layer.out_features) and y.dtype == dtype and err <= tol):
            errors.append(f"{layer.name}: err {err:.2e} shape {tuple(y.shape)} {y.dtype}")
    return errors


def _fused_group_interpreter_checks() -> list[str]:
    """The eager decode path of a group (routing/lora.py on the "fused" path: the members' base GEMMs into one
    buffer, the kept launcher adding every delta) against base + reference under the interpreter, fp32 / fp16,
    biases on some members: shared x; with grad enabled (deltas first, GEMMs onto them); members on different inputs
    (one kept launcher per member, reused by the next forward). Returns the failures (run by
    test_group_paths_under_the_interpreter)."""
    lora_mod.choose_group_path = lambda *a: "fused"  # what a CUDA decode call picks; the interpreter runs it
    fails = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
        gen = torch.Generator().manual_seed(5)
        layers = [RoutedLoRALinear(torch.nn.Linear(24, o, bias=bias).to(dtype), 3, 8, name=f"blk.{n}")
                  for n, o, bias in (("q_proj", 24, True), ("k_proj", 12, False), ("v_proj", 12, True))]
        group = group_projections(layers)[0]
        with torch.no_grad():
            for layer in layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / 5)
                layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) / 5)
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen))
                layer.lora_scale.copy_(torch.rand(3, generator=gen) + 0.5)
        slots = torch.tensor([0, 2, -1, 1, 1, 0])
        x = torch.randn(2, 3, 24, generator=gen).to(dtype)
        fails += [f"{dtype} shared: {e}" for e in _group_errors(layers, [x] * 3, slots, dtype, tol)]
        kept = group._launches.get(None)
        fails += [f"{dtype} shared again: {e}" for e in _group_errors(layers, [x] * 3, slots, dtype, tol)]
        fails += [f"{dtype} grad enabled: {e}" for e in _group_errors(layers, [x] * 3, slots, dtype, tol, grad=True)]
        if kept is None or group._launches.get(None) is not kept:
            fails.append(f"{dtype}: the group's launcher was not kept")
        apart = [torch.randn(2, 3, 24, generator=gen).to(dtype) for _ in layers]
        for i in range(3):  # the first forward finds out (q's call still ran the whole group), the next ones reuse
            fails += [f"{dtype} apart {i}: {e}" for e in _group_errors(layers, apart, slots, dtype, tol)]
            if i == 1:
                kept = dict(group._launches)
        if group.shares_input or set(kept) != {None, 0, 1, 2} or any(group._launches[p] is not kept[p] for p in kept):
            fails.append(f"{dtype}: members apart keep one launcher each: {sorted(map(str, kept))}")
    return fails


def _linear_group_interpreter_checks() -> list[str]:
    """The one-GEMM path of a group (routing/lora.py: kernels/triton_linear.py, what a CUDA call of 17..256 tokens
    takes) against base + reference under the interpreter, fp32 / fp16, biases on some members, static routing and
    top-2, one kernel call per group forward; with grad enabled the group call instead (no backward in the kernel).
    Returns the failures (run by test_group_paths_under_the_interpreter)."""
    calls = []
    real = lora_mod.stacked_linear_group
    lora_mod.fuses_base = lambda *a: True  # what a CUDA call of these sizes decides; the interpreter runs it
    lora_mod.stacked_linear_group = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    fails = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
        gen = torch.Generator().manual_seed(6)
        layers = [RoutedLoRALinear(torch.nn.Linear(24, o, bias=bias).to(dtype), 3, 8, name=f"blk.{n}", block=0)
                  for n, o, bias in (("q_proj", 40, True), ("k_proj", 12, False), ("v_proj", 12, True))]
        group_projections(layers)
        _fill_slots(layers, gen, 5)
        slots = torch.tensor([0, 2, -1, 1, 1, 0])
        x = torch.randn(2, 3, 24, generator=gen).to(dtype)
        calls.clear()
        fails += [f"{dtype} static: {e}" for e in _group_errors(layers, [x] * 3, slots, dtype, tol)]
        fails += [] if len(calls) == 1 else [f"{dtype}: {len(calls)} one-GEMM calls for one group forward"]
        fails += [f"{dtype} grad enabled: {e}" for e in _group_errors(layers, [x] * 3, slots, dtype, tol, grad=True)]
        fails += [] if len(calls) == 1 else [f"{dtype}: the one-GEMM path ran with grad enabled"]
        top2, weights = torch.randint(-1, 3, (6, 2), generator=gen), torch.rand(6, 2, generator=gen)
        routing = CallRouting(2, 3, top2[:, 0], 3, k=2)
        routing.learned = [None]
        routing.block_slots = {0: (top2, weights)}
        ys = _run_layers(layers, [x] * 3, routing)
        for layer, y in zip(layers, ys):
            want = F.linear(x, layer.weight, layer.bias).double().reshape(6, -1) + routed_lora_topk_reference(
                x.view(6, 24), layer.lora_A, layer.lora_B, top2, weights, layer.lora_scale).double()
            err = ((y.double().reshape(6, -1) - want).abs().max() / want.abs().max()).item()
            if not (y.shape == (2, 3, layer.out_features) and y.is_contiguous() and err <= tol):
                fails.append(f"{dtype} top-2 {layer.name}: err {err:.2e} shape {tuple(y.shape)}")
    return fails


@pytest.mark.parametrize("checks", ["_fused_group_interpreter_checks", "_linear_group_interpreter_checks"])
def test_group_paths_under_the_interpreter(checks):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    code = f"import json, tests.test_projection_groups as t; print('FAILS=' + json.dumps(t.{checks}()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("FAILS=")[-1]) == []
