"""The compiled decision of a learned decode step (routing/decision.py): the same slots and weights as the eager
LearnedGroup.decide, block after block, for text gates with a routing state, plain gates and per-picture image gates
with held decisions; one compiled call per gate set and block and no other tensor work in the block; and, through
inductor's CPU backend, the serving engine's learned rows decode to the same tokens, adapters and mixes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from molora.models.engine.core import Engine, EngineConfig
from molora.models.engine.synthetic import id_range_vocab, random_adapters, random_routed_model
from molora.routing import LearnedGates, LearnedRouter, decision
from molora.routing.context import CallRouting
from molora.routing.routers import LearnedGroup
from tests.test_engine import learned_batch, routed_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, BLOCKS, ROWS = 32, 3, 6
SLOT_OF = {"a": 0, "b": 1, "c": 2, "d": 3}


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Decode-step decisions on the CPU take the compiled path (fresh compiled functions, no earlier failure)."""
    monkeypatch.setattr(decision, "COMPILED_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(decision, "_compiled", {})
    monkeypatch.setattr(decision, "_failed", False)


@pytest.fixture
def uncompiled(compiled_on_cpu, monkeypatch):
    """... with the compiled functions run as plain Python (the math alone, quick)."""
    monkeypatch.setattr(decision, "_compile", lambda fn, name: fn)


def routers():
    torch.manual_seed(0)
    vocab = id_range_vocab(512, image_size=64)
    first = LearnedRouter(LearnedGates(D, ["a", "b"], BLOCKS, base_expert=True, context_decays=(0.5, 0.9), init_std=1.0),
                          top_k=2, vocab=vocab,
                          image_gates=LearnedGates(D, ["c", "d"], BLOCKS, base_expert=True, context_decays=(0.7,),
                                                   init_std=1.0), image_top_k=1)
    second = LearnedRouter(LearnedGates(D, ["b", "c", "d"], BLOCKS, init_std=1.0), top_k=1)
    return vocab, first, second


def decode_routing(seed: int) -> tuple[CallRouting, list[torch.Tensor]]:
    """A decode step's routing as the engine builds it (every group covers all rows, members by mask; held picture
    decisions; routing states carried in), and the blocks' inputs."""
    vocab, first, second = routers()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab.text_start, vocab.vocab_size, (ROWS, 1), generator=g)  # some text, some image codes
    member = torch.tensor([True, True, True, False, False, True])
    groups = []
    for router, rows in ((first, member), (second, ~member)):
        groups += LearnedGroup.for_router(router, None, ids, SLOT_OF, "cpu", member=rows)
    for group in groups:
        if group.gates.context_decays:
            group.state_in = torch.randn(ROWS, len(group.gates.context_decays), D, generator=g)
        if group.per_picture:
            held = torch.randint(-1, 4, (ROWS, BLOCKS, 1), generator=g), torch.rand(ROWS, BLOCKS, 1, generator=g)
            group.held = (*held, torch.tensor([[True], [False], [True], [False], [False], [False]]) & group.gated)
    static = torch.tensor([2, -1, 0, 1, -1, 3])
    routing = CallRouting(ROWS, 1, static, 4, learned=groups, k=2)
    hidden = [torch.randn(ROWS, 1, D, generator=g) for _ in range(BLOCKS)]
    return routing, hidden


def route_all(seed: int) -> CallRouting:
    routing, hidden = decode_routing(seed)
    with torch.no_grad():
        for block, h in enumerate(hidden):
            routing.route_block(block, h)
    return routing


def assert_same_decisions(got: CallRouting, want: CallRouting, atol: float) -> None:
    for block in range(BLOCKS):
        (slots, weights), (slots2, weights2) = got.block_slots[block], want.block_slots[block]
        assert torch.equal(slots, slots2), block
        torch.testing.assert_close(weights, weights2, atol=atol, rtol=0)
        for (_, mine), (_, theirs) in zip(got.decisions[block], want.decisions[block]):
            assert torch.equal(mine.topk, theirs.topk) and torch.equal(mine.mask, theirs.mask)
            torch.testing.assert_close(mine.logits, theirs.logits, atol=atol, rtol=0)
    for mine, theirs in zip(got.learned, want.learned):
        if mine.gates.context_decays:
            torch.testing.assert_close(mine.state_out, theirs.state_out, atol=atol, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_decision_math_equals_eager_decide(uncompiled, monkeypatch, seed):
    """Text gates with a routing state (top-2), per-picture image gates with held decisions (top-1, padded to 2)
    and a second router's plain gates, side by side: the compiled path's math gives the eager decide's slots,
    experts and logits, and its routing state, block after block."""
    got = route_all(seed)
    assert all(len(got.decisions[b]) == 3 for b in range(BLOCKS))
    monkeypatch.setattr(decision, "COMPILED_DEVICES", set())
    want = route_all(seed)
    assert_same_decisions(got, want, atol=1e-5)
    # the decisions vary: several slots chosen, static slots kept on rows no gate routes
    slots = torch.cat([got.block_slots[b][0] for b in range(BLOCKS)])
    assert len(set(slots[:, 0].tolist())) >= 3 and (slots[:, 1] == -1).any()


def test_decode_block_is_one_compiled_call_per_gate_set(uncompiled, monkeypatch):
    """The kernels of a learned block: after block 0 (which also steps the routing state) a decode step's block
    is one compiled call per gate set and no other tensor work (no clone of the static tables, no copies): only
    views outside the compiled function. The eager decide takes over a dozen ops per gate set and block."""
    calls = {"fused": 0}
    inside = [False]

    def counted(compiled):
        def call(*args):
            calls["fused"] += 1
            inside[0] = True
            try:
                return compiled(*args)
            finally:
                inside[0] = False
        return call

    decider = decision.decider
    monkeypatch.setattr(decision, "decider", lambda *a: counted(decider(*a)))

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and not func.is_view:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    routing, hidden = decode_routing(0)
    with torch.no_grad():
        routing.route_block(0, hidden[0])
        outside = Count()
        with outside:
            for block in range(1, BLOCKS):
                routing.route_block(block, hidden[block])
    assert outside.ops == []
    assert calls["fused"] == 3 * BLOCKS

    monkeypatch.setattr(decision, "COMPILED_DEVICES", set())
    routing, hidden = decode_routing(0)
    with torch.no_grad():
        routing.route_block(0, hidden[0])
        eager = Count()
        with eager:
            routing.route_block(1, hidden[1])
    assert len(eager.ops) >= 12 * 3


def test_training_and_picture_prefills_keep_the_eager_decide(uncompiled):
    """Calls without autograd over every row take the compiled decision, decode steps and prefills alike; training
    keeps the eager decide, and so does a prefill's per-picture gate set (its positions take the decision of their
    picture's anchor)."""
    routing, hidden = decode_routing(0)
    group = routing.learned[0]
    assert group.fuses(hidden[0]) is False  # gradients enabled (training)
    with torch.no_grad():
        assert group.fuses(hidden[0])
        routing, hidden = prefill_routing(0)
        assert [g.fuses(hidden[0]) for g in routing.learned] == [True, False, True]
        assert routing.learned[1].per_picture and routing.learned[1].anchor is not None


def prefill_routing(seed: int, positions: int = 5, device: str = "cpu") -> tuple[CallRouting, list[torch.Tensor]]:
    """A captured prefill's routing as the engine builds it (every group covers all rows, members by mask, several
    positions a row, routing states carried in for some rows' routers), and the blocks' inputs."""
    vocab, first, second = routers()
    for gates in (first.gates, first.image_gates, second.gates):
        gates.to(device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab.text_start, vocab.vocab_size, (ROWS, positions), generator=g).to(device)
    member = torch.tensor([True, False, True, False, True, True], device=device)
    groups = []
    for router, rows in ((first, member), (second, ~member)):
        groups += LearnedGroup.for_router(router, None, ids, SLOT_OF, device, member=rows)
    groups[0].state_in = torch.randn(ROWS, len(groups[0].gates.context_decays), D, generator=g).to(device)
    static = torch.randint(-1, 4, (ROWS * positions,), generator=g).to(device)
    routing = CallRouting(ROWS, positions, static, 4, learned=groups, k=2)
    hidden = [torch.randn(ROWS, positions, D, generator=g).to(device) for _ in range(BLOCKS)]
    return routing, hidden


def prefill_decisions_alike(seed: int, device: str, monkeypatch, atol: float) -> None:
    """A prefill's positions decided as rows of the compiled decision (text gates with a routing state carried in,
    a second router's plain gates; the image gates' anchored positions eagerly) give the eager decide's slots,
    experts and logits block after block, and the routing state after the last position."""
    def route(routing, hidden):
        with torch.no_grad():
            for block, h in enumerate(hidden):
                routing.route_block(block, h)
        return routing

    got = route(*prefill_routing(seed, device=device))
    monkeypatch.setattr(decision, "COMPILED_DEVICES", set())
    want = route(*prefill_routing(seed, device=device))
    assert_same_decisions(got, want, atol=atol)
    slots = torch.cat([got.block_slots[b][0].reshape(-1, 2) for b in range(BLOCKS)])
    assert len(set(slots[:, 0].tolist())) >= 3 and (slots[:, 1] >= 0).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_decision_math_equals_eager_decide(uncompiled, monkeypatch, seed):
    prefill_decisions_alike(seed, "cpu", monkeypatch, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefill_one_launch_decision_equals_eager_decide(monkeypatch):
    """The same on CUDA, where the compiled decision is the one-launch Triton kernel (a captured prefill's)."""
    monkeypatch.setattr(decision, "_failed", False)
    for seed in (0, 1):
        prefill_decisions_alike(seed, "cuda", monkeypatch, atol=1e-4)
        monkeypatch.setattr(decision, "COMPILED_DEVICES", {"cuda"})


def test_a_failing_compiler_falls_back_to_the_eager_decide(compiled_on_cpu, monkeypatch, caplog):
    def broken(fn, name):
        def fail(*args):
            raise RuntimeError("no compiler here")
        return fail
    monkeypatch.setattr(decision, "_compile", broken)
    got = route_all(0)
    assert decision._failed and "deciding eagerly" in caplog.text
    monkeypatch.setattr(decision, "COMPILED_DEVICES", set())
    assert_same_decisions(got, route_all(0), atol=0)


def test_engine_learned_rows_decode_alike_with_compiled_decisions(compiled_on_cpu, monkeypatch):
    """Inductor's CPU backend compiles the decisions of the engine's decode steps (two learned routers, image gates
    inside a picture, a guided row): tokens, adapters and top-k mixes equal the eager decide's."""
    routed, vocab = random_routed_model("tiny", device="cpu", dtype=torch.float32, num_slots=4, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c", "d"], std=0.2):
        routed.add_adapter(adapter)
    requests, configs = learned_batch(routed, vocab)
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    got = routed_tokens(engine, requests, configs)
    assert not decision._failed and decision._compiled
    monkeypatch.setattr(decision, "COMPILED_DEVICES", set())
    assert got == routed_tokens(engine, requests, configs)


def decision_fails(device: str) -> list[str]:
    """Where the one-launch decision (kernels/triton_decision.py) and block_decision's torch math differ on
    `device`: routing states or none, top-1/2/3 padded to k_max, held picture decisions read through a strided
    view, another gate set's decision or the static slot, float32 and float16 gate weights, two experts with equal
    gate rows (the lowest index wins on both sides); each with the kernel's tile (_TILE) as shipped (one tile of
    all parts), at 1024 (groups of two parts) and at 64 (one part at a time, its width in two passes)."""
    from molora.kernels import triton_decision

    fails = []
    shipped_tile = triton_decision._TILE
    cases = [(tile, *case) for tile in (shipped_tile, 1024, 64) for case in enumerate([
            (2, 2, 2, False, False, torch.float32), (2, 2, 3, True, True, torch.float32),
            (0, 1, 2, False, True, torch.float32), (1, 1, 1, True, False, torch.float16),
            (2, 2, 2, False, True, torch.float16), (0, 3, 4, True, False, torch.float32)])]
    for tile, case, (parts, k, k_max, old, held, dtype) in cases:
        g = torch.Generator().manual_seed(case)
        n, d, experts, blocks = 7, 40, 5, 3
        hidden = torch.randn(n, d, generator=g).to(torch.float16)
        state = torch.randn(n, parts, d, generator=g) * 3 if parts else None
        weight = torch.randn(experts, (parts + 1) * d, generator=g).to(dtype)
        if case == 0:  # exact ties: two experts with the same gate row
            weight[3] = weight[1]
        expert_slots = torch.tensor([2, 0, 3, 1, -1])
        gated = torch.rand(n, generator=g) < 0.7
        old_slots = torch.randint(-1, 4, (n, k_max), generator=g) if old else None
        old_weights = torch.rand(n, k_max, generator=g) if old else None
        static = torch.randint(-1, 4, (n,), generator=g)
        held_slots = torch.randint(-1, 4, (n, blocks, k), generator=g)[:, 1] if held else None  # a strided view
        held_weights = torch.rand(n, blocks, k, generator=g)[:, 1] if held else None
        held_use = (torch.rand(n, 1, generator=g) < 0.5) if held else None
        tensors = [None if t is None else t.to(device) for t in (hidden, state, weight, expert_slots, gated, old_slots,
                                                                 old_weights, static, held_slots, held_weights,
                                                                 held_use)]
        triton_decision._TILE = tile
        try:
            got = triton_decision.learned_decision(*tensors, k, k_max)
        finally:
            triton_decision._TILE = shipped_tile
        want = decision.block_decision(*tensors, k, k_max)
        for name, a, b in zip(("slots", "weights", "logits", "top"), got, want):
            same = torch.equal(a, b) if name in ("slots", "top") else torch.allclose(a, b, atol=2e-5, rtol=1e-5)
            if a.dtype != b.dtype or a.shape != b.shape or not same:
                fails.append(f"tile {tile} case {case} {name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}: {a} vs {b}")
    return fails


def test_one_launch_decision_equals_block_decision_in_the_interpreter():
    """decision_fails on the CPU under the Triton interpreter (a child process: triton reads TRITON_INTERPRET when
    the kernels are first imported)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "import json; from tests.test_learned_decision import decision_fails; print('FAILS=' + json.dumps(decision_fails('cpu')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("FAILS=")[-1]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_launch_decision_equals_block_decision():
    assert decision_fails("cuda") == []
