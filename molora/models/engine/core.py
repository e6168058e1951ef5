"""The serving engine: every live request, from any thread, decodes in ONE running batch.

    engine = Engine(routed_model, vocab, device="cuda")
    for index, item in engine.stream([Request(prompt_ids, router)], GenerationConfig(seed=0)):
        ...                                     # item is a Token (token id, producing adapter) or a Done

One background thread owns the model (gpt-fast's loop, vLLM's scheduler in miniature).  At every step boundary:

    1. drop cancelled requests (a consumer that stopped iterating): row, KV row and adapter pins are freed;
    2. admit waiting requests, first come first served, while rows (two with CFG), KV space and hot-set slots
       allow: their adapters are pinned ONCE for the whole request (`HotSetCache.acquire_nowait`; a copy into a
       slot runs on a side stream and only the request that needs it waits for it);
    3. prefill the admitted requests whose adapter copies have landed, each into its own row of the static KV
       cache (on CUDA together, one forward; on the CPU each alone, so its numbers never depend on its
       neighbours), and sample their first tokens;
    4. decode one token for every running row in one forward of fixed width (a bucket), captured as a CUDA
       graph on the GPU and replayed; on the CPU one call of the C step where the model allows
       (models/engine/cpu_step.py: only the live rows, each on its own); sampling is per row (own settings, own
       random generator), so a request's tokens do not depend on what else runs beside it.

Routing is device tables written in place (models/engine/row_states.py): a row's (text, image) slots and the
vocabulary's modality table; the captured step reads them, so no slot number is baked into a graph and adapters
may come and go between replays.  Learned (MoLoRA) rows are captured too: each learned router's rows and its
experts' slots are device tables written in place when the batch changes (`_LearnedRows`), its gates decide per
block inside the step, and gates that read a routing state continue each row's state from its previous step
(`_hold_states`).

A model dispatched over several devices by accelerate (`from_pretrained(..., device_map=...)`): the engine's
tables and inputs live on the first device (the input embedding's), each attention layer's KV cache on its
block's device, the routing each layer reads is copied to its device once per forward per device
(routing/context.py PlacedRouting), and the logits are brought back from wherever the head is.  CUDA graphs are
captured only when the model lives on one CUDA device; a spread or offloaded model runs every step eagerly
(the engine says so in its log).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import queue
import random
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from molora.kernels.graphs import capture_graph
from molora.models.engine.cpu_step import CpuStep, CpuStepError, learned_step
from molora.models.engine.decoder import LeanDecoder
from molora.models.engine.generation import GenerationConfig, Request, open_image_span
from molora.models.engine.kv_cache import RowKVCache
from molora.models.engine.row_states import Draw, RowStates
from molora.models.engine.runtime import available_cpus, available_memory
from molora.models.engine.sampling import MAX_SEED, GenerationError
from molora.models.engine.vocab import IMAGE, TEXT, UnifiedVocab
from molora.routing import CacheFullError, LearnedRouter, MoLoRAError, SequenceRouter, VocabRangeRouter
from molora.routing.context import CallRouting
from molora.routing.errors import RoutingError
from molora.routing.routers import LearnedGroup, Router

log = logging.getLogger(__name__)

# 16 rows on the CPU: 8 app visitors (guided pictures take two rows each) at once finish 4.24x sooner than one by one
# with 16 rows, 2.87x with 8 (embedded model, 2 shared cores, benchmarks/app_load.py --same-length, 2026-12-01)
CPU_MAX_ROWS = 16
CUDA_MAX_ROWS = 64
# Decode widths. On the CPU the narrowest is 4: a row's logits are bit-identical for every batch width >= 4 with
# one torch thread (measured on the embedded model, 2026-11-30: widths 1-3 differ from 16 by up to 3e-5, widths
# 4-15 by 0.0), so a request decodes exactly as alone whatever runs beside it.
# The price, same run: a lone guided request (2 live rows) decodes a step in 8.5 ms at width 4 and 6.8 ms at width 2,
# because MKL's small-matrix path (M < 4) is faster and rounds differently; padding only the matmuls to 4 rows keeps
# the numbers exact but not the speed (8.4 ms). EngineConfig(exact_rows=False) takes the speed instead. (2026-12-05:
# with the base GEMMs on oneDNN-packed weights, exact at every width, width 2 is no faster: one picture + ~60 words
# 3.08 s at width 2 against 2.91 s at width 4, and the LoRA matmuls are not exact below 4 rows.)
CPU_MIN_WIDTH = 4
# The CPU's exact-row decode GEMMs run on copies of the routed base weights made once (kernels/torch_ops.py
# pack_exact_rows: bfloat16 copies for our kernel where the values are bfloat16, else oneDNN-packed where oneDNN is
# exact), up to this many bytes of copies counted at float32 size (the embedded model's: 26 MB)
CPU_PACKED_MAX_BYTES = 256 * 2 ** 20
# Eager steps read only the KV columns the batch has written, rounded up to this many (shapes stay few; the masked
# columns beyond a row's own length add exact zeros, so a row's result does not depend on its neighbours' lengths).
KV_COLUMN_BLOCK = 64
# Captured decode steps with learned rows, one per (width, learned routers in the batch): the oldest goes beyond this
LEARNED_GRAPHS = 8


_ENGINES: weakref.WeakSet = weakref.WeakSet()


def _release_freed_heap() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim; elsewhere nothing). Many threads allocating and
    freeing tensors leave glibc's per-thread arenas holding freed memory: in the app load test (20 visitors a
    round, benchmarks/app_load.py) resident memory climbed 1.26 -> 2.83 GiB over 5 rounds, and malloc_trim took it
    back to 1.10 GiB, below where it started: nothing was held, only cached. The loop calls it when it goes idle."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@atexit.register
def _close_engines() -> None:
    """Stop every engine loop before the interpreter tears down torch (a loop thread still alive then aborts
    the process with 'terminate called without an active exception' when torch runs one thread)."""
    for engine in list(_ENGINES):
        engine.close()


@dataclass
class EngineConfig:
    """max_rows: rows decoded together (a CFG request takes two); max_len: positions per row (prompt + new
    tokens), default the model's; KV space is max_rows x max_len positions, allocated once.  cuda_graphs: capture
    the decode step per width on CUDA.  lean_decoder: run Llama-family models (Llama, Mistral, Qwen2/3) through
    LeanDecoder (models/engine/decoder.py) instead of transformers' module forward.  overlap_steps: on CUDA, launch
    each decode step before the previous step's tokens are read (the host's work per step runs beside the GPU's).
    queue_timeout_s: how long a request may wait for room.  batch_prefill:
    prefill requests admitted at the same step boundary in one forward.  cpu_step: on the CPU with exact rows,
    decode through the C step (models/engine/cpu_step.py) where the model allows it: one call a step, only the live
    rows, each on its own (False: torch's eager step); cpu_step_threads: how many threads share a step's rows
    (each row's numbers are the same whatever the split; default: the CPUs this process may use).
    exact_rows=False (torch's step) lets the CPU decode as few rows as are live, and a row's numbers may then
    differ slightly with the batch it shares."""

    max_rows: int | None = None
    max_len: int | None = None
    cuda_graphs: bool = True
    queue_timeout_s: float = 600.0
    batch_prefill: bool | None = None  # prefill newcomers together (default: on CUDA; see Engine._admit)
    exact_rows: bool = True  # CPU: decode >= CPU_MIN_WIDTH rows so a row's numbers never depend on its batch
    lean_decoder: bool = True  # Llama-family models run the engine's own forward (engine/decoder.py)
    overlap_steps: bool = True  # CUDA: launch step t+1 before reading step t's tokens
    cpu_step: bool = True  # CPU: one C call per decode step where the model allows (engine/cpu_step.py)
    cpu_step_threads: int | None = None  # CPU: threads a C step splits its rows over (None: the CPUs it may use)


@dataclass
class Token:
    """One generated token of a request: its index in the request, the adapter that produced it (None = base
    model; learned routing: the top-1, with the top-k and their weights in `mix`), the wall time since the request's previous token (the first: since it was submitted, so queueing and
    prefill included) and how many requests shared the step that made it."""

    index: int
    token: int
    adapter: str | None
    ms: float
    batch: int
    mix: tuple[tuple[str | None, float], ...] = ()  # learned routing: its top-k adapters and weights (None = base)


@dataclass
class Done:
    """A request ended: reason "eos", "length" or "cancelled"."""

    reason: str


class RequestHandle:
    """A submitted request; `cancel()` (any thread) frees its row and adapters at the next step boundary."""

    def __init__(self, engine: Engine, sink: queue.Queue, tag: Any) -> None:
        self.engine, self.sink, self.tag = engine, sink, tag
        self.cancelled = False
        self.finished = False

    def cancel(self) -> None:
        self.cancelled = True
        self.engine.wake()


@dataclass(eq=False)
class _Job:
    """A request inside the engine: what it asked for and the rows / adapters it holds once admitted."""

    handle: RequestHandle
    prompt: list[int]
    config: GenerationConfig
    text_adapter: str | None
    image_adapter: str | None
    learned: LearnedRouter | None
    open_span: int | None
    submitted: float
    last: float  # perf_counter of the previous token (or of the submission)
    names: list[str] = field(default_factory=list)  # distinct adapters to pin
    slot_of: dict[str, int] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)  # CUDA events of copies into its slots
    row: int = -1
    twin: int | None = None
    generator: torch.Generator | None = None
    emitted: int = 0
    uncond: list[int] | None = None  # the CFG twin's prefix (<bos> + negative prompt); None: <bos>

    @property
    def rows_needed(self) -> int:
        return 2 if self.config.uses_cfg else 1

    @property
    def random(self) -> bool:
        return self.config.text.temperature > 0 or self.config.image.temperature > 0


@dataclass
class _Batch:
    """The running batch as the decode step needs it: jobs by row, the jobs that sample (each draws its noise from
    its own generator), the decode width, the learned routers' tables (one per distinct LearnedRouter in the
    batch), what choosing its tokens must compute (Draw), and `live`: rows [0, live) hold the jobs' rows, the rest
    of the width is padding."""

    jobs: list[_Job]
    sampling: list[_Job]
    width: int
    learned: tuple[_LearnedRows, ...]
    draw: Draw
    live: int


def _router_key(router: LearnedRouter) -> tuple:
    """What a learned router's routing depends on (its gate objects, top-k's and vocabulary). Routers equal in it
    route alike, so they share the engine's tables and captured graphs: the pipeline makes one router per request
    over the same gates, and a new key would capture a new prefill and decode step for each request. (The tables
    hold one such router, so the objects named by the ids stay alive while the key is in use.)"""
    return (id(router.gates), router.top_k, id(router.vocab), router.image_adapter, id(router.image_gates),
            router.image_top_k)


@dataclass(eq=False)
class _LearnedRows:
    """One LearnedRouter's inputs to a decode step, written in place whenever the running batch changes, so that
    a captured step reads them: which cache rows the router routes (`member`, [rows + 1] bool), and each of its gate
    sets' expert -> hot-set slot map ([E] long; adapters are pinned per request, so the map holds while it runs)."""

    router: LearnedRouter
    member: torch.Tensor
    expert_slots: dict[Any, torch.Tensor]
    key: tuple  # _router_key(router): routers alike share these tables

    @classmethod
    def for_router(cls, router: LearnedRouter, rows: int, device: torch.device) -> _LearnedRows:
        gate_sets = [router.gates] + ([router.image_gates] if router.image_gates is not None else [])
        sets = {gates: torch.full((gates.num_experts,), -1, dtype=torch.long, device=device) for gates in gate_sets}
        return cls(router, torch.zeros(rows, dtype=torch.bool, device=device), sets, _router_key(router))

    def write(self, jobs: list[_Job]) -> None:
        """Point the tables at these jobs (the router's jobs in the running batch): their rows and slots."""
        member = torch.zeros(self.member.shape, dtype=torch.bool)
        slot_of: dict[str, int] = {}
        for job in jobs:
            member[[r for r in (job.row, job.twin) if r is not None]] = True
            slot_of.update(job.slot_of)
        self.member.copy_(member)
        for gates, slots in self.expert_slots.items():
            slots.copy_(gates.expert_slots(slot_of, "cpu"))


def _route_of(router: Router | None, vocab: UnifiedVocab) -> tuple[str | None, str | None, LearnedRouter | None]:
    """(text adapter, image adapter, learned router) of a request's router; the engine routes by tables."""
    if router is None:
        return None, None, None
    if isinstance(router, SequenceRouter):
        return router.adapter, router.adapter, None
    if isinstance(router, VocabRangeRouter):
        if router.vocab != vocab:
            raise GenerationError("the VocabRangeRouter was built for another vocabulary than the engine's")
        return router.text_adapter, router.image_adapter, None
    if isinstance(router, LearnedRouter):
        if router.vocab is not None and router.vocab != vocab:
            raise GenerationError("the LearnedRouter was built for another vocabulary than the engine's")
        return None, router.image_adapter, router
    raise GenerationError(f"the engine routes with SequenceRouter, VocabRangeRouter or LearnedRouter; got {router!r}")


class Engine:
    """Continuous batching over one RoutedModel: submit from any thread, one forward per step for everyone."""

    def __init__(self, routed: Any, vocab: UnifiedVocab, *, device: torch.device | str,
                 logits_size: int | None = None, config: EngineConfig | None = None,
                 max_positions: int | None = None) -> None:
        self.routed, self.vocab = routed, vocab
        self.device = torch.device(device)
        self.config = config or EngineConfig()
        on_cuda = self.device.type == "cuda"
        self.max_rows = self.config.max_rows or (CUDA_MAX_ROWS if on_cuda else CPU_MAX_ROWS)
        limit = max_positions or int(routed.model.config.get_text_config().max_position_embeddings)
        self.max_len = min(self.config.max_len or limit, limit)
        if self.max_rows < 1 or self.max_len < 2:
            raise GenerationError(f"an engine needs max_rows >= 1 and max_len >= 2, got {self.max_rows}, "
                                  f"{self.max_len}")
        threads = self.config.cpu_step_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise GenerationError(f"EngineConfig.cpu_step_threads must be a whole number >= 1 (None: the CPUs this "
                                  f"process may use), got {threads!r}")
        # a model dispatched over devices (accelerate's device_map): each attention layer's KV on its block's device
        placement = getattr(routed, "placement", None)
        num_layers = int(routed.model.config.get_text_config().num_hidden_layers)
        self.layer_devices = None
        if placement is not None and len(placement.block_devices) == num_layers:
            self.layer_devices = list(placement.block_devices)
        self._logits_elsewhere = placement is not None  # the head may sit on another device than the inputs
        # the KV space is sized from the model's config, which may declare any length: checked before allocating
        kv_bytes = RowKVCache.planned_nbytes(routed.model.config, self.max_rows + 1, self.max_len,
                                             next(routed.model.parameters()).dtype)
        devices = self.layer_devices or [self.device] * num_layers
        for kv_device in dict.fromkeys(devices):
            share = kv_bytes * devices.count(kv_device) // max(1, num_layers)
            free = available_memory(kv_device)
            if free is not None and share > free:
                raise GenerationError(f"the KV cache of {self.max_rows} rows x {self.max_len} positions needs "
                                      f"{share / 2 ** 30:.1f} GiB on {kv_device} but {free / 2 ** 30:.1f} GiB are free "
                                      f"(the model's config allows {limit} positions); pass "
                                      "EngineConfig(max_len=..., max_rows=...)")
        self.logits_size = logits_size or vocab.vocab_size
        # CUDA graphs only when the whole model lives on one CUDA device: a model spread over devices or with
        # weights streamed in by accelerate's offload hooks runs its steps eagerly
        self.use_graphs = on_cuda and self.config.cuda_graphs and (placement is None or placement.one_device)
        if on_cuda and self.config.cuda_graphs and not self.use_graphs:
            log.info("engine: the model is placed over %s%s: no CUDA-graph capture, every step runs eagerly",
                     [str(d) for d in placement.devices], " with offloaded weights" if placement.offloaded else "")
        low = 1 if on_cuda or not self.config.exact_rows else min(CPU_MIN_WIDTH, self.max_rows)
        self._exact_cpu = not on_cuda and self.config.exact_rows  # the CPU's decode rows computed row by row
        self.widths = sorted({min(low << i, self.max_rows) for i in range(self.max_rows.bit_length() + 1)})
        self._lock = threading.Condition()
        self._incoming: list[_Job] = []
        self._waiting: deque[_Job] = deque()
        self._starting: list[_Job] = []
        self._running: dict[int, _Job] = {}  # prompt row -> job
        self._free: list[int] = list(range(self.max_rows))
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ready = False
        self.steps = 0
        self.step_ms: list[float] | None = None  # set to a list to record each decode step's wall time
        self._graphs: dict[tuple[int, Draw], tuple[Any, torch.Tensor]] = {}  # captured decode steps
        # decode steps with learned rows: (width, Draw, each learned router's key) -> (graph, outputs, their tables)
        self._learned_graphs: OrderedDict[tuple, tuple[Any, Any, tuple[_LearnedRows, ...]]] = OrderedDict()
        self._learned_rows: dict[tuple, _LearnedRows] = {}  # _router_key -> its tables (holding one such router)
        self._prefill_graphs: dict[tuple[int, int], tuple[Any, tuple, tuple]] = {}
        # prefills with learned rows: ((rows, tokens), key of each learned router) -> (graph, inputs, outputs); the
        # graphs read the routers' tables, which _learned_rows keeps while a graph names their key
        self._learned_prefills: OrderedDict[tuple, tuple[Any, tuple, tuple]] = OrderedDict()
        self._index_cache: _Batch | None = None
        self._pending: _HostCopy | None = None  # CUDA: the launched step whose tokens are not read yet
        # the C step: may it decide the running batch's learned routers (its tables tuple -> yes / no)
        self._c_decides: tuple[tuple[_LearnedRows, ...], bool] | None = None
        self._last_delivery: float | None = None
        _ENGINES.add(self)

    # --- the public side (any thread) ----------------------------------------------------------------------
    def submit(self, request: Request, config: GenerationConfig, *, sink: queue.Queue | None = None,
               tag: Any = None) -> RequestHandle:
        """Queue one request; its Tokens and final Done go to `sink` as (tag, item), errors as (tag, exception).
        Bad requests raise here (GenerationError / CacheFullError / UnknownAdapterError), before queueing."""
        return self.submit_all([request], [config], sink, [tag])[0]

    def submit_all(self, requests: Sequence[Request], configs: Sequence[GenerationConfig],
                   sink: queue.Queue | None = None, tags: Sequence[Any] | None = None) -> list[RequestHandle]:
        """Queue several requests as one batch, their items going to `sink` (default: a new queue) tagged by `tags`
        (default: their indices). Every request is checked first: a bad one raises, naming the problem (and, in a
        batch of several, which request, counting from 1), and none is queued. Then all are queued at once, so the
        engine admits them in one pass as far as rows, slots and adapter copies allow (on CUDA, one prefill), not in
        the pieces that arrived while it was already prefilling the first."""
        if len(configs) != len(requests):
            raise GenerationError(f"{len(configs)} configs for {len(requests)} requests")
        if tags is not None and len(tags) != len(requests):
            raise GenerationError(f"{len(tags)} tags for {len(requests)} requests")
        sink = queue.Queue() if sink is None else sink
        jobs = []
        for index, (request, config) in enumerate(zip(requests, configs)):
            try:
                jobs.append(self._job(request, config, sink, index if tags is None else tags[index]))
            except MoLoRAError as err:
                if len(requests) == 1:
                    raise
                raise type(err)(f"request {index + 1} of {len(requests)}: {err}") from err
        if not jobs:
            return []
        with self._lock:
            if self._closed:
                raise GenerationError("the engine was closed")
            self._incoming.extend(jobs)
            self._start_thread()
            self._lock.notify_all()
        return [job.handle for job in jobs]

    def _job(self, request: Request, config: GenerationConfig, sink: queue.Queue, tag: Any) -> _Job:
        """A checked request, ready to queue (raises GenerationError / CacheFullError / UnknownAdapterError)."""
        prompt = list(request.prompt_ids)
        vocab = self.vocab
        if not prompt:
            raise GenerationError("a prompt must hold at least <bos>")
        if min(prompt) < 0 or max(prompt) >= vocab.vocab_size:
            raise GenerationError(f"prompt ids must lie in [0, {vocab.vocab_size})")
        if len(prompt) + config.max_new_tokens > self.max_len:
            raise GenerationError(f"prompt of {len(prompt)} tokens + max_new_tokens={config.max_new_tokens} exceeds "
                                  f"the {self.max_len} positions a row holds; shorten the prompt or max_new_tokens")
        span = open_image_span(prompt, vocab)
        if span is not None and span > vocab.tokens_per_image:
            raise GenerationError(f"a prompt's open image span already holds {span} tokens, more than the "
                                  f"{vocab.tokens_per_image} of one image")
        uncond = None if request.uncond_prompt is None else list(request.uncond_prompt)
        if uncond is not None and (not uncond or min(uncond) < 0 or max(uncond) >= vocab.vocab_size
                                   or len(uncond) + vocab.image_span_tokens > self.max_len):
            raise GenerationError(f"the unconditional prompt (negative prompt) must hold 1 to "
                                  f"{self.max_len - vocab.image_span_tokens} ids in [0, {vocab.vocab_size})")
        if config.seed is None:
            config = config.with_overrides(seed=random.SystemRandom().randrange(MAX_SEED + 1))
        text, image, learned = _route_of(request.router, vocab)
        names = list(dict.fromkeys(n for n in (text, image, *(learned.adapters() if learned else ()))
                                   if n is not None))
        cache = self.routed.cache
        for name in names:
            cache.adapter(name)  # raises UnknownAdapterError naming the loaded ones
        if len(names) > cache.num_slots:
            raise CacheFullError(f"this request routes over {len(names)} distinct adapters but the hot set has only "
                                 f"{cache.num_slots} slots; choose fewer adapters")
        job = _Job(RequestHandle(self, sink, tag), prompt, config, text, image, learned, span, time.monotonic(),
                   time.perf_counter(), names=names, uncond=uncond)
        if job.rows_needed > self.max_rows:
            raise GenerationError(f"classifier-free guidance needs two rows; this engine has {self.max_rows}")
        return job

    def stream(self, requests: Sequence[Request], config: GenerationConfig | Sequence[GenerationConfig]
               ) -> Generator[tuple[int, Token | Done], None, None]:
        """Submit `requests` (one config, or one per request) and yield (request index, Token / Done) as they
        come. Closing the iterator early cancels whatever has not finished."""
        configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(requests)
        sink: queue.Queue = queue.Queue()
        handles = self.submit_all(requests, configs, sink)
        return self._drain(sink, handles)

    def _drain(self, sink: queue.Queue, handles: list[RequestHandle]
               ) -> Generator[tuple[int, Token | Done], None, None]:
        open_ = len(handles)
        try:
            while open_:
                tag, item = sink.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Done):
                    open_ -= 1
                yield tag, item
        finally:
            for handle in handles:
                if not handle.finished:
                    handle.cancel()

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"running": len(self._running), "starting": len(self._starting),
                    "waiting": len(self._waiting) + len(self._incoming), "free_rows": len(self._free),
                    "max_rows": self.max_rows, "max_len": self.max_len, "steps": self.steps,
                    "graphs": sorted({width for width, _ in self._graphs}),
                    "prefill_graphs": sorted(self._prefill_graphs),
                    "learned_graphs": [key[0] for key in self._learned_graphs],
                    "learned_prefill_graphs": [key[0] for key in self._learned_prefills]}

    def close(self) -> None:
        """Stop the loop; requests still queued or running end with an error."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None and self._thread.is_alive():  # (a start cut short by a signal never ran)
            self._thread.join(timeout=30)

    # --- the loop (engine thread) ----------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="molora-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        # the CPU's eager steps run in inference mode: autograd's per-op bookkeeping (version counters, view
        # tracking) took 9% of a step (embedded model, 4 rows: 8.14 -> 7.38 ms, 2026-12-04); CUDA replays captured
        # steps, whose host cost it does not touch
        with torch.inference_mode() if self.device.type == "cpu" else torch.no_grad():
            while True:
                with self._lock:
                    if not (self._closed or self._incoming or self._waiting or self._starting or self._running):
                        _release_freed_heap()  # idle: the requests that just ended leave no cached heap behind
                    while not (self._closed or self._incoming or self._waiting or self._starting or self._running):
                        self._lock.wait()
                    if self._closed:
                        break
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
                try:
                    self._setup()
                    self._drop_cancelled()
                    self._admit()
                    if self._running:
                        self._step()
                    elif self._starting:
                        time.sleep(0.0005)  # only copies in flight: poll their events
                except Exception as err:  # a broken step fails the requests in it; the engine keeps serving
                    log.exception("decode step failed" if self._ready else "engine setup failed")
                    self._pending = None
                    failed = [*self._starting, *self._running.values()]
                    if not self._ready:  # no cache or tables to serve from: the waiting requests fail too (each
                        failed += self._waiting  # later request tries the setup again)
                        self._waiting.clear()
                    for job in failed:
                        self._end(job, error=GenerationError(f"generation failed: {type(err).__name__}: {err}"))
            # closed: still in the loop's mode (on the CPU the row tables are inference tensors, written in place);
            # requests submitted since the loop last looked end too
            with self._lock:
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            for job in [*self._waiting, *self._starting, *self._running.values()]:
                self._end(job, error=GenerationError("the engine was closed"))

    def _setup(self) -> None:
        """Allocate the static KV cache and row tables in the engine thread, once."""
        if self._ready:
            return
        model = self.routed.model
        dtype = next(model.parameters()).dtype
        # one row more than the batch: the scratch row, written by the padding rows of captured prefills
        self.kv = RowKVCache.for_model(model.config, self.max_rows + 1, self.max_len, dtype=dtype,
                                       device=self.device, layer_devices=self.layer_devices)
        self.scratch_row = self.max_rows
        self.states = RowStates(self.vocab, self.max_rows, self.device, self.logits_size, self.max_len)
        self.columns = torch.arange(self.max_len, device=self.device)
        self.all_rows = torch.arange(self.max_rows, device=self.device)
        self.noise = torch.ones(self.max_rows, self.logits_size, device=self.device)  # see _draw_noise
        self._prefill_lengths = [16 << i for i in range(max(1, self.max_len.bit_length()))]
        self.dtype = dtype
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.decoder = None
        if self.config.lean_decoder and self.layer_devices is None:
            reason = LeanDecoder.unsupported(model)
            if reason is None:
                self.decoder = LeanDecoder(model)
            else:
                log.info("engine: transformers' forward for this model (%s)", reason)
        if self._exact_cpu:
            packed, groups, spent = self.routed.pack_exact_rows(CPU_PACKED_MAX_BYTES)
            bf16 = sum(group.packed is not None and group.packed.dtype == torch.bfloat16
                       for group in self.routed.projection_groups())
            log.info("engine: %d of %d routed GEMMs on packed copies of their weights (%.1f MiB at float32 size): "
                     "%d bfloat16 copies for our kernel (kernels/cpu_bf16.py), %d oneDNN-packed; the others MKL's",
                     packed, groups, spent / 2 ** 20, bf16, packed - bf16)
        self.cpu_step = None
        if self._exact_cpu and self.config.cpu_step:
            reason = CpuStep.unsupported(self.decoder, self.kv)
            if reason is None:
                threads = self.config.cpu_step_threads or available_cpus()
                self.cpu_step = CpuStep(self.decoder, self.kv, self.max_len, threads=threads)
                try:
                    self.cpu_step.table()
                except CpuStepError as err:
                    self.cpu_step, reason = None, str(err)
            log.info("engine: decode steps through %s", f"the C step (models/engine/cpu_step.py), a step's rows over "
                     f"up to {self.cpu_step.threads} thread(s)" if reason is None
                     else f"torch's forward; the C step cannot run this model: {reason}")
        # learned image gates decide once per picture: each row's decision per block, kept across decode steps
        self._pictures: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # top-k -> (slots, weights) [rows+1, blocks, k]
        self._route_states: dict[tuple, torch.Tensor] = {}  # (image gates?, decays, d) -> routing state [rows+1, S, d]
        self._ready = True
        log.info("engine: %d rows x %d positions (%.1f MiB of KV cache), widths %s, CUDA graphs %s",
                 self.max_rows, self.max_len, self.kv.nbytes() / 2 ** 20, self.widths, self.use_graphs)
        if self.layer_devices is not None:
            log.info("engine: KV cache per device (MiB): %s",
                     {str(d): round(n / 2 ** 20, 1) for d, n in self.kv.nbytes_by_device().items()})

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.handle.cancelled]:
            self._waiting.remove(job)
            self._end(job, "cancelled")
        for job in [j for j in [*self._starting, *self._running.values()] if j.handle.cancelled]:
            self._end(job, "cancelled")

    def _admit(self) -> None:
        """First come first served: admit while rows and slots allow, then prefill those whose copies landed."""
        cache = self.routed.cache
        now = time.monotonic()
        while self._waiting:
            job = self._waiting[0]
            if now - job.submitted > self.config.queue_timeout_s:
                self._waiting.popleft()
                self._end(job, error=CacheFullError(f"no room for this request after waiting "
                                                    f"{self.config.queue_timeout_s:.0f} s; try again later"))
                continue
            if len(self._free) < job.rows_needed:
                break
            try:
                slots, job.pending = cache.acquire_nowait(job.names) if job.names else ([], [])
            except CacheFullError:
                break  # slots held by running requests: wait for them
            except MoLoRAError as err:  # e.g. the adapter was removed while the request waited
                self._waiting.popleft()
                self._end(job, error=err)
                continue
            self._waiting.popleft()
            job.slot_of = dict(zip(job.names, slots))
            self._free.sort()
            job.row = self._free.pop(0)
            job.twin = self._free.pop(0) if job.rows_needed == 2 else None
            self._starting.append(job)
        ready = [job for job in self._starting if all(event.query() for event in job.pending)]
        for job in ready:
            self._starting.remove(job)
        # the GPU prefills newcomers together; the CPU one at a time, so a request's numbers never depend on
        # its neighbours (batch widths change a row's matmul results there)
        together = self.config.batch_prefill if self.config.batch_prefill is not None else self.device.type == "cuda"
        groups = [ready] if ready and together else [[job] for job in ready]
        for group in groups:
            self._prefill(group)

    def _end(self, job: _Job, reason: str | None = None, error: BaseException | None = None) -> None:
        """Free the job's rows and pins (if any) and tell its consumer."""
        if job.row >= 0:
            rows = [job.row] + ([job.twin] if job.twin is not None else [])
            self.states.clear(rows)
            self._free.extend(rows)
            self._running.pop(job.row, None)
            if job in self._starting:
                self._starting.remove(job)
            if job.names:
                self.routed.cache.release(job.names)
            job.row = -1
            self._index_cache = None
        job.handle.finished = True
        job.handle.sink.put((job.handle.tag, error if error is not None else Done(reason or "cancelled")))

    # --- prefill --------------------------------------------------------------------------------------------
    def _slot(self, job: _Job, name: str | None) -> int:
        return -1 if name is None else job.slot_of[name]

    def _plan(self, ids: torch.Tensor, slots: torch.Tensor, members: list[tuple[_Job, int]],
              routed: bool = True, learned: tuple[_LearnedRows, ...] = (), rows: torch.Tensor | None = None
              ) -> CallRouting | None:
        """The CallRouting of one forward: static slots [N], plus one learned group per learned router over the
        batch rows its jobs hold (`members`: (job, batch row) for the call's rows), or, given the routers' device
        tables (`learned`, CUDA), over every row, routing the rows whose cache row (`rows`) the tables mark: fixed
        shapes, so a captured prefill routes learned rows. None (plain base linears, no LoRA work) when `routed` is
        False: no request in the call holds an adapter."""
        if not routed:
            return None
        batch, length = ids.shape
        if learned:
            groups = self._table_groups(learned, ids, rows)
            return self.routed.make_routing(batch, length, slots, self.routed.cache.num_slots, learned=groups,
                                            k=max((g.top_k for g in groups), default=1))
        by_router: dict[tuple, tuple[LearnedRouter, list[int], dict[str, int]]] = {}
        for job, row in members:
            if job.learned is not None:
                _, rows, slot_of = by_router.setdefault(_router_key(job.learned), (job.learned, [], {}))
                rows.append(row)
                slot_of.update(job.slot_of)
        groups = []
        for router, at, slot_of in by_router.values():
            index = None if len(at) == batch else torch.tensor(at, dtype=torch.long, device=self.device)
            groups += LearnedGroup.for_router(router, index, ids if index is None else ids[index], slot_of,
                                              self.device)
        k = max((g.top_k for g in groups), default=1)
        return self.routed.make_routing(batch, length, slots, self.routed.cache.num_slots, learned=groups, k=k)

    def _table_groups(self, learned: tuple[_LearnedRows, ...], ids: torch.Tensor, rows: torch.Tensor | None
                      ) -> list[LearnedGroup]:
        """One learned group per gate set of each router's tables, covering every row of `ids` and routing the
        member rows: by cache row (`rows`, a prefill), or rows [0, B) are cache rows 0..B-1 (None, a decode step)."""
        return [group for table in learned
                for group in LearnedGroup.for_router(
                    table.router, None, ids, {}, self.device, expert_slots=table.expert_slots,
                    member=table.member[:ids.shape[0]] if rows is None else table.member[rows])]

    def _columns(self, needed: int | None) -> int | None:
        """KV columns an eager call reads on the CPU (None = all: on CUDA every step has the captured step's
        fixed shape, so eager and replayed steps compute the same numbers)."""
        if needed is None or self.device.type == "cuda":
            return None
        return min(self.max_len, -(-needed // KV_COLUMN_BLOCK) * KV_COLUMN_BLOCK)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                 plan: CallRouting | None, leading: int = 0, length: int | None = None, live: int | None = None,
                 causal: bool = False) -> Any:
        self.kv.address(rows, positions, leading=leading, length=length, live=live, causal=causal)
        return self.routed.run(ids, plan, forward=self.decoder, attention_mask=mask, position_ids=positions,
                               past_key_values=self.kv, use_cache=True, logits_to_keep=1)

    def _prefill_forward(self, entries: list[tuple[_Job, int, list[int]]]) -> tuple[torch.Tensor, _Producing]:
        """Write each (job, cache row, prompt) into its row, positions from 0, in ONE forward; returns the last
        logits [n, V] and producing slots [n].  Prompts are left-padded so every last token is the last column;
        a pad token is written past its row's prompt, where the row's own next tokens overwrite it before any
        query reads it.  On CUDA the forward is a captured graph per (rows, tokens) bucket (and learned routers:
        their rows routed through the routers' device tables, as in a decode step), padded with rows that write
        only the cache's scratch row."""
        n, width = len(entries), max(len(prompt) for _, _, prompt in entries)
        bucketed = self.device.type == "cuda" and n <= self.max_rows
        captured = self.use_graphs and n <= self.max_rows
        learned = self._prefill_tables([job for job, _, _ in entries]) if bucketed else ()
        n_rows = n
        if bucketed:  # bucketed shapes, captured or not: the same
            n_rows = next(w for w in self.widths if w >= n)    # GEMM shapes give the same bf16 numbers
            width = min(next(t for t in self._prefill_lengths if t >= width), self.max_len)
        ids = torch.full((n_rows, width), self.vocab.pad_id, dtype=torch.long)
        positions = torch.arange(width).repeat(n_rows, 1)
        rows = torch.full((n_rows,), self.scratch_row, dtype=torch.long)
        table = torch.full((n_rows, 2), -1, dtype=torch.long)
        for i, (job, row, prompt) in enumerate(entries):
            pad = width - len(prompt)
            ids[i, pad:] = torch.tensor(prompt)
            positions[i] = torch.cat([torch.arange(len(prompt), width), torch.arange(len(prompt))])
            rows[i] = row
            table[i] = torch.tensor([self._slot(job, job.text_adapter), self._slot(job, job.image_adapter)])
        inputs = (ids, positions, rows, table)
        if captured:
            logits, producing = self._replay_prefill(inputs, learned)
            return logits[:n], producing[:n]
        ids, positions, rows, table = (t.to(self.device) for t in inputs)
        members = [(job, i) for i, (job, _, _) in enumerate(entries)]
        return self._prefill_body(ids, positions, rows, table, members, self._columns(width),
                                  routed=any(job.names for job, _, _ in entries), learned=learned)

    def _prefill_tables(self, jobs: list[_Job]) -> tuple[_LearnedRows, ...]:
        """The device tables of the learned routers among these newcomers, written for them and the running jobs
        (the next decode step writes them again for the running batch)."""
        routers = {_router_key(job.learned) for job in jobs if job.learned is not None}
        if not routers:
            return ()
        everyone = [*self._running.values(), *dict.fromkeys(jobs)]
        return tuple(table for table in self._learned_tables(everyone) if table.key in routers)

    def _prefill_body(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
                      members: list[tuple[_Job, int]], length: int | None = None, routed: bool = True,
                      learned: tuple[_LearnedRows, ...] = ()) -> tuple[torch.Tensor, _Producing]:
        columns = self.columns if length is None else self.columns[:length]
        mask = torch.where(columns[None, None, :] <= positions[:, :, None], 0.0, float("-inf"))
        mask = mask.to(self.dtype)[:, None]
        slots = table.gather(1, self.states.modality[ids])
        plan = self._plan(ids, slots.view(-1), members, routed, learned, rows)
        out = self._forward(ids, positions, rows, mask, plan, length=length)
        self._keep_pictures(plan, rows)
        self._keep_states(plan, rows, positions)
        return self._last_logits(out), _producing(out.routing, slots[:, -1])

    def _last_logits(self, out: Any) -> torch.Tensor:
        """The last position's logits [n, V], on the engine's device (a dispatched model's head may be elsewhere)."""
        logits = out.logits[:, -1]
        if self._logits_elsewhere:
            logits = logits.to(self.device)
        return logits

    def _replay_prefill(self, inputs: tuple[torch.Tensor, ...], learned: tuple[_LearnedRows, ...]
                        ) -> tuple[torch.Tensor, _Producing]:
        """Copy the host layout into the static inputs of the (rows, tokens) bucket's graph (with learned routers:
        of the bucket's and routers' graph, the LEARNED_GRAPHS most recently used of those kept) and replay it."""
        shape = tuple(inputs[0].shape)
        graphs, key = (self._learned_prefills, (shape, *(t.key for t in learned))) if learned \
            else (self._prefill_graphs, shape)
        if key not in graphs:
            static = tuple(t.to(self.device) for t in inputs)
            graph, outputs = self._capture(lambda: self._prefill_body(*static, [], learned=learned))
            graphs[key] = (graph, static, outputs)
            log.info("engine: captured the prefill for %d rows x %d tokens (%d learned routers)",
                     *shape, len(learned))
            if learned:
                self._forget_learned()
        if learned:
            self._learned_prefills.move_to_end(key)
        graph, static, outputs = graphs[key]
        for target, source in zip(static, inputs):
            target.copy_(source, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, body: Any) -> tuple[Any, Any]:
        """Capture `body` into the engine's graph pool (all its graphs share one memory pool)."""
        return capture_graph(body, pool=self._graph_pool)

    def _capture_step(self, body: Any) -> tuple[Any, Any]:
        """_capture of a decode step, which moves every row past its token: the capture's warm-up runs the step
        (twice), so the tables it moves (row states, routing states kept by position parity, pictures' decisions)
        are put back as they were before the real step runs. (The KV entries the warm-up writes one position ahead
        are written again, with the same numbers, by the step that reaches that position.)"""
        tables = [*self.states.tables(), *self._route_states.values(), *(t for pair in self._pictures.values()
                                                                             for t in pair)]
        kept = [table.clone() for table in tables]
        try:
            return self._capture(body)
        finally:
            for table, before in zip(tables, kept):
                table.copy_(before)

    def _prefill(self, jobs: list[_Job]) -> None:
        """Prefill the jobs' rows (and CFG twins) in one forward, sample each job's first token, and let them
        join the running batch. A group that does not fit in memory is retried one job at a time, so only a
        request that is too large itself fails."""
        vocab = self.vocab
        entries, twin_prompts = [], {}
        for job in jobs:
            entries.append((job, job.row, job.prompt))
            if job.twin is not None:
                tail = [] if job.open_span is None else job.prompt[len(job.prompt) - job.open_span - 1:]
                twin_prompts[job.row] = [*(job.uncond or [vocab.bos_id]), *tail]
                entries.append((job, job.twin, twin_prompts[job.row]))
        try:
            logits, producing = self._prefill_forward(entries)
        except torch.OutOfMemoryError as err:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(jobs) > 1:
                for job in jobs:
                    self._prefill([job])
                return
            self._end(jobs[0], error=GenerationError(f"this request does not fit in the GPU's memory ({err}); "
                                                     "shorten the prompt or lower max_new_tokens"))
            return
        except Exception as err:  # a request that breaks the model fails alone; the engine keeps serving
            log.exception("prefill failed")
            for job in jobs:
                self._end(job, error=GenerationError(f"prefill failed: {type(err).__name__}: {err}"))
            return
        states = self.states
        cond = [i for i, (job, row, _) in enumerate(entries) if row == job.row]
        twin_at = {job.row: i for i, (job, row, _) in enumerate(entries) if row != job.row}
        for job in jobs:
            states.start(job.row, job.config, last_pos=len(job.prompt) - 1, open_span=job.open_span,
                         slots=(self._slot(job, job.text_adapter), self._slot(job, job.image_adapter)),
                         twin=job.twin, twin_last_pos=len(twin_prompts.get(job.row, [])) - 1,
                         twin_prefix=len(job.uncond or [vocab.bos_id]))
            job.generator = torch.Generator(device=self.device).manual_seed(job.config.seed) if job.random else None
            self._running[job.row] = job
        self._index_cache = None
        rows = torch.tensor([job.row for job in jobs], dtype=torch.long, device=self.device)
        uncond = logits[[twin_at.get(job.row, c) for job, c in zip(jobs, cond)]] if twin_at else None
        self._draw_noise([job for job in jobs if job.generator is not None])
        tokens = states.choose(rows, logits[cond], uncond, self.noise[rows], Draw.of([job.config for job in jobs]))
        done = states.advance_rows(rows, tokens)
        flat = _flat(tokens, producing[cond], done)
        self._deliver(self._to_host(jobs, list(range(len(jobs))), flat, len(jobs), len(self._running)))

    # --- one decode step ------------------------------------------------------------------------------------
    def _indices(self) -> _Batch:
        """The running batch's index tensors and facts, rebuilt only when a request joins or leaves."""
        if self._index_cache is None:
            jobs = [self._running[r] for r in sorted(self._running)]
            highest = max(max(j.row, j.twin if j.twin is not None else -1) for j in jobs)
            self._index_cache = _Batch(
                jobs, [j for j in jobs if j.generator is not None], width=next(w for w in self.widths if w > highest),
                learned=self._learned_tables(jobs), draw=Draw.of([j.config for j in jobs]), live=highest + 1)
        return self._index_cache

    def _learned_tables(self, jobs: list[_Job]) -> tuple[_LearnedRows, ...]:
        """Write each learned router's tables for these jobs (the running batch, or it and a prefill's newcomers),
        allocating a router's tables, and the per-row decision and state tables its gates keep, on its first use.
        Routers with the same _router_key share one set of tables."""
        by_router: dict[tuple, list[_Job]] = {}
        for job in jobs:
            if job.learned is not None:
                by_router.setdefault(_router_key(job.learned), []).append(job)
        tables = []
        for key, members in by_router.items():
            table = self._learned_rows.get(key)
            if table is None:
                router = members[0].learned
                table = self._learned_rows[key] = _LearnedRows.for_router(router, self.max_rows + 1, self.device)
                for gates in table.expert_slots:
                    per_picture = gates is router.image_gates
                    if per_picture:
                        self._picture_tables(router.image_top_k)
                    if gates.context_decays:
                        self._state_table(gates, per_picture)
            table.write(members)
            tables.append(table)
        if len(self._learned_rows) > len(tables):
            self._forget_learned(set(by_router))
        return tuple(tables)

    def _decode(self, width: int, jobs: list[_Job], learned: tuple[_LearnedRows, ...], live: int, draw: Draw
                ) -> torch.Tensor:
        """One decode step over rows [0, W) (rows from `live` on are padding: an eager step skips their attention):
        the forward, then every running row's next token chosen and its row moved past it (_sampled), on CUDA
        all of it one captured graph."""
        if self.use_graphs:
            return self._replay(width, learned, draw)
        return self._sampled(width, *self._forward_step(width, jobs, learned, live), draw)

    def _forward_step(self, width: int, jobs: list[_Job], learned: tuple[_LearnedRows, ...], live: int
                      ) -> tuple[torch.Tensor, _Producing]:
        """Logits [W, V] and producing slots [W] of an uncaptured decode step: the C step's where it runs."""
        if self.cpu_step is not None:
            return self._c_decode(width, jobs, learned, live)
        return self._eager_decode(width, jobs, learned, live)

    def _sampled(self, width: int, logits: torch.Tensor, producing: _Producing, draw: Draw) -> torch.Tensor:
        """A decode step's tokens, producing adapters and done flags of rows [0, W), flat (_flat), from its logits:
        fixed shapes whatever the batch holds, so a captured step holds them too."""
        tokens, done = self.states.decode(width, logits, self.noise[:width], draw)
        return _flat(tokens, producing, done)

    def _eager_decode(self, width: int, jobs: list[_Job], learned: tuple[_LearnedRows, ...], live: int
                      ) -> tuple[torch.Tensor, _Producing]:
        """_decode through the engine's torch forward, over the columns the longest running request has written."""
        needed = max(len(j.prompt) + j.emitted for j in jobs)
        # exact rows on the CPU: every step is routed, adapters or not, so every row takes the base GEMMs of a routed
        # call with exact rows (kernels/torch_ops.py cpu_linear), whatever its neighbours hold
        routed = self._exact_cpu or any(j.names for j in jobs)
        return self._decode_body(width, learned, self._columns(needed), routed=routed, live=live)

    def _c_decode(self, width: int, jobs: list[_Job], learned: tuple[_LearnedRows, ...], live: int
                  ) -> tuple[torch.Tensor, _Producing]:
        """_decode through the C step: rows [0, live) (the rest are padding), each on its own, so every row's numbers
        are those of its solo run."""
        try:
            table = self.cpu_step.table()  # (made again where the model changed)
        except CpuStepError as err:
            log.warning("engine: the C decode step cannot run the model any more (%s); torch's step from now on", err)
            self.cpu_step = None
            return self._forward_step(width, jobs, learned, live)
        if self._c_decides is None or self._c_decides[0] is not learned:  # once per running batch (its tuple)
            self._c_decides = (learned, all(self.cpu_step.decides(t.router) for t in learned))
        if not self._c_decides[1]:  # (logged once): torch's step
            return self._eager_decode(width, jobs, learned, live)
        ids, positions, slots = self.states.decode_feeds(width)
        rows = self.all_rows[:live]
        logits = torch.zeros(width, self.cpu_step.vocab, device=self.device)
        if not learned:
            self.cpu_step.run(rows, ids, positions, slots, logits, table=table)
            return logits, _Producing(slots)
        # learned rows: the C step makes each block's decision itself and writes it, and the routing states, into
        # the plan (cpu_step.learned_step); the static rows keep their slot with weight 1 (the same numbers)
        plan = self._decode_plan(width, learned, ids[:, None], slots, live)
        cache_rows, at = self.all_rows[:width], positions[:, None]
        self._hold_pictures(plan)
        self._hold_states(plan, cache_rows, at)
        step = learned_step(plan)
        self.cpu_step.run(rows, ids, positions, slots, logits, learned=step, table=table)
        self._keep_pictures(plan, cache_rows)
        self._keep_states(plan, cache_rows, at)
        return logits, _producing(self.routed.token_routing(plan, ids[:, None]), slots)

    def _decode_plan(self, width: int, learned: tuple[_LearnedRows, ...], ids: torch.Tensor, slots: torch.Tensor,
                     live: int | None) -> CallRouting:
        """A decode step's routing over rows [0, width): the static slots, and one learned group per learned router
        covering every row and routing its member rows (fixed shapes)."""
        groups = self._table_groups(learned, ids, None)
        return self.routed.make_routing(width, 1, slots, self.routed.cache.num_slots, learned=groups,
                                        k=max((g.top_k for g in groups), default=1), exact_rows=self._exact_cpu,
                                        live_rows=live if self._exact_cpu else None)

    def _decode_body(self, width: int, learned: tuple[_LearnedRows, ...] = (), length: int | None = None,
                     routed: bool = True, live: int | None = None) -> tuple[torch.Tensor, _Producing]:
        columns = self.columns if length is None else self.columns[:length]
        ids, positions, mask, slots = self.states.decode_inputs(width, columns, self.dtype)
        plan = self._decode_plan(width, learned, ids, slots, live) if routed else None
        rows = self.all_rows[:width]
        self._hold_pictures(plan)
        self._hold_states(plan, rows, positions)
        out = self._forward(ids, positions, rows, mask, plan, leading=width, length=length, live=live,
                            causal=True)  # decode_inputs' mask: each row sees its columns up to its position
        self._keep_pictures(plan, rows)
        self._keep_states(plan, rows, positions)
        return self._last_logits(out), _producing(out.routing, slots)

    def _picture_tables(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k not in self._pictures:
            shape = (self.max_rows + 1, self.routed.num_blocks, k)
            self._pictures[k] = (torch.full(shape, -1, dtype=torch.long, device=self.device),
                                 torch.zeros(shape, dtype=torch.float32, device=self.device))
        return self._pictures[k]

    def _state_table(self, gates: Any, per_picture: bool) -> torch.Tensor:
        """Each row's routing state [2, rows + 1, S, d], one table per gate set's role (text or image gates) and
        decays: gate sets with other decays (or updated by other positions) never share a state. The state after
        position p is kept at [p % 2]: a step reads the other half and writes its own, so running the same step
        again (a graph's warm-up runs before its capture) gives the same state, not a second update."""
        key = (per_picture, gates.context_decays, gates.d_model)
        if key not in self._route_states:
            self._route_states[key] = torch.zeros(2, self.max_rows + 1, len(gates.context_decays), gates.d_model,
                                                  dtype=torch.float32, device=self.device)
        return self._route_states[key]

    def _hold_states(self, plan: CallRouting | None, cache_rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode step: gates with a routing state continue each row's state from its previous position."""
        for group in plan.learned if plan is not None else ():
            if group.gates.context_decays:
                table = self._state_table(group.gates, group.per_picture)
                if group.rows is None:  # every row (a decode step): no index tensor, three kernels
                    group.state_in = table[(positions[:, 0] - 1) % 2, cache_rows]
                else:
                    local = group.rows
                    group.state_in = table[(positions[local, 0] - 1) % 2, cache_rows[local]]

    def _keep_states(self, plan: CallRouting | None, cache_rows: torch.Tensor, positions: torch.Tensor) -> None:
        """After a forward (prefill or decode): keep each routed row's state after its last position."""
        for group in plan.learned if plan is not None else ():
            if group.gates.context_decays and group.state_out is not None:
                table = self._state_table(group.gates, group.per_picture)
                if group.rows is None:
                    at = (positions[:, -1] % 2, cache_rows)
                else:
                    at = (positions[group.rows, -1] % 2, cache_rows[group.rows])
                state = group.state_out
                if group.member is not None:
                    state = torch.where(group.member[:, None, None], state, table[at])
                table[at] = state

    def _hold_pictures(self, plan: CallRouting | None) -> None:
        """Decode step: rows inside a picture begun in an earlier step reuse the decision kept for it (the rows
        of a decode step are cache rows; a CFG twin has no picture state and decides at each of its steps)."""
        for group in plan.learned if plan is not None else ():
            if group.per_picture:
                rows = group.rows if group.rows is not None else self.all_rows[:group.gated.shape[0]]
                inside = self.states.in_image[rows] & (self.states.image_pos[rows] > 0)
                slots, weights = self._picture_tables(group.top_k)
                group.held = (slots[rows], weights[rows], inside[:, None] & group.gated)

    def _keep_pictures(self, plan: CallRouting | None, cache_rows: torch.Tensor) -> None:
        """After a forward: rows whose last position is inside a picture keep that position's decision per block
        (the picture's own decision: anchored or held), for the picture's later steps."""
        for group in plan.learned if plan is not None else ():
            if not group.per_picture or not plan.block_slots:
                continue
            local = group.rows if group.rows is not None else torch.arange(plan.batch, device=self.device)
            last = group.gated[:, -1, None]  # [b, 1]: rows this group routes whose last position is in a picture
            rows = cache_rows[local]
            slots, weights = self._picture_tables(group.top_k)
            at_last = local * plan.length + plan.length - 1
            if list(plan.block_slots) != list(range(slots.shape[1])):  # every block routes, in order (the hooks)
                raise RoutingError(f"a picture keeps a decision per block; this forward routed blocks "
                                   f"{list(plan.block_slots)} of {slots.shape[1]}")
            k = group.top_k  # all blocks at once: ~14 kernels a step, not ~9 a block
            kept_s = torch.stack([s for s, _ in plan.block_slots.values()], 1)[at_last, :, :k]  # [b, blocks, k]
            kept_w = torch.stack([w for _, w in plan.block_slots.values()], 1)[at_last, :, :k].float()
            slots[rows] = torch.where(last[:, :, None], kept_s, slots[rows])
            weights[rows] = torch.where(last[:, :, None], kept_w, weights[rows])

    def _replay(self, width: int, learned: tuple[_LearnedRows, ...], draw: Draw) -> torch.Tensor:
        """Replay the captured step of this width, these learned routers and this Draw (capturing it on first
        use): its flat tokens, producing adapters and done flags (_sampled)."""
        def body() -> torch.Tensor:
            return self._sampled(width, *self._decode_body(width, learned), draw)

        if not learned:
            if (width, draw) not in self._graphs:
                self._graphs[(width, draw)] = self._capture_step(body)
                log.info("engine: captured the decode step for width %d (%s)", width, draw)
            graph, outputs = self._graphs[(width, draw)]
        else:
            key = (width, draw, *(table.key for table in learned))
            if key not in self._learned_graphs:
                graph, outputs = self._capture_step(body)
                self._learned_graphs[key] = (graph, outputs, learned)
                log.info("engine: captured the decode step for width %d with %d learned router(s)",
                         width, len(learned))
                self._forget_learned()
            self._learned_graphs.move_to_end(key)
            graph, outputs, _ = self._learned_graphs[key]
        graph.replay()
        return outputs

    def _forget_learned(self, using: set[tuple] = frozenset()) -> None:
        """Keep the LEARNED_GRAPHS most recently used learned steps (and as many learned prefills), and the tables
        of routers still in use: by a kept graph, a running job or `using` (router keys)."""
        for graphs in (self._learned_graphs, self._learned_prefills):
            while len(graphs) > LEARNED_GRAPHS:
                graphs.popitem(last=False)
        running = {_router_key(job.learned) for job in self._running.values() if job.learned is not None}
        kept = {key for graphs in (self._learned_graphs, self._learned_prefills)
                for graph_key in graphs for key in graph_key[1:]} | running | using
        for key in [k for k in self._learned_rows if k not in kept]:
            del self._learned_rows[key]

    def _draw_noise(self, sampling: list[_Job]) -> None:
        """Exp(1) noise into each sampling job's row of `noise` [rows, V], from the job's own generator, so its
        draws never depend on its neighbours (greedy rows read none: their row holds whatever it held)."""
        for job in sampling:
            self.noise[job.row].exponential_(1.0, generator=job.generator)

    def _step(self) -> None:
        """Decode one token for every running row.  On CUDA a step is launched before the previous step's tokens
        are read: the GPU decodes step t+1 while the host waits for step t's tokens and tells their consumers
        (every input of step t+1 is already on the device).  A row that step t finished decodes once more into
        its own row; that token is dropped (_deliver skips finished requests)."""
        started = time.perf_counter()
        batch = self._indices()
        self._draw_noise(batch.sampling)
        flat = self._decode(batch.width, batch.jobs, batch.learned, batch.live, batch.draw)
        self.steps += 1
        launched = self._to_host(batch.jobs, [job.row for job in batch.jobs], flat, batch.width, len(batch.jobs))
        previous, self._pending = self._pending, launched
        if previous is not None:
            self._deliver(previous)
        if self.device.type != "cuda" or not self.config.overlap_steps or not self._running:  # deliver it now
            self._pending = None
            self._deliver(launched)
        if self.step_ms is not None and (previous is not None or self._pending is None):
            now = time.perf_counter()  # a step's time: from the previous delivery (or this step's start) to this one
            self.step_ms.append((now - (self._last_delivery if self._last_delivery is not None else started)) * 1e3)
            self._last_delivery = now if self._running else None

    def _to_host(self, jobs: list[_Job], at: list[int], flat: torch.Tensor, rows: int, batch: int) -> _HostCopy:
        """Start one host transfer of a forward's flat tokens (_flat over `rows` rows; job i's entries at index
        at[i] of each part), into pinned memory on CUDA (no wait here)."""
        if flat.device.type != "cuda":
            return _HostCopy(jobs, at, rows, flat, None, batch)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _HostCopy(jobs, at, rows, host, ready, batch)

    def _deliver(self, copy: _HostCopy) -> None:
        """Wait for a step's tokens and tell every consumer; requests that ended meanwhile are skipped."""
        if copy.ready is not None:
            copy.ready.synchronize()
        host = copy.host.tolist()
        jobs, batch = copy.jobs, copy.batch
        now = time.perf_counter()
        n = copy.rows  # entries per part of the flat layout (_flat)
        k = (len(host) - 3 * n) // (2 * n)
        names = self.routed.cache.slots

        def name(slot: int) -> str | None:
            return names[slot] if 0 <= slot < len(names) else None

        eos = self.vocab.eos_id
        mix_slots, mix_weights = host[3 * n:3 * n + n * k], host[3 * n + n * k:]
        for job, i in zip(jobs, copy.at):
            if job.handle.finished:  # ended (or cancelled) after this step was launched: its token is void
                continue
            token, slot = host[i], host[n + i]
            mix = ()
            if k and job.learned is not None:  # its own router's top-k, whatever k its neighbours mix
                top = min(k, job.learned.max_k)
                pairs = zip(mix_slots[i * k:i * k + top], mix_weights[i * k:i * k + top])
                mix = tuple((name(s), w / 1e4) for s, w in pairs if w > 0)
            job.handle.sink.put((job.handle.tag, Token(job.emitted, token, name(slot), (now - job.last) * 1000.0,
                                                       batch, mix)))
            job.emitted += 1
            job.last = now
            if host[2 * n + i]:
                self._end(job, "eos" if token == eos else "length")


@dataclass
class _HostCopy:
    """A forward's flat tokens (_flat) on their way to the host: `host` (pinned, filled when `ready` fires; None:
    already there); job i's entries are at index at[i] of each part."""

    jobs: list[_Job]
    at: list[int]
    rows: int  # entries in each part of the flat layout (the forward's rows)
    host: torch.Tensor
    ready: Any
    batch: int


@dataclass
class _Producing:
    """Which adapter produced each row's output: the slot [n] (static routing's, or learned routing's top-1), and
    for learned routing its top-k slots and routing weights [n, k] (the weight averaged over blocks)."""

    slots: torch.Tensor
    mix_slots: torch.Tensor | None = None
    mix_weights: torch.Tensor | None = None

    def __getitem__(self, index: Any) -> _Producing:
        if self.mix_slots is None or self.mix_weights is None:
            return _Producing(self.slots[index])
        return _Producing(self.slots[index], self.mix_slots[index], self.mix_weights[index])


def _flat(tokens: torch.Tensor, producing: _Producing, done: torch.Tensor) -> torch.Tensor:
    """One forward's results for its n rows as one long tensor (one host transfer): tokens [n], producing slots [n],
    done flags [n], and with learned routing its top-k slots [n * k] and weights [n * k] in 1e-4 steps."""
    parts = [tokens, producing.slots.long(), done.long()]
    if producing.mix_slots is not None and producing.mix_weights is not None:
        parts += [producing.mix_slots.reshape(-1).long(), (producing.mix_weights.reshape(-1) * 1e4).round().long()]
    return torch.cat(parts)


def _producing(routing: Any, slots: torch.Tensor) -> _Producing:
    if routing is None or routing.weights is None:
        return _Producing(slots)
    top_slots, top_weights = routing.slots[:, -1], routing.weights[:, -1]
    best = top_weights.argmax(dim=-1, keepdim=True)
    return _Producing(top_slots.gather(1, best).squeeze(1), top_slots, top_weights)


__all__ = ["Engine", "EngineConfig", "Token", "Done", "RequestHandle", "TEXT", "IMAGE"]
