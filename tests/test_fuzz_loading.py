"""Bad input, fuzzed with hypothesis: every loader of a file a user hands us either loads it or raises a project
error (MoLoRAError) whose message names the problem, and a refused file changes nothing (the model's adapters,
its hot-set slots, its learned gates).

Covered: PEFT adapter folders (routing.load_peft_adapter, RoutedModel.load_adapter), learned-gate files
(LearnedGates.load), router folders (gates + config.json, InterleavedPipeline.load_learned_router), model
directories (models.loading.load_model_dir: vocab.json, tokenizer.json, the LM and the VQ checkpoints,
generation.json) and adapter uploads (app/uploads.py, then the pipeline).  Inputs: random bytes, truncated and
altered files, crafted safetensors headers (wrong dtypes, huge declared shapes), NaN/Inf, wrong key names, configs
of other model families.  Any other exception type is a bug hypothesis shrinks and reports.

Deterministic (derandomize=True, no example database) and bounded (max_examples per test) so CI is stable and
the file runs in well under a minute on two cores.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from molora.kernels.errors import MoLoRAError
from molora.routing.adapters import CONFIG_NAME, WEIGHTS_NAME, load_peft_adapter
from molora.routing.errors import AdapterError, RoutingError

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
FEW = settings(FUZZ, max_examples=12)

SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3",
                      "F8_E5M2", "C64", "F4", "XX")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8, "F4": 1, "XX": 1}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HUGE = (2 ** 31, 2 ** 40, 2 ** 62, 2 ** 64 - 1)
# a few payloads random bytes rarely hit: deep nesting (RecursionError in json), NaN literals, odd unicode
NASTY_JSON = (b"[" * 100_000, b'{"a":' * 50_000, b"NaN", b"Infinity", b'"\\ud800"', b"\xef\xbb\xbf{}", b"{}", b"[]",
              b"null", b"1e999", b"\x00\x00\x00\x00\x00\x00\x00\x00")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


# --- helpers ----------------------------------------------------------------------------------------------

def refused_or_loaded(load: Callable[[], Any], errors: type[BaseException] | tuple = MoLoRAError) -> Any:
    """`load()`'s result, or None when it raised one of `errors` with a message; any other exception propagates
    (and fails the test): that is the bug the fuzzing looks for."""
    try:
        return load()
    except errors as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return None


def safetensors_bytes(entries: dict[str, tuple[str, list[int], list[int]]], data: bytes,
                      metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file from a hand-written header: {name: (dtype, shape, data_offsets)} + raw data."""
    header: dict[str, Any] = {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in entries.items()}
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def flip_bytes(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out)


@contextmanager
def scratch() -> Iterator[Path]:
    """A fresh temporary folder per hypothesis example (function-scoped pytest fixtures are not reset)."""
    folder = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def adapter_folder(root: Path, config: bytes, weights: bytes) -> Path:
    folder = root / "adapter"
    folder.mkdir()
    (folder / CONFIG_NAME).write_bytes(config)
    (folder / WEIGHTS_NAME).write_bytes(weights)
    return folder


edits = st.lists(st.tuples(st.integers(0, 2 ** 31), st.integers(0, 255)), min_size=1, max_size=8)


# --- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_adapter(tiny_assets: Path) -> tuple[bytes, bytes, dict[str, torch.Tensor]]:
    folder = tiny_assets / "adapters" / "text_style"
    tensors, _ = read_tensors(folder / WEIGHTS_NAME)
    return _Quiet(((folder / CONFIG_NAME).read_bytes(), (folder / WEIGHTS_NAME).read_bytes(), tensors))


class _Quiet(tuple):
    """A fixture value whose repr is short: hypothesis prints the arguments of a failing example."""

    def __repr__(self) -> str:
        return "<the tiny text_style adapter: config bytes, weights bytes, tensors>"


@pytest.fixture(scope="module")
def routed(tiny_assets: Path):
    """The tiny LM with routed layers and one adapter loaded (and in a slot), shared by the adapter tests."""
    from transformers import LlamaForCausalLM

    from molora.models.families.shapes.testing import set_base_model_name
    from molora.routing import attach_routed_lora

    lm = set_base_model_name(LlamaForCausalLM.from_pretrained(tiny_assets / "model" / "lm"))
    model = attach_routed_lora(lm, num_slots=2, r_max=8)
    model.load_adapter(tiny_assets / "adapters" / "image_style", name="resident")
    model.cache.acquire(["resident"])
    model.cache.release(["resident"])
    return model


def model_state(model) -> tuple:
    """What a refused adapter must leave alone: the pool, the slots, the counters and every slot tensor."""
    tensors = [t.clone() for layer in model.cache.layers.values() for t in (layer.lora_A, layer.lora_B, layer.lora_scale)]
    return model.cache.stats(), model.cache.names, tensors


def assert_unchanged(before: tuple, after: tuple) -> None:
    assert before[0] == after[0] and before[1] == after[1]
    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2], strict=True))


def load_into(model, folder: Path) -> str | None:
    """RoutedModel.load_adapter: loaded (then removed again) or refused with the model untouched."""
    before = model_state(model)
    name = refused_or_loaded(lambda: model.load_adapter(folder, name="fuzzed", force=True))
    if name is None:
        assert_unchanged(before, model_state(model))
    else:
        model.remove_adapter(name)
    return name


# --- PEFT adapter folders -----------------------------------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=4096) | st.sampled_from(NASTY_JSON))
def test_random_bytes_as_adapter_weights_are_refused(good_adapter, data):
    with scratch() as root:
        folder = adapter_folder(root, good_adapter[0], data)
        with pytest.raises(AdapterError, match="safetensors|tensor|LoRA|weights"):
            load_peft_adapter(folder)


@FUZZ
@given(cut=st.floats(0.0, 0.9999))
def test_truncated_adapter_weights_are_refused(good_adapter, cut):
    config, weights, _ = good_adapter
    with scratch() as root:
        folder = adapter_folder(root, config, weights[:int(cut * len(weights))])
        with pytest.raises(AdapterError, match="safetensors|truncated|corrupt"):
            load_peft_adapter(folder)


@FUZZ
@given(changes=edits)
def test_altered_adapter_weights_load_or_are_refused_leaving_the_model_untouched(good_adapter, routed, changes):
    config, weights, _ = good_adapter
    with scratch() as root:
        load_into(routed, adapter_folder(root, config, flip_bytes(weights, changes)))


header_entries = st.dictionaries(
    st.sampled_from(["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                     "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                     "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                     "base_model.model.model.embed_tokens.lora_embedding_A", "lora_A.weight", "", "x" * 300]),
    st.tuples(st.sampled_from(SAFETENSORS_DTYPES),
              st.lists(st.integers(0, 6) | st.sampled_from(HUGE), max_size=3),
              st.none() | st.tuples(st.integers(0, 64), st.integers(0, 2 ** 64 - 1))),
    max_size=3)


def crafted_file(entries: dict, fill: bytes, metadata: dict | None = None) -> bytes:
    """Consistent data offsets where the entry gives none (so safetensors' own checks pass), else the given ones."""
    header, offset = {}, 0
    for key, (dtype, shape, offsets) in entries.items():
        if offsets is None:
            size = DTYPE_BYTES[dtype]
            for dim in shape:
                size *= dim
            size = min(size, 1 << 16)  # a huge declared shape gets a small buffer: its header must be refused
            offsets = (offset, offset + size)
        header[key] = (dtype, shape, list(offsets))
        offset = max(offset, offsets[1] if offsets[1] < (1 << 16) else offset)
    data = (fill * (offset // max(len(fill), 1) + 1))[:offset] if fill else bytes(offset)
    return safetensors_bytes(header, data, metadata)


@FUZZ
@example(entries={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("F8_E4M3", [2, 32], None), "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": ("F8_E4M3", [32, 2], None)},
         fill=b"\x7f")  # hypothesis found it: torch has no isfinite for float8; the loader refuses the dtype
@example(entries={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("F32", [2 ** 31, 2 ** 31], None)}, fill=b"")
@given(entries=header_entries, fill=st.binary(max_size=16))
def test_crafted_safetensors_headers_are_checked_before_any_tensor_is_read(good_adapter, entries, fill):
    """Wrong dtypes, huge declared shapes, inconsistent offsets, odd names: refused from the header alone."""
    with scratch() as root:
        folder = adapter_folder(root, b'{"peft_type": "LORA", "r": 2, "lora_alpha": 4}', crafted_file(entries, fill))
        refused_or_loaded(lambda: load_peft_adapter(folder, force=True))


@FUZZ
@given(dtype=st.sampled_from(FLOAT_DTYPES), module=st.integers(0, 27), position=st.integers(0, 10 ** 6),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300, -1e39, 7e4]))
def test_nan_inf_and_out_of_range_weights_are_refused(good_adapter, routed, dtype, module, position, value):
    config, _, tensors = good_adapter
    key = sorted(tensors)[module]
    changed = {k: t.to(dtype).clone() for k, t in tensors.items()}
    flat = changed[key].reshape(-1)
    flat[position % flat.numel()] = torch.tensor(value, dtype=torch.float64).to(dtype)  # may overflow to Inf
    with scratch() as root:
        save_file(changed, str(root / "w.safetensors"))
        folder = adapter_folder(root, config, (root / "w.safetensors").read_bytes())
        bad_in_model = not bool(torch.isfinite(flat.to(torch.float32)).all())  # the tiny LM is float32
        name = load_into(routed, folder)
        assert (name is None) == bad_in_model


def _rename(key: str, how: str) -> str:
    return {"drop_prefix": key.removeprefix("base_model.model."),
            "lowercase": key.replace("lora_A", "lora_a").replace("lora_B", "lora_b"),
            "adapter_infix": key.replace(".weight", ".default.weight"),
            "bias": key.replace(".weight", ".bias"),
            "other_family": key.replace("model.layers", "model.text_model.layers"),
            "unknown_module": key.replace(".lora_", "_x.lora_"),
            "dora": re.sub(r"lora_[AB](\.\w+)?\.weight$", "lora_magnitude_vector", key),
            "embedding": re.sub(r"lora_([AB])(\.\w+)?\.weight$", r"lora_embedding_\1", key)}[how]


@FUZZ
@given(hows=st.lists(st.sampled_from(["drop_prefix", "lowercase", "adapter_infix", "bias", "other_family",
                                      "unknown_module", "dora", "embedding", "drop"]), min_size=1, max_size=3),
       which=st.lists(st.integers(0, 27), min_size=1, max_size=4, unique=True))
def test_wrong_key_names_are_refused_naming_the_key(good_adapter, routed, hows, which):
    config, _, tensors = good_adapter
    keys = sorted(tensors)
    renamed = dict(tensors)
    for i in which:
        key = keys[i]
        del renamed[key]
        for how in hows:
            if how == "drop":
                break
            key = _rename(key, how)
        else:
            renamed[key] = tensors[keys[i]]
    with scratch() as root:
        save_file(renamed, str(root / "w.safetensors"))
        folder = adapter_folder(root, config, (root / "w.safetensors").read_bytes())
        name = load_into(routed, folder)
        # PEFT's own spellings of the same keys, each at most once
        harmless = set(hows) <= {"drop_prefix", "adapter_infix"} and hows.count("adapter_infix") <= 1
        assert (name is not None) == harmless


class _CountingOpen:
    """safe_open, counting the tensors read (to show a refusal came from the header alone)."""

    def __init__(self) -> None:
        self.reads = 0

    @contextmanager
    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        counter = self

        class Handle:
            def __init__(self, f: Any) -> None:
                self.f = f

            def __getattr__(self, attr: str) -> Any:
                return getattr(self.f, attr)

            def get_tensor(self, key: str) -> torch.Tensor:
                counter.reads += 1
                return self.f.get_tensor(key)

        with safe_open(*args, **kwargs) as f:
            yield Handle(f)


@FEW
@given(width=st.integers(33, 5000), rank=st.integers(9, 64), which=st.sampled_from(["in", "out", "rank", "module"]))
def test_an_adapter_that_does_not_fit_is_refused_from_its_header_before_any_tensor_is_read(
        good_adapter, routed, width, rank, which):
    config, _, tensors = good_adapter
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    shapes = {"in": ((4, width), (32, 4)), "out": ((4, 32), (width, 4)), "rank": ((rank, 32), (32, rank)),
              "module": ((4, 32), (32, 4))}[which]
    changed = {k: v for k, v in tensors.items() if not k.startswith(q)}
    prefix = q.replace("q_proj", "qkv_proj") if which == "module" else q
    changed[prefix + "A.weight"], changed[prefix + "B.weight"] = torch.zeros(shapes[0]), torch.zeros(shapes[1])
    cfg = {**json.loads(config), "r": shapes[0][0], "rank_pattern": {}}
    counting = _CountingOpen()
    with scratch() as root, pytest.MonkeyPatch.context() as patch:
        patch.setattr("molora.routing.adapters.safe_open", counting)
        save_file(changed, str(root / "w.safetensors"))
        folder = adapter_folder(root, json.dumps(cfg).encode(), (root / "w.safetensors").read_bytes())
        before = model_state(routed)
        with pytest.raises(AdapterError, match="fit|rank|does not have"):
            routed.load_adapter(folder, name="fuzzed", force=True)
        assert_unchanged(before, model_state(routed))
    assert counting.reads == 0


config_keys = st.sampled_from(["r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "peft_type",
                               "base_model_name_or_path", "target_modules", "use_dora", "modules_to_save",
                               "fan_in_fan_out", "lora_bias", "layer_replication"])


@FUZZ
@example(changes={"rank_pattern": [1]})  # found: AttributeError
@example(changes={"alpha_pattern": {"(": 1}})  # found: re.error
@example(changes={"lora_alpha": 1e308, "use_rslora": True})  # found: a scale that is Inf in float32
@given(changes=st.dictionaries(config_keys, json_values | st.sampled_from([0, -4, 4, 8, True, 1e308, "(", {"(": 1},
                                                                          {"q_proj": 0}, {".*": 2 ** 40}]),
       max_size=4))
def test_fuzzed_adapter_config_loads_or_is_refused_leaving_the_model_untouched(good_adapter, routed, changes):
    config = {**json.loads(good_adapter[0]), **changes}
    with scratch() as root:
        load_into(routed, adapter_folder(root, json.dumps(config).encode(), good_adapter[1]))


@FUZZ
@given(data=st.binary(max_size=512) | st.sampled_from(NASTY_JSON))
def test_random_bytes_as_adapter_config_are_refused(good_adapter, data):
    with scratch() as root:
        folder = adapter_folder(root, data, good_adapter[1])
        refused_or_loaded(lambda: load_peft_adapter(folder))


def _other_configs() -> list[dict]:
    from transformers import BertConfig, Emu3Config, GPT2Config, LlamaConfig

    configs = [c().to_dict() for c in (LlamaConfig, BertConfig, GPT2Config, Emu3Config)]
    configs += [{"peft_type": t, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
                for t in ("IA3", "PREFIX_TUNING", "LOHA", "LOKR", "ADALORA", "XLORA", "lora ")]
    return configs


@pytest.mark.parametrize("index", range(11))
def test_a_config_of_another_kind_is_refused(good_adapter, routed, index):
    """A transformers model config.json where adapter_config.json belongs, or a PEFT method other than LoRA."""
    config = _other_configs()[index]
    with scratch() as root:
        folder = adapter_folder(root, json.dumps(config, default=str).encode(), good_adapter[1])
        before = model_state(routed)
        with pytest.raises(AdapterError, match="model_type|peft_type|LoRA"):
            routed.load_adapter(folder, name="fuzzed")
        assert_unchanged(before, model_state(routed))


@FUZZ
@given(rank=st.integers(1, 12), dims=st.tuples(st.integers(1, 40), st.integers(1, 40)), module=st.integers(0, 27))
def test_an_adapter_for_another_model_size_or_above_r_max_is_refused(good_adapter, routed, rank, dims, module):
    config, _, tensors = good_adapter
    key = sorted(tensors)[module]
    other = key.replace("lora_A", "lora_B") if "lora_A" in key else key.replace("lora_B", "lora_A")
    a_key, b_key = sorted([key, other])  # lora_A sorts first
    changed = dict(tensors)
    changed[a_key], changed[b_key] = torch.randn(rank, dims[0]), torch.randn(dims[1], rank)
    cfg = {**json.loads(config), "r": rank}
    widened = {k: torch.randn(rank, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], rank)
               for k, v in changed.items() if k not in (a_key, b_key)}  # every module at the new rank
    changed.update(widened)
    with scratch() as root:
        save_file(changed, str(root / "w.safetensors"))
        folder = adapter_folder(root, json.dumps(cfg).encode(), (root / "w.safetensors").read_bytes())
        fits = tuple(changed[a_key].shape) == (rank, tensors[a_key].shape[1]) and \
            tuple(changed[b_key].shape) == (tensors[b_key].shape[0], rank) and rank <= routed.cache.r_max
        name = load_into(routed, folder)
        assert (name is not None) == fits


@FUZZ
@example(meta=b"[" * 100_000)  # found: RecursionError
@given(meta=st.sampled_from(NASTY_JSON) | st.binary(max_size=64)
       | st.dictionaries(st.sampled_from(["modality", "description"]),
                         json_values | st.sampled_from(["text", "image", "any", "merged"])).map(
                             lambda d: json.dumps(d).encode()))
def test_a_fuzzed_molora_json_is_refused_or_loads_leaving_the_pipeline_untouched(pipe, good_adapter, meta):
    """The modality file beside an adapter (pipeline.load_adapter) and inside an uploaded zip (app/uploads.py)."""
    from molora.app.uploads import validate_upload

    before = (dict(pipe.adapters), pipe.routed.cache.stats())
    with scratch() as root:
        folder = adapter_folder(root, good_adapter[0], good_adapter[1])
        (folder / "molora.json").write_bytes(meta)
        name = refused_or_loaded(lambda: pipe.load_adapter(folder, name="fuzzed"))
        if name is None:
            assert (dict(pipe.adapters), pipe.routed.cache.stats()) == before
        else:
            pipe.remove_adapter(name)
        (root / "up.zip").write_bytes(_zip([(f"a/{n}", (folder / n).read_bytes())
                                            for n in (CONFIG_NAME, WEIGHTS_NAME, "molora.json")]))
        refused_or_loaded(lambda: validate_upload([root / "up.zip"]))


# --- learned-gate files and router folders ---------------------------------------------------------------------

def gate_bytes(adapters: list[str], d_model: int, num_blocks: int, *, base_expert: bool = False,
               values: torch.Tensor | None = None) -> bytes:
    from molora.routing import LearnedGates

    gates = LearnedGates(d_model, adapters, num_blocks, base_expert=base_expert)
    if values is not None:
        with torch.no_grad():
            gates.gates[0].weight.copy_(values)
    with scratch() as root:
        gates.save(root / "g.safetensors")
        return (root / "g.safetensors").read_bytes()


def load_gates(data: bytes):
    from molora.routing import LearnedGates

    with scratch() as root:
        (root / "gates.safetensors").write_bytes(data)
        return refused_or_loaded(lambda: LearnedGates.load(root / "gates.safetensors"), RoutingError)


@FUZZ
@given(data=st.binary(max_size=2048), cut=st.floats(0, 0.999), changes=edits, how=st.sampled_from("rtf"))
def test_random_truncated_or_altered_gate_files_are_refused_or_load(data, cut, changes, how):
    good = gate_bytes(["a", "b"], 8, 2)
    fuzzed = {"r": data, "t": good[:int(cut * len(good))], "f": flip_bytes(good, changes)}[how]
    gates = load_gates(fuzzed)
    if how in "rt":
        assert gates is None


gate_meta = st.fixed_dictionaries({
    "adapters": st.sampled_from(['["a", "b"]', '"ab"', "[1, 2]", '{"a": 1}', '[["a"]]', '["a", "a"]', "[]", "[",
                                 '["' + "a" * 300 + '"]']),
    "d_model": st.sampled_from(["8", "0", "-1", "2.5", "1e9", str(10 ** 9), str(2 ** 64), "x", ""]),
    "num_blocks": st.sampled_from(["2", "1", "0", "-2", str(10 ** 7), str(2 ** 63), "two"]),
    "base_expert": st.sampled_from(["false", "true", "1", "null", "[", "FALSE"]),
}, optional={"format": st.just("molora-gates")})


@FUZZ
@example(meta={"adapters": '["a", "b"]', "d_model": str(10 ** 5), "num_blocks": str(10 ** 4), "base_expert": "false"},
         drop=set(), shape=[2, 8], dtype="F32", blocks=1)  # found: 8 GB of gates built before the tensors were checked
@example(meta={"adapters": '"ab"', "d_model": "8", "num_blocks": "1", "base_expert": "false"}, drop=set(),
         shape=[2, 8], dtype="F32", blocks=1)  # found: a string taken as one adapter per letter
@given(meta=gate_meta, drop=st.sets(st.sampled_from(["adapters", "d_model", "num_blocks", "base_expert"])),
       shape=st.lists(st.integers(0, 9) | st.sampled_from(HUGE), max_size=3),
       dtype=st.sampled_from(SAFETENSORS_DTYPES), blocks=st.integers(0, 3))
def test_crafted_gate_files_are_refused_before_anything_is_allocated(meta, drop, shape, dtype, blocks):
    """Declared sizes (d_model, num_blocks, shapes) are checked against the header before any gate exists."""
    meta = {k: v for k, v in meta.items() if k not in drop}
    entries = {f"gates.{i}.weight": (dtype, shape, None) for i in range(blocks)}
    load_gates(crafted_file(entries, b"\x01", metadata=meta))


@FUZZ
@given(position=st.integers(0, 23), value=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_non_finite_gate_weights_are_refused(position, value):
    values = torch.zeros(3, 8)
    values.view(-1)[position] = value
    assert load_gates(gate_bytes(["a", "b", "c"], 8, 1, values=values)) is None


@pytest.fixture(scope="module")
def pipe(tiny_assets: Path):
    """An own pipeline (the shared tiny_pipeline is read-only), with the text_style and image_style adapters."""
    from molora.models import InterleavedPipeline

    pipeline = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    yield pipeline
    pipeline.engine.close()


router_config = st.dictionaries(
    st.sampled_from(["top_k", "adapter_sha256_16", "adapters", "steps", "image_gates"]),
    json_values | st.sampled_from([0, 1, 2, 3, True, 2.0, "2", {"text_style": "0" * 16}, {"text_style": 5},
                                   {"unknown": "x"}, ["text_style"], {"text_style": None}, {"file": 5},
                                   {"file": "../gates.safetensors"}, {"file": "gates.safetensors"},
                                   {"file": "gates.safetensors", "adapter_sha256_16": [1]},
                                   {"adapter_sha256_16": {"image_style": 3}}]),
    max_size=3)


@FUZZ
@example(config={"image_gates": "x"}, gates="good", random=b"")
@example(config={"image_gates": {"adapter_sha256_16": [1]}}, gates="good", random=b"")
@example(config={"image_gates": {"file": "../router/gates.safetensors"}}, gates="good", random=b"")
@given(config=router_config | st.sampled_from(NASTY_JSON) | st.binary(max_size=64),
       gates=st.sampled_from(["good", "base", "unknown", "size", "random"]), random=st.binary(max_size=256))
def test_a_router_folder_loads_or_is_refused_leaving_the_pipeline_untouched(pipe, config, gates, random):
    names = ["text_style", "image_style"]
    gate_file = {"good": lambda: gate_bytes(names, 32, 2), "base": lambda: gate_bytes(names, 32, 2, base_expert=True),
                 "unknown": lambda: gate_bytes(["text_style", "nope"], 32, 2), "size": lambda: gate_bytes(names, 16, 3),
                 "random": lambda: random}[gates]()
    before = (pipe.gates, pipe.image_gates, pipe.learned_top_k, dict(pipe.adapters))
    with scratch() as root:
        (root / "gates.safetensors").write_bytes(gate_file)
        (root / "image_gates.safetensors").write_bytes(gate_bytes(["image_style"], 32, 2))
        (root / "config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
        loaded = refused_or_loaded(lambda: pipe.load_learned_router(root / "gates.safetensors") or True)
    try:
        if loaded is None:
            assert (pipe.gates, pipe.image_gates, pipe.learned_top_k, dict(pipe.adapters)) == before
        else:
            assert gates in ("good", "base") and pipe.gates is not before[0]
            if pipe.gates.num_experts:  # the learned router is usable with what was loaded
                pipe.make_router("learned", None, None)
    finally:
        pipe.gates, pipe.image_gates, pipe.learned_top_k = before[0], before[1], before[2]


# --- model directories ---------------------------------------------------------------------------------------

MODEL_FILES = ("vocab.json", "tokenizer.json", "lm/config.json", "lm/model.safetensors", "vq/config.json",
               "vq/diffusion_pytorch_model.safetensors", "generation.json")


@contextmanager
def model_copy(model_dir: Path) -> Iterator[Path]:
    with scratch() as root:
        shutil.copytree(model_dir, root / "model")
        yield root / "model"


def load_dir(path: Path):
    from molora.models.families.shapes.loading import load_model_dir

    return refused_or_loaded(lambda: load_model_dir(path, device="cpu", threads=0))


@FUZZ
@given(name=st.sampled_from(MODEL_FILES), how=st.sampled_from(["random", "truncate", "flip", "empty", "nasty"]),
       data=st.binary(max_size=1024), cut=st.floats(0, 0.999), changes=edits, nasty=st.sampled_from(NASTY_JSON))
def test_a_damaged_model_directory_file_is_refused_or_loads(tiny_model_dir, name, how, data, cut, changes, nasty):
    with model_copy(tiny_model_dir) as model:
        path = model / name
        good = path.read_bytes() if path.is_file() else b"{}"
        path.write_bytes({"random": data, "truncate": good[:int(cut * len(good))], "flip": flip_bytes(good, changes),
                          "empty": b"", "nasty": nasty}[how])
        loaded = load_dir(model)
        if how in ("random", "truncate", "empty") and name.endswith(".safetensors"):
            assert loaded is None


@settings(FUZZ, max_examples=10)
@given(defaults=st.dictionaries(
    st.sampled_from(["max_new_tokens", "text", "image", "cfg_scale", "seed", "max_images", "start_image",
                     "min_new_tokens", "best_of", "check", "negative_prompt", "temperature", "unknown"]),
    json_values | st.sampled_from([0, -1, 2 ** 63, 1e309, {"temperature": -1}, {"top_k": "x"}, {"top_p": 2}]),
    min_size=1, max_size=3))
def test_fuzzed_generation_defaults_are_refused_when_the_pipeline_is_built(tiny_assets, defaults):
    """generation.json is read by the loader and turned into a GenerationConfig by the pipeline: a project error
    at load time, never a later failure in generate."""
    from molora.models import InterleavedPipeline

    with model_copy(tiny_assets / "model") as model:
        (model / "generation.json").write_text(json.dumps(defaults))
        pipeline = refused_or_loaded(lambda: InterleavedPipeline.from_pretrained(model, device="cpu"))
        if pipeline is not None:
            try:
                pipeline.generate("a red circle", max_new_tokens=2, seed=0)
            finally:
                pipeline.engine.close()


@settings(FUZZ, max_examples=12)
@example(changes={"rank_pattern": {"q_proj": 2 ** 28}}, empty_rank=None)  # found: 128 GB of slots allocated
@example(changes={}, empty_rank=2 ** 62)
@given(changes=st.dictionaries(st.sampled_from(["r", "rank_pattern", "lora_alpha", "peft_type"]),
                               st.sampled_from([2 ** 28, 2 ** 62, -1, 0, "x", {"q_proj": 2 ** 28}, {"q_proj": -1},
                                                {"(": 2}, [4], "IA3"]), max_size=2),
       empty_rank=st.sampled_from([None, 2 ** 28, 2 ** 62]))
def test_a_bad_adapter_beside_the_model_is_refused_before_the_hot_set_is_sized(tiny_assets, good_adapter, changes,
                                                                               empty_rank):
    """The pipeline sizes its slots (r_max) from the adapters it finds: from their weights' headers, never from a
    config's r / rank_pattern (2**28 allocated 128 GB), nor from an empty A of a huge declared rank."""
    from molora.models import InterleavedPipeline

    config, _, tensors = good_adapter
    weights = dict(tensors)
    if empty_rank is not None:
        weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(empty_rank, 0)
    with model_copy(tiny_assets / "model") as model:
        folder = model / "adapters" / "fuzzed"
        folder.mkdir(parents=True)
        (folder / CONFIG_NAME).write_text(json.dumps({**json.loads(config), **changes}))
        save_file(weights, str(folder / WEIGHTS_NAME))
        pipeline = refused_or_loaded(lambda: InterleavedPipeline.from_pretrained(model, device="cpu"))
        if pipeline is not None:
            assert pipeline.routed.cache.r_max <= 16
            pipeline.engine.close()


vocab_fields = st.sampled_from(["vocab_size", "text_start", "text_size", "image_start", "image_size", "pad_id",
                                "bos_id", "eoi_id", "image_grid", "row_end_ids", "special_tokens", "extra"])


@FUZZ
@example(changes={"image_grid": []}, drop=set())  # found: IndexError
@example(changes={"special_tokens": 5}, drop=set())  # found: AttributeError
@given(changes=st.dictionaries(vocab_fields, json_values | st.sampled_from([0, -1, 2 ** 40, 2 ** 63, [16], [0, 16],
                                                                            [16, 16, 16], ["a", 1], [2 ** 40, 1]]),
                               min_size=1, max_size=3),
       drop=st.sets(vocab_fields, max_size=2))
def test_a_fuzzed_vocab_json_is_refused_or_loads(tiny_model_dir, changes, drop):
    from molora.models.engine.vocab import UnifiedVocab
    from molora.models.families.shapes.tokenizer import UnifiedTokenizer

    with model_copy(tiny_model_dir) as model:
        vocab = {k: v for k, v in {**json.loads((model / "vocab.json").read_text()), **changes}.items() if k not in drop}
        (model / "vocab.json").write_text(json.dumps(vocab))
        refused_or_loaded(lambda: UnifiedVocab.load(model / "vocab.json"))
        refused_or_loaded(lambda: UnifiedTokenizer.load(model))
        load_dir(model)


def _tokenizer_edit(how: str, value: int) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        if how == "padding":
            t["padding"] = {"strategy": {"Fixed": value}, "direction": "Right", "pad_to_multiple_of": None,
                            "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}
        elif how == "truncation":
            t["truncation"] = {"max_length": value, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}
        elif how == "no_added_tokens":
            t["added_tokens"] = []
        elif how == "special_id":
            t["added_tokens"][value % len(t["added_tokens"])]["id"] = value
        elif how == "vocab_id":
            t["model"]["vocab"]["zzz"] = value
        elif how == "model_type":
            t["model"]["type"] = ("WordPiece", "Unigram", "WordLevel", "Foo")[value % 4]
        elif how == "merges":
            t["model"]["merges"] = [["qq", "ww"]] if value % 2 else [[1, 2]]
    return edit


@FUZZ
@example(how="padding", value=2 ** 33)  # found: the process aborted on the first encode
@given(how=st.sampled_from(["padding", "truncation", "no_added_tokens", "special_id", "vocab_id", "model_type",
                            "merges"]),
       value=st.sampled_from([0, 1, 3, 7, 2 ** 20, 2 ** 33, 2 ** 40, -1]))
def test_a_fuzzed_tokenizer_json_is_refused_or_encodes_exactly(tiny_model_dir, how, value):
    """Settings inside tokenizer.json never change the ids: padding to 2**33 aborted the process on encode."""
    from molora.models.families.shapes.tokenizer import UnifiedTokenizer

    good = UnifiedTokenizer.load(tiny_model_dir)
    with model_copy(tiny_model_dir) as model:
        data = json.loads((model / "tokenizer.json").read_text())
        _tokenizer_edit(how, value)(data)
        (model / "tokenizer.json").write_text(json.dumps(data))
        tok = refused_or_loaded(lambda: UnifiedTokenizer.load(model))
        if tok is not None and how in ("padding", "truncation"):
            text = "a red circle in the top left " * 3
            assert tok.encode_text(text) == good.encode_text(text)


lm_fields = st.sampled_from(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "intermediate_size", "max_position_embeddings", "model_type",
                             "architectures", "torch_dtype", "dtype", "rope_theta", "tie_word_embeddings"])


@FUZZ
@example(changes={"num_attention_heads": 0})  # found: ZeroDivisionError
@example(changes={"num_hidden_layers": 10 ** 6})
@given(changes=st.dictionaries(lm_fields, st.sampled_from([0, -1, 1, 3, 64, 10 ** 6, 2 ** 40, None, "x", 1.5, [1],
                                                           "bert", "gpt2", "emu3", "chameleon", "t5", "llama",
                                                           "float8", ["BertModel"], True]),
                               min_size=1, max_size=3))
def test_a_fuzzed_lm_config_is_refused_without_allocating_its_declared_size(tiny_model_dir, changes):
    """Huge declared sizes are caught against the checkpoint's header before the model is built."""
    with model_copy(tiny_model_dir) as model:
        config = {**json.loads((model / "lm" / "config.json").read_text()), **changes}
        (model / "lm" / "config.json").write_text(json.dumps(config))
        load_dir(model)


vq_fields = st.sampled_from(["block_out_channels", "down_block_types", "up_block_types", "layers_per_block",
                             "latent_channels", "vq_embed_dim", "num_vq_embeddings", "norm_num_groups", "sample_size",
                             "in_channels", "out_channels", "_class_name", "norm_type", "act_fn"])


@FUZZ
@given(changes=st.dictionaries(vq_fields, st.sampled_from([0, -1, 1, 3, 7, 10 ** 6, 2 ** 40, None, "x", 1.5, [],
                                                           [8] * 2000, [8, 8], [2 ** 40, 8, 8], ["DownEncoderBlock2D"],
                                                           "UNet2DModel", "spatial", "gelu"]),
                               min_size=1, max_size=3))
def test_a_fuzzed_vq_config_is_refused_without_allocating_its_declared_size(tiny_model_dir, changes):
    from molora.models.families.shapes.image_tokenizer import ImageTokenizer

    with model_copy(tiny_model_dir) as model:
        config = {**json.loads((model / "vq" / "config.json").read_text()), **changes}
        (model / "vq" / "config.json").write_text(json.dumps(config))
        refused_or_loaded(lambda: ImageTokenizer.from_pretrained(model / "vq"))
        load_dir(model)


@pytest.mark.parametrize("positions", [2 ** 40, 2 ** 62])
def test_a_declared_context_too_long_for_memory_is_refused_when_the_pipeline_is_built(tiny_model_dir, positions):
    """max_position_embeddings sizes the engine's KV cache and no weight bounds it (rotary positions): a length
    whose cache cannot fit is a project error at load, not an allocation failure at the first generate."""
    from molora.models import InterleavedPipeline

    with model_copy(tiny_model_dir) as model:
        config = {**json.loads((model / "lm" / "config.json").read_text()), "max_position_embeddings": positions}
        (model / "lm" / "config.json").write_text(json.dumps(config))
        with pytest.raises(MoLoRAError, match="KV cache.*max_len"):
            InterleavedPipeline.from_pretrained(model, device="cpu")


def _family_configs() -> list[dict]:
    from transformers import BertConfig, ChameleonConfig, Emu3Config, GPT2Config, JanusConfig, T5Config

    return [c().to_dict() for c in (BertConfig, GPT2Config, T5Config, Emu3Config, ChameleonConfig, JanusConfig)]


@pytest.mark.parametrize("index", range(6))
def test_an_lm_config_of_another_family_is_refused(tiny_model_dir, index):
    """The embedded model's lm/ with another family's config.json: weights do not fit, an error names them."""
    from molora.models.families.loading import ModelDirError
    from molora.models.families.shapes.loading import load_model_dir

    with model_copy(tiny_model_dir) as model:
        (model / "lm" / "config.json").write_text(json.dumps(_family_configs()[index], default=str))
        with pytest.raises(ModelDirError, match="lm"):
            load_model_dir(model, device="cpu", threads=0)


def _mutate_checkpoint(path: Path, how: str, index: int) -> None:
    tensors, metadata = read_tensors(path)
    key = sorted(tensors)[index % len(tensors)]
    t = tensors[key]
    if how == "rename":
        tensors[key.replace("weight", "wieght") if "weight" in key else key + ".x"] = tensors.pop(key)
    elif how == "drop":
        del tensors[key]
    elif how == "int":
        tensors[key] = t.to(torch.int32)
    elif how == "bool":
        tensors[key] = t > 0
    elif how == "half":
        tensors[key] = t.half()  # a float of another width is fine: the loader casts
    elif how == "nan":
        tensors[key] = t.clone().reshape(-1).index_fill_(0, torch.tensor([0]), float("nan")).reshape(t.shape)
    elif how == "inf":
        tensors[key] = t.clone().reshape(-1).index_fill_(0, torch.tensor([0]), float("inf")).reshape(t.shape)
    elif how == "shape":
        tensors[key] = torch.zeros(*[d + 1 for d in t.shape]) if t.dim() else torch.zeros(2)
    elif how == "extra":
        tensors["model.layers.99.unknown.weight"] = torch.zeros(2)
    save_file(tensors, str(path), metadata=metadata)


CHECKPOINT_EDITS = ("rename", "drop", "int", "bool", "half", "nan", "inf", "shape", "extra")


@FUZZ
@given(which=st.sampled_from(["lm/model.safetensors", "vq/diffusion_pytorch_model.safetensors"]),
       how=st.sampled_from(CHECKPOINT_EDITS), index=st.integers(0, 500))
def test_renamed_retyped_or_non_finite_checkpoint_tensors_are_refused(tiny_model_dir, which, how, index):
    with model_copy(tiny_model_dir) as model:
        _mutate_checkpoint(model / which, how, index)
        loaded = load_dir(model)
        if how in ("rename", "drop", "int", "bool", "nan", "inf", "shape"):
            assert loaded is None, f"{which}: {how} went unnoticed"


# --- transformers families (Emu3, Chameleon, Janus: models/families/hf.py) ---------------------------------------

@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from molora.models.families.chameleon.testing import build_tiny_chameleon
    from molora.models.families.emu3.testing import build_tiny_emu3
    from molora.models.families.janus.testing import build_tiny_janus

    root = tmp_path_factory.mktemp("hf_models")
    return {"emu3": build_tiny_emu3(root / "emu3"), "chameleon": build_tiny_chameleon(root / "chameleon"),
            "janus": build_tiny_janus(root / "janus")}


HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
            "generation.json")
hf_config_changes = st.dictionaries(
    st.sampled_from(["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "intermediate_size", "codebook_size", "embed_dim", "base_channels", "model_type", "num_res_blocks",
                     "image_token_id", "vocabulary_map", "vq_config", "text_config", "vision_config"]),
    st.sampled_from([0, -1, 1, 3, 10 ** 5, 2 ** 40, None, "x", 1.5, [], {}, "emu3", "chameleon", "janus", "llama"]),
    min_size=1, max_size=3)


@FEW
@example(family="emu3", name="config.json", how="config", data=b"", cut=0.0, changes=[(0, 0)], nasty=b"{}",
         config={"num_hidden_layers": 10 ** 5}, nested="text_config", edit="drop", index=0)  # found: 188 s, GBs
@example(family="emu3", name="config.json", how="config", data=b"", cut=0.0, changes=[(0, 0)], nasty=b"{}",
         config={"model_type": "chameleon"}, nested=None, edit="drop", index=0)  # found: AttributeError
@example(family="chameleon", name="config.json", how="nasty", data=b"", cut=0.0, changes=[(0, 0)],
         nasty=b"[" * 100_000, config={"x": 0}, nested=None, edit="drop", index=0)  # found: RecursionError
@given(family=st.sampled_from(["emu3", "chameleon", "janus"]), name=st.sampled_from(HF_FILES),
       how=st.sampled_from(["random", "truncate", "flip", "nasty", "config", "tensors"]),
       data=st.binary(max_size=512), cut=st.floats(0, 0.999), changes=edits, nasty=st.sampled_from(NASTY_JSON),
       config=hf_config_changes, nested=st.sampled_from([None, "text_config", "vq_config", "vision_config"]),
       edit=st.sampled_from(CHECKPOINT_EDITS), index=st.integers(0, 500))
def test_a_damaged_transformers_family_folder_is_refused_or_loads(hf_models, family, name, how, data, cut, changes,
                                                                   nasty, config, nested, edit, index):
    """Another family's config, huge or broken sizes, damaged weights and tokenizer files: a project error."""
    from molora.models.families.family import load_family_model

    with scratch() as root:
        model = shutil.copytree(hf_models[family], root / family)
        path = model / name
        good = path.read_bytes() if path.is_file() else b"{}"
        if how == "config":
            path = model / "config.json"
            data = json.loads(path.read_text())
            target = data.get(nested) if nested else data
            (target if isinstance(target, dict) else data).update(config)
            path.write_text(json.dumps(data))
        elif how == "tensors":
            _mutate_checkpoint(model / "model.safetensors", edit, index)
        else:
            path.write_bytes({"random": data, "truncate": good[:int(cut * len(good))], "flip": flip_bytes(good, changes),
                              "nasty": nasty}[how])
        loaded = refused_or_loaded(lambda: load_family_model(model, device="cpu", threads=0))
        if how == "tensors" and edit in ("rename", "drop", "int", "bool", "nan", "inf", "shape"):
            assert loaded is None, f"{family}: {edit} went unnoticed"


# --- uploads (app/uploads.py, then the pipeline, as the app does) -----------------------------------------------

def _zip(entries: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            archive.writestr(name, data)
    return buffer.getvalue()


upload_names = st.sampled_from([CONFIG_NAME, WEIGHTS_NAME, "a/" + CONFIG_NAME, "a/" + WEIGHTS_NAME, "molora.json",
                                "a/molora.json", "../" + WEIGHTS_NAME, "/etc/x", "a/b/c.json", "README.md",
                                "adapter_model.bin", "__MACOSX/._x", "b/" + CONFIG_NAME])


@FUZZ
@example(entries=[("a/" + CONFIG_NAME, "config"), ("a/" + WEIGHTS_NAME, "weights"), ("a/molora.json", "nasty")],
         random=b"", cut=0.0, changes=[(0, 0)], as_zip=True, nasty=b"[" * 100_000)  # found: RecursionError
@given(entries=st.lists(st.tuples(upload_names, st.sampled_from(["config", "weights", "random", "truncated",
                                                                 "flipped", "meta", "nasty"])), max_size=5),
       random=st.binary(max_size=512), cut=st.floats(0, 0.999), changes=edits, as_zip=st.booleans(),
       nasty=st.sampled_from(NASTY_JSON))
def test_an_upload_is_refused_or_loads_leaving_the_pipeline_untouched(pipe, good_adapter, entries, random, cut,
                                                                      changes, as_zip, nasty):
    from molora.app.uploads import remove_folder, validate_upload

    config, weights, _ = good_adapter
    contents = {"config": config, "weights": weights, "random": random, "truncated": weights[:int(cut * len(weights))],
                "flipped": flip_bytes(weights, changes), "meta": b'{"modality": "text"}', "nasty": nasty}
    files = [(name, contents[kind]) for name, kind in entries]
    before = (dict(pipe.adapters), pipe.routed.cache.stats())
    with scratch() as root:
        if as_zip:
            (root / "up.zip").write_bytes(_zip(files))
            paths = [root / "up.zip"]
        else:
            paths = []
            for i, (name, data) in enumerate(files):
                (root / str(i)).mkdir()
                path = root / str(i) / Path(name).name
                path.write_bytes(data)
                paths.append(path)
        upload = refused_or_loaded(lambda: validate_upload(paths))
        if upload is None:
            return
        folder = upload.write(root)
        name = refused_or_loaded(lambda: pipe.load_adapter(folder, name="uploaded"))
        if name is None:
            remove_folder(folder)
            assert (dict(pipe.adapters), pipe.routed.cache.stats()) == before
        else:
            pipe.remove_adapter(name)
