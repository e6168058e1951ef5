"""A learned gate's decision of one decode step's block as a few kernels (issue 32, "learned rows captured too").

LearnedGroup.decide (routing/routers.py) is ~20 tensor ops per block and gate set: the gate's RMS-normalised input
(cast, cat, pow, mean, add, rsqrt, mul, cast), its GEMM, topk, softmax, the expert -> slot lookup, the picture's
anchor or held decision, padding to the call's k, the gated-position select and the copies into the block's tables,
plus a clone of the static tables per block. On a captured Qwen3-1.7B-shaped step (28 blocks, top-2 gates with a
routing state) that was ~700 of the step's 1348 kernels (vocabulary routing: 639), and learned rows ran at 0.57x
of vocabulary-routed ones (H200, 2026-12-04).

Here the same math is one function of tensors (`block_decision`): on CUDA one Triton launch a block and gate set
(kernels/triton_decision.py: its loads all in flight at once, since a launch that waited on each load in turn took
as long as the five kernels torch.compile makes of it; RESULTS.md, E1), elsewhere, where Triton is missing, or with
ONE_LAUNCH off, torch.compile's (on CUDA five kernels: the norm's sums, the gate logits as a reduction fused with
the norm, top-k, softmax, slots and select), the way LeanDecoder compiles its elementwise pieces; the static tables
are made inside it, not cloned. The routing state of a decode step
(block 0, one position per row) is compiled the same way (`state_step`). Calls over every row of the batch without
autograd on CUDA take it: decode steps (one position per row) and the serving engine's captured prefills (each
position a row of the decision; a picture's anchor, where a prefill has one, keeps the eager decide). The CPU keeps
the eager decide, whose rows are exact (a row's numbers never depend on the batch), training too. A compile that
fails falls back to the eager decide for the rest of the process.

The top-k here is k rounds of argmax (a reduction inductor fuses; aten.topk would stay a separate kernel, fed by
a separate cast): equal logits go to the lowest expert index. The eager decide and the CPU's C step
(kernels/decode_step.c) take the same rule: torch.topk leaves equal values to the implementation (the CPU returns
[2, 4] for topk(zeros(5), 2)), and exact ties happen (an adapter added to trained gates starts with a zero gate
row), so with topk the paths could pick different adapters. Every decision is the same top-k, and the weights the
same softmax up to float rounding.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from molora.kernels import triton_decision

log = logging.getLogger(__name__)

# Devices whose decode-step decisions run compiled (tests add "cpu" to check the compiled math against eager)
COMPILED_DEVICES = {"cuda"}
# The one-launch Triton decision where it is usable (False: torch.compile's on CUDA too, as benchmarks compare them)
ONE_LAUNCH = True
_compiled: dict[Any, Callable] = {}
_failed = False


def gate_logits(hidden: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor,
                as_reduction: bool = False) -> torch.Tensor:
    """Float32 gate logits [n, E] of block inputs `hidden` [n, d] (and routing states [n, S, d]) for a gate
    weight [E, in]: LearnedGates.logits without its checks. `as_reduction`: the product as a sum of products
    (block_decision's: inductor fuses it with the norm before it and the decision after it, where F.linear is a
    cuBLAS GEMV of its own, two kernels a block on CUDA for a few experts), rounded to the weight's dtype as
    F.linear's output is."""
    if state is None:
        x = hidden
    else:
        parts = torch.cat([hidden.float()[:, None], state.float()], dim=1)
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = parts.reshape(parts.shape[0], -1)
    x = x.to(weight.dtype)
    if not as_reduction:
        return F.linear(x, weight).float()
    return (x.float()[:, None, :] * weight.float()[None]).sum(-1).to(weight.dtype).float()


def top_k_first(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [n, k] of the k largest logits, largest first, equal values by lowest index: k argmax
    rounds, which inductor fuses with what follows (aten.topk is a kernel of its own)."""
    experts = torch.arange(logits.shape[-1], device=logits.device)
    rest, values, indices = logits, [], []
    for _ in range(k):
        index = rest.argmax(-1, keepdim=True)
        values.append(logits.gather(-1, index))
        indices.append(index)
        rest = torch.where(experts == index, float("-inf"), rest)
    return torch.cat(values, -1), torch.cat(indices, -1)


def block_decision(hidden: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor, expert_slots: torch.Tensor,
                   gated: torch.Tensor, old_slots: torch.Tensor | None, old_weights: torch.Tensor | None,
                   static: torch.Tensor, held_slots: torch.Tensor | None, held_weights: torch.Tensor | None,
                   held_use: torch.Tensor | None, k: int, k_max: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One gate set's decision over n positions: (slots [n, k_max], weights [n, k_max], logits [n, E],
    top-k experts [n, k]). Gated positions take the gate's top-k; the others keep `old_slots` / `old_weights`
    (another gate set's decision this block), or, when None, the static slot `static` [n] in column 0 with weight 1
    (-1 / 0 elsewhere: CallRouting.static_topk). `held_use` [n, 1]: take `held_slots` / `held_weights` [n, k] (a
    picture's kept decision) instead. (No picture anchor: each position decides for itself.)"""
    logits = gate_logits(hidden, state, weight, as_reduction=True)
    top_val, top_idx = top_k_first(logits, k)
    w = torch.softmax(top_val, dim=-1)
    s = expert_slots[top_idx]
    if held_use is not None:
        s = torch.where(held_use, held_slots, s)
        w = torch.where(held_use, held_weights, w)
    if k < k_max:
        s = torch.cat([s, s.new_full((s.shape[0], k_max - k), -1)], dim=1)
        w = torch.cat([w, w.new_zeros(w.shape[0], k_max - k)], dim=1)
    if old_slots is None:
        old_slots, old_weights = static_tables(static, k_max)
    mask = gated[:, None]
    return torch.where(mask, s, old_slots), torch.where(mask, w, old_weights), logits, top_idx


def static_tables(static: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static slots [N] as [N, k] slots / weights: the slot in column 0 with weight 1 (-1 / 0 elsewhere)."""
    first = torch.arange(k, device=static.device) == 0  # (no in-place writes: it also runs inside block_decision)
    slots = torch.where(first, static.long()[:, None], -1)
    weights = torch.where(first, (static >= 0)[:, None].float(), 0.0)
    return slots, weights


def state_update(embeddings: torch.Tensor, updates: torch.Tensor, state_in: torch.Tensor,
                 decays: Sequence[float], log_decays: Sequence[float]) -> torch.Tensor:
    """[b, S, d] float32: routers.routing_state for one position per row (embeddings [b, d], updates [b] bool,
    state_in [b, S, d]) as its chunked form computes it at T = 1 (exp(log λ), (1 - λ) times e)."""
    e = embeddings.float() * updates[:, None]
    n = updates.float()[:, None]  # updates up to and including this position: 0 or 1
    prev = state_in.float()
    parts = [(1 - lam) * e + torch.exp(n * log_lam) * prev[:, i] for i, (lam, log_lam) in enumerate(zip(decays, log_decays))]
    return torch.stack(parts, dim=1)


def log_decays(decays: Sequence[float]) -> list[float]:
    """log(λ) in float32 as Python numbers (routing_state's: no host-to-device copy inside a captured step)."""
    return [float(torch.log(torch.tensor(lam, dtype=torch.float32))) for lam in decays]


def compiled_for(device: torch.device) -> bool:
    """Do decode-step decisions on `device` run compiled (and the compiler has not failed in this process)?"""
    return device.type in COMPILED_DEVICES and not _failed


def run(compiled: Callable, *args: Any) -> Any:
    """compiled(*args), or None when compiling failed (then, and from then on, callers take their eager path)."""
    global _failed
    try:
        return compiled(*args)
    except Exception as err:  # no working compiler here, or it failed on these shapes: eager from now on
        _failed = True
        log.warning("routing: compiling the learned decision failed (%s: %s); deciding eagerly",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return None


def _compile(fn: Callable, name: str) -> Callable:
    """torch.compile of `fn` under a code object of its own (dynamo keeps its graphs and its recompile limit per
    code object: one per set of constants, whatever else is compiled)."""
    fn.__code__ = fn.__code__.replace(co_name=name)
    return torch.compile(fn, fullgraph=True)


def decider(k: int, k_max: int, tensors: Sequence[torch.Tensor | None]) -> Callable:
    """block_decision for these k and this pattern of absent (None) arguments: on CUDA with Triton the one-launch
    kernel (kernels/triton_decision.py), else compiled once: one code object, so one graph cache, per variant
    (dynamo recompiles on each None pattern, and the recompile limit counts per code object). Its arguments are
    tensors only: one graph serves every block (the gate weights are inputs, not guarded constants) and every
    width from the second on (automatic dynamic shapes)."""
    if ONE_LAUNCH and triton_decision.usable(tensors[0], tensors[2]):
        return functools.partial(_one_launch, k, k_max)
    absent = tuple(t is None for t in tensors)
    key = ("decide", k, k_max, absent)
    if key not in _compiled:
        def decide(*tensors: Any) -> Any:
            return block_decision(*tensors, k, k_max)
        name = f"decide_top{k}_of_{k_max}_" + "".join("n" if a else "t" for a in absent)
        _compiled[key] = _compile(decide, name)
    return _compiled[key]


def _one_launch(k: int, k_max: int, *tensors: torch.Tensor | None) -> Any:
    return triton_decision.learned_decision(*tensors, k, k_max)


def stepper(decays: Sequence[float]) -> Callable:
    """state_update for these decays (constants of the graph), compiled once."""
    key = ("state", tuple(decays))
    if key not in _compiled:
        constants, logs = tuple(decays), log_decays(decays)

        def step(embeddings: torch.Tensor, updates: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
            return state_update(embeddings, updates, state_in, constants, logs)
        _compiled[key] = _compile(step, "state_step")
    return _compiled[key]
