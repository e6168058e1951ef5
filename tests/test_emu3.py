"""Emu3 as a model family, on a tiny random Emu3ForConditionalGeneration + Emu3Processor saved with save_pretrained
(nothing downloaded): its vocabulary on the engine's layout, Emu3's picture grammar forced by our state machine,
the routing rule on every generated token, pictures decoded by its VQ-VAE, and PEFT adapters made by `peft`."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_picture_grammar, check_routing_rule, make_peft_adapter
from PIL import Image

from molora.models import InterleavedPipeline
from molora.models.families.emu3.family import LORA_TARGETS
from molora.models.families.emu3.testing import build_tiny_emu3
from molora.models.families.loading import ModelDirError
from molora.routing import SequenceRouter, VocabRangeRouter

GRID = (4, 4)


@pytest.fixture(scope="module")
def emu3_dir(tmp_path_factory):
    from transformers import Emu3ForConditionalGeneration

    path = build_tiny_emu3(tmp_path_factory.mktemp("emu3") / "tiny-emu3")
    make_peft_adapter(Emu3ForConditionalGeneration, path, path / "adapters" / "txt", LORA_TARGETS, seed=1)
    make_peft_adapter(Emu3ForConditionalGeneration, path, path / "adapters" / "img", LORA_TARGETS, seed=2)
    return path


@pytest.fixture(scope="module")
def emu3(emu3_dir):
    return InterleavedPipeline.from_pretrained(emu3_dir, device="cpu", grid=GRID)


def test_the_directory_is_recognised_as_emu3_and_its_vocabulary_maps_onto_the_layout(emu3):
    v, hf = emu3.vocab, emu3.tokenizer.hf
    assert emu3.family == "emu3" and sorted(emu3.adapters) == ["img", "txt"]
    assert [v.image_start + c for c in range(v.image_size)] == \
        hf.convert_tokens_to_ids([f"<|visual token {c:06d}|>" for c in range(v.image_size)])
    assert v.row_end_ids == (hf.convert_tokens_to_ids("<|extra_200|>"),)
    assert (v.boi_id, v.eoi_id) == tuple(hf.convert_tokens_to_ids(["<|image start|>", "<|image end|>"]))
    assert hf.decode(list(v.image_prefix_ids)) == "4*4<|image token|>"
    assert v.image_suffix_ids == (hf.convert_tokens_to_ids("<|extra_201|>"),)
    # our picture span is Emu3's own layout: Emu3ImageVocabularyMapping.convert_img2bpe rows, with the header
    codes = torch.randint(0, v.image_size, (4, 4))
    ids = emu3.tokenizer.image_span(codes)
    ours = ids[1 + len(v.image_prefix_ids):-1 - len(v.image_suffix_ids)]
    theirs = emu3.routed.model.model.vocabulary_mapping.convert_img2bpe(codes.int()).flatten().tolist()
    assert ours == theirs
    assert torch.equal(emu3.tokenizer.codes_from_ids(ids[1:-1]), codes)


def test_routed_lora_wraps_only_the_language_model(emu3):
    names = list(emu3.routed.cache.layers)
    assert names and all(n.startswith("model.text_model.layers.") for n in names)
    assert len(names) == 2 * 7


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_generated_documents_follow_emu3_grammar_and_the_routing_rule(emu3, cfg_scale):
    v = emu3.vocab
    budget = 2 * v.image_span_tokens + 10
    docs = emu3.generate(["draw a cat", "two blue squares"], seed=3, start_image=True, max_new_tokens=budget,
                         min_new_tokens=budget, text_adapter="txt", image_adapter="img", routing="vocab",
                         cfg_scale=cfg_scale, temperature=1.0)
    for doc in docs:
        prompt = emu3.encode_prompt(doc.prompt, emu3.default_config.with_overrides(start_image=True), budget)[0]
        tokens = [r.id for r in doc.routing]
        assert len(tokens) == budget
        assert check_picture_grammar(v, prompt, tokens) >= 1
        check_routing_rule(v, prompt, doc, "txt", "img")
        assert all(im.size == (GRID[1] * 8, GRID[0] * 8) for im in doc.images)


def test_a_picture_of_the_configured_grid_is_decoded_by_the_vq(emu3_dir):
    pipe = InterleavedPipeline.from_pretrained(emu3_dir, device="cpu", grid=(2, 3))
    doc = pipe.generate("draw a cat", seed=0, start_image=True, max_new_tokens=pipe.vocab.tokens_per_image + 1,
                        cfg_scale=1.0)
    (image,) = doc.images
    assert image.size == (3 * 8, 2 * 8) and image.mode == "RGB"
    assert pipe.tokenizer.hf.decode(list(pipe.vocab.image_prefix_ids)) == "2*3<|image token|>"


def test_a_prompt_picture_is_encoded_as_emu3_encodes_it(emu3):
    image = Image.fromarray((torch.rand(32, 32, 3) * 255).byte().numpy())
    ours = emu3.image_tokenizer.encode(image)[0]
    processor = emu3.image_tokenizer.processor
    pixels = processor.image_processor(image, return_tensors="pt")
    vq = emu3.routed.model.model.vqmodel
    theirs = vq.encode(pixels["pixel_values"], pixels["image_sizes"], return_dict=True).image_tokens[0]
    assert torch.equal(ours, theirs.long())
    doc = emu3.generate(["describe this picture", image], seed=0, max_new_tokens=6, text_adapter="txt",
                        image_adapter="img", max_images=0)
    assert doc.meta["prompt_tokens"] > emu3.vocab.image_span_tokens


def test_every_token_to_one_adapter_equals_peft(emu3, emu3_dir):
    from peft import PeftModel
    from transformers import Emu3ForConditionalGeneration

    v = emu3.vocab
    ids = torch.tensor([[v.bos_id, *emu3.tokenizer.encode_text("draw a cat"),
                         *emu3.tokenizer.image_span(torch.randint(0, v.image_size, GRID))]])
    reference = PeftModel.from_pretrained(Emu3ForConditionalGeneration.from_pretrained(str(emu3_dir)),
                                          str(emu3_dir / "adapters" / "txt")).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        base = emu3.routed(ids).logits
        for router in (SequenceRouter("txt"), VocabRangeRouter(v, "txt", "txt")):
            got = emu3.routed(ids, routers=router).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        mixed = emu3.routed(ids, routers=VocabRangeRouter(v, "txt", "img")).logits
    assert (base - expected).abs().max() > 1e-2  # the adapter does something
    assert (mixed - expected).abs().max() > 1e-3  # and image positions went elsewhere


def test_missing_weights_are_an_error_not_a_warning(emu3_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(emu3_dir, broken, ignore=shutil.ignore_patterns("adapters"))
    weights = load_file(str(broken / "model.safetensors"))
    dropped = next(k for k in weights if "layers.0.self_attn.q_proj" in k)
    del weights[dropped]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelDirError, match="missing"):
        InterleavedPipeline.from_pretrained(broken, device="cpu", grid=GRID)


def test_guidance_with_emu3s_negative_prompt_keeps_the_grammar(emu3):
    v = emu3.vocab
    budget = v.image_span_tokens + 4
    doc = emu3.generate("a lighthouse at dusk", seed=0, start_image=True, max_new_tokens=budget, cfg_scale=3.0,
                        negative_prompt="lowres, bad anatomy, blurry", text_adapter="txt", image_adapter="img")
    prompt = emu3.encode_prompt(doc.prompt, emu3.default_config.with_overrides(start_image=True), budget)[0]
    assert check_picture_grammar(v, prompt, [r.id for r in doc.routing]) == 1
    check_routing_rule(v, prompt, doc, "txt", "img")


def test_the_command_line_loads_emu3_with_a_grid_and_a_negative_prompt(emu3_dir, tmp_path):
    from molora.models.cli import main

    out = tmp_path / "doc.html"
    assert main(["draw a cat", "--model", str(emu3_dir), "--grid", "2x2", "--start-image", "--max-new-tokens", "20",
                 "--negative-prompt", "lowres", "--seed", "0", "--device", "cpu", "--out", str(out)]) == 0
    assert out.is_file()
    assert main(["draw a cat", "--model", str(emu3_dir), "--grid", "two", "--out", str(out)]) == 2


def test_learned_gates_route_emu3_text_positions(emu3_dir, tmp_path):
    from molora.routing import LearnedGates

    pipe = InterleavedPipeline.from_pretrained(emu3_dir, device="cpu", grid=(2, 2))
    torch.manual_seed(0)
    LearnedGates.for_model(pipe.routed, ["txt", "img"]).save(tmp_path / "gates.safetensors")
    pipe.load_learned_router(tmp_path / "gates.safetensors", top_k=1)
    v = pipe.vocab
    doc = pipe.generate("draw a cat", seed=0, start_image=True, max_new_tokens=v.image_span_tokens + 6,
                        min_new_tokens=v.image_span_tokens + 6, routing="learned", image_adapter="img")
    prompt = pipe.encode_prompt(doc.prompt, pipe.default_config.with_overrides(start_image=True), 30)[0]
    table = v.modality_table()
    inputs = [prompt[-1], *[r.id for r in doc.routing][:-1]]
    for record, source in zip(doc.routing, inputs):
        if table[source] == 1:  # image positions: the image adapter, as in vocabulary routing
            assert record.adapter == "img"
        else:  # text positions: whichever adapter the gates picked
            assert record.adapter in ("txt", "img")


def test_the_app_serves_an_emu3_directory(emu3_dir):
    from molora.app.server import create_demo, load_pipeline, warm_up

    pipe = load_pipeline(str(emu3_dir), "cpu", "2x2")
    assert pipe.family == "emu3" and pipe.vocab.image_grid == (2, 2)
    warm_up(pipe)
    demo = create_demo(pipe)
    assert demo is not None


def test_picture_progress_comes_once_per_row_after_the_header(emu3):
    from molora.models.engine.events import ImageProgress

    v = emu3.vocab
    events = list(emu3.stream("draw a cat", seed=0, start_image=True, max_new_tokens=v.tokens_per_image + 1,
                              cfg_scale=1.0))
    done = [e.done for e in events if isinstance(e, ImageProgress)]
    rows, cols = v.image_grid
    assert done == [len(v.image_prefix_ids) + (r + 1) * (cols + 1) for r in range(rows)]


def test_the_picture_size_can_come_from_an_area_and_a_ratio_as_emu3_computes_it(emu3_dir):
    pipe = InterleavedPipeline.from_pretrained(emu3_dir, device="cpu", image_area=32 * 32, ratio="2:1")
    assert pipe.vocab.image_grid == (3, 6)  # Emu3Processor.calculate_generate_size("2:1", 1024, 8)
    doc = pipe.generate("draw a cat", seed=0, start_image=True, max_new_tokens=pipe.vocab.tokens_per_image + 1,
                        cfg_scale=1.0)
    assert doc.images[0].size == (48, 24)
    with pytest.raises(ModelDirError, match="ratio"):
        InterleavedPipeline.from_pretrained(emu3_dir, device="cpu", ratio="wide")
