"""Interleaved decoding through the serving engine: span structure, masks, sampling, seeds, batching, CFG and
routing records.

Runs on the tiny random model (tests/conftest.py) with a 4x4 image grid so spans are short.  A logit bias
pushes the model towards the tokens the state machine must forbid, so the masks (not luck) keep spans valid.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from molora.models.engine.core import Done, Engine
from molora.models.engine.generation import GenerationConfig, Request, build_phase_masks
from molora.models.engine.row_states import Draw, RowStates
from molora.models.engine.sampling import GenerationError, SamplingConfig, filter_logits, guide, sample
from molora.routing import SequenceRouter, VocabRangeRouter


class Biased:
    """A RoutedModel stand-in adding a fixed bias to the logits (to tempt the sampler into invalid ids)."""

    def __init__(self, model, bias: torch.Tensor) -> None:
        self.model, self.bias = model, bias

    def __call__(self, input_ids, **kwargs):
        out = self.model(input_ids, **kwargs)
        out.logits = out.logits.float() + self.bias
        return out


def small_vocab(vocab, row_end: str | None = None):
    """The tiny model's vocabulary on a 4x4 grid, with no row markers, one shared end-of-line marker (as Emu3)
    or a marker per row (as the embedded model); unused marker ids stay in the vocabulary, never allowed."""
    markers = {None: (), "shared": vocab.row_end_ids[:1], "per_row": vocab.row_end_ids[:4]}[row_end]
    return dataclasses.replace(vocab, image_grid=(4, 4), row_end_ids=markers)


def tempting_bias(vocab, size: int, boi: float = 8.0) -> torch.Tensor:
    """Huge logits on ids that must never be sampled freely; <boi> favoured so images keep coming."""
    bias = torch.zeros(size)
    for token in (vocab.eoi_id, vocab.pad_id, vocab.bos_id):
        bias[token] = 50.0
    bias[list(vocab.row_end_ids)] = 50.0
    bias[vocab.boi_id] = boi
    return bias


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm(tiny_pipeline):
    return tiny_pipeline.routed


class Decoder:
    """An engine over the tiny model for `vocab`, whose logits get `bias` added while it runs (a forward hook on
    the LM head, so the captured/eager step itself is what is tested)."""

    def __init__(self, lm, vocab, bias=None) -> None:
        self.lm, self.bias = lm, bias
        self.engine = Engine(lm, vocab, device="cpu", logits_size=lm.model.config.vocab_size)

    def stream(self, requests, config):
        hook = None
        if self.bias is not None:
            hook = self.lm.model.lm_head.register_forward_hook(lambda m, i, out: out.float() + self.bias)
        try:
            yield from self.engine.stream(requests, config)
        finally:
            if hook is not None:
                hook.remove()


def make_decoder(lm, vocab, bias=None):
    return Decoder(lm, vocab, bias)


def run(decoder, prompts, config, routers=None):
    routers = routers or [None] * len(prompts)
    rows = [[] for _ in prompts]
    adapters = [[] for _ in prompts]
    for b, item in decoder.stream([Request(p, r) for p, r in zip(prompts, routers)], config):
        if not isinstance(item, Done):
            rows[b].append(item.token)
            adapters[b].append(item.adapter)
    return rows, adapters


def check_structure(tokens, vocab, budget_ended: bool = True):
    """Reference state machine (plain Python): returns the image spans; fails on any invalid token."""
    rows, cols = vocab.image_grid
    period = cols + 1 if vocab.row_end_ids else None
    spans, span = [], None
    for i, t in enumerate(tokens):
        if span is None:
            assert vocab.text_start <= t < vocab.text_start + vocab.text_size or t in (vocab.eos_id, vocab.boi_id), \
                f"token {t} at {i} is not allowed in text"
            if t == vocab.boi_id:
                span = []
            elif t == vocab.eos_id:
                assert i == len(tokens) - 1, "tokens after <eos>"
        elif len(span) == vocab.tokens_per_image:
            assert t == vocab.eoi_id, f"image span not closed by <eoi> at {i}"
            spans.append(span)
            span = None
        else:
            if period and len(span) % period == cols:
                assert t == vocab.row_end_id(len(span) // period), f"missing row marker at {i}"
            else:
                assert vocab.is_image_code(t), f"token {t} inside an image span is not a codebook id"
            span.append(t)
    assert span is None, "an image span was left open"
    return spans


# --- sampling -----------------------------------------------------------------------------------------------

def test_filter_logits_keeps_top_k_and_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 10.0, 0.0, 0.0, 0.0]])
    out = filter_logits(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False, False]
    assert torch.isfinite(out[1]).all()
    out = filter_logits(logits, torch.tensor([0, 0]), torch.tensor([0.5, 0.5]))
    assert torch.isfinite(out[0]).sum() == 1 and torch.isfinite(out[0, 0])  # p(best) = 0.64 >= 0.5
    assert torch.isfinite(out[1]).sum() == 1 and torch.isfinite(out[1, 1])


def test_rows_with_both_filters_off_sample_as_without_filters_bit_for_bit():
    """RowStates.choose skips filter_logits on the CPU when no row of the step filters: the same tokens."""
    torch.manual_seed(0)
    logits = torch.randn(16, 300).masked_fill(torch.rand(16, 300) < 0.2, float("-inf"))
    temperature = torch.rand(16) * 2
    noise = torch.empty(16, 300).exponential_()
    off = sample(logits, temperature, torch.zeros(16, dtype=torch.long), torch.ones(16), noise=noise)
    assert torch.equal(off, sample(logits, temperature, None, None, noise=noise))
    assert torch.equal(filter_logits(logits, torch.zeros(16, dtype=torch.long), torch.ones(16)), logits)


def test_sample_greedy_rows_take_argmax_and_respect_masks():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    masked = logits.masked_fill(torch.arange(50) % 3 != 0, float("-inf"))
    gen = torch.Generator().manual_seed(0)
    temperature = torch.tensor([0.0, 1.5] * 32)
    out = sample(masked, temperature, torch.full((64,), 5), torch.full((64,), 0.9), gen)
    assert (out % 3 == 0).all()
    assert torch.equal(out[0::2], masked[0::2].argmax(-1))


def test_guide_is_cond_at_scale_one():
    cond, uncond = torch.randn(3, 7), torch.randn(3, 7)
    assert torch.allclose(guide(cond, uncond, 1.0), cond)
    assert torch.allclose(guide(cond, uncond, 0.0), uncond)


def test_bad_settings_raise_clear_errors():
    with pytest.raises(GenerationError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(GenerationError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(GenerationError, match="valid settings"):
        GenerationConfig().with_overrides(temprature=1.0)
    config = GenerationConfig().with_overrides(temperature=0.0, image_top_k=5, seed=3)
    assert config.text.temperature == config.image.temperature == 0.0 and config.image.top_k == 5
    assert GenerationConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("row_end", ["shared", "per_row"])
def test_phase_masks_allow_only_the_state_machine_ids(tiny_pipeline, row_end):
    vocab = small_vocab(tiny_pipeline.vocab, row_end)
    masks = build_phase_masks(vocab, "cpu", vocab.vocab_size + 3)
    assert masks[0].sum() == vocab.text_size + 2 and masks[0, vocab.boi_id] and masks[0, vocab.eos_id]
    assert masks[1].sum() == vocab.image_size and masks[3].sum() == 1
    assert masks[2].sum() == len(vocab.row_end_ids)
    assert not masks[:, vocab.vocab_size:].any()


# --- the state machine ------------------------------------------------------------------------------------

@pytest.mark.parametrize("row_end", [None, "shared", "per_row"])
def test_image_spans_have_exactly_the_grid_and_end_with_forced_eoi(lm, tiny_pipeline, row_end):
    vocab = small_vocab(tiny_pipeline.vocab, row_end)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size))
    prompt = [vocab.bos_id, *tiny_pipeline.tokenizer.encode_text("a red circle")]
    for seed in range(3):
        config = GenerationConfig(max_new_tokens=90, seed=seed, cfg_scale=2.0,
                                  text=SamplingConfig(1.0, top_k=20), image=SamplingConfig(1.3, top_p=0.95))
        (tokens,), _ = run(decoder, [prompt], config)
        spans = check_structure(tokens, vocab)
        assert len(spans) >= 3  # <boi> is favoured: several images per sequence
        assert all(len(s) == vocab.tokens_per_image for s in spans)


def test_no_image_starts_without_room_to_finish_it(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=50.0))
    prompt = [vocab.bos_id]
    for max_new in (17, 18, 19, 40):
        (tokens,), _ = run(decoder, [prompt], GenerationConfig(max_new_tokens=max_new, seed=0))
        spans = check_structure(tokens, vocab)
        assert len(spans) == max_new // (vocab.tokens_per_image + 2)


def test_max_images_caps_images(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=50.0))
    for cap in (0, 1, 2):
        (tokens,), _ = run(decoder, [[vocab.bos_id]], GenerationConfig(max_new_tokens=80, seed=0, max_images=cap))
        assert len(check_structure(tokens, vocab)) == cap


def test_prompt_ending_in_boi_continues_the_open_image(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab)
    prompt = [vocab.bos_id, *tiny_pipeline.tokenizer.encode_text("a star"), vocab.boi_id, vocab.image_start + 1]
    (tokens,), _ = run(decoder, [prompt], GenerationConfig(max_new_tokens=30, seed=0, cfg_scale=3.0))
    assert all(vocab.is_image_code(t) for t in tokens[:15]) and tokens[15] == vocab.eoi_id


# --- seeds, batching, CFG -------------------------------------------------------------------------------------

def test_same_seed_same_tokens_different_seed_different_tokens(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=2.0))
    prompt = [vocab.bos_id, *tiny_pipeline.tokenizer.encode_text("two blue squares")]
    config = GenerationConfig(max_new_tokens=60, seed=1234, text=SamplingConfig(1.0), image=SamplingConfig(1.0))
    first, _ = run(decoder, [prompt], config)
    second, _ = run(decoder, [prompt], config)
    other, _ = run(decoder, [prompt], config.with_overrides(seed=4321))
    assert first == second
    assert first != other


def test_batched_greedy_decode_equals_each_prompt_alone(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=0.3))
    tok = tiny_pipeline.tokenizer
    prompts = [[vocab.bos_id, *tok.encode_text(t)] for t in ("a red circle in the top left", "draw", "")]
    prompts.append([vocab.bos_id, *tok.encode_text("yellow stars"), vocab.boi_id])
    routers = [VocabRangeRouter(vocab, "text_style", "image_style"), SequenceRouter("image_style"), None,
               VocabRangeRouter(vocab, None, "image_style")]
    config = GenerationConfig(max_new_tokens=70, seed=0, cfg_scale=2.5, text=SamplingConfig(0.0),
                              image=SamplingConfig(0.0))
    batched, batched_adapters = run(decoder, prompts, config, routers)
    assert any(vocab.boi_id in row for row in batched[:3])  # the batch mixes text rows and image rows
    for b, (prompt, router) in enumerate(zip(prompts, routers)):
        alone, alone_adapters = run(decoder, [prompt], config, [router])
        assert batched[b] == alone[0], f"row {b} differs when decoded in a batch"
        assert batched_adapters[b] == alone_adapters[0]


def test_cfg_barely_above_one_matches_no_cfg(lm, tiny_pipeline):
    """Running the unconditional rows in the same batch must not disturb the conditional rows."""
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=3.0))
    prompt = [vocab.bos_id, *tiny_pipeline.tokenizer.encode_text("a green triangle")]
    greedy = dict(text=SamplingConfig(0.0), image=SamplingConfig(0.0), max_new_tokens=70, seed=0)
    plain, _ = run(decoder, [prompt], GenerationConfig(cfg_scale=1.0, **greedy))
    guided, _ = run(decoder, [prompt], GenerationConfig(cfg_scale=1.0 + 1e-6, **greedy))
    assert len(check_structure(plain[0], vocab)) >= 2
    assert plain == guided


def test_cfg_tokens_match_full_recompute_of_both_streams(lm, tiny_pipeline):
    """Greedy CFG image tokens = argmax of uncond + s*(cond - uncond), both streams recomputed without a cache,
    the unconditional one as <bos> <boi> codes-so-far of the CURRENT image (several images per sequence)."""
    vocab = small_vocab(tiny_pipeline.vocab)
    bias = tempting_bias(vocab, lm.model.config.vocab_size, boi=3.0)
    decoder = make_decoder(lm, vocab, bias)
    router = VocabRangeRouter(vocab, "text_style", "image_style")
    prompt = [vocab.bos_id, *tiny_pipeline.tokenizer.encode_text("a purple square")]
    scale = 4.0
    config = GenerationConfig(max_new_tokens=60, seed=0, cfg_scale=scale, text=SamplingConfig(0.0),
                              image=SamplingConfig(0.0))
    (tokens,), _ = run(decoder, [prompt], config, [router])
    spans = check_structure(tokens, vocab)
    assert len(spans) >= 2
    full = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        cond = Biased(lm, bias)(full, routers=router).logits[0].float()
        checked, i = 0, 0
        while i < len(tokens):
            if tokens[i] != vocab.boi_id:
                i += 1
                continue
            span = tokens[i + 1:i + 1 + vocab.tokens_per_image]
            unc_ids = torch.tensor([[vocab.bos_id, vocab.boi_id, *span]])
            uncond = Biased(lm, bias)(unc_ids, routers=router).logits[0].float()
            for j, token in enumerate(span):
                p = len(prompt) + i + j  # position predicting span[j]
                scores = guide(cond[p], uncond[1 + j], scale)
                codes = scores[vocab.image_start:vocab.image_start + vocab.image_size]
                assert scores[token] >= codes.max() - 1e-4, f"image token {j} of the span at {i} is not the CFG argmax"
                checked += 1
            i += 1 + vocab.tokens_per_image
    assert checked >= 2 * vocab.tokens_per_image


# --- routing records -------------------------------------------------------------------------------------------

def test_routing_record_follows_the_predicts_rule_and_matches_prefill(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=3.0))
    router = VocabRangeRouter(vocab, "text_style", "image_style")
    prompt = [vocab.bos_id, *tiny_pipeline.tokenizer.encode_text("a blue star")]
    (tokens,), (adapters,) = run(decoder, [prompt], GenerationConfig(max_new_tokens=50, seed=5, cfg_scale=2.0),
                                 [router])
    assert len(check_structure(tokens, vocab)) >= 1
    # the adapter that produced token i is the one at the position holding the previous token
    previous = [prompt[-1], *tokens[:-1]]
    for prev, adapter in zip(previous, adapters):
        image_input = prev == vocab.boi_id or vocab.is_image_code(prev) or vocab.is_row_end(prev)
        assert adapter == ("image_style" if image_input else "text_style")
    # one prefill of the whole sequence routes every position exactly as the token-by-token decode did
    with torch.inference_mode():
        out = lm(torch.tensor([prompt + tokens]), routers=router)
    prefill = out.routing.adapter_names(0)
    assert prefill[len(prompt) - 1:-1] == adapters


@pytest.mark.parametrize("router, expected", [(SequenceRouter("image_style"), {"image_style"}), (None, {None})])
def test_sequence_and_no_routing_records(lm, tiny_pipeline, router, expected):
    vocab = small_vocab(tiny_pipeline.vocab)
    decoder = make_decoder(lm, vocab, tempting_bias(vocab, lm.model.config.vocab_size, boi=3.0))
    _, (adapters,) = run(decoder, [[vocab.bos_id]], GenerationConfig(max_new_tokens=30, seed=0), [router])
    assert set(adapters) == expected


def test_engine_rejects_bad_requests(lm, tiny_pipeline):
    vocab = small_vocab(tiny_pipeline.vocab)
    engine = make_decoder(lm, vocab).engine
    with pytest.raises(GenerationError, match="at least <bos>"):
        engine.submit(Request([]), GenerationConfig())
    with pytest.raises(GenerationError, match="prompt ids"):
        engine.submit(Request([vocab.bos_id, 10 ** 6]), GenerationConfig())
    with pytest.raises(GenerationError, match="positions"):
        engine.submit(Request([vocab.bos_id] * 600), GenerationConfig(max_new_tokens=100))
    assert engine.stats()["waiting"] == 0


def test_draw_of_a_batch_names_only_what_its_rows_need():
    greedy = GenerationConfig(text=SamplingConfig(0.0, top_p=0.9), image=SamplingConfig(0.0), cfg_scale=1.0)
    assert Draw.of([greedy]) == Draw(sampling=False, filters=False, guided=False)  # filters: greedy rows ignore them
    guided = dataclasses.replace(greedy, cfg_scale=3.0)
    assert Draw.of([greedy, guided]) == Draw(sampling=False, filters=False, guided=True)
    assert Draw.of([greedy, GenerationConfig(cfg_scale=1.0)]) == Draw(sampling=True, filters=True, guided=False)


def test_greedy_choice_without_softmax_or_noise_equals_the_full_sampler(tiny_pipeline):
    """RowStates.choose with Draw.sampling off takes the argmax of the masked, guided scores: the tokens sample()
    gives greedy rows, for text rows, rows inside a picture, and guided rows reading their twins' logits."""
    vocab = tiny_pipeline.vocab
    states = RowStates(vocab, 6, torch.device("cpu"), vocab.vocab_size)
    greedy = GenerationConfig(seed=0, text=SamplingConfig(0.0), image=SamplingConfig(0.0), max_new_tokens=40)
    guided = dataclasses.replace(greedy, cfg_scale=4.0)
    states.start(0, greedy, last_pos=3, open_span=None, slots=(-1, -1))
    states.start(1, guided, last_pos=5, open_span=None, slots=(-1, -1), twin=2, twin_last_pos=1, twin_prefix=1)
    states.start(3, greedy, last_pos=2, open_span=None, slots=(-1, -1))
    states.advance_rows(torch.tensor([1, 3]), torch.tensor([vocab.boi_id, vocab.boi_id]))  # rows 1, 3: in a picture
    torch.manual_seed(1)  # (a draw where the guided row's token differs from its unguided one)
    logits = torch.randn(4, vocab.vocab_size) * 4
    rows = torch.tensor([0, 1, 3])
    noise = torch.empty(3, vocab.vocab_size).exponential_()
    full = states.choose(rows, logits[rows], logits[states.twin[rows]], noise, Draw(True, True, True))
    fast = states.choose(rows, logits[rows], logits[states.twin[rows]], noise, Draw(False, False, True))
    assert torch.equal(fast, full)
    assert not torch.equal(fast, states.choose(rows, logits[rows], None, noise, Draw(False, False, False)))
