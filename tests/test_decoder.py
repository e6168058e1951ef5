"""The engine's LeanDecoder: the same logits as transformers' own forward of the same routed model (Qwen3 with q/k
norms and grouped KV heads, Llama), prefill and decode through the engine's RowKVCache; the engine gives the same
tokens with it as with transformers' forward, learned rows included; models it cannot run keep transformers' forward."""

from __future__ import annotations

import pytest
import torch

from molora.models.engine.core import Engine, EngineConfig, Token
from molora.models.engine.decoder import LeanDecoder
from molora.models.engine.generation import GenerationConfig, Request
from molora.models.engine.kv_cache import RowKVCache
from molora.models.engine.sampling import SamplingConfig
from molora.models.engine.synthetic import random_adapters, random_routed_model
from molora.routing import LearnedGates, LearnedRouter, VocabRangeRouter, attach_routed_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(text=SamplingConfig(0.0), image=SamplingConfig(0.0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=300, max_position_embeddings=128,
                         attn_implementation="sdpa")
    torch.manual_seed(1)
    return attach_routed_lora(LlamaForCausalLM(config).eval(), num_slots=2, r_max=8)


def _qwen3():
    routed, _ = random_routed_model("tiny", device="cpu", dtype=torch.float32, num_slots=2, r_max=8)
    return routed


def _steps(routed, forward, ids: torch.Tensor, slots: torch.Tensor, live: int | None = None) -> list[torch.Tensor]:
    """Prefill ids[:, :5] into rows 0-1 of a RowKVCache, then decode ids[:, 5:] one at a time; the logits of each
    call (its last position), every position routed to `slots`; `live`: decode calls whose rows from there on are
    padding."""
    model = routed.model
    kv = RowKVCache.for_model(model.config, 2, 16, dtype=torch.float32, device="cpu")
    columns = torch.arange(16)
    rows = torch.arange(2)
    logits = []
    with torch.no_grad():
        for start, end in [(0, 5), *((t, t + 1) for t in range(5, ids.shape[1]))]:
            chunk = ids[:, start:end]
            positions = torch.arange(start, end).repeat(2, 1)
            mask = torch.where(columns[None, None, :] <= positions[:, :, None], 0.0, float("-inf"))[:, None]
            plan = routed.make_routing(2, end - start, slots[:, start:end].reshape(-1), routed.cache.num_slots)
            decode = end - start == 1
            kv.address(rows, positions, leading=2 if decode else 0, live=live if decode else None)
            out = routed.run(chunk, plan, forward=forward, attention_mask=mask, position_ids=positions,
                             past_key_values=kv, use_cache=True, logits_to_keep=1)
            logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("make", [_qwen3, _llama], ids=["qwen3 (q/k norms, grouped KV heads)", "llama"])
def test_lean_decoder_gives_transformers_logits_through_the_row_cache(make):
    routed = make()
    for adapter in random_adapters(routed, ["a", "b"], rank=8, std=0.2):
        routed.add_adapter(adapter)
    vocab_size = routed.model.config.vocab_size
    ids = torch.randint(5, vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([[0, 0, 1, -1, 0, 1, 1, 0, -1], [1, -1, 1, 0, 0, -1, 1, 1, 0]])
    reference = _steps(routed, None, ids, slots)
    lean = _steps(routed, LeanDecoder(routed.model), ids, slots)
    for want, got in zip(reference, lean):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_rows_past_the_live_ones_skip_attention_and_leave_the_live_rows_bit_identical(monkeypatch):
    routed = _qwen3()  # grouped KV heads: the query rows of a KV head fold into one attention call
    for adapter in random_adapters(routed, ["a", "b"], rank=8, std=0.2):
        routed.add_adapter(adapter)
    ids = torch.randint(5, routed.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([[0, 1, 1, -1, 0, 1, 0, 0, 1], [1, 0, -1, 0, 1, -1, 1, 0, 0]])
    decoder = LeanDecoder(routed.model)
    full = _steps(routed, decoder, ids, slots)
    attended = []
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, *args, **kwargs):
        attended.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    padded = _steps(routed, decoder, ids, slots, live=1)
    blocks = len(decoder.blocks)
    assert attended == [2] * blocks + [1] * (blocks * (ids.shape[1] - 5))  # prefill: both rows; decode: row 0
    for want, got in zip(full, padded):
        assert torch.equal(got[0], want[0])


def _tokens(engine: Engine, requests: list[Request], config: GenerationConfig) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for index, item in engine.stream(requests, config):
        if isinstance(item, Token):
            out.setdefault(index, []).append(item.token)
    return out


def _mixed_requests(device: str, lengths: tuple[int, ...]):
    """A tiny model with 3 random adapters and requests of these prompt lengths routed in turn by vocabulary range
    (a, b), not at all, by learned top-2 gates with a routing state, and by vocabulary range (c)."""
    routed, vocab = random_routed_model("tiny", device=device, dtype=torch.float32, num_slots=4, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c"], std=0.2):
        routed.add_adapter(adapter)
    torch.manual_seed(3)
    gates = LearnedGates.for_model(routed, ["a", "b", "c"], context_decays=(0.5, 0.9), init_std=0.5)
    g = torch.Generator().manual_seed(5)
    prompts = [[vocab.bos_id, *torch.randint(vocab.text_start, vocab.vocab_size, (n,), generator=g).tolist()]
               for n in lengths]
    routers = [VocabRangeRouter(vocab, "a", "b"), None, LearnedRouter(gates, top_k=2), VocabRangeRouter(vocab, "c")]
    return routed, vocab, [Request(p, r) for p, r in zip(prompts, routers)]


def test_the_engine_gives_the_same_tokens_with_either_forward_learned_rows_included():
    routed, vocab, requests = _mixed_requests("cpu", (4, 9, 6))
    config = GenerationConfig(max_new_tokens=12, **GREEDY)
    runs = []
    for lean in (True, False):
        engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_rows=8, max_len=48, lean_decoder=lean))
        runs.append(_tokens(engine, requests, config))
        assert (engine.decoder is not None) == lean
        engine.close()
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0].values())


def test_models_the_lean_decoder_cannot_run_keep_transformers_forward(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    assert "model type 'gpt2'" in LeanDecoder.unsupported(gpt2)
    sliding = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           vocab_size=64, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0))
    assert LeanDecoder.unsupported(sliding) == "sliding-window attention"
    with pytest.raises(ValueError, match="sliding-window attention"):
        LeanDecoder(sliding)
    routed = attach_routed_lora(sliding, num_slots=1, r_max=4)
    from molora.models.engine.synthetic import id_range_vocab

    engine = Engine(routed, id_range_vocab(64, image_size=16), device="cpu", config=EngineConfig(max_rows=4,
                                                                                                  max_len=24))
    with caplog.at_level("INFO", logger="molora.models.engine.core"):
        engine._setup()
    assert engine.decoder is None and "sliding-window attention" in caplog.text
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_failing_compiler_leaves_the_eager_pieces_and_the_same_tokens(monkeypatch, caplog):
    """Where torch.compile fails (no compiler, an unsupported model), the decoder logs one line and runs its pieces
    eagerly: the tokens are those of a decoder built without compiling, captured steps included."""
    routed, vocab = random_routed_model("tiny", device="cuda", dtype=torch.bfloat16, num_slots=2, image_size=64)
    for adapter in random_adapters(routed, ["a", "b"], std=0.2):
        routed.add_adapter(adapter)
    requests = [Request([vocab.bos_id, 7 + i, 9], VocabRangeRouter(vocab, "a", "b")) for i in range(3)]
    config = GenerationConfig(max_new_tokens=10, **GREEDY)
    plain = Engine(routed, vocab, device="cuda", config=EngineConfig(max_rows=4, max_len=32))
    plain._setup()
    plain.decoder = LeanDecoder(routed.model, compile=False)
    want = _tokens(plain, requests, config)
    plain.close()

    def broken(fn, **kwargs):
        def call(*args, **kw):
            raise RuntimeError("no working C compiler")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    engine = Engine(routed, vocab, device="cuda", config=EngineConfig(max_rows=4, max_len=32))
    with caplog.at_level("WARNING", logger="molora.models.engine.decoder"):
        got = _tokens(engine, requests, config)
    engine.close()
    assert got == want
    assert caplog.text.count("running them eagerly") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_split_attention_gives_sdpa_tokens_in_captured_steps_learned_rows_included():
    """Decode steps on CUDA attend through the split-K kernel (kernels/triton_attention.py), reading each row's
    columns up to its position: the greedy tokens equal those of sdpa over the whole cache under the mask, for rows
    of different lengths joining at different steps, vocabulary and learned routing, captured steps."""
    routed, vocab, requests = _mixed_requests("cuda", (4, 37, 6, 70))
    config = GenerationConfig(max_new_tokens=24, **GREEDY)
    runs = []
    for split in (True, False):
        engine = Engine(routed, vocab, device="cuda", config=EngineConfig(max_rows=4, max_len=160))
        engine._setup()
        engine.decoder.split_attention = split
        runs.append(_tokens(engine, requests, config))
        engine.close()
    assert runs[0] == runs[1] and all(len(t) == 24 for t in runs[0].values())
