"""RoutedLoRALinear: an nn.Linear that adds a per-token routed LoRA delta, y = x W^T + b + routed_lora(x, ...).

It *is* an nn.Linear sharing the original weight and bias Parameters (same state-dict keys, so the HF model
still saves and loads as the base model), plus non-persistent buffers holding the hot-set slots
A[S, r_max, in], B[S, out, r_max], scale[S].  They are allocated once; HotSetCache only ever copies into them, so
their addresses stay fixed (CUDA-graph friendly).  Buffers follow `model.to(device / dtype)`.

Projections that read the same input (q/k/v of an attention block, gate/up of an MLP) form a ProjectionGroup:
their A, B and scale buffers are views into one stacked tensor each (A [P, S, r, in], B [S, sum(out), r],
scale [P, S]), so the first member called in a forward computes every member's output in one group call (one
kernel call for all the deltas, x read once, and the members' base GEMMs next to it), and the other members pick
theirs up from the call's CallRouting with no work of their own (an eager decode step is host-bound: each layer's
reshape, checks and GEMM call cost host time).  The base GEMMs and the deltas meet without an extra pass over the
output: on the eager decode path the GEMMs write one [N, O] buffer and the one-launch kernel adds the deltas into
it; on narrow hot sets, 16-bit, with no gradient recorded, groups of three or more (q/k/v) up to 256 tokens and
every group up to 32 (eager calls from 17, captured ones from 1; kernels.dispatch.fuses_base) run as one GEMM with
the deltas inside (kernels/triton_linear.py); on the others each GEMM runs *onto* its member's fresh delta
(addmm_, beta = 1).

The layer builds no routing metadata: it reads the per-call `CallRouting` (routing/context.py) that
RoutedModel.forward set up once for the whole pass.  No routing active -> exactly the base linear.

A model spread over devices (accelerate's device_map): the slots live on the device the layer computes on
(`device=`), and the layer asks the routing for its metadata by `route_key` = (block, device), so it reads copies
on its own device (PlacedRouting, made once per forward per device).  On one device `route_key` is the block
number, the same key as ever: the single-device path does no extra work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from molora.kernels import reads_meta, routed_lora, routed_lora_topk
from molora.kernels.autograd import needs_autograd
from molora.kernels.dispatch import (
    choose_group_path,
    dense_fits,
    flat_blocks,
    fuses_base,
    loads_graph_path,
    routed_lora_group_forward,
)
from molora.kernels.graphs import call_key, load_graph_path
from molora.kernels.torch_ops import pack_exact_rows, routed_linear_torch_slots
from molora.kernels.triton_linear import stacked_linear_group
from molora.kernels.triton_stacked import FusedLaunch
from molora.routing.context import CallRouting, SharedOutputs, current_routing
from molora.routing.errors import RoutingError

log = logging.getLogger(__name__)

# Sibling linear layers that read the same input tensor in the model families we know (Llama, Qwen, Mistral,
# Emu3, Chameleon, Janus's LM: q/k/v and gate/up; Mixtral-style MLPs: w1/w3).
SHARED_INPUT_SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
# True: a group call computes its members' outputs, base GEMMs and deltas together (see the module doc). False:
# every layer runs the base linear, then adds its own delta (no sharing); kept for comparisons.
GROUP_OUTPUTS = True


class ProjectionGroup:
    """Routed layers of one module that read the same input: their adapters stacked for one shared kernel call.

    Members' lora_A / lora_B / lora_scale buffers are views into self.A [P, S, r, in], self.B [S, O, r] and
    self.scale [P, S]. `model.to(...)` replaces every buffer by a separate copy; stacked() notices (the members'
    buffers are no longer the views it made) and stacks again, once.
    """

    def __init__(self, members: Iterable[RoutedLoRALinear]) -> None:
        self.members = list(members)
        self.shares_input = True  # cleared if members turn out to be called on different inputs
        bounds = [0]
        for p, layer in enumerate(self.members):
            layer.group, layer.group_index = self, p
            bounds.append(bounds[-1] + layer.out_features)
        self.bounds = tuple(bounds)
        self.widths = tuple(layer.out_features for layer in self.members)
        self.size = len(self.members)
        # the base weight's copy for the CPU's exact-row GEMMs (kernels/torch_ops.py pack_exact_rows: bfloat16 for our
        # kernel or oneDNN-packed), and the weight's (address, version) it was made from: None until the engine asks
        self.packed: torch.Tensor | None = None
        self._packed_from: tuple[int, int] | None = None
        self._stack()

    def __len__(self) -> int:
        return self.size

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: the launchers hold the old tensors' addresses,
        return {**self.__dict__, "_launches": {}, "packed": None}  # and a packed weight is opaque (packed again)

    @torch.no_grad()
    def _stack(self) -> None:
        """Stack the members' buffers into one tensor each and make the buffers views of them (a group of one
        uses its buffers as they are); where the members' base weights are real tensors on the adapters' device,
        stack them too, into one [O, in] storage whose rows the weight Parameters become views of (memory does
        not double), so one GEMM computes every member's base output (self.weight; None otherwise). Forget the
        launchers made for the previous tensors."""
        first = self.members[0]
        weights = [layer._parameters["weight"] for layer in self.members]
        joins = all(w.device == first.lora_A.device and w.dim() == 2 for w in weights)
        if self.size == 1:
            buffers = first._buffers
            A, B, scale = buffers["lora_A"][None], buffers["lora_B"], buffers["lora_scale"][None]
            base = weights[0] if joins else None
        else:
            p_count, out = len(self.members), self.bounds[-1]
            num_slots, r_max, d_in = first.lora_A.shape
            kw = {"dtype": first.lora_A.dtype, "device": first.lora_A.device}
            A = torch.empty(p_count, num_slots, r_max, d_in, **kw)
            B = torch.empty(num_slots, out, r_max, **kw)
            scale = torch.empty(p_count, num_slots, dtype=first.lora_scale.dtype, device=kw["device"])
            base = torch.empty(out, d_in, dtype=weights[0].dtype, device=kw["device"]) if joins else None
            for p, (layer, weight) in enumerate(zip(self.members, weights)):
                lo, hi = self.bounds[p], self.bounds[p + 1]
                A[p].copy_(layer.lora_A)
                B[:, lo:hi].copy_(layer.lora_B)
                scale[p].copy_(layer.lora_scale)
                layer._buffers["lora_A"], layer._buffers["lora_B"] = A[p], B[:, lo:hi]
                layer._buffers["lora_scale"] = scale[p]
                if base is not None:
                    base[lo:hi].copy_(weight)
                    weight.data = base[lo:hi]
        self.A, self.B, self.scale, self.weight = A, B, scale, base
        self._views = [(layer._buffers, layer.lora_A, layer.lora_B, layer.lora_scale) for layer in self.members]
        self._weight_ptrs = [w.data_ptr() for w in weights]
        self._slot_form_of: tuple[int, int] | None = None  # the CPU's per-slot form: made on first use (slot_form)
        # kernels' FusedLaunch for these tensors, made on the first eager decode call: key None for the whole
        # group, p for member p called on its own input (the group's members turned out not to share x)
        self._launches: dict[int | None, FusedLaunch] = {}

    def pack_exact_rows(self) -> bool:
        """Copy the members' stacked base weight into the CPU engine's exact-row GEMM form (kernels/torch_ops.py
        pack_exact_rows: our bfloat16 kernel's copy or oneDNN's packed one, each only where it is exact here); True
        when there is one."""
        weight = self.weight
        self.packed = pack_exact_rows(weight) if weight is not None else None
        self._packed_from = (weight.data_ptr(), tensor_version(weight)) if weight is not None else None
        return self.packed is not None

    def exact_rows_weight(self) -> torch.Tensor | None:
        """The base weight's packed copy (made again when the weight was replaced or written in place since); None
        when none was asked for or no packed form is exact here: cpu_linear's MKL form."""
        if self._packed_from is None:
            return None
        weight = self.weight
        if weight is None or self._packed_from != (weight.data_ptr(), tensor_version(weight)):
            self.pack_exact_rows()
        return self.packed

    def slot_form(self) -> list[tuple[torch.Tensor, ...]]:
        """What the CPU's per-slot form reads of slot s (kernels/torch_ops.py routed_linear_torch_slots): every
        member's scale[p, s] * A[p, s]^T side by side [in, P*r] (one shrink GEMM for all members; a copy, made again
        when the hot set writes A or the scales: their version counters), then each member's B[s]^T [r, width_p]
        (views). Call after stacked()."""
        A, scale = self.A, self.scale
        key = (tensor_version(A), tensor_version(scale))
        if self._slot_form_of != key or -1 in key:  # (inference tensors: no counter, made every call)
            p_count, num_slots, r, d_in = A.shape
            shrink = (A * scale[:, :, None, None]).permute(1, 3, 0, 2).reshape(num_slots, d_in, p_count * r)
            spans = list(zip(self.bounds, self.bounds[1:]))
            self._slot_form = [(shrink[s], *(self.B[s, lo:hi].t() for lo, hi in spans)) for s in range(num_slots)]
            self._slot_form_of = key
        return self._slot_form

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A [P, S, r, in], B [S, O, r], scale [P, S]) over the members' current buffers and weights."""
        for buffers, a, b, sc in self._views:  # plain dict reads: this runs on every routed call
            if buffers["lora_A"] is not a or buffers["lora_B"] is not b or buffers["lora_scale"] is not sc:
                self._stack()  # the model was moved or cast: buffers are separate copies now
                return self.A, self.B, self.scale
        for layer, ptr in zip(self.members, self._weight_ptrs):
            if layer._parameters["weight"].data_ptr() != ptr:  # weights replaced (load_state_dict(assign=True), ...)
                self._stack()
                break
        return self.A, self.B, self.scale

    def needs_autograd(self, x2: torch.Tensor, weights: torch.Tensor | None) -> bool:
        """Does a gradient flow through the group call's deltas (x, the weights, any member's adapters)? Then each
        member takes the autograd path (its siblings take their outputs from a group call unchecked)."""
        return torch.is_grad_enabled() and (needs_autograd(x2, weights) or any(
            buffers["lora_A"].requires_grad or buffers["lora_B"].requires_grad for buffers, *_ in self._views))

    def outputs(self, routing: CallRouting, block: Any, x: torch.Tensor, x2: torch.Tensor, slots: torch.Tensor,
                weights: torch.Tensor | None, only: int | None = None) -> list[torch.Tensor]:
        """Outputs (base linear + routed delta, x's dtype, x's shape with each member's width) of every member, or
        of member `only`; x2: x as [N, in]; slots [N, k]; `block`: the members' route_key."""
        A, B, scale = self.stacked()
        members, bounds, widths = self.members, self.bounds, self.widths
        if only is not None:
            lo, hi = bounds[only], bounds[only + 1]
            A, B, scale = A[only:only + 1], B[:, lo:hi], scale[only:only + 1]
            members, bounds, widths = (members[only],), (0, hi - lo), (hi - lo,)
        lead = x.shape[:-1]
        # one path decision (by shape) for the call; the grouped kernel and the CPU read per-forward metadata
        path = choose_group_path(x2, slots.shape[1], True, A.shape[1], A.shape[2], A.shape[0])
        if loads_graph_path(x2, path):  # what a capture after this eager call takes (kernels/graphs.py)
            load_graph_path(call_key(x2, "linear", slots, weights, A, B, scale, bounds, only, self.weight is not None),
                            lambda: self.outputs(routing, block, x, x2, slots, weights, only))
        if path == "fused":  # the eager decode path: one launch through the launcher kept for these tensors
            launch = self._launches.get(only)
            if launch is None:
                launch = self._launches[only] = FusedLaunch(A, B, scale, bounds)
            if not torch.is_grad_enabled():  # (GEMMs with out= record no autograd)
                # the members' GEMMs write column blocks of one [N, O] buffer (one GEMM where their weights share
                # the group's storage), the launch adds every delta into it (split_with_sizes, not Tensor.split:
                # its Python wrapper cost more host time than the split)
                out = x2.new_empty(x2.shape[0], bounds[-1])
                if only is None and self.weight is not None:
                    F.linear(x2, self.weight, out=out)
                    out = launch(x2, slots, weights, out)
                    return _with_bias(members, list(out.split_with_sizes(widths, 1)), lead)
                for layer, y in zip(members, out.split_with_sizes(widths, 1) if len(members) > 1 else (out,)):
                    params = layer._parameters
                    F.linear(x2, params["weight"], params.get("bias"), out=y)  # (bias=False: a None attribute)
                out = launch(x2, slots, weights, out).view(*lead, bounds[-1])
                return out.split_with_sizes(widths, -1) if len(members) > 1 else [out]
            delta = launch(x2, slots, weights)
            deltas = delta.split_with_sizes(widths, 1) if len(members) > 1 else [delta]
        elif path == "torch" and only is None and self.weight is not None and not x2.is_cuda and \
                x2.dtype in (torch.float32, torch.float64) and not torch.is_grad_enabled() and \
                dense_fits(x2, A, B, slots.shape[1]):
            # the CPU: one GEMM for the members' base outputs, then the deltas of the slots present only
            meta = routing.meta(block)
            exact = routing.exact_rows
            ys = routed_linear_torch_slots(x2, self.weight, self.slot_form(),
                                           meta.slot_columns(x2.dtype, routing.live_rows), widths, exact,
                                           self.exact_rows_weight() if exact else None)
            return _with_bias(members, ys, lead)
        elif not torch.is_grad_enabled() and fuses_base(x2, A.shape[1], A.shape[2], A.shape[0]) and \
                (base := _weights_of_one_layout(members)) is not None:
            # one GEMM per call: every member's base GEMM with its delta inside (no autograd: no backward there)
            flat = stacked_linear_group(x2, base, A, B, slots, weights, scale, bounds)
            return _with_bias(members, flat_blocks(flat, x2.shape[0], bounds), lead)
        else:
            meta = routing.meta(block) if path == "grouped" or path == "torch" else None
            deltas = routed_lora_group_forward(x2, A, B, slots, weights, scale, bounds, meta, path)
        grad = torch.is_grad_enabled()
        ys = []
        for layer, delta in zip(members, deltas):
            weight_t = layer._parameters["weight"].t()
            # the base GEMM accumulates onto the delta (cuBLAS beta = 1); in place unless grad is enabled (the deltas
            # can be views of one buffer, which autograd does not let an in-place op modify)
            ys.append(torch.addmm(delta, x2, weight_t) if grad else delta.addmm_(x2, weight_t))
        return _with_bias(members, ys, lead)


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write); -1 for an inference tensor, which has none."""
    return -1 if tensor.is_inference() else tensor._version


def _weights_of_one_layout(members: Iterable[RoutedLoRALinear]) -> list[torch.Tensor] | None:
    """The members' base weights when they share one set of strides (the one-GEMM kernel reads every weight with
    the first one's), else None."""
    base = [layer._parameters["weight"] for layer in members]
    return base if all(w.stride() == base[0].stride() for w in base[1:]) else None


def _with_bias(members: Iterable[RoutedLoRALinear], ys: list[torch.Tensor], lead: torch.Size) -> list[torch.Tensor]:
    """Each member's output [N, width] plus its bias (in place), viewed as x's leading dims + width."""
    outs = []
    for layer, y in zip(members, ys):
        bias = layer._parameters.get("bias")
        if bias is not None:
            y.add_(bias)
        outs.append(y.view(*lead, y.shape[1]))
    return outs


def group_projections(layers: Iterable[RoutedLoRALinear]) -> list[ProjectionGroup]:
    """Group sibling routed layers that read the same input (SHARED_INPUT_SETS, same module, same shapes and
    dtypes: a group call checks the first member's only); call once after wrapping. Layers left out stay groups of
    one, offloaded ones too (weights on "meta" until their own accelerate hook brings them in for their own call: a
    group call runs its members' GEMMs)."""
    by_parent: dict[str, dict[str, RoutedLoRALinear]] = {}
    for layer in layers:
        parent, _, child = layer.name.rpartition(".")
        by_parent.setdefault(parent, {})[child] = layer
    groups = []
    for children in by_parent.values():
        for names in SHARED_INPUT_SETS:
            members = [children[n] for n in names if n in children]
            first = members[0] if members else None
            if len(members) < 2 or any(m.weight.is_meta for m in members) or any(
                    (m.in_features, m.num_slots, m.r_max, m.lora_A.dtype, m.lora_A.device, m.weight.dtype)
                    != (first.in_features, first.num_slots, first.r_max, first.lora_A.dtype, first.lora_A.device,
                        first.weight.dtype)
                    for m in members):
                continue
            groups.append(ProjectionGroup(members))
    return groups


class RoutedLoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, num_slots: int, r_max: int, *, name: str = "",
                 block: int | None = None, device: torch.device | None = None) -> None:
        """`device`: where the slots live (default: the base weight's device; a layer that accelerate offloads has
        its weight on "meta" between calls and computes on its hook's execution device: pass that)."""
        nn.Module.__init__(self)  # skip nn.Linear.__init__: reuse the base Parameters, allocate nothing new
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.num_slots, self.r_max = num_slots, r_max
        self.name, self.block = name, block
        self.route_key: Any = block  # (block, device) once attach_routed_lora finds the model spread over devices
        w = base.weight
        kw = {"dtype": w.dtype, "device": w.device if device is None else device}
        self.register_buffer("lora_A", torch.zeros(num_slots, r_max, self.in_features, **kw), persistent=False)
        self.register_buffer("lora_B", torch.zeros(num_slots, self.out_features, r_max, **kw), persistent=False)
        self.register_buffer("lora_scale", torch.zeros(num_slots, **kw), persistent=False)
        self.group_index = 0
        self.group = ProjectionGroup([self])  # group_projections() may put it in a larger one

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slots={self.num_slots}, r_max={self.r_max}, block={self.block}"

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.lora_scale[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = current_routing()
        params = self._parameters  # (dict reads, not nn.Module.__getattr__: this runs on every routed call)
        if routing is None:
            return F.linear(x, params["weight"], params.get("bias"))  # (bias=False: a plain None attribute)
        group = self.group
        shared = routing.shared.get(group)
        if shared is not None and shared.x is x and shared.outputs[self.group_index] is not None:
            return shared.take(self.group_index, routing, group)  # a sibling's group call made this layer's output
        slots, weights = routing.kernel_slots(self.route_key)
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != slots.shape[0]:
            raise RoutingError(f"routed layer '{self.name}' got {x2.shape[0]} tokens but the routing covers "
                               f"{slots.shape[0]}; call the model through RoutedModel.forward with the same input_ids")
        # (the cheap flags first: this runs on every routed group call of an eager decode step)
        if not GROUP_OUTPUTS or x2.dtype != params["weight"].dtype or \
                torch.is_autocast_enabled("cuda" if x2.is_cuda else "cpu") or group.needs_autograd(x2, weights):
            return self._forward_add(x, x2, routing, slots, weights)
        if group.size == 1:
            return group.outputs(routing, self.route_key, x, x2, slots, weights)[0]
        index = self.group_index
        if shared is not None and shared.outputs[index] is not None and group.shares_input:
            # a sibling computed this layer's output from another input: these members do not share x
            group.shares_input = False
            log.info("routed layers %s are called on different inputs; computing their outputs separately",
                     [m.name for m in group.members])
        if not group.shares_input:
            return group.outputs(routing, self.route_key, x, x2, slots, weights, only=index)[0]
        outputs = list(group.outputs(routing, self.route_key, x, x2, slots, weights))
        mine, outputs[index] = outputs[index], None
        routing.shared[group] = SharedOutputs(x, outputs, group.size - 1)  # the siblings take theirs
        return mine

    def _forward_add(self, x: torch.Tensor, x2: torch.Tensor, routing: CallRouting, slots: torch.Tensor,
                     weights: torch.Tensor | None) -> torch.Tensor:
        """Base linear, then the delta added into it (autograd, autocast): the ops' checks and backward."""
        y = F.linear(x, self.weight, self.bias)
        meta = routing.meta(self.route_key) if reads_meta(x2, slots.shape[1], self.lora_A) else None
        out = y.view(-1, self.out_features)  # the kernels add the delta into the base output in place
        if weights is None:
            routed_lora(x2, self.lora_A, self.lora_B, slots[:, 0], self.lora_scale, out=out, meta=meta)
        else:
            routed_lora_topk(x2, self.lora_A, self.lora_B, slots, weights, self.lora_scale, out=out, meta=meta)
        return y


class PlacedRoutedLoRALinear(RoutedLoRALinear):
    """A routed layer on a CUDA device of a model spread over several: it runs with its own device current, since
    Triton launches its kernels on the current device, not on its arguments' (attach_routed_lora makes these only
    for spread models: a one-device model pays for no device switch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(self._buffers["lora_A"].device):
            return super().forward(x)
