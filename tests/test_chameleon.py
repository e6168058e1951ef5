"""Chameleon / Anole as a model family, on a tiny random ChameleonForConditionalGeneration + ChameleonProcessor saved
with save_pretrained (nothing downloaded): its IMGIMG codes on the engine's layout, pictures of exactly one grid of
codes then <eoss>, the routing rule on every generated token, and the output said plainly: codes, not pixels."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_picture_grammar, check_routing_rule, make_peft_adapter
from PIL import Image

from molora.models import InterleavedPipeline
from molora.models.families.chameleon.family import CODE_PIXELS, LORA_TARGETS
from molora.models.families.chameleon.testing import build_tiny_chameleon, image_token_name
from molora.routing import SequenceRouter


@pytest.fixture(scope="module")
def chameleon_dir(tmp_path_factory):
    from transformers import ChameleonForConditionalGeneration

    path = build_tiny_chameleon(tmp_path_factory.mktemp("chameleon") / "tiny-chameleon")
    make_peft_adapter(ChameleonForConditionalGeneration, path, path / "adapters" / "txt", LORA_TARGETS, seed=1)
    make_peft_adapter(ChameleonForConditionalGeneration, path, path / "adapters" / "img", LORA_TARGETS, seed=2)
    return path


@pytest.fixture(scope="module")
def chameleon(chameleon_dir):
    return InterleavedPipeline.from_pretrained(chameleon_dir, device="cpu")


def test_the_directory_is_recognised_and_the_codes_map_onto_the_layout(chameleon):
    v, tok = chameleon.vocab, chameleon.tokenizer
    assert chameleon.family == "chameleon" and v.image_grid == (4, 4) and not v.row_end_ids
    assert (v.boi_id, v.eoi_id) == tuple(tok.hf.convert_tokens_to_ids(["<racm3:break>", "<eoss>"]))
    assert tok.img2bpe.tolist() == tok.hf.convert_tokens_to_ids([image_token_name(c) for c in range(v.image_size)])
    codes = torch.randint(0, v.image_size, (4, 4))
    ids = tok.image_span(codes)
    mapping = chameleon.routed.model.model.vocabulary_mapping
    assert ids[1:-1] == mapping.convert_img2bpe(codes.int()).flatten().tolist()
    assert torch.equal(tok.codes_from_ids(ids[1:-1]), codes)
    assert all(n.startswith("model.layers.") for n in chameleon.routed.cache.layers)


def test_image_codes_can_be_generated_the_forward_mask_is_lifted(chameleon):
    v = chameleon.vocab
    with torch.no_grad():
        logits = chameleon.routed(torch.tensor([[v.bos_id, v.boi_id]])).logits[0, -1]
    codes = logits[v.image_start:v.image_start + v.image_size]
    assert bool((codes > torch.finfo(logits.dtype).min).all()) and codes.unique().numel() > 1


def test_documents_hold_one_grid_of_codes_per_picture_routed_by_the_rule_and_kept_as_codes(chameleon):
    v = chameleon.vocab
    budget = 2 * v.image_span_tokens + 8
    docs = chameleon.generate(["draw a cat", "two blue squares"], seed=1, start_image=True, max_new_tokens=budget,
                              min_new_tokens=budget, text_adapter="txt", image_adapter="img", temperature=1.0)
    for doc in docs:
        prompt = chameleon.encode_prompt(doc.prompt, chameleon.default_config.with_overrides(start_image=True),
                                         budget)[0]
        tokens = [r.id for r in doc.routing]
        assert check_picture_grammar(v, prompt, tokens) >= 1
        check_routing_rule(v, prompt, doc, "txt", "img")
        first = chameleon.tokenizer.codes_from_ids(tokens[:v.tokens_per_image])
        image = doc.images[0]
        assert image.info["molora_codes"] == first.tolist()  # the codes, not pixels
        assert image.size == (4 * CODE_PIXELS, 4 * CODE_PIXELS)
    assert chameleon.image_tokenizer.decodes_pixels is False


def test_a_prompt_picture_is_encoded_as_chameleon_encodes_it(chameleon):
    image = Image.fromarray((torch.rand(40, 36, 3) * 255).byte().numpy())
    ours = chameleon.image_tokenizer.encode(image)[0]
    pixels = chameleon.image_tokenizer.processor.image_processor(image, return_tensors="pt")["pixel_values"]
    theirs = chameleon.routed.model.model.get_image_tokens(pixels)[0]
    assert chameleon.tokenizer.image_ids(ours) == theirs.tolist()
    doc = chameleon.generate(["describe this picture", image], seed=0, max_new_tokens=5, max_images=0)
    assert doc.meta["prompt_tokens"] > chameleon.vocab.image_span_tokens


def test_every_token_to_one_adapter_equals_peft(chameleon, chameleon_dir):
    from peft import PeftModel
    from transformers import ChameleonForConditionalGeneration

    v = chameleon.vocab
    ids = torch.tensor([[v.bos_id, *chameleon.tokenizer.encode_text("draw a cat"),
                         *chameleon.tokenizer.image_span(torch.randint(0, v.image_size, (4, 4)))]])
    reference = PeftModel.from_pretrained(ChameleonForConditionalGeneration.from_pretrained(str(chameleon_dir)),
                                          str(chameleon_dir / "adapters" / "img")).eval()
    text = [i for i in range(v.vocab_size) if not v.is_image_code(i)]  # peft's forward masks the code logits
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[..., text]
        got = chameleon.routed(ids, routers=SequenceRouter("img")).logits[..., text]
        base = chameleon.routed(ids).logits[..., text]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (base - expected).abs().max() > 1e-2
