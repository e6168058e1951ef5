"""The serving engine: requests joining and leaving a running batch, per-row sampling equal to solo runs,
cancellation, queueing on full hot-set slots, in-place slot tables, bad requests; on CUDA, captured decode
steps that stay exact while adapters move between slots."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import molora.models.engine.core as core
from molora.models.engine.core import Done, Engine, EngineConfig, Token
from molora.models.engine.generation import GenerationConfig, Request
from molora.models.engine.sampling import GenerationError, SamplingConfig
from molora.models.engine.synthetic import random_adapters, random_routed_model
from molora.routing import (
    CacheFullError,
    LearnedGates,
    LearnedRouter,
    SequenceRouter,
    UnknownAdapterError,
    VocabRangeRouter,
)
from molora.routing.context import current_routing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(text=SamplingConfig(0.0), image=SamplingConfig(0.0))


@pytest.fixture(scope="module")
def model():
    """A tiny random Qwen3 routed on all projections, four adapters in the pool, a hot set of two slots."""
    routed, vocab = random_routed_model("tiny", device="cpu", dtype=torch.float32, num_slots=2, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c", "d"], std=0.2):
        routed.add_adapter(adapter)
    return routed, vocab


def prompts(vocab, n, seed=0, length=(3, 12)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        size = int(torch.randint(length[0], length[1], (1,), generator=g))
        out.append([vocab.bos_id, *torch.randint(vocab.text_start, vocab.vocab_size, (size,), generator=g).tolist()])
    return out


def collect(items):
    """{request index: [(token, adapter), ...]} and {index: Done reason} from engine.stream."""
    tokens, ends = {}, {}
    for index, item in items:
        if isinstance(item, Done):
            ends[index] = item.reason
        else:
            tokens.setdefault(index, []).append((item.token, item.adapter))
    return tokens, ends


def solo(engine, request, config):
    return collect(engine.stream([request], config))[0][0]


def sampled(seed, **kw):
    return GenerationConfig(max_new_tokens=40, seed=seed, cfg_scale=2.0,
                            text=SamplingConfig(0.9, top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0)),
                            image=SamplingConfig(1.1, top_k=kw.get("image_top_k", 0)))


def test_requests_joining_a_running_batch_equal_their_solo_runs(model):
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    ps = prompts(vocab, 4)
    routers = [VocabRangeRouter(vocab, "a", "b"), SequenceRouter("b"), None, VocabRangeRouter(vocab, None, "a")]
    configs = [sampled(1), sampled(2, top_k=20), sampled(3, top_p=0.8), GenerationConfig(max_new_tokens=30, seed=0,
                                                                                         **GREEDY)]
    alone = [solo(engine, Request(p, r), c) for p, r, c in zip(ps, routers, configs)]
    # the first request starts alone; the others join while it runs, at different steps
    first = engine.stream([Request(ps[0], routers[0])], configs[0])
    got = {0: []}
    results: dict[int, list] = {}

    def late(i: int) -> None:
        results[i] = solo(engine, Request(ps[i], routers[i]), configs[i])

    threads = []
    for _index, item in first:
        if isinstance(item, Done):
            break
        got[0].append((item.token, item.adapter))
        if len(got[0]) in (3, 7, 12):
            i = len(threads) + 1
            threads.append(threading.Thread(target=late, args=(i,)))
            threads[-1].start()
    for thread in threads:
        thread.join(timeout=60)
    assert got[0] == alone[0]
    for i in (1, 2, 3):
        assert results[i] == alone[i], f"request {i} differs when it joined a running batch"
    assert engine.steps > 0 and engine.stats()["running"] == 0


def test_cpu_steps_run_in_inference_mode_and_every_decode_step_is_routed(model):
    """No autograd bookkeeping on the CPU's steps; a request holding no adapter still decodes through the routed
    layers' group calls (the base GEMMs a routed neighbour's rows take: kernels/torch_ops.py cpu_linear)."""
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64))
    engine._setup()
    decoder, calls = engine.decoder, []

    def recording(**kwargs):
        calls.append((torch.is_inference_mode_enabled(), kwargs["input_ids"].shape[1], current_routing() is not None))
        return decoder(**kwargs)

    engine.decoder = recording
    solo(engine, Request(prompts(vocab, 1)[0]), GenerationConfig(max_new_tokens=4, seed=0, **GREEDY))
    engine.close()
    assert calls and all(inference for inference, _, _ in calls)
    assert [routed_call for _, length, routed_call in calls if length == 1] == [True] * 3  # decode steps
    assert not calls[0][2]  # the prefill of a request without adapters runs the plain base model


def test_closing_a_busy_engine_ends_its_requests_with_an_error(model):
    """close() while a request runs and another waits: both streams end with "the engine was closed" (the CPU loop's
    row tables are inference tensors: ending the requests runs in the loop's inference mode too)."""
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128, max_rows=1))
    sinks = [engine.stream([Request(p)], GenerationConfig(max_new_tokens=100, min_new_tokens=100, cfg_scale=1.0,
                                                           **GREEDY))
             for p in prompts(vocab, 2, seed=5)]
    first = next(sinks[0])  # the first request is running
    assert isinstance(first[1], Token)
    engine.close()
    for stream in sinks:
        with pytest.raises(GenerationError, match="the engine was closed"):
            for _ in stream:
                pass
    assert not engine._thread.is_alive()


def test_a_failed_setup_fails_the_waiting_requests_and_the_next_request_tries_again(model, monkeypatch):
    """The engine's first setup (KV cache, tables) raising: the request waiting on it ends with that error instead of
    waiting forever, and a later request sets the engine up again."""
    from molora.models.engine.kv_cache import RowKVCache

    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64))
    real = RowKVCache.for_model

    def no_memory(*args, **kwargs):
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(RowKVCache, "for_model", no_memory)
    request, config = Request(prompts(vocab, 1)[0]), GenerationConfig(max_new_tokens=3, **GREEDY)
    with pytest.raises(GenerationError, match="generation failed: RuntimeError: no memory for the KV cache"):
        list(engine.stream([request], config))
    monkeypatch.setattr(RowKVCache, "for_model", real)
    tokens, ends = collect(engine.stream([request], config))
    engine.close()
    assert ends == {0: "length"} and len(tokens[0]) == 3


def test_cancelling_frees_the_row_kv_and_adapter_pins_within_one_step(model, monkeypatch):
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    ended_at: dict[str, int] = {}
    real_end = engine._end

    def end(job, reason=None, error=None):  # the engine step at which each request's resources are freed
        ended_at.setdefault(reason or "error", engine.steps)
        return real_end(job, reason, error)

    monkeypatch.setattr(engine, "_end", end)
    long_config = GenerationConfig(max_new_tokens=100, min_new_tokens=100, seed=0, cfg_scale=1.0, **GREEDY)
    keeper = engine.stream([Request(prompts(vocab, 1, seed=5)[0])], long_config)
    next(keeper)  # a neighbour (base model: both slots stay free for the other) keeps the engine stepping
    stream = engine.stream([Request(prompts(vocab, 1)[0], VocabRangeRouter(vocab, "a", "b"))], sampled(0))
    for _ in range(3):
        next(stream)
    assert routed.cache.pins("a") == 1 and engine.stats()["free_rows"] == engine.max_rows - 3
    stream.close()
    steps_at_cancel = engine.steps  # a step already running may finish; the next boundary frees everything
    deadline = time.monotonic() + 10
    while routed.cache.pins("a") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert routed.cache.pins("a") == routed.cache.pins("b") == 0
    assert ended_at["cancelled"] - steps_at_cancel <= 1
    assert engine.stats()["free_rows"] == engine.max_rows - 1  # only the neighbour's row is held
    assert engine.states.row_slots[:engine.max_rows].eq(-1).sum() >= 2 * (engine.max_rows - 1)
    keeper.close()


def test_requests_wait_for_hot_set_slots_and_then_run_exactly(model):
    """Two slots: a request needing two other adapters waits until the running one releases its slots."""
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    config = GenerationConfig(max_new_tokens=25, seed=0, cfg_scale=1.0, **GREEDY)
    ab, cd = prompts(vocab, 2, seed=3)
    alone_cd = solo(engine, Request(cd, VocabRangeRouter(vocab, "c", "d")), config)
    order = []
    for index, item in engine.stream([Request(ab, VocabRangeRouter(vocab, "a", "b")),
                                      Request(cd, VocabRangeRouter(vocab, "c", "d"))], config):
        order.append((index, type(item).__name__))
    first_of_second = order.index((1, "Token"))
    assert order.index((0, "Done")) < first_of_second, "the second request ran before slots were free"
    assert solo(engine, Request(cd, VocabRangeRouter(vocab, "c", "d")), config) == alone_cd
    assert routed.cache.stats()["evictions"] >= 2


def test_slot_tables_are_device_tensors_written_in_place(model):
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    config = GenerationConfig(max_new_tokens=10, seed=0, cfg_scale=1.0, **GREEDY)
    solo(engine, Request([vocab.bos_id, 7], None), config)
    table = engine.states.row_slots
    address = table.data_ptr()
    stream = engine.stream([Request([vocab.bos_id, 9, 10], VocabRangeRouter(vocab, "d", "c"))], config)
    next(stream)
    row = next(iter(engine._running))
    assert table[row].tolist() == [routed.cache.slot_of("d"), routed.cache.slot_of("c")]
    stream.close()
    assert engine.states.row_slots.data_ptr() == address
    # the same request after its adapters moved to other slots: new table entries, the same tokens
    first = solo(engine, Request([vocab.bos_id, 9, 10], VocabRangeRouter(vocab, "d", "c")), config)
    solo(engine, Request([vocab.bos_id, 11], VocabRangeRouter(vocab, "a", "b")), config)  # evicts c and d
    before = (routed.cache.slot_of("c"), routed.cache.slot_of("d"))
    solo(engine, Request([vocab.bos_id, 11], VocabRangeRouter(vocab, "c", None)), config)  # c comes back
    again = solo(engine, Request([vocab.bos_id, 9, 10], VocabRangeRouter(vocab, "d", "c")), config)
    assert before == (None, None)
    assert again == first
    assert {a for _, a in again} <= {"c", "d"}


def test_bad_requests_are_refused_before_queueing(model):
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64))
    with pytest.raises(GenerationError, match="positions"):
        engine.submit(Request([vocab.bos_id] * 40), GenerationConfig(max_new_tokens=30))
    short = GenerationConfig(max_new_tokens=8)
    with pytest.raises(UnknownAdapterError, match="nope"):
        engine.submit(Request([vocab.bos_id], SequenceRouter("nope")), short)
    gates = LearnedGates.for_model(routed, ["a", "b", "c"])
    with pytest.raises(CacheFullError, match="2 slots"):
        engine.submit(Request([vocab.bos_id], LearnedRouter(gates, top_k=2)), short)
    with pytest.raises(GenerationError, match="SequenceRouter"):
        engine.submit(Request([vocab.bos_id], object()), short)
    assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == 0


def test_a_batch_is_queued_at_once_and_prefilled_together_or_not_at_all(model, monkeypatch):
    """engine.stream (and the pipeline) queue a batch in one step: the engine admits all of it in one pass (one
    prefill where prefills are batched), not the pieces that arrived while it prefilled the first; a bad request
    in the batch raises, naming the problem, with none of the others queued."""
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128, batch_prefill=True))
    groups = []
    real_prefill, real_route = Engine._prefill, core._route_of
    monkeypatch.setattr(Engine, "_prefill", lambda self, group: groups.append(len(group)) or real_prefill(self, group))
    # checking a request takes a while (as when the submitting thread loses the GIL): the engine thread wakes
    # meanwhile. Queued one by one, as before, the batch went in pieces: [1, 5], [1, 1, 1, 1, 1, 1]
    monkeypatch.setattr(core, "_route_of", lambda *args: (time.sleep(0.01), real_route(*args))[1])
    config = GenerationConfig(max_new_tokens=6, seed=0, **GREEDY)
    requests = [Request(p, VocabRangeRouter(vocab, "a", "b")) for p in prompts(vocab, 6, seed=4)]
    for _ in range(3):
        groups.clear()
        tokens, ends = collect(engine.stream(requests, config))
        assert groups == [6] and len(tokens) == 6 and set(ends.values()) == {"length"}
    bad = Request([vocab.bos_id], SequenceRouter("nope"))
    with pytest.raises(UnknownAdapterError, match="request 4 of 4: .*nope"):
        engine.stream([*requests[:3], bad], config)
    with pytest.raises(GenerationError, match="2 configs for 3 requests"):
        engine.submit_all(requests[:3], [config] * 2)
    with pytest.raises(GenerationError, match="1 tags for 2 requests"):
        engine.submit_all(requests[:2], [config] * 2, tags=["x"])
    assert list(engine.stream([], config)) == []
    time.sleep(0.05)
    assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == 0 and engine.stats()["starting"] == 0
    engine.close()


def test_batched_prefill_gives_the_same_greedy_tokens(model):
    routed, vocab = model
    config = GenerationConfig(max_new_tokens=30, seed=0, cfg_scale=2.0, **GREEDY)
    requests = [Request(p, VocabRangeRouter(vocab, "a", "b")) for p in prompts(vocab, 3, seed=9)]
    requests.append(Request([vocab.bos_id, 20, vocab.boi_id, vocab.image_start + 1], SequenceRouter("b")))
    one = collect(Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128)).stream(requests, config))
    together = collect(Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128, batch_prefill=True))
                       .stream(requests, config))
    assert [[t for t, _ in row] for row in one[0].values()] == [[t for t, _ in row] for row in together[0].values()]


def test_tokens_carry_the_batch_they_shared(model):
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    config = GenerationConfig(max_new_tokens=12, min_new_tokens=12, seed=0, cfg_scale=1.0, **GREEDY)
    items = [item for _, item in engine.stream([Request(p) for p in prompts(vocab, 3)], config)]
    batches = [item.batch for item in items if isinstance(item, Token)]
    assert max(batches) == 3 and len(batches) == 36


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_steps_equal_eager_steps_while_adapters_move_between_slots():
    routed, vocab = random_routed_model("tiny", device="cuda", dtype=torch.float32, num_slots=2, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c", "d"], std=0.2):
        routed.add_adapter(adapter)
    captured = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=128, max_rows=8))
    eager = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=128, max_rows=8, cuda_graphs=False))
    config = GenerationConfig(max_new_tokens=20, seed=0, cfg_scale=2.0, **GREEDY)
    pairs = [("a", "b"), ("c", "d"), ("b", "a"), ("d", "c"), ("a", "c")]
    for i, (t, im) in enumerate(pairs):  # each pair evicts the previous one: slots are reassigned between runs
        request = [Request(p, VocabRangeRouter(vocab, t, im)) for p in prompts(vocab, 2, seed=i)]
        assert collect(captured.stream(request, config)) == collect(eager.stream(request, config))
    assert captured.stats()["graphs"] and routed.cache.stats()["evictions"] >= 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_captured_steps_choose_and_advance_as_eager_steps():
    """A captured decode step chooses every row's token and moves its row itself (sampling from each request's
    own generator, top-k / top-p, guidance, pictures): side by side with greedy rows, sampled and filtering rows
    get the eager engine's tokens, and the first capture (its warm-up runs the step) moves no running row twice."""
    routed, vocab = random_routed_model("tiny", device="cuda", dtype=torch.float32, num_slots=2, image_size=64)
    for adapter in random_adapters(routed, ["a", "b"], std=0.2):
        routed.add_adapter(adapter)
    captured = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=128, max_rows=8))
    eager = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=128, max_rows=8, cuda_graphs=False))
    requests = [Request(p, VocabRangeRouter(vocab, "a", "b")) for p in prompts(vocab, 4, seed=5)]
    configs = [sampled(0), sampled(1, top_k=5, top_p=0.8, image_top_k=7),
               GenerationConfig(max_new_tokens=40, seed=2, cfg_scale=3.0, **GREEDY), sampled(3, top_p=0.5)]
    got = collect(captured.stream(requests[:2], configs[:2]))
    assert got == collect(eager.stream(requests[:2], configs[:2])) and all(len(t) > 1 for t in got[0].values())
    for request, config in zip(requests, configs):  # one at a time (a batch's width may round a row differently)
        assert solo(captured, request, config) == solo(eager, request, config)
    assert captured.stats()["graphs"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlapped_steps_deliver_exactly_each_requests_tokens():
    """On CUDA a step is launched before the previous one's tokens are read: a request that ends at its row's last
    position, ends early or samples gets the tokens it gets without the overlap; side by side, every request gets
    its tokens in order and one end (after exactly its budget when it ends by length), and one cancelled mid-way
    ends cancelled.  (Side by side, the batch's width may round a row's numbers differently, so values are compared
    one request at a time.)"""
    routed, vocab = random_routed_model("tiny", device="cuda", dtype=torch.float32, num_slots=4, image_size=64)
    for adapter in random_adapters(routed, ["a", "b"], std=0.2):
        routed.add_adapter(adapter)
    overlapped = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=40, max_rows=8))
    plain = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=40, max_rows=8, overlap_steps=False))
    base = prompts(vocab, 5, seed=9, length=(3, 8))
    requests = [Request(p, VocabRangeRouter(vocab, "a", "b")) for p in base]
    configs = [GenerationConfig(max_new_tokens=40 - len(p), min_new_tokens=40 - len(p), seed=i, cfg_scale=1.0,
                                **GREEDY) if i % 2 == 0 else
               GenerationConfig(max_new_tokens=5 + 3 * i, seed=i, cfg_scale=1.0) for i, p in enumerate(base)]
    want = [solo(plain, r, c) for r, c in zip(requests, configs)]
    assert [solo(overlapped, r, c) for r, c in zip(requests, configs)] == want
    assert [len(w) for w in want[::2]] == [40 - len(p) for p in base[::2]]  # to the row's last position
    configs[1] = GenerationConfig(max_new_tokens=30, min_new_tokens=30, seed=1, cfg_scale=1.0)  # the one cancelled
    handles = [overlapped.submit(r, c) for r, c in zip(requests, configs)]
    for i in (1, 0, 2, 3, 4):  # the one to cancel first, while it runs
        handle, items = handles[i], []
        while not items or not isinstance(items[-1], (Done, Exception)):
            items.append(handle.sink.get(timeout=60)[1])
            if i == 1 and len(items) == 3:
                handle.cancel()
        tokens = [t for t in items if isinstance(t, Token)]
        budget = configs[i].max_new_tokens
        assert [t.index for t in tokens] == list(range(len(tokens))) and isinstance(items[-1], Done)
        if i == 1:
            assert items[-1].reason == "cancelled" and len(tokens) < budget
        else:
            if tokens[-1].token == vocab.eos_id:
                assert items[-1].reason == "eos"
            else:
                assert items[-1].reason == "length" and len(tokens) == budget
    assert overlapped.stats()["running"] == 0 and routed.cache.pins("a") == 0


def test_a_request_that_does_not_fit_in_memory_fails_alone(model, monkeypatch):
    routed, vocab = model
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128, batch_prefill=True))
    real = engine._prefill_forward

    def prefill(entries):  # a prompt of 60+ tokens "runs out of memory", as a huge one would on a GPU
        if any(len(prompt) >= 60 for _, _, prompt in entries):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(entries)

    monkeypatch.setattr(engine, "_prefill_forward", prefill)
    config = GenerationConfig(max_new_tokens=10, seed=0, cfg_scale=1.0, **GREEDY)
    small = prompts(vocab, 2, seed=4)
    requests = [Request(small[0]), Request([vocab.bos_id] * 60, SequenceRouter("a")), Request(small[1])]
    handles = [engine.submit(r, config) for r in requests]  # three users, each with its own stream
    results = []
    for handle in handles:
        items = []
        while not items or not isinstance(items[-1], (Done, Exception)):
            items.append(handle.sink.get(timeout=30)[1])
        results.append(items)
    assert isinstance(results[1][-1], GenerationError) and "does not fit" in str(results[1][-1])
    for items in (results[0], results[2]):
        assert isinstance(items[-1], Done) and len(items) == 11
    assert routed.cache.pins("a") == 0 and engine.stats()["running"] == 0
    assert solo(engine, requests[0], config) == [(t.token, t.adapter) for t in results[0][:-1]]


def test_exact_rows_off_lets_the_cpu_decode_only_the_live_rows(model):
    routed, vocab = model
    exact = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64))
    fast = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=64, exact_rows=False))
    assert exact.widths[0] == 4 and fast.widths[0] == 1
    config = GenerationConfig(max_new_tokens=12, min_new_tokens=12, seed=0, cfg_scale=1.0, **GREEDY)
    tokens = solo(fast, Request(prompts(vocab, 1)[0], VocabRangeRouter(vocab, "a", "b")), config)
    assert len(tokens) == 12 and {a for _, a in tokens} <= {"a", "b"}


def learned_batch(routed, vocab):
    """Requests of two learned routers (one with routing-state text gates and per-picture image gates, one with
    plain top-1 gates; one request guided, one inside a picture) beside a vocabulary-routed request."""
    torch.manual_seed(0)  # random gates whose decisions vary by position
    first = LearnedRouter(
        LearnedGates.for_model(routed, ["a", "b"], base_expert=True, context_decays=(0.5, 0.9), init_std=1.0),
        top_k=2, vocab=vocab,
        image_gates=LearnedGates.for_model(routed, ["c"], base_expert=True, context_decays=(0.7,), init_std=1.0))
    second = LearnedRouter(LearnedGates.for_model(routed, ["b", "c"], init_std=1.0), top_k=1)
    ps = prompts(vocab, 3, seed=4)
    picture = [vocab.bos_id, 20, vocab.boi_id, vocab.image_start + 1]
    requests = [Request(ps[0], first), Request(picture, first), Request(ps[1], second),
                Request(ps[2], VocabRangeRouter(vocab, "a", "d"))]
    configs = [GenerationConfig(max_new_tokens=24, seed=0, cfg_scale=2.0 if i == 0 else 1.0, **GREEDY)
               for i in range(len(requests))]
    return requests, configs


def routed_tokens(engine, requests, configs):
    """Per request: its (token, adapter, top-k mix) in order, all requests running side by side."""
    handles = [engine.submit(r, c) for r, c in zip(requests, configs)]
    out = []
    for handle in handles:
        items = []
        while not items or not isinstance(items[-1], (Done, Exception)):
            items.append(handle.sink.get(timeout=120)[1])
        assert isinstance(items[-1], Done), items[-1]
        out.append([(t.token, t.adapter, t.mix) for t in items if isinstance(t, Token)])
    return out


def test_learned_rows_of_two_routers_beside_a_static_row_decode_as_alone():
    """Learned rows decode through per-router row tables (the form a captured step reads): side by side, every
    request gets exactly the tokens, adapters and top-k mixes it gets alone."""
    routed, vocab = random_routed_model("tiny", device="cpu", dtype=torch.float32, num_slots=4, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c", "d"], std=0.2):
        routed.add_adapter(adapter)
    requests, configs = learned_batch(routed, vocab)
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=128))
    alone = [routed_tokens(engine, [r], [c])[0] for r, c in zip(requests, configs)]
    assert routed_tokens(engine, requests, configs) == alone
    assert {a for row in alone[:3] for _, a, _ in row} >= {"a", "b", "c"}  # the gates chose several adapters
    assert any(len(mix) == 2 for _, _, mix in alone[0])  # top-2 rows report both adapters they mix


def test_learned_routers_alike_share_the_engines_tables():
    """Two LearnedRouter objects over the same gates, top-k and vocabulary (the pipeline makes one per request)
    share one set of the engine's tables (on CUDA, one captured prefill and step), and each request still gets
    exactly what it gets alone; a router with another top-k gets tables of its own."""
    routed, vocab = random_routed_model("tiny", device="cpu", dtype=torch.float32, num_slots=4, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c"], std=0.2):
        routed.add_adapter(adapter)
    torch.manual_seed(0)
    gates = LearnedGates.for_model(routed, ["a", "b"], base_expert=True, context_decays=(0.5, 0.9), init_std=1.0)
    first, second = (LearnedRouter(gates, top_k=2, vocab=vocab) for _ in range(2))
    other = LearnedRouter(gates, top_k=1, vocab=vocab)
    ps = prompts(vocab, 3, seed=5)
    requests = [Request(ps[0], first), Request(ps[1], second), Request(ps[2], other)]
    configs = [GenerationConfig(max_new_tokens=16, seed=0, **GREEDY)] * 3
    from molora.models.engine import core
    assert core._router_key(first) == core._router_key(second) != core._router_key(other)
    engine = Engine(routed, vocab, device="cpu", config=EngineConfig(max_len=96))
    alone = [routed_tokens(engine, [r], [c])[0] for r, c in zip(requests, configs)]
    assert routed_tokens(engine, requests, configs) == alone  # first's and second's rows in one table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_learned_steps_equal_eager_steps_while_adapters_move(monkeypatch):
    """Learned rows are captured too, in decode steps and prefills: the replayed graphs give the eager forwards'
    tokens, adapters and mixes, also after the adapters moved between slots and after a learned graph was dropped
    (LEARNED_GRAPHS)."""
    from molora.models.engine import core
    monkeypatch.setattr(core, "LEARNED_GRAPHS", 1)
    routed, vocab = random_routed_model("tiny", device="cuda", dtype=torch.float32, num_slots=4, image_size=64)
    for adapter in random_adapters(routed, ["a", "b", "c", "d", "e", "f"], std=0.2):
        routed.add_adapter(adapter)
    captured = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=128, max_rows=8))
    eager = Engine(routed, vocab, device="cuda", config=EngineConfig(max_len=128, max_rows=8, cuda_graphs=False))
    requests, configs = learned_batch(routed, vocab)
    evict = [Request(p, VocabRangeRouter(vocab, "e", "f")) for p in prompts(vocab, 2, seed=8)]
    def same(got, want):
        """Tokens and adapters exactly; mixes as {adapter: weight} within 2e-3 (the replayed step's kernels round
        float32 differently from the eager step's, and a mix weight is reported in 1e-4 steps)."""
        assert [[t[:2] for t in row] for row in got] == [[t[:2] for t in row] for row in want]
        for row, other in zip(got, want):
            for (_, _, mix), (_, _, mix2) in zip(row, other):
                a, b = dict(mix), dict(mix2)
                assert a.keys() == b.keys() and all(abs(a[n] - b[n]) <= 2e-3 for n in a), (mix, mix2)

    for _ in range(2):  # the second round: slots reassigned by the evicting requests in between
        same(routed_tokens(captured, requests, configs), routed_tokens(eager, requests, configs))
        same(routed_tokens(captured, requests[2:3], configs[2:3]), routed_tokens(eager, requests[2:3], configs[2:3]))
        assert collect(captured.stream(evict, configs[3])) == collect(eager.stream(evict, configs[3]))
    stats = captured.stats()
    assert len(stats["learned_graphs"]) == 1 and stats["graphs"]
    assert len(stats["learned_prefill_graphs"]) == 1 and stats["prefill_graphs"]
    assert not eager.stats()["learned_prefill_graphs"]
    assert routed.cache.stats()["evictions"] >= 4
