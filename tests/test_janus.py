"""Janus as a model family, on a tiny random JanusForConditionalGeneration + JanusProcessor saved with
save_pretrained (nothing downloaded): its two generation modes as one vocabulary (text ids scored by lm_head,
image codes by the generation head), routing by generation mode, pictures decoded by its VQ-VAE."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_picture_grammar, check_routing_rule, make_peft_adapter
from PIL import Image

from molora.models import InterleavedPipeline
from molora.models.families.janus.family import LORA_TARGETS
from molora.models.families.janus.testing import build_tiny_janus
from molora.routing import MoLoRAError, SequenceRouter


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    from transformers import JanusForConditionalGeneration

    path = build_tiny_janus(tmp_path_factory.mktemp("janus") / "tiny-janus")
    make_peft_adapter(JanusForConditionalGeneration, path, path / "adapters" / "txt", LORA_TARGETS, seed=1)
    make_peft_adapter(JanusForConditionalGeneration, path, path / "adapters" / "img", LORA_TARGETS, seed=2)
    return path


@pytest.fixture(scope="module")
def janus(janus_dir):
    return InterleavedPipeline.from_pretrained(janus_dir, device="cpu")


@pytest.fixture(scope="module")
def reference(janus_dir):
    from transformers import JanusForConditionalGeneration

    return JanusForConditionalGeneration.from_pretrained(str(janus_dir)).eval()


def test_codes_are_appended_after_the_text_vocabulary(janus):
    v, hf = janus.vocab, janus.tokenizer.hf
    assert janus.family == "janus" and v.image_start == len(hf) and v.image_size == 16 and v.image_grid == (4, 4)
    assert (v.boi_id, v.eoi_id) == tuple(hf.convert_tokens_to_ids(["<begin_of_image>", "<end_of_image>"]))
    assert all(n.startswith("model.language_model.layers.") for n in janus.routed.cache.layers)


def test_one_vocabulary_computes_what_janus_computes_in_each_mode(janus, reference):
    v = janus.vocab
    text = [v.bos_id, *janus.tokenizer.encode_text("draw a cat")]
    codes = torch.tensor([[3, 7, 1]])
    ids = torch.tensor([[*text, v.boi_id, *(codes[0] + v.image_start).tolist()]])
    with torch.no_grad():
        ours = janus.routed(ids).logits
        # text mode: lm_head over the text ids
        torch.testing.assert_close(ours[:, :len(text), :v.image_start],
                                   reference(input_ids=torch.tensor([text])).logits, rtol=1e-4, atol=1e-5)
        # image mode: the codes fed through the generation embedding, scored by the generation head
        embeds = torch.cat([reference.get_input_embeddings()(ids[:, :len(text) + 1]),
                            reference.prepare_embeddings_for_image_generation(codes)], dim=1)
        hidden = reference.model.language_model(inputs_embeds=embeds).last_hidden_state
        torch.testing.assert_close(ours[:, len(text):, v.image_start:],
                                   reference.model.generation_head(hidden[:, len(text):]), rtol=1e-4, atol=1e-5)


def test_documents_route_by_generation_mode_and_decode_pictures(janus):
    v = janus.vocab
    budget = 2 * v.image_span_tokens + 8
    docs = janus.generate(["draw a cat", "two blue squares"], seed=2, start_image=True, max_new_tokens=budget,
                          min_new_tokens=budget, text_adapter="txt", image_adapter="img", temperature=1.0)
    for doc in docs:
        prompt = janus.encode_prompt(doc.prompt, janus.default_config.with_overrides(start_image=True), budget)[0]
        assert check_picture_grammar(v, prompt, [r.id for r in doc.routing]) >= 1
        check_routing_rule(v, prompt, doc, "txt", "img")
        assert all(im.size == (32, 32) for im in doc.images)


def test_every_token_to_one_adapter_equals_peft_in_text_mode(janus, janus_dir):
    from peft import PeftModel
    from transformers import JanusForConditionalGeneration

    v = janus.vocab
    ids = torch.tensor([[v.bos_id, *janus.tokenizer.encode_text("two blue squares on a green field")]])
    peft_model = PeftModel.from_pretrained(JanusForConditionalGeneration.from_pretrained(str(janus_dir)),
                                           str(janus_dir / "adapters" / "txt")).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        got = janus.routed(ids, routers=SequenceRouter("txt")).logits[..., :v.image_start]
        base = janus.routed(ids).logits[..., :v.image_start]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (base - expected).abs().max() > 1e-2


def test_prompt_pictures_are_refused_plainly(janus):
    with pytest.raises(MoLoRAError, match="SigLIP"):
        janus.generate(["describe this", Image.new("RGB", (32, 32))], max_new_tokens=4)
