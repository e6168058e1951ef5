"""Models placed over devices (issue 14, "Beyond one GPU"): device_map / max_memory through transformers and
accelerate, routed slots on each layer's device, routing copied to each device, the engine on such a model.

On the CPU there is one real device, so: accelerate's real dispatch with every module on "cpu" (hooks on every
module), disk offload (weights streamed in per call, as "cpu" offload does beside a GPU), the spread path forced on
one device (PlacedRouting and per-device tables run, copies are no-ops), and a block moved to "meta" for where the
slots and the routing copies land.  benchmarks/device_map_check.py runs the real splits on GPUs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from molora.models.families.loading import PlacementError
from molora.models.families.shapes.loading import load_model_dir
from molora.models.pipeline import InterleavedPipeline
from molora.routing import LearnedGates, MoLoRAError, attach_routed_lora
from molora.routing import model as routing_model
from molora.routing.context import PlacedRouting
from molora.routing.lora import RoutedLoRALinear

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def block_map(where_last: str = "cpu") -> dict[str, str]:
    """Every module of the tiny shapes LM on "cpu", its last block on `where_last`."""
    return {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
            "model.layers.1": where_last, "model.norm": "cpu", "lm_head": "cpu"}


def vocab_tokens(pipe: InterleavedPipeline) -> list[int]:
    """Greedy tokens of a text + picture document, text and image positions routed to two adapters."""
    doc = pipe.generate("a red circle", seed=0, start_image=True, temperature=0.0, cfg_scale=1.0,
                        max_new_tokens=pipe.vocab.image_span_tokens + 4, text_adapter="text_style",
                        image_adapter="image_style", routing="vocab")
    return [r.id for r in doc.routing]


def learned_tokens(pipe: InterleavedPipeline, gates: Path) -> list[tuple[int, str | None]]:
    """Greedy tokens of a text document routed by learned gates (top-2), with the adapter each token took."""
    pipe.load_learned_router(gates, top_k=2)
    doc = pipe.generate("two blue squares", seed=0, temperature=0.0, max_new_tokens=12, min_new_tokens=12,
                        max_images=0, routing="learned")
    return [(r.id, r.adapter) for r in doc.routing]


@pytest.fixture(scope="module")
def gates(tiny_pipeline, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gates") / "gates.safetensors"
    torch.manual_seed(3)
    LearnedGates.for_model(tiny_pipeline.routed, ["text_style", "image_style"], init_std=1.0).save(path)
    return path


@pytest.fixture(scope="module")
def plain(tiny_model_dir, gates):
    pipe = InterleavedPipeline.from_pretrained(tiny_model_dir, device="cpu")
    return vocab_tokens(pipe), learned_tokens(pipe, gates)


def test_device_and_device_map_together_are_refused_before_loading(tiny_model_dir, tmp_path):
    with pytest.raises(PlacementError, match="not both"):
        InterleavedPipeline.from_pretrained(tiny_model_dir, device="cpu", device_map="auto")
    with pytest.raises(PlacementError, match="need device_map"):
        InterleavedPipeline.from_pretrained(tiny_model_dir, max_memory={"cpu": "1GiB"})
    with pytest.raises(PlacementError, match="max_memory must be"):
        InterleavedPipeline.from_pretrained(tiny_model_dir, device_map="auto", max_memory="1GiB")
    assert issubclass(PlacementError, MoLoRAError)


def test_max_memory_passes_through_and_offloaded_layers_give_the_plain_tokens(tiny_model_dir, tmp_path, plain,
                                                                                 gates):
    # the tiny LM holds ~170 kB of weights: 60 kB of "cpu" sends the rest to disk, so max_memory was read
    pipe = InterleavedPipeline.from_pretrained(tiny_model_dir, device_map="auto", max_memory={"cpu": 60_000},
                                               offload_folder=tmp_path / "offload")
    assert "disk" in pipe.routed.model.hf_device_map.values()
    assert pipe.routed.placement.offloaded and not pipe.routed.placement.spread
    assert pipe.device == torch.device("cpu")
    assert vocab_tokens(pipe) == plain[0]
    assert learned_tokens(pipe, gates) == plain[1]


def test_an_explicit_device_map_with_a_block_on_disk_keeps_accelerates_hooks(tiny_model_dir, tmp_path, plain,
                                                                               gates):
    pipe = InterleavedPipeline.from_pretrained(tiny_model_dir, device_map=block_map("disk"),
                                               offload_folder=tmp_path / "offload")
    lm = pipe.routed.model
    assert lm.hf_device_map == block_map("disk")
    offloaded = lm.model.layers[1].self_attn.q_proj
    assert isinstance(offloaded, RoutedLoRALinear) and hasattr(offloaded, "_hf_hook")
    assert offloaded.weight.device.type == "meta"  # streamed in per call by the hook it kept
    assert offloaded.lora_A.device == torch.device("cpu")  # its slots live where it computes
    assert vocab_tokens(pipe) == plain[0]
    assert learned_tokens(pipe, gates) == plain[1]


def test_accelerates_dispatch_with_hooks_on_every_module_gives_the_plain_tokens(tiny_model_dir, plain, gates):
    from accelerate import dispatch_model

    loaded = load_model_dir(tiny_model_dir, device="cpu")
    dispatch_model(loaded.lm, block_map("cpu"), force_hooks=True, skip_keys=loaded.lm._skip_keys_device_placement)
    pipe = InterleavedPipeline(loaded)
    layers = list(pipe.routed.cache.layers.values())
    assert all(hasattr(layer, "_hf_hook") for layer in layers)
    assert pipe.routed.placement is not None and pipe.routed.placement.one_device
    assert vocab_tokens(pipe) == plain[0]
    assert learned_tokens(pipe, gates) == plain[1]


def test_the_spread_path_gives_the_plain_tokens(tiny_model_dir, plain, gates, monkeypatch):
    """Force the placement a multi-device model gets (here all on the CPU): every layer reads its routing through
    PlacedRouting by (block, device), the engine sizes the KV cache per block device."""
    found = routing_model.find_placement

    def spread(*args, **kwargs):
        placement = found(*args, **kwargs)
        placement.spread = True
        return placement

    monkeypatch.setattr(routing_model, "find_placement", spread)
    pipe = InterleavedPipeline.from_pretrained(tiny_model_dir, device="cpu")
    layers = list(pipe.routed.cache.layers.values())
    assert all(layer.route_key == (layer.block, torch.device("cpu")) for layer in layers)
    seen = []
    run = pipe.routed.run
    monkeypatch.setattr(pipe.routed, "run", lambda ids, plan, **kw: (seen.append(type(plan)), run(ids, plan, **kw))[1])
    assert vocab_tokens(pipe) == plain[0]
    assert learned_tokens(pipe, gates) == plain[1]
    assert PlacedRouting in seen
    assert pipe.engine.layer_devices == [torch.device("cpu")] * 2  # KV per block device (here one: a plain cache)


def test_slots_and_routing_copies_live_on_each_layers_device(tiny_model_dir):
    """Block 1 moved to "meta" (a device of its own, honestly: nothing runs there): its layers' slots are allocated
    there, adapters are written to every layer's own device, and PlacedRouting gives each device one copy per
    forward."""
    from molora.models.engine.kv_cache import PlacedRowKVCache, RowKVCache
    from molora.models.engine.synthetic import random_adapters

    lm = load_model_dir(tiny_model_dir, device="cpu").lm
    lm.model.layers[1].to("meta")
    routed = attach_routed_lora(lm, num_slots=2, r_max=4)
    placement = routed.placement
    assert placement.spread and placement.block_devices == [torch.device("cpu"), torch.device("meta")]
    for layer in routed.cache.layers.values():
        assert layer.lora_A.device == layer.weight.device == torch.device("cpu" if layer.block == 0 else "meta")
        assert layer.route_key == (layer.block, layer.lora_A.device)
    adapter = random_adapters(routed, ["a"], rank=4)[0]
    routed.add_adapter(adapter)
    slot = routed.cache.acquire(["a"])[0]
    q0 = lm.model.layers[0].self_attn.q_proj
    a, _ = adapter.weights["model.layers.0.self_attn.q_proj"]
    assert torch.allclose(q0.lora_A[slot, :4], a)  # written on the CPU layer; the meta layer took its copy silently
    slots = torch.tensor([slot, -1, slot])
    plan = routed.make_routing(1, 3, slots, 2)
    assert isinstance(plan, PlacedRouting)
    cpu_slots, _ = plan.kernel_slots((0, torch.device("cpu")))
    meta_slots, _ = plan.kernel_slots((1, torch.device("meta")))
    assert cpu_slots.device.type == "cpu" and meta_slots.device.type == "meta" and meta_slots.shape == (3, 1)
    assert plan.kernel_slots((1, torch.device("meta")))[0] is meta_slots  # once per forward per device
    assert plan.kernel_slots((0, torch.device("meta")))[0] is meta_slots  # shared by every block there
    assert plan.meta((1, torch.device("meta"))) is plan.meta((0, torch.device("meta")))
    kv = RowKVCache.for_model(lm.config, 2, 8, dtype=torch.float32, device="cpu",
                              layer_devices=placement.block_devices)
    assert isinstance(kv, PlacedRowKVCache)
    assert [k.device.type for k in kv.keys] == ["cpu", "meta"]


def test_a_model_on_one_device_keeps_the_plain_routing_path(tiny_pipeline):
    routed = tiny_pipeline.routed
    assert routed.placement is None
    assert all(type(layer) is RoutedLoRALinear and layer.route_key == layer.block
               for layer in routed.cache.layers.values())
    assert routed.make_routing(1, 1, torch.tensor([-1]), routed.cache.num_slots).__class__.__name__ == "CallRouting"


def test_emu3_loads_with_a_device_map_and_gives_the_plain_tokens(tmp_path):
    from transformers import Emu3ForConditionalGeneration

    from molora.models.families.emu3.family import LORA_TARGETS
    from molora.models.families.emu3.testing import build_tiny_emu3
    from tests.family_checks import make_peft_adapter

    path = build_tiny_emu3(tmp_path / "emu3")
    make_peft_adapter(Emu3ForConditionalGeneration, path, path / "adapters" / "txt", LORA_TARGETS, seed=1)
    make_peft_adapter(Emu3ForConditionalGeneration, path, path / "adapters" / "img", LORA_TARGETS, seed=2)
    device_map = {"model.vqmodel": "cpu", "model.text_model.embed_tokens": "cpu",
                  "model.text_model.rotary_emb": "cpu", "model.text_model.layers.0": "cpu",
                  "model.text_model.layers.1": "disk", "model.text_model.norm": "cpu", "lm_head": "cpu"}
    kw = dict(seed=0, temperature=0.0, cfg_scale=1.0, start_image=True, text_adapter="txt", image_adapter="img",
              routing="vocab")
    plain = InterleavedPipeline.from_pretrained(path, device="cpu", grid=(2, 2))
    placed = InterleavedPipeline.from_pretrained(path, device_map=device_map, offload_folder=tmp_path / "off",
                                                 grid=(2, 2))
    assert placed.routed.placement.offloaded
    n = plain.vocab.image_span_tokens + 4
    want = plain.generate("draw a cat", max_new_tokens=n, **kw)
    got = placed.generate("draw a cat", max_new_tokens=n, **kw)
    assert [r.id for r in got.routing] == [r.id for r in want.routing]
    with pytest.raises(PlacementError):
        InterleavedPipeline.from_pretrained(path, device="cpu", device_map=device_map, grid=(2, 2))


def test_the_gpu_check_runs_on_the_cpu():
    out = subprocess.run([sys.executable, "benchmarks/device_map_check.py", "--shape", "tiny", "--new", "6",
                          "--requests", "2", "--prompt", "5"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cpu + disk offload" in out.stdout and "all placements gave the one-device tokens" in out.stdout
