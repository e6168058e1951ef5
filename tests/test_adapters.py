"""Loading PEFT adapter folders: every bad input is a clear project error, and after each failed load the cache
contents and the model outputs are exactly as before."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from molora.routing import (
    AdapterError,
    MoLoRAError,
    SequenceRouter,
    UnknownAdapterError,
    attach_routed_lora,
    load_peft_adapter,
)

IDS = torch.tensor([[1, 7, 9, 3, 33, 40, 4, 8]])
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("good") / "good"
    peft_model.save_pretrained(str(path))
    return base, path


@pytest.fixture()
def routed(good_dir):
    base, path = good_dir
    model = copy.deepcopy(base)
    model.config.name_or_path = "org/tiny-llama"
    routed = attach_routed_lora(model, num_slots=2, r_max=4)
    routed.load_adapter(path, "good", force=True)
    with torch.no_grad():
        routed(IDS, routers=SequenceRouter("good"))  # put it in a slot
    return routed


def state(routed):
    with torch.no_grad():
        logits = routed(IDS, routers=SequenceRouter("good")).logits
    buffers = [(m.lora_A.clone(), m.lora_B.clone(), m.lora_scale.clone())
               for m in routed.cache.layers.values()]
    stats = routed.cache.stats()
    stats.pop("hits")  # the probe forward itself is a hit
    return logits, buffers, stats, routed.adapter_names


def assert_same_state(a, b):
    assert torch.equal(a[0], b[0])
    for (x, y, z), (x0, y0, z0) in zip(a[1], b[1]):
        assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(z, z0)
    assert a[2] == b[2] and a[3] == b[3]


def copy_adapter(good_dir, tmp_path, name="bad"):
    dst = tmp_path / name
    shutil.copytree(good_dir[1], dst)
    return dst


def edit_weights(path, fn):
    tensors = load_file(str(path / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def edit_config(path, **changes):
    config = json.loads((path / CONFIG).read_text())
    config.update(changes)
    (path / CONFIG).write_text(json.dumps(config))


Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _pickle_only(p):
    (p / WEIGHTS).rename(p / "adapter_model.bin")


def _truncate(p):
    data = (p / WEIGHTS).read_bytes()
    (p / WEIGHTS).write_bytes(data[: len(data) - 100])


def _nan(p):
    edit_weights(p, lambda t: t[Q0B].__setitem__((0, 0), float("nan")))


def _inf(p):
    edit_weights(p, lambda t: t[Q0A].__setitem__((1, 2), float("inf")))


def _rank_above_r_max(p):
    def grow(t):
        for key in list(t):
            if key.endswith("lora_A.weight"):
                t[key] = torch.randn(8, t[key].shape[1])
            else:
                t[key] = torch.randn(t[key].shape[0], 8)
    edit_weights(p, grow)
    edit_config(p, r=8)


def _missing_module(p):
    def rename(t):
        t[Q0A.replace("layers.0", "layers.7")] = t.pop(Q0A)
        t[Q0B.replace("layers.0", "layers.7")] = t.pop(Q0B)
    edit_weights(p, rename)


def _unrouted_module(p):
    def rename(t):
        t["base_model.model.lm_head.lora_A.weight"] = t.pop(Q0A)
        t.pop(Q0B)
        t["base_model.model.lm_head.lora_B.weight"] = torch.randn(64, 4)
    edit_weights(p, rename)


def _wrong_shape(p):
    edit_weights(p, lambda t: t.__setitem__(Q0A, torch.randn(4, 48)))


def _base_mismatch(p):
    edit_config(p, base_model_name_or_path="org/another-model")


def _no_config(p):
    (p / CONFIG).unlink()


def _bad_json(p):
    (p / CONFIG).write_text("{not json")


def _not_lora(p):
    edit_config(p, peft_type="IA3")


def _dora(p):
    edit_config(p, use_dora=True)


def _missing_b(p):
    edit_weights(p, lambda t: t.pop(Q0B))


def _rank_disagrees_with_config(p):
    edit_config(p, r=2)


def _embedding_lora(p):
    edit_weights(p, lambda t: t.__setitem__("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 64)))


BAD = {
    "pickle_only": (_pickle_only, "pickle"),
    "truncated": (_truncate, "truncated"),
    "nan": (_nan, "NaN"),
    "inf": (_inf, "Inf"),
    "rank_above_r_max": (_rank_above_r_max, "r_max"),
    "missing_module": (_missing_module, "does not have"),
    "unrouted_module": (_unrouted_module, "not routed"),
    "wrong_shape": (_wrong_shape, "do not fit"),
    "base_mismatch": (_base_mismatch, "force=True"),
    "no_config": (_no_config, "adapter_config.json"),
    "bad_json": (_bad_json, "not valid JSON"),
    "not_lora": (_not_lora, "only LoRA"),
    "dora": (_dora, "use_dora"),
    "missing_b": (_missing_b, "lora_B"),
    "rank_disagrees_with_config": (_rank_disagrees_with_config, "do not belong together"),
    "embedding_lora": (_embedding_lora, "unexpected tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_refused_and_nothing_changes(routed, good_dir, tmp_path, case):
    breaker, message = BAD[case]
    bad = copy_adapter(good_dir, tmp_path)
    breaker(bad)
    before = state(routed)
    with pytest.raises(AdapterError, match=message):
        routed.load_adapter(bad, "bad")
    assert_same_state(state(routed), before)
    assert "bad" not in routed.adapter_names


def test_pickle_file_path_is_refused(tmp_path):
    (tmp_path / "adapter.pt").write_bytes(b"\x80\x04not really")
    with pytest.raises(AdapterError, match="pickle"):
        load_peft_adapter(tmp_path / "adapter.pt")
    with pytest.raises(AdapterError, match="does not exist"):
        load_peft_adapter(tmp_path / "missing")


def test_base_model_mismatch_loads_with_force(routed, good_dir, tmp_path):
    other = copy_adapter(good_dir, tmp_path, "other")
    _base_mismatch(other)
    assert routed.load_adapter(other, force=True) == "other"
    # a local copy of the same model counts as the same base model
    same = copy_adapter(good_dir, tmp_path, "same")
    edit_config(same, base_model_name_or_path="/data/models/tiny-llama/")
    assert routed.load_adapter(same) == "same"


def test_duplicate_and_unknown_names(routed, good_dir):
    before = state(routed)
    with pytest.raises(AdapterError, match="already loaded"):
        routed.load_adapter(good_dir[1], "good")
    with pytest.raises(UnknownAdapterError, match=r"'ghost'.*loaded: good"):
        routed(IDS, routers=SequenceRouter("ghost"))
    with pytest.raises(UnknownAdapterError, match="ghost"):
        routed.remove_adapter("ghost")
    assert_same_state(state(routed), before)
    assert issubclass(UnknownAdapterError, MoLoRAError)


def test_load_names_default_to_the_folder_and_remove_restores_the_base(routed, good_dir, tmp_path):
    path = copy_adapter(good_dir, tmp_path, "style")
    assert routed.load_adapter(path) == "style"
    assert routed.adapter_names == ["good", "style"]
    routed.remove_adapter("style")
    assert routed.adapter_names == ["good"]


def test_base_model_names_match_only_when_the_same_model():
    from molora.routing.adapters import same_base_model

    assert same_base_model("org/Model-1B", "org/Model-1B")
    assert same_base_model(None, "org/Model-1B") and same_base_model("org/Model-1B", "")
    assert not same_base_model("orgA/Model-1B", "orgB/Model-1B")  # two hub names: different models
    assert same_base_model("assets/model/lm", str(__import__("pathlib").Path("assets/model/lm").resolve()))
