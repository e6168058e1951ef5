"""CpuStep: the CPU engine's decode step through the C step (kernels/cpu_decode.py) for models LeanDecoder runs.

The engine's eager CPU step spent most of its time on the dispatch of ~575 small torch ops (benchmarks/RESULTS.md,
C1). Where the model allows, a decode step is one C call instead: the same forward (LeanDecoder's, with each row's
LoRA slot from the vocabulary routing), each row computed on its own (exact rows: a request's tokens equal its solo
run), padding rows skipped. It serves rows routed by vocabulary range, a fixed adapter or none, and rows of learned
(MoLoRA) routers, whose decision the C code makes at each block itself (LearnedGroup.decide's math, row by row:
`learned_step` hands it a decode step's routing tables); where a router's gates are not float32 on the CPU
(`CpuStep.decides`), the engine takes torch's step for the steps that router's rows share.

Where it cannot serve (`CpuStep.unsupported` says why: no built C library, weights whose values are not all
bfloat16, projection biases, an activation other than SiLU, a projection left unrouted or ungrouped, ...), the
engine keeps the torch step and logs the reason once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from molora.kernels import cpu_decode
from molora.kernels.errors import MoLoRAError
from molora.models.engine.decoder import LeanDecoder
from molora.models.engine.kv_cache import RowKVCache
from molora.routing.context import CallRouting
from molora.routing.lora import tensor_version
from molora.routing.routers import LearnedRouter

log = logging.getLogger(__name__)

# each block's projection groups, as the C step reads them (kernels/decode_step.c), and their members in order
GROUP_MEMBERS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                 ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


class CpuStepError(MoLoRAError, RuntimeError):
    """The model changed so that the C step can no longer run it (the engine goes back to torch's step)."""


@dataclass
class _Table:
    """A pointer table and what it was made from: (parent's modules, child name, module, its weight, the weight's
    address) of each plain weight (the head's third), the head's (address, version) its copy was made from, and each
    projection group's (packed weight, A, B, scale)."""

    weights: cpu_decode.StepWeights
    head_key: tuple[int, int]
    checks: list[tuple[dict, str, nn.Module, torch.Tensor, int]]
    groups: list[tuple[Any, tuple[torch.Tensor, ...]]]


class CpuStep:
    """The C decode step over one engine's model and KV cache (see the module docstring)."""

    def __init__(self, decoder: LeanDecoder, kv: RowKVCache, max_len: int, threads: int = 1) -> None:
        """`threads`: how many threads share a step's rows (cpu_decode.decode_step)."""
        reason = self.unsupported(decoder, kv)
        if reason is not None:
            raise ValueError(f"the C decode step cannot run this model: {reason}")
        self.decoder, self.kv, self.max_len, self.threads = decoder, kv, max_len, threads
        model = decoder.model
        self.vocab = int(model.lm_head.weight.shape[0])
        self.d = int(decoder.base.norm.weight.shape[0])
        positions = torch.arange(max_len)[None]
        cos, sin = decoder.base.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        self.cos, self.sin_signed = cpu_decode.rope_tables(cos[0], sin[0])
        self._table: _Table | None = None
        self._refused: set[tuple[int, str]] = set()  # (router, reason) pairs logged

    @staticmethod
    def unsupported(decoder: LeanDecoder | None, kv: RowKVCache) -> str | None:
        """Why the C step cannot run this model and cache (None: it can)."""
        if not cpu_decode.available():
            return "the C library is not built here (kernels/cpu_bf16.py logged why)"
        if decoder is None:
            return "the engine runs transformers' forward, not LeanDecoder"
        model = decoder.model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        rope_type = str(getattr(decoder.base.rotary_emb, "rope_type", "default"))
        if "dynamic" in rope_type or rope_type == "longrope":
            return f"rope type {rope_type!r} (its frequencies depend on the longest position of a call)"
        if decoder.act is not torch.nn.functional.silu:
            return f"activation {getattr(config, 'hidden_act', None)!r} (the C step has SiLU)"
        if type(kv) is not RowKVCache or any(t.dtype != torch.float32 or t.device.type != "cpu"
                                              for t in (*kv.keys, *kv.values)):
            return "the KV cache is not one float32 RowKVCache on the CPU"
        if model.lm_head.bias is not None or cpu_decode.head_copy(model.lm_head.weight) is None:
            return "the output head has a bias, or values that are not all bfloat16"
        embed = decoder.base.embed_tokens
        if type(embed) is not nn.Embedding or embed.weight.dtype != torch.float32 or \
                getattr(embed, "embed_scale", None) is not None:
            return "the token embedding is not a plain float32 nn.Embedding"
        eps = {decoder.eps} | {float(norm.variance_epsilon) for block in decoder.blocks
                               for norm in (block.input_layernorm, block.post_attention_layernorm)}
        if len(eps | {float(decoder.base.norm.variance_epsilon)}) != 1:
            return "the RMSNorms use different epsilons"
        for index, block in enumerate(decoder.blocks):
            for parent, names in GROUP_MEMBERS:
                layers = [getattr(getattr(block, parent), name) for name in names]
                group = getattr(layers[0], "group", None)
                if group is None or list(group.members) != layers:
                    return f"block {index}'s {'/'.join(names)} are not one routed projection group"
                if any(layer.bias is not None for layer in layers):
                    return f"block {index}'s {'/'.join(names)} have biases"
                A, _, _ = group.stacked()
                weight = group.exact_rows_weight()
                if weight is None or weight.dtype != torch.bfloat16 or A.dtype != torch.float32:
                    return (f"block {index}'s {'/'.join(names)} weights have no bfloat16 copy (values not all "
                            "bfloat16, more than one torch thread, or the engine's packing budget spent)")
        return None

    def table(self) -> cpu_decode.StepWeights:
        """The C step's pointer table for the model as it is now: the last one while _current says it still points at
        what the model holds, else a new one (CpuStepError where the model no longer allows one)."""
        if self._table is None or not self._current(self._table):
            self._table = None
            try:
                self._table = self._make_table()
            except Exception as err:  # (whatever the model's change broke: the engine goes back to torch's step)
                raise CpuStepError(f"{type(err).__name__}: {err}") from err
        return self._table.weights

    def _places(self) -> list[tuple[nn.Module, str]]:
        """(parent module, child name) of every module whose `weight` the C step reads where it lies."""
        decoder = self.decoder
        places: list[tuple[nn.Module, str]] = [(decoder.base, "embed_tokens"), (decoder.base, "norm"),
                                               (decoder.model, "lm_head")]
        for block in decoder.blocks:
            places += [(block, "input_layernorm"), (block, "post_attention_layernorm")]
            if decoder.qk_norm:
                places += [(block.self_attn, "q_norm"), (block.self_attn, "k_norm")]
        return places

    def _groups(self) -> list[Any]:
        return [getattr(getattr(block, parent), names[0]).group for block in self.decoder.blocks
                for parent, names in GROUP_MEMBERS]

    @staticmethod
    def _current(table: _Table) -> bool:
        """Does `table` still point at what the model holds? Cheap (a step's check): the same modules holding the
        same parameter objects over the same storage, the head at the version its copy was made from, and each
        group's stacked adapters and base-weight copy the same tensors (ProjectionGroup.stacked / exact_rows_weight
        make new ones when the model was moved or a weight written in place). A write through `.data` bumps no
        version: as for torch's step's packed copies, it is not seen."""
        for modules, name, module, param, address in table.checks:
            if modules.get(name) is not module or module._parameters.get("weight") is not param or \
                    param.data_ptr() != address:
                return False
        head = table.checks[2][3]
        if table.head_key != (head.data_ptr(), tensor_version(head)):
            return False
        for group, (packed, A, B, scale) in table.groups:
            stacked = group.stacked()
            if stacked[0] is not A or stacked[1] is not B or stacked[2] is not scale or \
                    group.exact_rows_weight() is not packed:
                return False
        return True

    def _make_table(self) -> _Table:
        decoder = self.decoder
        checks = []
        for parent, name in self._places():
            module = parent._modules[name]
            param = module._parameters["weight"]
            checks.append((parent._modules, name, module, param, param.data_ptr()))
        head = checks[2][3]
        head_key = (head.data_ptr(), tensor_version(head))
        head_copy = cpu_decode.head_copy(head)
        if head_copy is None:
            raise RuntimeError("the output head's values are no longer all bfloat16")
        groups = [(group, (group.exact_rows_weight(), *group.stacked())) for group in self._groups()]
        weights = {(parent, name): param.detach() for (parent, name), (_, _, _, param, _) in
                   zip(self._places(), checks)}
        tensors: list[torch.Tensor | None] = [weights[decoder.base, "embed_tokens"], weights[decoder.base, "norm"],
                                              head_copy, self.cos, self.sin_signed]
        members = iter(groups)
        for index, block in enumerate(decoder.blocks):
            attn = block.self_attn
            tensors += [weights[block, "input_layernorm"], weights[block, "post_attention_layernorm"],
                        weights[attn, "q_norm"] if decoder.qk_norm else None,
                        weights[attn, "k_norm"] if decoder.qk_norm else None]
            for _ in GROUP_MEMBERS:
                tensors += list(next(members)[1])
            tensors += [self.kv.keys[index], self.kv.values[index]]
        first = decoder.blocks[0].self_attn.q_proj
        dims = dict(layers=len(decoder.blocks), d=int(decoder.base.norm.weight.shape[0]), heads=decoder.heads,
                    kv_heads=decoder.kv_heads, head_dim=decoder.head_dim,
                    ffn=int(decoder.blocks[0].mlp.gate_proj.out_features), vocab=self.vocab,
                    slots=int(first.num_slots), rank=int(first.r_max), max_len=self.max_len,
                    qk_norm=int(decoder.qk_norm))
        return _Table(cpu_decode.StepWeights(dims, decoder.eps, decoder.scaling, tensors), head_key, checks, groups)

    def decides(self, router: LearnedRouter) -> bool:
        """Can the C step make this router's decisions (every gate weight a contiguous float32 tensor on the CPU,
        sized for this model)? Logs why not, once per router and reason."""
        layers = len(self.decoder.blocks)
        for gates in [router.gates] + ([router.image_gates] if router.image_gates is not None else []):
            if gates.d_model != self.d or gates.num_blocks != layers:
                reason = f"gates sized for d={gates.d_model} and {gates.num_blocks} blocks"
            elif any(gate.weight.dtype != torch.float32 or gate.weight.device.type != "cpu" or
                     not gate.weight.is_contiguous() for gate in gates.gates):
                reason = "gate weights that are not contiguous float32 on the CPU (the C step decides in float32)"
            else:
                continue
            if (id(router), reason) not in self._refused:
                self._refused.add((id(router), reason))
                log.info("engine: the C decode step cannot make a learned router's decisions (%s); its steps take "
                         "torch's step", reason)
            return False
        return True

    def run(self, rows: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            logits: torch.Tensor, learned: cpu_decode.LearnedStep | None = None,
            table: cpu_decode.StepWeights | None = None) -> None:
        """Decode one token for each batch row in `rows` (see cpu_decode.decode_step); ids, positions, slots [W].
        `table`: this step's table() when the caller just asked for it."""
        cpu_decode.decode_step(table or self.table(), rows, ids, positions, slots, logits, learned, self.threads)


def learned_step(plan: CallRouting) -> cpu_decode.LearnedStep:
    """The C step's learned routing for a decode step's `plan` over W rows (the engine's: each group covers every
    row, one position each, with its held picture decisions and routing states in): one GateSet per group, in order.
    The plan then reads what the step writes, as if torch's gates had routed its blocks: each block's decision
    (plan.block_slots: views of the step's [W, blocks, k] tables; rows the step skips: -1 / 0) and each group's
    state after the step (`state_out`; rows the step skips keep `state_in`)."""
    width, blocks = plan.batch, plan.learned[0].gates.num_blocks
    step = cpu_decode.LearnedStep([], torch.full((width, blocks, plan.k), -1, dtype=torch.long),
                                  torch.zeros(width, blocks, plan.k))
    for group in plan.learned:
        gates, decays = group.gates, group.gates.context_decays
        gate_set = cpu_decode.GateSet(group.top_k, group.expert_slots, [gate.weight for gate in gates.gates],
                                      group.gated.reshape(width), decays)
        if decays:
            group.state_out = group.state_in.clone()
            gate_set.updates, gate_set.state_in = group.updates.reshape(width), group.state_in
            gate_set.state_out = group.state_out
        if group.held is not None:
            held_slots, held_weights, use = group.held
            gate_set.held = (held_slots, held_weights, use.reshape(width))
        step.sets.append(gate_set)
    plan.block_slots = {block: (step.slots[:, block], step.weights[:, block]) for block in range(blocks)}
    return step


__all__ = ["CpuStep", "CpuStepError", "learned_step"]
