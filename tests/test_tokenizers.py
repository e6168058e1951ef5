"""UnifiedTokenizer and ImageTokenizer: round trips, hostile text, id layout, image code shapes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from molora.models.engine.vocab import VocabError
from molora.models.families.shapes.image_tokenizer import ImageTokenizer, ImageTokenizerError
from molora.models.families.shapes.testing import BASE_MODEL_NAME, write_tiny_adapter, write_tiny_model_dir
from molora.models.families.shapes.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerError,
    UnifiedTokenizer,
    build_tiny_tokenizer,
)
from molora.routing.errors import MoLoRAError

TOK = build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def test_specials_come_first_and_ranges_follow():
    v = TOK.vocab
    assert [TOK.backend.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (v.pad_id, v.bos_id, v.eos_id, v.boi_id, v.eoi_id) == (0, 1, 2, 3, 4)
    assert v.text_start == 5 and v.image_start == v.text_start + v.text_size
    assert v.vocab_size == v.image_start + v.image_size
    assert all(v.text_start <= i < v.image_start for i in TOK.encode_text("a red circle, arr!"))


@pytest.mark.parametrize("text", ["", "a red circle in the top left", "héllo wörld 🌍🚀", "\x00\x01\ufffd\u200b",
                                  "日本語のテキスト", "  spaces\tand\nnewlines  ", "<bos><boi>not special<eoi>"])
def test_round_trip(text):
    ids = TOK.encode_text(text)
    assert TOK.decode_text(ids) == text


def test_typed_special_names_stay_text():
    ids = TOK.encode_text("<boi>")
    assert TOK.vocab.boi_id not in ids and ids


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_any_unicode_round_trips(text):
    assert TOK.decode_text(TOK.encode_text(text)) == text


def test_very_long_text():
    text = "a red circle and a blue square 🌍 " * 20_000
    ids = TOK.encode_text(text)
    assert len(ids) > 0 and TOK.decode_text(ids) == text


def test_bad_inputs_raise_project_errors():
    with pytest.raises(TokenizerError, match="expects a str"):
        TOK.encode_text(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        TOK.decode_text([TOK.vocab.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        TOK.decode_text([-1])
    assert issubclass(TokenizerError, MoLoRAError)


def test_decode_skips_specials_and_image_codes():
    ids = [1, *TOK.encode_text("a red"), 3, TOK.vocab.image_start + 5, 4, 2]
    assert TOK.decode_text(torch.tensor(ids)) == "a red"
    assert TOK.token_piece(3) == "<boi>" and TOK.token_piece(TOK.vocab.image_start + 5) == "<img:5>"


def test_image_span_round_trip():
    codes = torch.randint(0, TOK.vocab.image_size, (16, 16))
    span = TOK.image_span(codes)
    assert span[0] == TOK.vocab.boi_id and span[-1] == TOK.vocab.eoi_id and len(span) == 258
    assert torch.equal(TOK.codes_from_ids(span[1:-1]), codes)
    with pytest.raises(TokenizerError):
        TOK.image_span(torch.full((16, 16), TOK.vocab.image_size))
    with pytest.raises(TokenizerError):
        TOK.codes_from_ids(TOK.encode_text("abc") * 100)


def test_row_markers_close_every_row_and_route_to_the_image_side():
    tok = UnifiedTokenizer(TOK.backend, TOK.vocab.with_row_markers())
    v = tok.vocab
    assert v.vocab_size == TOK.vocab.vocab_size + 16 and v.row_end_ids == tuple(range(TOK.vocab.vocab_size,
                                                                                       v.vocab_size))
    assert v.tokens_per_image == 16 * 17
    codes = torch.randint(0, v.image_size, (3, 16, 16))
    batch = tok.image_ids_batch(codes)
    for k in range(3):
        ids = batch[k]
        assert ids == tok.image_ids(codes[k]) and len(ids) == 272
        assert [ids[17 * r + 16] for r in range(16)] == list(v.row_end_ids)
        assert torch.equal(tok.codes_from_ids(ids), codes[k])
    table = v.modality_table()
    assert all(table[i] == 1 for i in v.row_end_ids)
    assert tok.token_piece(v.row_end_ids[3]) == "<row:3>"
    swapped = list(batch[0])
    swapped[16], swapped[33] = swapped[33], swapped[16]
    with pytest.raises(TokenizerError, match="row marker"):
        tok.codes_from_ids(swapped)
    with pytest.raises(TokenizerError, match="272 ids"):
        tok.codes_from_ids(batch[0][:-1])
    with pytest.raises(VocabError, match="already has row markers"):
        v.with_row_markers()
    shared = dataclasses.replace(TOK.vocab, vocab_size=TOK.vocab.vocab_size + 1, row_end_ids=(TOK.vocab.vocab_size,))
    assert UnifiedTokenizer(TOK.backend, shared).token_piece(shared.row_end_ids[0]) == "<eol>"


@pytest.mark.parametrize("ids, match", [((5,), "outside the text and image"), ((1,), "outside the text"),
                                        ((10**6,), "must be an id"), ((0, 0), "expected none, one")])
def test_bad_row_markers_are_refused(ids, match):
    with pytest.raises(VocabError, match=match):
        dataclasses.replace(TOK.vocab, row_end_ids=ids)


def test_save_load_and_corrupt_files(tmp_path):
    TOK.save(tmp_path)
    again = UnifiedTokenizer.load(tmp_path)
    assert again.vocab == TOK.vocab
    assert again.encode_text("a green star") == TOK.encode_text("a green star")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizers file"):
        UnifiedTokenizer.load(tmp_path)
    with pytest.raises(TokenizerError, match="missing"):
        UnifiedTokenizer.load(tmp_path / "nowhere")


def test_vocab_mismatch_is_refused(tmp_path):
    TOK.save(tmp_path)
    data = json.loads((tmp_path / "vocab.json").read_text())
    data["text_size"] -= 3
    data["image_start"] -= 3
    data["vocab_size"] -= 3
    (tmp_path / "vocab.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="does not match"):
        UnifiedTokenizer.load(tmp_path)


def test_image_tokenizer_shapes(tiny_dir):
    vq = ImageTokenizer.from_pretrained(tiny_dir / "vq")
    assert vq.grid == (16, 16) and vq.image_size == 64
    imgs = [Image.new("RGB", (64, 64), "red"), Image.new("RGBA", (100, 80), "blue")]
    codes = vq.encode(imgs)
    assert codes.shape == (2, 16, 16) and codes.dtype == torch.long
    assert 0 <= int(codes.min()) and int(codes.max()) < vq.codebook_size
    out = vq.decode(codes)
    assert len(out) == 2 and out[0].size == (64, 64) and out[0].mode == "RGB"
    assert len(vq.decode(codes[0])) == 1 and len(vq.decode(codes.reshape(2, 256))) == 2
    x = torch.rand(3, 3, 64, 64) * 2 - 1
    assert vq.encode(x).shape == (3, 16, 16)


def test_image_tokenizer_errors(tiny_dir, tmp_path):
    vq = ImageTokenizer.from_pretrained(tiny_dir / "vq")
    with pytest.raises(ImageTokenizerError, match="codes must lie"):
        vq.decode(torch.full((1, 16, 16), vq.codebook_size))
    with pytest.raises(ImageTokenizerError, match="expected codes"):
        vq.decode(torch.zeros(1, 8, 8, dtype=torch.long))
    with pytest.raises(ImageTokenizerError, match="expected a tensor"):
        vq.encode(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ImageTokenizerError, match="no config.json"):
        ImageTokenizer.from_pretrained(tmp_path)


def test_tiny_model_dir_layout(tiny_dir, tmp_path):
    from transformers import LlamaForCausalLM

    for name in ("vocab.json", "tokenizer.json", "lm/config.json", "lm/model.safetensors",
                 "vq/config.json", "vq/diffusion_pytorch_model.safetensors"):
        assert (tiny_dir / name).is_file(), name
    tok = UnifiedTokenizer.load(tiny_dir)
    lm = LlamaForCausalLM.from_pretrained(tiny_dir / "lm")
    assert lm.config.vocab_size == tok.vocab.vocab_size
    assert lm.config.molora_base_model == BASE_MODEL_NAME
    ad = write_tiny_adapter(tiny_dir, tmp_path / "pirate", modality="text")
    cfg = json.loads((ad / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == BASE_MODEL_NAME
    assert json.loads((ad / "molora.json").read_text())["modality"] == "text"
    assert (ad / "adapter_model.safetensors").is_file()
