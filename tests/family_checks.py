"""Checks shared by the model-family tests (tests/test_emu3.py, tests/test_chameleon.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from molora.routing.modality import IMAGE


def make_peft_adapter(model_cls, model_dir: Path, out: Path, targets: str, seed: int) -> None:
    """A LoRA made by `peft` on the saved model (random, visibly non-zero weights), saved to `out`."""
    from peft import LoraConfig, get_peft_model

    model = model_cls.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(str(out))


def check_picture_grammar(vocab, prompt: list[int], tokens: list[int]) -> int:
    """Every picture after a <boi>: the forced header, rows of codes each closed by its row marker (where the
    vocabulary has one), the forced trailer, <eoi>; outside pictures no code or row marker. Returns the number
    of whole pictures (the last may be cut by the token budget)."""
    rows, cols = vocab.image_grid
    span = [*vocab.image_prefix_ids]
    for r in range(rows):
        span += ["code"] * cols + ([vocab.row_end_id(r)] if vocab.row_end_ids else [])
    span += [*vocab.image_suffix_ids, vocab.eoi_id]
    pictures, i, seq = 0, 0, [prompt[-1], *tokens]
    while i < len(seq):
        if seq[i] == vocab.boi_id:
            got = seq[i + 1:i + 1 + len(span)]
            for want, token in zip(span, got):
                assert (vocab.is_image_code(token) if want == "code" else token == want), (want, token)
            pictures += len(got) == len(span)
            i += 1 + len(got)
        else:
            assert not vocab.is_image_code(seq[i]) and not vocab.is_row_end(seq[i]), seq[i]
            i += 1
    return pictures


def check_routing_rule(vocab, prompt: list[int], doc, text_adapter: str, image_adapter: str) -> None:
    """Each generated token was produced at the position holding the token before it, and that position went to
    the image adapter exactly when the modality table says IMAGE for its id."""
    table = vocab.modality_table()
    inputs = [prompt[-1], *[r.id for r in doc.routing][:-1]]
    for record, source in zip(doc.routing, inputs):
        assert record.adapter == (image_adapter if table[source] == IMAGE else text_adapter), (record, source)
