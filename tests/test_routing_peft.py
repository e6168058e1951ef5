"""Acceptance: routed LoRA reproduces the real `peft` package, and per-token routing equals peft switching
adapters token by token, in ONE forward pass.  Tiny random models, fp32, no downloads."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from molora.models.engine.vocab import UnifiedVocab
from molora.routing import (
    SequenceRouter,
    VocabRangeRouter,
    attach_routed_lora,
    load_peft_adapter,
    save_peft_adapter,
)
from molora.routing.errors import AdapterError

VOCAB = UnifiedVocab(vocab_size=64, text_start=5, text_size=27, image_start=32, image_size=32, pad_id=0, bos_id=1,
                     eos_id=2, boi_id=3, eoi_id=4, image_grid=(2, 2))
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


def make_peft_adapter(base, path, seed: int, **lora_kwargs) -> PeftModel:
    """A LoRA made by peft on a copy of `base`, with random NONZERO B (peft initialises B to zero), saved to path."""
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


def mixed_sequence() -> torch.Tensor:
    """<bos> text <boi> 4 codes <eoi> text <boi> 4 codes <eoi> <eos>: both modalities, both markers."""
    return torch.tensor([[1, 7, 9, 12, 3, 33, 40, 57, 63, 4, 8, 30, 3, 32, 35, 36, 50, 4, 2]])


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    base = tiny_llama()
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(base, root / "T", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    make_peft_adapter(base, root / "I", 2, r=8, lora_alpha=4, use_rslora=True,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return base, root


def test_routing_every_token_to_one_adapter_equals_peft(llama_pair):
    base, root = llama_pair
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(root / "T")).eval()
    routed = attach_routed_lora(copy.deepcopy(base), num_slots=2, r_max=8)
    routed.load_adapter(root / "T", "T")
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = routed(ids, routers=SequenceRouter("T")).logits
        plain = base(input_ids=ids).logits
    assert rel_err(plain, want) > 1e-2  # the adapter really changes the model
    assert rel_err(got, want) <= 1e-5


def test_vocab_routing_in_one_pass_equals_peft_switching_adapters_token_by_token(llama_pair):
    base, root = llama_pair
    ids = mixed_sequence()
    rule = VOCAB.modality_table()[ids[0]].tolist()  # 0 = text -> T, 1 = image -> I
    assert 0 in rule and 1 in rule

    # reference: peft with both adapters, decoding one token at a time, switching to the adapter the rule names
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(root / "T"), adapter_name="T").eval()
    peft_model.load_adapter(str(root / "I"), adapter_name="I")
    cache = DynamicCache()
    want = []
    with torch.no_grad():
        for t, modality in enumerate(rule):
            peft_model.set_adapter("I" if modality == 1 else "T")
            out = peft_model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            want.append(out.logits[:, -1])
    want = torch.stack(want, dim=1)

    routed = attach_routed_lora(copy.deepcopy(base), num_slots=2, r_max=8)
    routed.load_adapter(root / "T", "T")
    routed.load_adapter(root / "I", "I")
    calls = []
    routed.model.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        out = routed(ids, routers=VocabRangeRouter(VOCAB, text_adapter="T", image_adapter="I"))
    assert len(calls) == 1  # ONE forward pass of the HF model
    assert out.routing.adapter_names(0) == ["I" if m == 1 else "T" for m in rule]
    assert rel_err(out.logits, want) <= 1e-5
    # and it is not trivially equal to either single adapter
    with torch.no_grad():
        only_t = routed(ids, routers=SequenceRouter("T")).logits
        only_i = routed(ids, routers=SequenceRouter("I")).logits
    assert rel_err(only_t, want) > 1e-3 and rel_err(only_i, want) > 1e-3


def test_rank_pattern_alpha_pattern_and_rslora_scales_match_peft(tmp_path):
    base = tiny_llama(5)
    kwargs = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                  rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 6}, alpha_pattern={"down_proj": 3})
    peft_model = make_peft_adapter(base, tmp_path / "pat", 7, **kwargs)
    adapter = load_peft_adapter(tmp_path / "pat")
    assert adapter.weights["model.layers.0.self_attn.v_proj"][0].shape[0] == 2
    assert adapter.scales["model.layers.0.self_attn.v_proj"] == pytest.approx(8 / 2)
    assert adapter.scales["model.layers.1.self_attn.q_proj"] == pytest.approx(8 / 6)
    assert adapter.scales["model.layers.0.self_attn.q_proj"] == pytest.approx(8 / 4)
    assert adapter.scales["model.layers.1.mlp.down_proj"] == pytest.approx(3 / 4)

    make_peft_adapter(base, tmp_path / "rs", 8, r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj"])
    rs = load_peft_adapter(tmp_path / "rs")
    assert rs.scales and all(v == pytest.approx(8 / math.sqrt(4)) for v in rs.scales.values())

    routed = attach_routed_lora(copy.deepcopy(base), num_slots=2, r_max=8)
    routed.add_adapter(adapter)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(routed(ids, routers=SequenceRouter("pat")).logits, peft_model(input_ids=ids).logits) <= 1e-5


@pytest.mark.parametrize("rslora", [False, True])
def test_saved_adapter_loads_back_in_peft_with_the_same_logits(tmp_path, rslora):
    base = tiny_llama(9)
    make_peft_adapter(base, tmp_path / "src", 3, r=4, lora_alpha=16, use_rslora=rslora,
                      target_modules=["q_proj", "up_proj"], rank_pattern={} if rslora else {"up_proj": 2})
    routed = attach_routed_lora(copy.deepcopy(base), num_slots=2, r_max=8)
    name = routed.load_adapter(tmp_path / "src", "mine")
    routed.save_adapter(name, tmp_path / "out")
    save_peft_adapter(routed.adapter(name), tmp_path / "out2")
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = routed(ids, routers=SequenceRouter(name)).logits
        for folder in ("out", "out2"):
            reloaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / folder)).eval()
            assert rel_err(reloaded(input_ids=ids).logits, ours) <= 1e-5
    again = load_peft_adapter(tmp_path / "out")
    for module, (a, b) in routed.adapter(name).weights.items():
        assert torch.equal(again.weights[module][0], a) and torch.equal(again.weights[module][1], b)
        assert again.scales[module] == pytest.approx(routed.adapter(name).scales[module])


def test_an_adapter_stored_as_bfloat16_loads_back_rounded_and_the_store_script_rewrites_a_folder(tmp_path):
    """save_peft_adapter(dtype=...) and scripts/store_adapter.py: the weights come back as the old ones rounded to
    bfloat16, peft loads the folder, molora.json stays; an integer dtype is refused before anything is written."""
    from tests.script_loader import load_script

    base = tiny_llama()
    make_peft_adapter(base, tmp_path / "src", 5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    adapter = load_peft_adapter(tmp_path / "src")
    save_peft_adapter(adapter, tmp_path / "half", dtype=torch.bfloat16)
    half = load_peft_adapter(tmp_path / "half")
    for module, (a, b) in adapter.weights.items():
        assert half.weights[module][0].dtype == torch.bfloat16
        assert torch.equal(half.weights[module][0], a.to(torch.bfloat16))
        assert torch.equal(half.weights[module][1], b.to(torch.bfloat16))
    PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "half"))
    with pytest.raises(AdapterError, match="not torch.int8"):
        save_peft_adapter(adapter, tmp_path / "ints", dtype=torch.int8)
    assert not (tmp_path / "ints").exists()
    (tmp_path / "src" / "molora.json").write_text('{"modality": "image"}')
    load_script("store_adapter").main([str(tmp_path / "src"), "--dtype", "bfloat16"])
    stored = load_peft_adapter(tmp_path / "src")
    assert all(torch.equal(stored.weights[m][0], half.weights[m][0]) for m in adapter.weights)
    assert (tmp_path / "src" / "molora.json").read_text() == '{"modality": "image"}'


def test_qwen3_routed_model_equals_peft(tmp_path):
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=8)).eval()
    peft_model = make_peft_adapter(base, tmp_path / "q", 4, r=4, lora_alpha=8,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    routed = attach_routed_lora(copy.deepcopy(base), num_slots=2, r_max=4)
    routed.load_adapter(tmp_path / "q")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_err(routed(ids, routers=SequenceRouter("q")).logits, peft_model(input_ids=ids).logits) <= 1e-5
        assert torch.equal(routed(ids).logits, base(input_ids=ids).logits)
