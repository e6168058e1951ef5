"""Routers: small per-request objects that turn token ids (and, for the learned router, block inputs) into
per-token adapter slots.  They hold no global state; the only tensors they keep are device-side lookup tables
cached on the router instance (reuse one router object across decode steps to build the table once).

    VocabRangeRouter  vocabulary range: a position is routed by the modality of the token it predicts
                      (vocab.modality_table: `<boi>`, image codes and row markers -> image adapter, the rest -> text adapter).
    SequenceRouter    one adapter for the whole sequence: the S-LoRA / PEFT baseline.
    LabelRouter       known per-position adapters (an evaluation's oracle: the true domain of each span).
    LearnedRouter     MoLoRA: per transformer block a gate Linear(d_model, E) on the block input picks top-k of
                      E named adapters, softmax over the k kept logits; optionally hierarchical (a vocabulary
                      decides the modality first, image positions go to `image_adapter`, the gate routes text).
                      Gates with `context_decays` also read one shared routing state: causal moving averages
                      of the token embeddings (block 0's input), so block 0 does not route from a bare token.

Protocol used by RoutedModel: `adapters() -> list[str]` and `route(input_ids [b, T], slot_of) -> [b, T]` long
slots (-1 = base).  Learned routers also give `gated(input_ids)` (where the gate decides) and the gate module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import molora.routing.decision as fused
from molora.routing.context import BlockDecision
from molora.routing.decision import gate_logits
from molora.routing.errors import RoutingError
from molora.routing.modality import IMAGE, ModalityTable

GATES_FORMAT_VERSION = 2  # 2: optional "context_decays" (gates read a routing state); 1: block input only


@runtime_checkable
class Router(Protocol):
    def adapters(self) -> list[str]: ...

    def route(self, input_ids: torch.Tensor, slot_of: Mapping[str, int]) -> torch.Tensor: ...


def _slot(slot_of: Mapping[str, int], name: str | None) -> int:
    return -1 if name is None else slot_of[name]


@dataclass
class SequenceRouter:
    """Every position of the sequence uses `adapter` (None = base model)."""

    adapter: str | None

    def adapters(self) -> list[str]:
        return [] if self.adapter is None else [self.adapter]

    def route(self, input_ids: torch.Tensor, slot_of: Mapping[str, int]) -> torch.Tensor:
        return torch.full(input_ids.shape, _slot(slot_of, self.adapter), dtype=torch.long, device=input_ids.device)


@dataclass
class VocabRangeRouter:
    """Text positions -> `text_adapter`, image positions -> `image_adapter` (None = base), by vocab.modality_table.

    A pure per-token lookup on the device (no Python loop, no host sync), so prefill and token-by-token decode
    route identically.  Ids beyond the vocabulary layout (e.g. a model's padded embedding rows) count as text.
    """

    vocab: ModalityTable  # the vocabulary's modality table (routing/modality.py), e.g. a family's layout
    text_adapter: str | None = None
    image_adapter: str | None = None
    _tables: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def adapters(self) -> list[str]:
        return [n for n in dict.fromkeys((self.text_adapter, self.image_adapter)) if n is not None]

    def modality(self, input_ids: torch.Tensor) -> torch.Tensor:
        """TEXT / IMAGE (int8) of every position of `input_ids`, any shape."""
        table = self._tables.get(input_ids.device)
        if table is None:
            table = self._tables[input_ids.device] = self.vocab.modality_table(input_ids.device)
        size = table.shape[0]
        inside = (input_ids >= 0) & (input_ids < size)
        return torch.where(inside, table[input_ids.clamp(0, size - 1)], torch.zeros_like(table[:1]))

    def route(self, input_ids: torch.Tensor, slot_of: Mapping[str, int]) -> torch.Tensor:
        is_image = self.modality(input_ids) == IMAGE
        text, image = _slot(slot_of, self.text_adapter), _slot(slot_of, self.image_adapter)
        return torch.where(is_image, image, text).long()


@dataclass(eq=False)
class LabelRouter:
    """Known per-position adapters: `labels` [b, T] index into `names` (-1 = base model).

    The oracle of an evaluation (each position routed to the true domain of the span it predicts), or any fixed
    routing replayed exactly.  Only for a forward over exactly these positions (prefill / teacher forcing).
    """

    names: Sequence[str]
    labels: torch.Tensor

    def adapters(self) -> list[str]:
        return list(dict.fromkeys(self.names))

    def route(self, input_ids: torch.Tensor, slot_of: Mapping[str, int]) -> torch.Tensor:
        if tuple(self.labels.shape) != tuple(input_ids.shape):
            raise RoutingError(f"LabelRouter holds labels of shape {tuple(self.labels.shape)} but the input is "
                               f"{tuple(input_ids.shape)}; give one label per input position")
        table = torch.tensor([slot_of[n] for n in self.names] + [-1], dtype=torch.long, device=input_ids.device)
        labels = self.labels.to(input_ids.device).long()
        if bool(((labels < -1) | (labels >= len(self.names))).any()):
            raise RoutingError(f"labels must lie in [-1, {len(self.names) - 1}] (indices into {list(self.names)})")
        return table[torch.where(labels < 0, len(self.names), labels)]


# --- learned (MoLoRA) -------------------------------------------------------------------------------------

class LearnedGates(nn.Module):
    """One gate Linear(d_model, E) per transformer block over E experts (no bias, as in Switch): the named
    adapters, and with `base_expert` one more, last, that means "no adapter" (the base model's own output).

    The base expert lets the gate leave context alone: domain adapters trained apart each act only on their own
    answer positions and read the prompt as the base model wrote it (scripts/train_domain_adapters.py), so the
    gate learns to send prompt positions to the base and answer positions to a domain.

    `context_decays` (e.g. (0.5, 0.8, 0.97)): every gate also reads the routing state of its position, one causal
    exponential moving average of the token embeddings per decay (`routing_state`), each part RMS-normalised:
    Linear(d_model * (1 + len(decays)), E). A block-0 gate on the token embedding alone cannot know which question
    an answer position answers (probe: 0.46 of answer positions; with the state 0.96, benchmarks/RESULTS.md).
    The state is computed once per forward from block 0's input and carried across forwards by `LearnedGroup`.
    """

    def __init__(self, d_model: int, adapters: Sequence[str], num_blocks: int, *, base_expert: bool = False,
                 context_decays: Sequence[float] = (), init_std: float = 0.02) -> None:
        super().__init__()
        names = list(adapters)
        if len(names) < 1 or len(set(names)) != len(names):
            raise RoutingError(f"LearnedGates needs distinct adapter names, got {names}")
        if d_model < 1 or num_blocks < 1:
            raise RoutingError(f"LearnedGates needs d_model >= 1 and num_blocks >= 1, got {d_model}, {num_blocks}")
        decays = tuple(float(x) for x in context_decays)
        if not all(0.0 < x < 1.0 for x in decays) or len(set(decays)) != len(decays):
            raise RoutingError(f"context_decays must be distinct numbers strictly between 0 and 1, got {decays}")
        self.adapters, self.d_model, self.num_blocks = names, d_model, num_blocks
        self.base_expert = bool(base_expert)
        self.context_decays = decays
        self.gates = nn.ModuleList(nn.Linear(self.in_features, self.num_experts, bias=False)
                                   for _ in range(num_blocks))
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=init_std)

    @classmethod
    def for_model(cls, routed: nn.Module, adapters: Sequence[str], **kw: Any) -> LearnedGates:
        """Gates sized for a RoutedModel (its hidden size and number of blocks), on its device."""
        gates = cls(routed.hidden_size, adapters, routed.num_blocks, **kw)
        return gates.to(routed.device)

    @property
    def in_features(self) -> int:
        """Width of a gate's input: the block input, plus one embedding average per context decay."""
        return self.d_model * (1 + len(self.context_decays))

    @property
    def num_experts(self) -> int:
        return len(self.adapters) + self.base_expert

    @property
    def experts(self) -> list[str | None]:
        """The gate's outputs in order: adapter names, then None for the base expert."""
        return [*self.adapters, *([None] if self.base_expert else [])]

    def expert_slots(self, slot_of: Mapping[str, int], device: torch.device | str) -> torch.Tensor:
        """[E] long: the hot-set slot of each expert (-1, no adapter, for the base expert)."""
        return torch.tensor([_slot(slot_of, n) for n in self.experts], dtype=torch.long, device=device)

    def logits(self, block: int, hidden: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 gate logits [n, E] of block `block` for block inputs `hidden` [n, d_model] and, with context
        decays, the positions' routing state [n, len(decays), d_model] (`routing_state`)."""
        weight = self.gate_weight(block, hidden)
        if not self.context_decays:
            return gate_logits(hidden, None, weight)
        if state is None or tuple(state.shape[1:]) != (len(self.context_decays), self.d_model):
            raise RoutingError(f"these gates read a routing state [n, {len(self.context_decays)}, {self.d_model}] "
                               "beside the block input (LearnedGroup computes it at block 0)")
        return gate_logits(hidden, state, weight)

    def gate_weight(self, block: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block `block`'s gate weight [E, in], after checking that there is one and that `hidden` [..., d] has the
        gates' width."""
        if not 0 <= block < self.num_blocks:
            raise RoutingError(f"no gate for block {block}: these gates cover {self.num_blocks} blocks")
        if hidden.shape[-1] != self.d_model:
            raise RoutingError(f"gate expects hidden size {self.d_model}, the model's blocks give {hidden.shape[-1]}")
        return self.gates[block].weight

    def with_adapters(self, adapters: Sequence[str]) -> LearnedGates:
        """New gates over `adapters` (every adapter of these gates, plus new ones): known adapters keep their
        gate rows in every block, new adapters start with zero rows (logit 0 everywhere, so they join the top-k
        only where every known adapter's logit is negative, until trained). Train the new rows before serving:
        gates with context decays are often negative everywhere (the shipped ones: a zero row takes 28% of prompt
        positions and old domains fall from 0.72 to 0.45); `scripts/train_router.py --init-from ...
        --train-new-only` trains only them (benchmarks/RESULTS.md, "Adding a fifth adapter to the routing-state
        gates")."""
        names = list(adapters)
        missing = [n for n in self.adapters if n not in names]
        if missing:
            raise RoutingError(f"with_adapters keeps every adapter of these gates; {missing} are missing from {names}")
        weight = self.gates[0].weight
        new = LearnedGates(self.d_model, names, self.num_blocks, base_expert=self.base_expert,
                           context_decays=self.context_decays).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            for old, gate in zip(self.gates, new.gates):
                gate.weight.zero_()
                for i, n in enumerate(self.experts):
                    gate.weight[new.experts.index(n)] = old.weight[i]
        return new

    def save(self, path: str | Path) -> None:
        """Safetensors file; the adapter names and sizes go in its metadata."""
        tensors = {f"gates.{i}.weight": g.weight.detach().cpu().contiguous() for i, g in enumerate(self.gates)}
        meta = {"adapters": json.dumps(self.adapters), "d_model": str(self.d_model),
                "num_blocks": str(self.num_blocks), "base_expert": json.dumps(self.base_expert),
                "format": "molora-gates", "version": str(GATES_FORMAT_VERSION)}
        if self.context_decays:
            meta["context_decays"] = json.dumps(list(self.context_decays))
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> LearnedGates:
        path = Path(path)
        if path.suffix.lower() != ".safetensors":
            raise RoutingError(f"{path}: gate weights are read from .safetensors files only (pickles can run code)")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                adapters = json.loads(meta["adapters"])
                d_model, num_blocks = int(meta["d_model"]), int(meta["num_blocks"])
                base_expert = json.loads(meta.get("base_expert", "false"))
                if not isinstance(base_expert, bool):
                    raise ValueError(f"base_expert must be true or false, got {base_expert!r}")
                version = int(meta.get("version", "1"))  # files of version 1 carry no "version" key
                if version > GATES_FORMAT_VERSION:
                    raise RoutingError(f"{path} is a gate file of format version {version}; this MoLoRA reads "
                                       f"versions up to {GATES_FORMAT_VERSION}: upgrade MoLoRA to load it")
                decays = json.loads(meta.get("context_decays", "[]"))
                if not isinstance(decays, list) or not all(type(x) in (int, float) for x in decays):
                    raise ValueError(f"context_decays must be a JSON list of numbers, got {decays!r:.200}")
                if not isinstance(adapters, list) or not all(isinstance(n, str) and n for n in adapters):
                    raise ValueError(f"adapters must be a JSON list of adapter names, got {adapters!r:.200}")
                # the header is checked before any tensor is read or any gate allocated: a file may declare any sizes
                keys = set(f.keys())
                if num_blocks != len(keys) or keys != {f"gates.{i}.weight" for i in range(len(keys))}:
                    raise RoutingError(f"{path}: tensors {sorted(keys)[:8]} do not match {num_blocks} gates")
                shape = [len(adapters) + base_expert, d_model * (1 + len(decays))]
                for key in sorted(keys):
                    dtype, got = f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()
                    if got != shape or dtype not in ("F16", "BF16", "F32", "F64"):
                        raise RoutingError(f"{path}: {key} is {dtype} {got}; expected a float tensor {shape}")
                tensors = {k: f.get_tensor(k) for k in keys}
        except RoutingError:
            raise
        except Exception as e:
            raise RoutingError(f"{path} is not a gate file written by LearnedGates.save ({type(e).__name__}: {e})") from e
        gates = cls(d_model, adapters, num_blocks, base_expert=base_expert, context_decays=decays)
        expected = {f"gates.{i}.weight" for i in range(num_blocks)}
        if set(tensors) != expected:
            raise RoutingError(f"{path}: tensors {sorted(tensors)} do not match {num_blocks} gates")
        for i, g in enumerate(gates.gates):
            t = tensors[f"gates.{i}.weight"]
            if tuple(t.shape) != tuple(g.weight.shape) or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise RoutingError(f"{path}: gate {i} has shape {tuple(t.shape)} / dtype {t.dtype} or non-finite "
                                   f"values; expected finite {tuple(g.weight.shape)}")
            with torch.no_grad():
                g.weight.copy_(t)
        return gates.to(device) if device is not None else gates


@dataclass(eq=False)
class LearnedRouter:
    """MoLoRA top-k routing over `gates.adapters`, decided per block from the block input.

    With `vocab`, routing is hierarchical: the vocabulary decides the modality, then text positions are gated by
    `gates` and image positions go to `image_adapter` (None = base), or, with `image_gates`, are gated among the
    image adapters by their own gates (top `image_top_k`): a picture's style is picked from what the words before
    it asked for, one pass for the whole document.
    """

    gates: LearnedGates
    top_k: int = 2
    vocab: ModalityTable | None = None
    image_adapter: str | None = None
    image_gates: LearnedGates | None = None
    image_top_k: int = 1
    _vocab_router: VocabRangeRouter | None = field(default=None, init=False, repr=False)
    # gates with context decays: each gate set's routing state after the last forward, per row ([b, S, d]), for
    # RoutedModel.forward to continue from when the next forward extends a KV cache (reuse the router object)
    carried_states: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.gates.num_experts:
            raise RoutingError(f"top_k={self.top_k} must be between 1 and the number of adapters "
                               f"({self.gates.num_experts})")
        if (self.image_adapter is not None or self.image_gates is not None) and self.vocab is None:
            raise RoutingError("image routing needs a vocab to tell image positions from text positions")
        if self.image_adapter is not None and self.image_gates is not None:
            raise RoutingError("give image positions either one image_adapter or image_gates, not both")
        if self.image_gates is not None and not 1 <= self.image_top_k <= self.image_gates.num_experts:
            raise RoutingError(f"image_top_k={self.image_top_k} must be between 1 and the number of image experts "
                               f"({self.image_gates.num_experts})")
        if self.vocab is not None:
            self._vocab_router = VocabRangeRouter(self.vocab, None, self.image_adapter)

    @property
    def max_k(self) -> int:
        """The most adapters one position mixes: the top-k of its text gates or, if larger, of its image gates."""
        return max(self.top_k, self.image_top_k if self.image_gates is not None else 1)

    def adapters(self) -> list[str]:
        extra = [self.image_adapter] if self.image_adapter is not None else []
        image = self.image_gates.adapters if self.image_gates is not None else []
        return list(dict.fromkeys(self.gates.adapters + extra + image))

    def route(self, input_ids: torch.Tensor, slot_of: Mapping[str, int]) -> torch.Tensor:
        """The static part: image positions' slot (hierarchical), -1 where a gate will decide."""
        if self._vocab_router is None:
            return torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
        return self._vocab_router.route(input_ids, slot_of)

    def gated(self, input_ids: torch.Tensor) -> torch.Tensor:
        """bool, same shape: positions the text gates route."""
        if self._vocab_router is None:
            return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        return self._vocab_router.modality(input_ids) != IMAGE

    def gate_sets(self, input_ids: torch.Tensor) -> list[tuple[LearnedGates, int, torch.Tensor]]:
        """(gates, top-k, positions they route) of this router: the text gates, and the image gates if any."""
        text = self.gated(input_ids)
        sets = [(self.gates, self.top_k, text)]
        if self.image_gates is not None:
            sets.append((self.image_gates, self.image_top_k, ~text))
        return sets


@dataclass(eq=False)
class LearnedGroup:
    """One gate set of a LearnedRouter in a forward pass: its rows, gates, k, expert -> slot map and the
    positions it routes.

    Image gates decide once per picture: every position of a picture takes the decision made at its first
    position (`anchor`, within this forward), or, when the picture began in an earlier forward (token-by-token
    decode), the decision kept from then (`held`: the serving engine keeps it per row). Gated per position, the
    first codes drawn pull a picture's later positions to whichever adapter drew them (benchmarks/RESULTS.md).
    Image gates with context decays read a routing state updated by the TEXT positions (the words asking for a
    style), not by the pictures they route: at a second picture's first position the short decays hold the
    sentence just written, where the block inputs are dominated by the first picture.
    """

    router: LearnedRouter
    rows: torch.Tensor | None  # row indices into the batch, None = every row
    expert_slots: torch.Tensor  # [E] long
    gated: torch.Tensor  # [b, T] bool
    gates: LearnedGates  # the router's text gates or its image gates
    top_k: int
    anchor: torch.Tensor | None = None  # [b*T] long: the position whose decision each position takes
    held: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # slots, weights [b, blocks, k]; use [b, T]
    # gates with context decays: the routing state before this forward's first position ([b, S, d], None = the
    # sequence starts here; a serving engine passes the state it kept per row), which positions update it
    # ([b, T] bool: the text positions, not padding, for text and image gates alike), and, after block 0, every
    # position's state [b*T, S, d] and each row's state after its last position (`state_out` [b, S, d]: what to
    # pass as `state_in` to the row's next forward)
    state_in: torch.Tensor | None = None
    updates: torch.Tensor | None = None
    state: torch.Tensor | None = field(default=None, repr=False)
    state_out: torch.Tensor | None = field(default=None, repr=False)
    # [b] bool: the rows of the batch this router routes, when the group covers every row of a batch shared with
    # other routers (a serving engine's decode step: fixed shapes, so a captured step can route learned rows)
    member: torch.Tensor | None = None

    @property
    def per_picture(self) -> bool:
        return self.gates is self.router.image_gates

    @classmethod
    def for_router(cls, router: LearnedRouter, rows: torch.Tensor | None, input_ids: torch.Tensor,
                   slot_of: Mapping[str, int], device: torch.device | str, *, member: torch.Tensor | None = None,
                   expert_slots: Mapping[LearnedGates, torch.Tensor] | None = None) -> list[LearnedGroup]:
        """One group per gate set of `router` over these rows (`input_ids`: those rows' ids). With `member` [b]
        bool, the group covers every row and routes only the member rows; `expert_slots` (per gate set, [E] long)
        replaces the slots looked up in `slot_of`: tensors a captured step reads, written in place between steps."""
        groups = []
        pad = getattr(router.vocab, "pad_id", None)
        real = input_ids != pad if isinstance(pad, int) else torch.ones_like(input_ids, dtype=torch.bool)
        for gates, k, mask in router.gate_sets(input_ids):
            image = gates is router.image_gates
            # the state is the words: updated by text positions for every gate set. Image gates route positions
            # whose own ids say nothing of the style asked; the sentence before a picture does (benchmarks/RESULTS.md)
            updates = ((~mask if image else mask) & real) if gates.context_decays else None
            if member is not None:
                mask = mask & member[:, None]
            # (one position per row, a decode step: every position is its own anchor, so none is needed)
            anchor = picture_anchor(mask) if image and mask.shape[1] > 1 else None
            slots = expert_slots[gates] if expert_slots is not None else gates.expert_slots(slot_of, device)
            groups.append(cls(router, rows, slots, mask, gates, k, anchor, updates=updates, member=member))
        return groups

    def fuses(self, hidden: torch.Tensor) -> bool:
        """Does this group decide `hidden` [B, T, d] with the compiled decision (routing/decision.py)? Every row of
        the batch (the serving engine's decode steps and captured prefills) without autograd, on CUDA; with more
        than one position a row, only without a picture's anchor or held decisions (the per-picture gates': a
        decode step's position is its own anchor, and its held decision one row of the table)."""
        one_position = hidden.shape[1] == 1
        return self.rows is None and (one_position or self.anchor is None and self.held is None) and \
            not torch.is_grad_enabled() and fused.compiled_for(hidden.device)

    def decide(self, block: int, hidden: torch.Tensor, slots: torch.Tensor | None, weights: torch.Tensor | None,
               k_max: int, static: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockDecision]:
        """Gate this group's rows of `hidden` [B, T, d]: (slots, weights) [B, T, K] with its top-k slots/weights
        at its gated positions, the given tables' (None: the static slots `static` [B*T] in column 0) elsewhere,
        and its decision. The eager form writes into the given tables; the compiled one returns new ones."""
        if self.fuses(hidden):
            got = self._decide_fused(block, hidden, slots, weights, k_max, static)
            if got is not None:
                return got
        if slots is None:  # (the compiled decision failed in this block: the static tables, as route_block makes)
            slots, weights = fused.static_tables(static, k_max)
            slots, weights = slots.view(*hidden.shape[:2], k_max), weights.view(*hidden.shape[:2], k_max)
        h = hidden if self.rows is None else hidden[self.rows]
        b, t = h.shape[0], h.shape[1]
        if self.gates.context_decays:
            self._route_state(block, h, compiled=False)
            logits = self.gates.logits(block, h.reshape(b * t, -1), self.state)
        else:
            logits = self.gates.logits(block, h.reshape(b * t, -1))
        k = self.top_k
        top_val, top_idx = fused.top_k_first(logits, k)  # equal logits by lowest expert, as every decide path
        w = torch.softmax(top_val, dim=-1)
        s = self.expert_slots[top_idx]
        if self.anchor is not None:
            s, w = s[self.anchor], w[self.anchor]
        if self.held is not None:
            held_slots, held_weights, use = self.held
            use = use.reshape(-1, 1)
            s = torch.where(use, held_slots[:, block].repeat_interleave(t, dim=0), s)
            w = torch.where(use, held_weights[:, block].repeat_interleave(t, dim=0), w)
        if k < k_max:
            s = torch.cat([s, s.new_full((b * t, k_max - k), -1)], dim=1)
            w = torch.cat([w, w.new_zeros(b * t, k_max - k)], dim=1)
        mask = self.gated.reshape(-1)
        old_s = (slots if self.rows is None else slots[self.rows]).reshape(b * t, k_max)
        old_w = (weights if self.rows is None else weights[self.rows]).reshape(b * t, k_max)
        new_s = torch.where(mask[:, None], s, old_s).view(b, t, k_max)
        new_w = torch.where(mask[:, None], w, old_w).view(b, t, k_max)
        if self.rows is None:
            slots.copy_(new_s)
            weights.copy_(new_w)
        else:
            slots[self.rows] = new_s
            weights[self.rows] = new_w
        return slots, weights, BlockDecision(logits=logits, topk=top_idx, mask=mask, base_expert=self.gates.base_expert)

    def _decide_fused(self, block: int, hidden: torch.Tensor, slots: torch.Tensor | None,
                      weights: torch.Tensor | None, k_max: int, static: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, BlockDecision] | None:
        """decide() through the compiled decision, each of the B * T positions a row of it. None when compiling
        failed."""
        b, t = hidden.shape[:2]
        gates = self.gates
        weight = gates.gate_weight(block, hidden)
        h = hidden.reshape(b * t, -1)
        if gates.context_decays and not self._route_state(block, hidden, compiled=True):
            return None
        held = (None, None, None)
        if self.held is not None:
            held_slots, held_weights, use = self.held
            held = (held_slots[:, block], held_weights[:, block], use.reshape(-1, 1))
        mask = self.gated.reshape(-1)
        args = (h, self.state if gates.context_decays else None, weight, self.expert_slots, mask,
                None if slots is None else slots.reshape(b * t, k_max),
                None if weights is None else weights.reshape(b * t, k_max), static, *held)
        got = fused.run(fused.decider(self.top_k, k_max, args), *args)
        if got is None:
            return None
        new_s, new_w, logits, top_idx = got
        return (new_s.view(b, t, k_max), new_w.view(b, t, k_max),
                BlockDecision(logits=logits, topk=top_idx, mask=mask, base_expert=gates.base_expert))

    def _route_state(self, block: int, h: torch.Tensor, compiled: bool) -> bool:
        """At block 0 (or whenever none is held), this group's routing state from its rows' block inputs h
        [b, T, d]: `state` [b * T, S, d] per position, `state_out` [b, S, d] after the last. One position a row
        with a state carried in takes the compiled step when `compiled`; False when compiling it failed."""
        if block != 0 and self.state is not None:
            return True
        if block != 0:
            raise RoutingError("gates with context decays compute their routing state from block 0's input; "
                               f"block {block} was routed first")
        updates = self.gated if self.updates is None else self.updates
        b, t = h.shape[:2]
        if compiled and t == 1 and self.state_in is not None:
            state = fused.run(fused.stepper(self.gates.context_decays), h.reshape(b, -1), updates[:, 0],
                              self.state_in)
            if state is None:
                return False
            self.state = self.state_out = state
        else:
            states = routing_state(h, updates, self.gates.context_decays, self.state_in)  # [b, T, S, d]
            self.state, self.state_out = states.reshape(b * t, *states.shape[2:]), states[:, -1]
        return True


STATE_CHUNK = 256  # positions per step of the routing-state scan: memory [b, chunk, chunk] per decay


def routing_state(embeddings: torch.Tensor, updates: torch.Tensor, decays: Sequence[float],
                  state_in: torch.Tensor | None = None) -> torch.Tensor:
    """[b, T, S, d] float32: per position and decay λ, the causal moving average s_t = λ s_(t-1) + (1 - λ) e_t over
    the positions that `updates` ([b, T] bool) marks (others carry s_(t-1) unchanged), from `state_in` [b, S, d]
    (zeros when None) before the first position. One pass over the forward's positions (chunked matrix products,
    no Python loop over tokens), so prefill equals token-by-token decode when each step passes the last state."""
    b, t, d = embeddings.shape
    e = embeddings.float() * updates[..., None]
    # log(decay) computed in float32 and held as a Python number: no host-to-device copy inside a captured step
    log_decays = [torch.log(torch.tensor(lam, dtype=torch.float32)).item() for lam in decays]
    prev = embeddings.new_zeros(b, len(decays), d, dtype=torch.float32) if state_in is None else state_in.float()
    out = []
    for c0 in range(0, t, STATE_CHUNK):
        n = torch.cumsum(updates[:, c0:c0 + STATE_CHUNK].float(), dim=1)  # [b, c]: updates up to and including t
        c = n.shape[1]
        causal = torch.ones(c, c, dtype=torch.bool, device=e.device).tril()
        chunk = []
        for i, (lam, log_lam) in enumerate(zip(decays, log_decays)):
            gap = (n[:, :, None] - n[:, None, :]).clamp(min=0)  # updates after s up to t: exponent >= 0
            w = torch.where(causal, torch.exp(gap * log_lam), torch.zeros((), device=e.device)) * (1 - lam)
            chunk.append(w @ e[:, c0:c0 + c] + torch.exp(n * log_lam)[..., None] * prev[:, i, None])
        block = torch.stack(chunk, dim=2)  # [b, c, S, d]
        out.append(block)
        prev = block[:, -1]
    return torch.cat(out, dim=1)


def picture_anchor(image: torch.Tensor) -> torch.Tensor:
    """[b*T] long: for each image position of `image` [b, T] (bool), the flat index of its picture's first position
    in this forward (a run of image positions is one picture); every other position points at itself."""
    b, t = image.shape
    columns = torch.arange(t, device=image.device).expand(b, t)
    before = torch.cat([torch.zeros_like(image[:, :1]), image[:, :-1]], dim=1)
    starts = torch.where(image & ~before, columns, torch.full_like(columns, -1))
    first = torch.cummax(starts, dim=1).values
    local = torch.where(image & (first >= 0), first, columns)
    return (local + torch.arange(b, device=image.device)[:, None] * t).reshape(-1)


# --- auxiliary losses (training the gates) ----------------------------------------------------------------

def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    while m.dim() < values.dim():
        m = m.unsqueeze(-1)
    return (values * m).sum(0) / m.sum(0).clamp(min=1.0)


def load_balance_loss(decision: BlockDecision) -> torch.Tensor:
    """Switch-Transformer load-balance loss generalised to top-k: E * sum_i f_i * P_i.

    f_i = share of the assignments to adapters that went to adapter i, P_i = mean gate probability of adapter i
    (among the adapters), over gated positions.  Equals 1 when routing is uniform; grows as it collapses onto a
    few adapters.  The base expert is left out: how much text needs no adapter is the data's business.
    """
    logits, topk, mask = decision.logits, decision.topk, decision.mask
    num_experts = logits.shape[-1]
    adapters = num_experts - 1 if decision.base_expert else num_experts
    probs = torch.softmax(logits[:, :adapters], dim=-1)
    dispatch = F.one_hot(topk, num_experts).sum(1).float()[:, :adapters]
    share = _masked_mean(dispatch, mask)
    return adapters * (share / share.sum().clamp(min=1e-9) * _masked_mean(probs, mask)).sum()


def router_z_loss(decision: BlockDecision) -> torch.Tensor:
    """ST-MoE router z-loss: mean squared log-sum-exp of the gate logits (keeps logits small and stable)."""
    z = torch.logsumexp(decision.logits, dim=-1) ** 2
    return _masked_mean(z, decision.mask)

