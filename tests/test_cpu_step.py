"""The CPU engine's C decode step (kernels/decode_step.c, kernels/cpu_decode.py, models/engine/cpu_step.py):
against transformers' own forward of the same weights with each adapter merged in, on random tiny Llama and Qwen3
models; a row's numbers whatever rows share the step; the engine's requests equal to their solo runs, learned rows
beside C rows included; the learned decisions the C step makes against torch's gates, block by block; the checks that
keep bad indices and tables out of the C code; the fallbacks."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from molora.kernels import cpu_bf16, cpu_decode
from molora.models.engine.core import Engine, EngineConfig
from molora.models.engine.cpu_step import CpuStep, CpuStepError
from molora.models.engine.decoder import LeanDecoder
from molora.models.engine.generation import GenerationConfig, Request
from molora.models.engine.kv_cache import RowKVCache
from molora.models.engine.sampling import GenerationError, SamplingConfig
from molora.models.engine.synthetic import SHAPES, id_range_vocab, random_adapters
from molora.routing import LearnedGates, LearnedRouter, SequenceRouter, VocabRangeRouter, attach_routed_lora
from tests.test_engine import learned_batch, routed_tokens

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler with AVX-512 here")]

GREEDY = dict(text=SamplingConfig(0.0), image=SamplingConfig(0.0))
MAX_LEN = 48


def bf16_valued_model(architecture: str, seed: int = 0, adapters: tuple[str, ...] = ("a", "b"), **shape):
    """A tiny random model whose weights are all bfloat16 values (as the embedded checkpoint's), routed on all
    projections, `adapters` in its pool (one hot-set slot each, and one more); `shape` overrides SHAPES["tiny"]."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[architecture]
    model = model_class(config_class(**{**SHAPES["tiny"], **shape}, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.bfloat16().float())
        for norm in [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]:
            norm.weight.copy_((1 + 0.1 * torch.randn_like(norm.weight)).bfloat16().float())
    routed = attach_routed_lora(model, num_slots=len(adapters) + 1, r_max=8)
    for adapter in random_adapters(routed, list(adapters), rank=8, std=0.2):
        routed.add_adapter(adapter)
    vocab = id_range_vocab(model.config.vocab_size, image_size=64)
    return routed, vocab


def merged(routed, name: str):
    """A plain copy of the model with adapter `name` merged into its weights (the reference)."""
    plain = copy.deepcopy(routed.model)
    adapter = routed.cache.adapter(name)
    modules = dict(plain.named_modules())
    with torch.no_grad():
        for module, (a, b) in adapter.weights.items():
            modules[module].weight += adapter.scales[module] * (b @ a)
    return plain


def c_step(routed, rows: int = 4) -> CpuStep:
    routed.pack_exact_rows(2 ** 30)
    kv = RowKVCache.for_model(routed.model.config, rows + 1, MAX_LEN, dtype=torch.float32, device="cpu")
    step = CpuStep(LeanDecoder(routed.model, compile=False), kv, MAX_LEN)
    return step


def decode(step, feeds: list[tuple[list[int], int]], rows: list[int] | None = None) -> torch.Tensor:
    """Feed row i the ids feeds[i][0] one token a step with slot feeds[i][1]; logits [steps, rows, V] of `rows`."""
    n, steps = len(feeds), len(feeds[0][0])
    rows = list(range(n)) if rows is None else rows
    out = []
    for t in range(steps):
        logits = torch.full((n, step.vocab), float("nan"))
        step.run(torch.tensor(rows), torch.tensor([f[0][t] for f in feeds]), torch.full((n,), t),
                 torch.tensor([f[1] for f in feeds]), logits)
        out.append(logits[rows])
    return torch.stack(out)


# head_dim: one vector of 16; not a multiple of 16 (attention's plain loop); 9 vectors (two passes over the values)
@pytest.mark.parametrize("architecture,head_dim", [("llama", 16), ("qwen3", 16), ("llama", 24), ("qwen3", 144)])
def test_the_c_step_gives_transformers_logits_with_each_rows_adapter_merged(architecture, head_dim):
    routed, vocab = bf16_valued_model(architecture, head_dim=head_dim)
    step = c_step(routed)
    slots = dict(zip(["a", "b"], routed.cache.acquire(["a", "b"])))
    ids = torch.randint(5, vocab.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    got = decode(step, [(ids[0].tolist(), slots["a"]), (ids[1].tolist(), slots["b"]), (ids[2].tolist(), -1)])
    references = [merged(routed, "a"), merged(routed, "b"), routed.model]
    with torch.no_grad():
        for row, reference in enumerate(references):
            want = reference(input_ids=ids[row:row + 1]).logits[0]
            assert torch.allclose(got[:, row], want, rtol=1e-4, atol=1e-4), \
                f"row {row}: max error {(got[:, row] - want).abs().max():.2e}"
    # the K/V it wrote are the keys and values transformers' forward sees (here: the first layer's at position 3)
    assert torch.isfinite(step.kv.keys[0][:3, :, :20]).all() and step.kv.keys[0][3:].abs().sum() == 0


def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it():
    routed, vocab = bf16_valued_model("qwen3", seed=3)
    slots = routed.cache.acquire(["a", "b"])
    feeds = [(torch.randint(5, vocab.vocab_size, (12,), generator=torch.Generator().manual_seed(i)).tolist(),
              [slots[0], slots[1], -1, slots[0]][i]) for i in range(4)]
    together = decode(c_step(routed), feeds)
    for row in range(4):
        alone = decode(c_step(routed), [feeds[row]] * 4, rows=[row])  # in its own place, the other rows idle
        assert torch.equal(alone[:, 0], together[:, row])


def test_a_step_split_over_threads_gives_every_row_the_same_numbers(monkeypatch):
    """cpu_step_threads: a step's rows go in parts, one thread each; every row's logits and K/V are those of the
    whole step in one thread (bit for bit), with 2 or 3 parts, and a row given twice is refused. (Parts of one row
    and up here; the engine's are PART_MIN_ROWS rows or more.)"""
    monkeypatch.setattr(cpu_decode, "PART_MIN_ROWS", 1)
    routed, vocab = bf16_valued_model("qwen3", seed=5)
    slots = routed.cache.acquire(["a", "b"])
    feeds = [(torch.randint(5, vocab.vocab_size, (10,), generator=torch.Generator().manual_seed(i)).tolist(),
              [slots[0], slots[1], -1, slots[0]][i]) for i in range(4)]
    steps = {}
    for threads in (1, 2, 3):
        step = c_step(routed)
        step.threads = threads
        steps[threads] = (decode(step, feeds), [t.clone() for t in step.kv.keys + step.kv.values])
    for threads in (2, 3):
        assert torch.equal(steps[threads][0], steps[1][0])
        assert all(torch.equal(a, b) for a, b in zip(steps[threads][1], steps[1][1]))
    step = c_step(routed)
    step.threads = 2
    with pytest.raises(ValueError, match="appears twice"):
        step.run(torch.tensor([0, 0]), torch.full((4,), 7), torch.zeros(4, dtype=torch.long),
                 torch.full((4,), -1), torch.zeros(4, step.vocab))


def stream_all(engine, requests, configs):
    out: dict[int, list] = {}
    for index, item in engine.stream(requests, configs):
        if hasattr(item, "token"):
            out.setdefault(index, []).append((item.token, item.adapter))
    return [out.get(i, []) for i in range(len(requests))]


def test_the_engine_decodes_through_the_c_step_and_a_request_equals_its_solo_run(caplog):
    routed, vocab = bf16_valued_model("llama", seed=5)
    with caplog.at_level(logging.INFO, logger="molora.models.engine.core"):
        engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=96, max_rows=8))
        engine._setup()
    assert engine.cpu_step is not None
    assert any("through the C step" in r.getMessage() for r in caplog.records)
    g = torch.Generator().manual_seed(0)
    prompts = [[vocab.bos_id, *torch.randint(5, vocab.text_start + vocab.text_size, (n,), generator=g).tolist()]
               for n in (3, 7, 5, 9)]
    routers = [VocabRangeRouter(vocab, "a", "b"), SequenceRouter("b"), None, VocabRangeRouter(vocab, None, "a")]
    configs = [GenerationConfig(max_new_tokens=30, seed=i, cfg_scale=2.0 if i == 0 else 1.0,
                                text=SamplingConfig(0.9, top_k=20 if i == 1 else 0), image=SamplingConfig(1.1))
               for i in range(4)]
    requests = [Request(p, r) for p, r in zip(prompts, routers)]
    alone = [stream_all(engine, [r], [c])[0] for r, c in zip(requests, configs)]
    assert stream_all(engine, requests, configs) == alone
    # the C step against torch's step: the same greedy tokens (sums differ only by float32 rounding)
    greedy = GenerationConfig(max_new_tokens=24, seed=0, **GREEDY)
    torch_engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=96, max_rows=8, cpu_step=False))
    assert stream_all(engine, requests, [greedy] * 4) == stream_all(torch_engine, requests, [greedy] * 4)
    engine.close()
    torch_engine.close()


def test_learned_rows_decode_in_the_c_step_with_torchs_gates_and_every_row_equals_its_solo_run():
    routed, vocab = bf16_valued_model("llama", seed=6)
    torch.manual_seed(0)
    gates = LearnedGates.for_model(routed, ["a", "b"])
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=96, max_rows=8))
    prompts = [[vocab.bos_id, 9, 10, 11], [vocab.bos_id, 20, 21], [vocab.bos_id, 30]]
    requests = [Request(prompts[0], LearnedRouter(gates, top_k=2)),
                Request(prompts[1], VocabRangeRouter(vocab, "a", "b")), Request(prompts[2], None)]
    configs = [GenerationConfig(max_new_tokens=20, seed=i, **GREEDY) for i in range(3)]
    learned_alone = stream_all(engine, [requests[0]], [configs[0]])[0]
    alone = [learned_alone] + [stream_all(engine, [r], [c])[0] for r, c in zip(requests[1:], configs[1:])]
    engine._setup()
    served, run = [], engine.cpu_step.run
    engine.cpu_step.run = lambda rows, *args, learned=None, **kw: \
        served.append((rows.tolist(), learned is not None)) or run(rows, *args, learned=learned, **kw)
    assert stream_all(engine, requests, configs) == alone
    # the steps the three shared: every live row in one C call, the learned decision made in it
    assert any(learned and len(rows) >= 3 for rows, learned in served)
    # and the learned tokens report their top-2 adapters with weights, as torch's step does
    mixes = [item.mix for _, item in engine.stream([requests[0]], [configs[0]]) if hasattr(item, "mix")]
    assert mixes and all(1 <= len(mix) <= 2 and abs(sum(w for _, w in mix) - 1) < 1e-3 for mix in mixes[1:])
    torch_engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=96, max_rows=8, cpu_step=False))
    torch_learned = stream_all(torch_engine, [requests[0]], [configs[0]])[0]
    # the same greedy tokens and producing adapters as torch's step (the numbers differ by float32 rounding only)
    assert torch_learned == learned_alone
    engine.close()
    torch_engine.close()


def four_adapter_engines():
    """A bfloat16-valued model with adapters a-d, an engine on the C step and one on torch's step."""
    routed, vocab = bf16_valued_model("llama", seed=14, adapters=("a", "b", "c", "d"))
    config = dict(max_len=128, max_rows=8)
    return routed, vocab, Engine(routed, vocab, device="cpu", config=EngineConfig(**config)), \
        Engine(routed, vocab, device="cpu", config=EngineConfig(**config, cpu_step=False))


def recorded_decisions(engine) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], bool]]:
    """Every forward's learned decisions ([rows, blocks, k] slots and weights), routing states after it (as the
    engine keeps them: its _keep_pictures / _keep_states read them) and whether a row took a picture's held
    decision, recorded as the engine runs."""
    recorded, keep = [], engine._keep_pictures

    def record(plan, cache_rows):
        if plan is not None and plan.block_slots:
            slots, weights = (torch.stack([pair[i] for pair in plan.block_slots.values()], 1).clone() for i in (0, 1))
            states = [g.state_out.clone() for g in plan.learned if g.gates.context_decays]
            held = any(bool(g.held[2].any()) for g in plan.learned if g.held is not None)
            recorded.append((slots, weights, states, held))
        keep(plan, cache_rows)

    engine._keep_pictures = record
    return recorded


def test_the_c_steps_learned_decisions_equal_torchs_gates_block_by_block():
    """Text gates with a routing state (top-2), per-picture image gates with held decisions (top-1), a guided
    twin and a second router's plain top-1 gates: every decode step's decisions made in C are torch's
    (LearnedGroup.decide on torch's block inputs): the same slots in every block, the weights and routing states
    within float32 rounding. (One request at a time: both engines then run the same forwards.)"""
    routed, vocab, engine, torch_engine = four_adapter_engines()
    requests, configs = learned_batch(routed, vocab)
    got, want = recorded_decisions(engine), recorded_decisions(torch_engine)
    for request, config in zip(requests[:3], configs[:3]):  # the learned ones
        before = len(got)
        assert routed_tokens(engine, [request], [config]) == routed_tokens(torch_engine, [request], [config])
        assert len(got) == len(want) > before
    for (slots, weights, states, held), (want_slots, want_weights, want_states, want_held) in zip(got, want):
        assert torch.equal(slots, want_slots) and held == want_held
        torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=0)
        for state, want_state in zip(states, want_states, strict=True):
            torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    # the decisions vary: several adapters chosen, both columns of the top-2 used, pictures' decisions held
    first = torch.cat([slots[..., 0].reshape(-1) for slots, _, _, _ in got])
    assert len(got) > 60 and len(set(first.tolist()) - {-1}) >= 3
    assert any((slots[..., 1] >= 0).any() for slots, _, _, _ in got if slots.shape[-1] == 2)
    assert any(held for _, _, _, held in got)
    engine.close()
    torch_engine.close()


def test_learned_requests_in_the_c_step_equal_their_solo_runs_and_torchs_greedy_tokens():
    routed, vocab, engine, torch_engine = four_adapter_engines()
    requests, configs = learned_batch(routed, vocab)
    engine._setup()
    decided = []
    run = engine.cpu_step.run
    engine.cpu_step.run = lambda *args, learned=None, **kw: \
        decided.append(learned is not None) or run(*args, learned=learned, **kw)
    alone = [routed_tokens(engine, [r], [c])[0] for r, c in zip(requests, configs)]
    together = routed_tokens(engine, requests, configs)
    assert together == alone  # tokens, adapters and top-k mixes
    assert any(decided) and {a for row in alone[:3] for _, a, _ in row} >= {"a", "b", "c"}
    assert any(len(mix) == 2 for _, _, mix in alone[0])  # the top-2 rows report both adapters they mix
    # torch's step: the same greedy tokens and producing adapters (the mixes' weights may differ by rounding)
    assert [[(t, a) for t, a, _ in row] for row in together] == \
        [[(t, a) for t, a, _ in row] for row in routed_tokens(torch_engine, requests, configs)]
    engine.close()
    torch_engine.close()


def test_learned_and_static_rows_give_the_same_tokens_and_mixes_whatever_the_threads(monkeypatch):
    """Learned rows (text gates with a routing state, image gates holding a picture's decision, a guided twin)
    beside static ones, their steps in up to three parts: every request's tokens, adapters and top-k mixes are
    those of the step in one thread."""
    monkeypatch.setattr(cpu_decode, "PART_MIN_ROWS", 1)
    calls = []
    real_pool = cpu_decode._pool
    monkeypatch.setattr(cpu_decode, "_pool", lambda workers, pid: calls.append(workers) or real_pool(workers, pid))
    routed, vocab, *engines = four_adapter_engines()
    for engine in engines:
        engine.close()
    requests, configs = learned_batch(routed, vocab)
    runs = []
    for threads in (1, 3):
        engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128, max_rows=8,
                                                                         cpu_step_threads=threads))
        runs.append(routed_tokens(engine, requests, configs))
        engine.close()
    assert 2 in calls  # steps in three parts
    assert runs[0] == runs[1] and all(len(tokens) > 5 for tokens in runs[0])
    with pytest.raises(GenerationError, match="cpu_step_threads"):
        Engine(routed, vocab, device="cpu", config=EngineConfig(cpu_step_threads=0))


def test_exactly_equal_gate_logits_pick_the_same_adapters_in_the_c_step_and_torchs_step():
    """Zero gate rows tie exactly (as an adapter added to trained gates starts): both steps take the lowest expert
    (decision.top_k_first), so they mix the same adapters."""
    routed, vocab, engine, torch_engine = four_adapter_engines()
    torch.manual_seed(3)
    gates = LearnedGates.for_model(routed, ["a", "b", "c"], base_expert=True, context_decays=(0.5,), init_std=1.0)
    with torch.no_grad():
        for gate in gates.gates:
            gate.weight[:2] = 0.0  # a and b: logit 0 at every position; c and the base expert random
    router = LearnedRouter(gates, top_k=2, vocab=vocab)
    requests = [Request([vocab.bos_id, 20 + i, 30 + i], router) for i in range(3)]
    configs = [GenerationConfig(max_new_tokens=16, seed=0, cfg_scale=1.0, **GREEDY)] * 3
    got = routed_tokens(engine, requests, configs)
    assert engine.cpu_step is not None
    assert any(mix and mix[0][0] == "a" for row in got for _, _, mix in row)  # the tie decided
    want = routed_tokens(torch_engine, requests, configs)
    assert [[(t, a, [n for n, _ in mix]) for t, a, mix in row] for row in got] == \
        [[(t, a, [n for n, _ in mix]) for t, a, mix in row] for row in want]
    engine.close()
    torch_engine.close()


def test_gates_the_c_step_cannot_decide_take_torchs_step_with_the_reason_logged_once(caplog):
    routed, vocab, engine, torch_engine = four_adapter_engines()
    requests, configs = learned_batch(routed, vocab)
    requests[2].router.gates.to(torch.float64)  # the second router's gates: not float32
    with caplog.at_level(logging.INFO, logger="molora.models.engine.cpu_step"):
        got = routed_tokens(engine, requests, configs)
    lines = [r.getMessage() for r in caplog.records if "cannot make a learned router's decisions" in r.getMessage()]
    assert len(lines) == 1 and "float32 on the CPU" in lines[0]
    assert engine.cpu_step is not None  # the other steps keep the C step
    assert [[(t, a) for t, a, _ in row] for row in got] == \
        [[(t, a) for t, a, _ in row] for row in routed_tokens(torch_engine, requests, configs)]
    engine.close()
    torch_engine.close()


def test_models_the_c_step_cannot_run_keep_torchs_step_with_the_reason_logged(caplog):
    routed, vocab = bf16_valued_model("llama", seed=7)
    with torch.no_grad():
        routed.model.model.layers[1].mlp.down_proj.weight.add_(1e-3)  # no longer bfloat16 values
    with caplog.at_level(logging.INFO, logger="molora.models.engine.core"):
        engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64, max_rows=4))
        engine._setup()
    assert engine.cpu_step is None
    lines = [r.getMessage() for r in caplog.records if "C step cannot run" in r.getMessage()]
    assert len(lines) == 1 and "block 1's down_proj" in lines[0] and "bfloat16" in lines[0]
    assert solo_tokens(engine, vocab)
    engine.close()
    decoder = LeanDecoder(routed.model)
    decoder.base.rotary_emb.rope_type = "dynamic"  # frequencies that depend on a call's longest position
    assert "rope type 'dynamic'" in CpuStep.unsupported(decoder, engine.kv)
    decoder.base.rotary_emb.rope_type = "default"
    with caplog.at_level(logging.INFO, logger="molora.models.engine.core"):
        off = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64, max_rows=4, cpu_step=False))
        off._setup()
    assert off.cpu_step is None
    off.close()


def solo_tokens(engine, vocab):
    return stream_all(engine, [Request([vocab.bos_id, 7, 8])], [GenerationConfig(max_new_tokens=5, **GREEDY)])[0]


def test_without_a_built_library_the_engine_keeps_torchs_step(monkeypatch):
    routed, vocab = bf16_valued_model("llama", seed=8)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_bf16.library.cache_clear()
    try:
        assert CpuStep.unsupported(LeanDecoder(routed.model), None) == \
            "the C library is not built here (kernels/cpu_bf16.py logged why)"
        engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64, max_rows=4))
        engine._setup()
        assert engine.cpu_step is None and solo_tokens(engine, vocab)
        engine.close()
    finally:
        cpu_bf16.library.cache_clear()


def test_a_weight_written_in_place_is_read_at_its_new_values():
    routed, vocab = bf16_valued_model("qwen3", seed=9)
    step = c_step(routed)
    feeds = [([7, 8, 9], -1)]
    before = decode(step, feeds)
    with torch.no_grad():
        routed.model.lm_head.weight.mul_(2)  # the head's bfloat16 copy is made again
        routed.model.model.layers[0].self_attn.q_proj.weight.mul_(0.5)  # and the group's (exact_rows_weight)
    after = decode(step, feeds)
    with torch.no_grad():
        want = routed.model(input_ids=torch.tensor([[7, 8, 9]])).logits[0]
    assert not torch.allclose(before, after)
    assert torch.allclose(after[:, 0], want, rtol=1e-4, atol=1e-4)


def test_a_replaced_module_is_read_at_its_new_weights():
    routed, _ = bf16_valued_model("llama", seed=11)
    step = c_step(routed)
    decode(step, [([7, 8, 9], -1)])
    block = routed.model.model.layers[0]
    replacement = copy.deepcopy(block.input_layernorm)
    with torch.no_grad():
        replacement.weight.mul_(-1)
    block.input_layernorm = replacement
    with torch.no_grad():
        want = routed.model(input_ids=torch.tensor([[7, 8, 9]])).logits[0]
    assert torch.allclose(decode(step, [([7, 8, 9], -1)])[:, 0], want, rtol=1e-4, atol=1e-4)


def test_a_model_that_stops_fitting_the_c_step_is_refused_every_time_and_the_engine_goes_back_to_torch(caplog):
    routed, vocab = bf16_valued_model("llama", seed=12)
    step = c_step(routed)
    with torch.no_grad():
        routed.model.lm_head.weight.add_(1e-3)  # no longer bfloat16 values: no copy for the C step
    for _ in range(2):  # (never the table made before the write)
        with pytest.raises(CpuStepError, match="no longer all bfloat16"):
            decode(step, [([7, 8], -1)])
    with torch.no_grad():
        routed.model.lm_head.weight.sub_(1e-3).copy_(routed.model.lm_head.weight.bfloat16().float())
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64, max_rows=4))
    engine._setup()
    assert engine.cpu_step is not None
    with torch.no_grad():
        routed.model.lm_head.weight.add_(1e-3)
    with caplog.at_level(logging.WARNING, logger="molora.models.engine.core"):
        got = solo_tokens(engine, vocab)
    assert engine.cpu_step is None
    assert any("cannot run the model any more" in r.getMessage() for r in caplog.records)
    torch_engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64, max_rows=4, cpu_step=False))
    assert got == solo_tokens(torch_engine, vocab)  # the steps after the change are torch's
    engine.close()
    torch_engine.close()


def test_bad_indices_and_tables_are_refused_before_the_c_code_runs():
    routed, vocab = bf16_valued_model("llama", seed=10)
    step = c_step(routed, rows=4)
    ok = dict(rows=torch.tensor([0, 1]), ids=torch.tensor([7, 8]), positions=torch.tensor([0, 0]),
              slots=torch.tensor([-1, -1]), logits=torch.zeros(2, step.vocab))
    step.run(**ok)
    for field, value, message in (("ids", torch.tensor([7, vocab.vocab_size]), "ids must lie in"),
                                  ("positions", torch.tensor([0, MAX_LEN]), "positions must lie in"),
                                  ("slots", torch.tensor([-1, 3]), "slots must lie in"),
                                  ("rows", torch.tensor([0, 2]), "rows must lie in"),
                                  ("ids", torch.tensor([7, 8], dtype=torch.int32), "int64"),
                                  ("logits", torch.zeros(2, step.vocab + 1), "logits"),
                                  ("logits", torch.zeros(2, step.vocab).double(), "logits")):
        before = [k.clone() for k in step.kv.keys]
        with pytest.raises(ValueError, match=message):
            step.run(**{**ok, field: value})
        assert all(torch.equal(a, b) for a, b in zip(before, step.kv.keys))  # nothing was written
    learned_tables_are_checked(step, ok, routed)
    weights = step.table()
    with pytest.raises(ValueError, match="tensor 1: expected a contiguous CPU torch.float32"):
        cpu_decode.StepWeights(weights.dims, 1e-6, 0.25, [weights.tensors[0], weights.tensors[1][:-1],
                                                          *weights.tensors[2:]])
    with pytest.raises(ValueError, match="tensors for"):
        cpu_decode.StepWeights(weights.dims, 1e-6, 0.25, weights.tensors[:-1])


def learned_tables_are_checked(step, ok, routed):
    """Each table of a LearnedStep is checked (dtype, shape, values) before the C code runs: nothing is written."""
    width, blocks, d = 2, len(step.decoder.blocks), step.d
    gates = LearnedGates.for_model(routed, ["a", "b"], context_decays=(0.5,))

    def gate_set(**changes):
        fields = dict(top_k=2, expert_slots=torch.tensor([0, 1]), weights=[g.weight for g in gates.gates],
                      gated=torch.ones(width, dtype=torch.bool), decays=(0.5,),
                      updates=torch.ones(width, dtype=torch.bool), state_in=torch.zeros(width, 1, d),
                      state_out=torch.zeros(width, 1, d),
                      held=(torch.zeros(width, blocks, 2, dtype=torch.long), torch.zeros(width, blocks, 2),
                            torch.zeros(width, dtype=torch.bool)))
        return cpu_decode.GateSet(**{**fields, **changes})

    def learned(sets, k=2, slots=None):
        return cpu_decode.LearnedStep(sets, torch.full((width, blocks, k), -1) if slots is None else slots,
                                      torch.zeros(width, blocks, k))

    step.run(**ok, learned=learned([gate_set()]))
    # a row the step does not compute (padding): its decisions and routing state are left as they are
    skipped = gate_set(state_out=torch.full((width, 1, d), 5.0))
    decided = learned([skipped], slots=torch.full((width, blocks, 2), -7))
    step.run(**{**ok, "rows": torch.tensor([0])}, learned=decided)
    assert (decided.slots[1] == -7).all() and (decided.slots[0] != -7).all()
    assert (skipped.state_out[1] == 5.0).all() and not (skipped.state_out[0] == 5.0).all()
    for bad, message in ((learned([gate_set(expert_slots=torch.tensor([0, 4]))]), "expert_slots must lie in"),
                         (learned([gate_set(top_k=3)]), "top_k 3 must lie in"),
                         (learned([gate_set()], k=1), "top_k 2 must lie in"),
                         (learned([gate_set(weights=[g.weight for g in gates.gates][1:])]), "gate weights for"),
                         (learned([gate_set(weights=[g.weight.double() for g in gates.gates])]), "weight 0"),
                         (learned([gate_set(weights=[g.weight[:, :d] for g in gates.gates])]), "weight 0"),
                         (learned([gate_set(gated=torch.ones(width + 1, dtype=torch.bool))]), "gated"),
                         (learned([gate_set(state_in=None)]), "state_in"),
                         (learned([gate_set(state_out=torch.zeros(width, 2, d))]), "state_out"),
                         (learned([gate_set(held=(torch.full((width, blocks, 2), 5), torch.zeros(width, blocks, 2),
                                                  torch.zeros(width, dtype=torch.bool)))]), "held slots must lie in"),
                         (learned([gate_set(updates=torch.ones(width + 1, dtype=torch.bool))]), "updates"),
                         (learned([gate_set(held=(torch.zeros(width, blocks, 2, dtype=torch.long),
                                                  torch.zeros(width, blocks, 2).double(),
                                                  torch.zeros(width, dtype=torch.bool)))]), "held weights"),
                         (learned([gate_set(held=(torch.zeros(width, blocks, 2, dtype=torch.long),
                                                  torch.zeros(width, blocks, 2),
                                                  torch.zeros(width + 1, dtype=torch.bool)))]), "held use"),
                         (learned([]), "one gate set or more"),
                         (learned([gate_set()], slots=torch.full((width, blocks, 2), -1, dtype=torch.int32)),
                          "learned slots")):
        before = [k.clone() for k in step.kv.keys]
        with pytest.raises(ValueError, match=message):
            step.run(**ok, learned=bad)
        assert all(torch.equal(a, b) for a, b in zip(before, step.kv.keys))


def test_the_portable_build_without_avx512_gives_the_same_answers_within_rounding(monkeypatch):
    """vec16.h's plain-loop lanes (AVX2, NEON, ...): built here with AVX-512 turned off."""
    monkeypatch.setenv("CC", "cc -mno-avx512f")
    cpu_bf16.library.cache_clear()
    try:
        if cpu_bf16.library() is None:
            pytest.skip("this compiler does not take -mno-avx512f")
        routed, vocab = bf16_valued_model("qwen3", seed=13)
        slots = dict(zip(["a", "b"], routed.cache.acquire(["a", "b"])))
        ids = torch.randint(5, vocab.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
        feeds = [(ids[0].tolist(), slots["a"]), (ids[1].tolist(), -1)]
        together = decode(c_step(routed), feeds)
        with torch.no_grad():
            for row, reference in enumerate([merged(routed, "a"), routed.model]):
                want = reference(input_ids=ids[row:row + 1]).logits[0]
                assert torch.allclose(together[:, row], want, rtol=1e-4, atol=1e-4)
        alone = decode(c_step(routed), [feeds[0]] * 2, rows=[0])
        assert torch.equal(alone[:, 0], together[:, 0])
        # learned rows decided by the portable build: torch's gates' tokens and adapters
        routed, vocab, engine, torch_engine = four_adapter_engines()
        requests, configs = learned_batch(routed, vocab)
        tokens = routed_tokens(engine, requests[:2], configs[:2])
        assert engine.cpu_step is not None
        assert [[(t, a) for t, a, _ in row] for row in tokens] == \
            [[(t, a) for t, a, _ in row] for row in routed_tokens(torch_engine, requests[:2], configs[:2])]
        engine.close()
        torch_engine.close()
    finally:
        cpu_bf16.library.cache_clear()
