"""LeanDecoder: the engine's own forward for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3).

transformers' module forward spends most of a decode step on per-op overhead, not on work: on the embedded 6-layer
model it issues ~150 tensor ops per block (RMSNorm as cast/pow/mean/rsqrt/mul/cast, rotary as slice/neg/cat/mul/add
per tensor, GQA by copying every key and value row per head, masks and position tables rebuilt per call), and a
captured Qwen3-1.7B step was 2,072 kernels.  This forward runs the same model with the same weights and the same
routed layers (RoutedLoRALinear, their q/k/v and gate/up group calls) and does the rest in a few ops per block:

    fused RMSNorm (F.rms_norm, in float32 as transformers does, then cast and scale)
    rotary embedding: cos/sin once per forward for all blocks; q*cos + roll(q, D/2)*(sign*sin) (= rotate_half)
    the KV write straight from the [n, T, H, D] layout into the engine's RowKVCache (no transposes), in the same
    compiled piece as the rotary embedding
    GQA without copies: the G query heads of one KV head fold into the query axis ([n, Hkv, G*T, D])
    a decode step on CUDA: split-K decode attention (kernels/triton_attention.py) reading each row's columns up to
    its position, where sdpa walks the cache's whole length with a handful of programs

It is what the serving engine runs (EngineConfig.lean_decoder); `LeanDecoder.supports(model)` says when it can,
else the engine keeps transformers' forward (a model spread over devices, sliding-window attention, an unknown
architecture).  Learned (MoLoRA) gates route on each block's input exactly as the block pre-hooks do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from molora.kernels.triton_attention import decode_attention, decode_attention_runs_on
from molora.models.engine.kv_cache import write_rows
from molora.routing.context import current_routing

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class LeanDecoder:
    """Callable like the HF model's forward for the engine's calls (input_ids, attention_mask [n, 1, T, L],
    position_ids [n, T], past_key_values = the engine's RowKVCache, logits_to_keep = 1).  `compile`: on CUDA,
    the elementwise pieces run as torch.compile'd kernels (False: eager, as on the CPU).  `split_attention`: decode
    steps on CUDA attend through the split-K kernel (False: sdpa over the whole cache, as before it)."""

    def __init__(self, model: nn.Module, *, compile: bool = True, split_attention: bool = True) -> None:
        reason = self.unsupported(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        self.model = model
        self.base = model.model
        self.blocks = list(self.base.layers)
        config = _text_config(model)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.scaling = float(self.blocks[0].self_attn.scaling)
        self.qk_norm = hasattr(self.blocks[0].self_attn, "q_norm")
        if self.qk_norm:
            self.eps = float(self.blocks[0].self_attn.q_norm.variance_epsilon)
        act = getattr(config, "hidden_act", None)
        self.act = F.silu if act in ("silu", "swish") else self.blocks[0].mlp.act_fn
        self.compile = compile
        self.split_attention = split_attention
        self._fused_on: torch.device | None = None

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why this forward cannot run `model` (None: it can)."""
        config = _text_config(model)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_TYPES:
            return f"model type {model_type!r} is not one of {SUPPORTED_TYPES}"
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
            return "no model.layers / lm_head"
        if hasattr(model, "hf_device_map"):
            return "the model is dispatched over devices"
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False) or \
                (model_type == "mistral" and getattr(config, "sliding_window", None)):
            return "sliding-window attention"
        if getattr(config, "pretraining_tp", 1) != 1:
            return "pretraining_tp > 1"
        return None

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return cls.unsupported(model) is None

    def _fuse(self, device: torch.device) -> None:
        """On CUDA, compile the elementwise pieces once (each becomes one Triton kernel inside the captured step:
        norms, residual adds, q/k norm and rotary, the gated activation); the CPU keeps them eager."""
        if self._fused_on == device:
            return
        self._fused_on = device
        compiled = device.type == "cuda" and self.compile
        wrap = (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)) if compiled else (lambda fn: fn)
        self.norm, self.add_norm = wrap(_norm), wrap(_add_norm)
        self.attention_inputs, self.gated = wrap(_attention_inputs), wrap(_gated)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 past_key_values: Any, use_cache: bool = True, logits_to_keep: int = 1,
                 **unused: Any) -> CausalLMOutputWithPast:
        self._fuse(input_ids.device)
        try:
            return self._forward(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)
        except Exception as err:
            if not self.compile or input_ids.device.type != "cuda":
                raise
            # no working compiler here (or it failed on this model): the same pieces eagerly, from now on.  A
            # forward that failed part-way is simply run again: it rewrites the same KV entries with the same values
            log.warning("engine: compiling the decoder's elementwise pieces failed (%s: %s); running them eagerly",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self.compile, self._fused_on = False, None
            self._fuse(input_ids.device)
            return self._forward(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Any, logits_to_keep: int) -> CausalLMOutputWithPast:
        n, T = input_ids.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        G = H // Hkv
        x = self.base.embed_tokens(input_ids)
        cos, sin = self.base.rotary_emb(x, position_ids)  # [n, T, D], the model's own rope type and scaling
        sin_signed = torch.cat((-sin[..., :D // 2], sin[..., D // 2:]), -1)  # rotate_half's signs, once
        cos, sin_signed = cos[:, :, None], sin_signed[:, :, None]  # broadcast over heads: [n, T, 1, D]
        mask = attention_mask
        if G > 1 and T > 1:  # the G query heads of a KV head become G*T query rows: the mask repeats per head
            mask = mask.expand(n, G, T, mask.shape[-1]).reshape(n, 1, G * T, mask.shape[-1])
        routing = current_routing()
        learned = routing is not None and bool(routing.learned)
        live = min(n, getattr(cache, "live_rows", None) or n)
        lengths = None  # [n]: the columns each row reads, when the split-K kernel attends
        if T == 1 and self.split_attention and getattr(cache, "causal_rows", False) and x.is_cuda and \
                decode_attention_runs_on(x):
            lengths = position_ids[:, 0] + 1
        padded = lengths is None and live < n  # a decode step's padding rows: zeros, not attention over their KV rows
        if padded:  # (made once a forward: the padding rows of `o` stay zero in every block)
            o_padded, live_mask = x.new_zeros(n, Hkv, G * T, D), mask[:live]
        eps = self.eps
        first = self.blocks[0].input_layernorm
        h = self.norm(x, first.weight, first.variance_epsilon)
        for i, block in enumerate(self.blocks):
            if learned:
                routing.route_block(i, x)
            attn = block.self_attn
            q = attn.q_proj(h).view(n, T, H, D)
            k = attn.k_proj(h).view(n, T, Hkv, D)
            v = attn.v_proj(h).view(n, T, Hkv, D)
            q = self.attention_inputs(q, k, v, attn.q_norm.weight if self.qk_norm else None,
                                      attn.k_norm.weight if self.qk_norm else None, eps, cos, sin_signed,
                                      *cache.write_places(i))
            keys, values = cache.rows_of(i)  # the rows' whole buffers [n, Hkv, L, D]
            # [n, T, H, D] -> [n, Hkv, G*T, D]: query heads h = j*G + g read KV head j (transformers' repeat_kv)
            q = q.view(n, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(n, Hkv, G * T, D)
            if lengths is not None:
                o = decode_attention(q, keys, values, lengths, self.scaling)
            elif padded:
                o = o_padded
                o[:live] = F.scaled_dot_product_attention(q[:live], keys[:live], values[:live], attn_mask=live_mask,
                                                          scale=self.scaling)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            o = o.view(n, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(n, T, H * D)
            post = block.post_attention_layernorm
            x, h = self.add_norm(x, attn.o_proj(o), post.weight, post.variance_epsilon)
            mlp = block.mlp
            up = self.gated(mlp.gate_proj(h), mlp.up_proj(h), self.act)
            following = self.blocks[i + 1].input_layernorm if i + 1 < len(self.blocks) else self.base.norm
            x, h = self.add_norm(x, mlp.down_proj(up), following.weight, following.variance_epsilon)
        last = h[:, -logits_to_keep:] if logits_to_keep else h  # h: the final norm of the last block's output
        return CausalLMOutputWithPast(logits=self.model.lm_head(last))  # the cache is the caller's own RowKVCache


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in float32, cast back to x's dtype, then the weight (float32: one op, the weight
    inside F.rms_norm, the same numbers; the CPU's eager step pays per op)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm: (x + delta, norm(x + delta))."""
    x = x + delta
    return x, _norm(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * (sign * sin)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin_signed: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
                      ) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm (when it has one), the rotary embedding of both, and the new keys and values
    written into the cache (RowKVCache.write_places): compiled, the writes join the rotary's kernel, where they were
    two index_put kernels a block. Returns the rotated queries."""
    if q_weight is not None:
        q, k = _norm(q, q_weight, eps), _norm(k, k_weight, eps)
    write_rows(keys, values, rows, positions, _rotate(k, cos, sin_signed), v)
    return _rotate(q, cos, sin_signed)


def _gated(gate: torch.Tensor, up: torch.Tensor, act: Any) -> torch.Tensor:
    return act(gate) * up


__all__ = ["LeanDecoder", "SUPPORTED_TYPES"]
