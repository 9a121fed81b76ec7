"""Linear layers whose weights are packed once per generation for the CPU's bf16 matrix kernels
(`packed_linears`).

In bf16 on a CPU, torch.nn.functional.linear hands every call to oneDNN, which first reorders the weight into
the blocked layout its AMX kernel reads, at every call: in a decode step of SmolLM2-135M (32 rows) that
reorder is about a third of each linear layer's time. Inside `packed_linears(model)` every linear layer's
weight is reordered once (torch.ops.mkldnn._reorder_linear_weight, as inductor does for a frozen graph) and
the layer multiplies with it (torch.ops.mkldnn._linear_pointwise): the same kernel on the same bf16 values, so
the same bits (tests/units/test_packed_linear.py), in ~0.65x the time of the unpacked call. On exit the layers
are as they were.

Layers one module calls on the same input (q/k/v, gate/up: SIBLINGS) run as one product over their stacked
weights and LoRA A matrices, and every other LoRA layer as one product of its weight and A, so a decode step
makes about half the calls and none through PEFT's wrapper; each layer's columns are its own bits.

For generation only (no gradients): the packed copies are taken from the weights as they are on entry (merged
adapters included) and cost one more copy of the linear weights while inside. Applied where it measured faster
and bit-equal (PACKED_LINEAR_MEASURED, keyed like the other per-CPU choices of forge/model/precision.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from forge.model.precision import _bf16_units

# Where packing measured faster with the same bits: (device type, compute dtype, what runs bf16) -> the
# measurement.
# Unmeasured kinds run linear layers as torch does; bench/packed_linear.py measures a new kind.
PACKED_LINEAR_MEASURED: dict[tuple[str, torch.dtype, str], str] = {
    ("cpu", torch.bfloat16, "AMX tiles"): (
        "bit-equal, 0.65x the time of F.linear for the decode step's layers (SmolLM2-135M, 32 rows, "
        "AMX Xeon)"),
    ("cpu", torch.bfloat16, "AVX512-BF16"): (
        "bit-equal, 0.72-0.82x the CPU time of F.linear for the decode step's layers at 32 rows, "
        "0.59-0.76x at 8 (SmolLM2-135M shapes, AVX512-BF16 AMD EPYC; bench/packed_linear.py)"),
}
# fp32 is not applied: oneDNN's fp32 kernel sums in another order than F.linear's (MKL), so packing would
# change the sampler's bits. Measured: the AVX512-BF16 EPYC 0.35-0.88x the time per layer; the AVX2-only EPYC
# 0.85-1.38x per layer and 0.57-0.68x for the output layer, the demo's generation 1.09x the tokens per
# CPU-second (bench/packed_generation.py; its sampler/trainer gap 2.6e-6 against 1.5e-6 unpacked, the same
# tokens). bf16 on an AVX2-only CPU: oneDNN refuses to pack it (it needs AVX512 or AVX-NE-CONVERT).


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers computing in `dtype` on `device` are packed (PACKED_LINEAR_MEASURED)."""
    measured_here = any(kind[:2] == (device.type, dtype) for kind in PACKED_LINEAR_MEASURED)
    if not measured_here or not torch.backends.mkldnn.is_available():
        return False
    return (device.type, dtype, _bf16_units()) in PACKED_LINEAR_MEASURED


def may_pack(model: nn.Module) -> bool:
    """Whether any of the model's layers can be packed, decided before looking at each: some compute dtype of
    its layers on a CPU (autocast's when it is on, else its weights') is one PACKED_LINEAR_MEASURED holds."""
    if torch.is_autocast_enabled("cpu"):
        return packing_applies(torch.device("cpu"), torch.get_autocast_dtype("cpu"))
    return any(packing_applies(torch.device("cpu"), dtype) for dtype in {p.dtype for p in model.parameters()})


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer multiplies in: autocast's when it is on, else its weight's."""
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and "forward" not in module.__dict__  # no hook wrapping its forward
            and type(weight) in (torch.Tensor, nn.Parameter) and type(weight.data) is torch.Tensor
            and not weight.is_meta and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16))


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, rows: torch.Tensor):
    """(..., in) -> (..., out) in `dtype`, as F.linear computes it under autocast to `dtype` (or in
    `dtype`)."""
    if rows.is_floating_point() and rows.dtype != dtype:
        rows = rows.to(dtype)  # what autocast does to the input
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [None], "")


def _packed(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight (out, in) cast to `dtype` as autocast casts it, once, in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), 32)


# Layers that one module calls on the same input one after the other (Llama-style attention and MLP). Inside
# packed_linears they run as one product over their stacked weights and their LoRA A matrices; each layer's
# columns of it are the bits of its own product (tests/units/test_packed_linear.py), with one call instead of
# up to six and no adapter wrapper per layer.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# False: every layer packed on its own, adapters through PEFT's layer (bench/decode_switch.py fused)
FUSED = True


class _Parts(NamedTuple):
    base: nn.Linear  # the layer's own weight (a LoRA layer's base layer)
    lora: tuple[nn.Linear, nn.Linear, float] | None  # (lora_A, lora_B, scaling) of its active adapter


def _parts(layer: nn.Module) -> _Parts | None:
    """A plain nn.Linear, or a PEFT LoRA Linear with at most one plain adapter switched on (no DoRA or other
    variant, no dropout at work), as its parts; None for anything else."""
    if _packable(layer):
        return _Parts(layer, None)
    if type(layer).__name__ != "Linear" or not type(layer).__module__.startswith("peft.tuners.lora"):
        return None
    if "forward" in layer.__dict__ or not _packable(layer.base_layer):
        return None
    if layer.merged or layer.disable_adapters:
        return _Parts(layer.base_layer, None)
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if not active:
        return _Parts(layer.base_layer, None)
    name = active[0]
    dropout = layer.lora_dropout[name]
    plain = (len(active) == 1 and name not in layer.lora_variant and _packable(layer.lora_A[name])
             and _packable(layer.lora_B[name]) and (isinstance(dropout, nn.Identity) or not dropout.training))
    if not plain:
        return None
    return _Parts(layer.base_layer, (layer.lora_A[name], layer.lora_B[name], layer.scaling[name]))


class _Siblings:
    """Sibling layers (SIBLINGS) on one packed product: the first of them called with some rows computes every
    sibling's output, and each then takes its own (a call with other rows computes them again)."""

    def __init__(self, layers: list[nn.Module], parts: list[_Parts], dtype: torch.dtype):
        self.layers, self.dtype = layers, dtype
        adapted = [p.lora for p in parts if p.lora is not None]
        self.widths = [p.base.out_features for p in parts] + [a.out_features for a, _, _ in adapted]
        stacked = torch.cat([p.base.weight for p in parts] + [a.weight for a, _, _ in adapted])  # (sum, in)
        self.weight = _packed(stacked, dtype)
        biases = [torch.zeros(width, dtype=dtype) for width in self.widths]  # the A rows have none
        for i, p in enumerate(parts):
            biases[i] = biases[i] if p.base.bias is None else p.base.bias.detach().to(dtype)
        self.bias = torch.cat(biases) if any(p.base.bias is not None for p in parts) else None
        self.lora = [None if p.lora is None else _scaled_b(p.lora[1].weight, p.lora[2], dtype) for p in parts]
        self.rows, self.outputs = None, {}

    def forward(self, index: int, rows: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:  # e.g. PEFT's adapter_names: the layer's own forward
            layer = self.layers[index]
            return type(layer).forward(layer, rows, *args, **kwargs)
        if self.rows is not rows or index not in self.outputs:
            self.rows, self.outputs = rows, self._all(rows)
        out = self.outputs.pop(index)
        if not self.outputs:
            self.rows = None  # every sibling has its output: let go of the rows
        return out

    def _all(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        product = _packed_forward(self.weight, self.bias, self.dtype, rows)  # (..., sum of widths)
        columns = product.split(self.widths, dim=-1)
        outputs, adapted = {}, iter(columns[len(self.layers):])
        for i, lora in enumerate(self.lora):
            if lora is None:
                outputs[i] = columns[i].contiguous()  # as the layer's own product lays it out
                continue
            weight_b, scaling = lora  # PEFT's result + lora_B(lora_A(x)) * scaling, in the compute dtype
            update = _packed_forward(weight_b, None, self.dtype, next(adapted).contiguous())
            outputs[i] = columns[i] + (update if scaling == 1 else update * scaling)  # a new, dense tensor
        return outputs


def _scaled_b(weight: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(packed B, the scaling still to multiply by). A scaling of 1, 2, 4, ... goes into B, cast to `dtype`
    first: a power of two >= 1 scales every product, sum and rounding exactly, so (s B) x is (B x) s to the
    bit, one multiplication fewer per layer."""
    mantissa, _ = math.frexp(scaling)
    if scaling >= 1 and mantissa == 0.5:
        return _packed(weight.detach().to(dtype) * scaling, dtype), 1.0
    return _packed(weight, dtype), scaling


def _sibling_groups(model: nn.Module) -> list[tuple[list[nn.Module], list[_Parts], torch.dtype]]:
    """The groups of `model`'s layers that run as one packed product each: its SIBLINGS, and every other plain
    LoRA layer on its own (its weight and A in one product: no adapter wrapper); every layer plain or plain
    LoRA, all in one compute dtype that packing applies to."""
    if not FUSED:
        return []
    candidates = [[getattr(module, name, None) for name in names] for module in model.modules()
                  for names in SIBLINGS]
    candidates += [[m] for m in model.modules() if not _packable(m) and getattr(_parts(m), "lora", None)]
    groups, taken = [], set()
    for layers in candidates:
        parts = [None if layer is None or id(layer) in taken else _parts(layer) for layer in layers]
        if any(p is None for p in parts):
            continue
        weights = [w for p in parts for w in (p.base.weight, *((p.lora[0].weight, p.lora[1].weight) if p.lora
                                                                else ()))]
        dtypes = {_compute_dtype(weight) for weight in weights}  # fp32 adapters on a bf16 base: PEFT's way
        dtype = dtypes.pop()
        if not dtypes and packing_applies(parts[0].base.weight.device, dtype):
            groups.append((layers, parts, dtype))
            taken.update(id(layer) for layer in layers)
    return groups


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Run `model`'s nn.Linear layers on weights packed once for oneDNN (no-grad use: generation), sibling
    layers (SIBLINGS) as one product. Yields whether it packed: only the layers whose device and compute dtype
    PACKED_LINEAR_MEASURED holds, with gradients off."""
    layers, groups = [], []
    if enabled and not torch.is_grad_enabled() and may_pack(model):
        groups = _sibling_groups(model)
        grouped = {id(m) for _, parts, _ in groups for p in parts
                   for m in (p.base, *((p.lora[0], p.lora[1]) if p.lora else ()))}
        layers = [m for m in model.modules() if _packable(m) and id(m) not in grouped
                  and packing_applies(m.weight.device, _compute_dtype(m.weight))]
    wrapped = []
    try:
        for m in layers:
            dtype = _compute_dtype(m.weight)
            packed = _packed(m.weight, dtype)  # (out, in), oneDNN's blocked layout
            bias = None if m.bias is None else m.bias.detach().to(dtype)
            m.forward = lambda rows, w=packed, b=bias, d=dtype: _packed_forward(w, b, d, rows)
        for siblings, parts, dtype in groups:
            run = _Siblings(siblings, parts, dtype)
            for i, m in enumerate(siblings):
                m.forward = partial(run.forward, i)
                wrapped.append(m)
        yield bool(layers or groups)
    finally:
        for m in layers + wrapped:
            m.__dict__.pop("forward", None)
