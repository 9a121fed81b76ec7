"""Linear layers whose weights are packed once per generation for the CPU's bf16 matrix kernels
(`packed_linears`).

In bf16 on a CPU, torch.nn.functional.linear hands every call to oneDNN, which first reorders the weight into
the blocked layout its AMX kernel reads, at every call: in a decode step of SmolLM2-135M (32 rows) that
reorder is about a third of each linear layer's time. Inside `packed_linears(model)` every linear layer's
weight is reordered once (torch.ops.mkldnn._reorder_linear_weight, as inductor does for a frozen graph) and
the layer multiplies with it (torch.ops.mkldnn._linear_pointwise): the same kernel on the same bf16 values, so
the same bits (tests/units/test_packed_linear.py), in ~0.65x the time of the unpacked call. On exit the layers
are as they were.

For generation only (no gradients): the packed copies are taken from the weights as they are on entry (merged
adapters included) and cost one more copy of the linear weights while inside. Applied where it measured faster
and bit-equal (PACKED_LINEAR_MEASURED, keyed like the other per-CPU choices of forge/model/precision.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
# fp32 (measured on the AVX512-BF16 EPYC): 0.35-0.88x the time, but oneDNN's fp32 kernel sums in another order
# than F.linear's, so the bits differ from the loss pass's; not applied.


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


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Run `model`'s nn.Linear layers on weights packed once for oneDNN (no-grad use: generation). Yields
    whether it packed: only the layers whose device and compute dtype PACKED_LINEAR_MEASURED holds, with
    gradients off."""
    layers = []
    if enabled and not torch.is_grad_enabled() and may_pack(model):
        layers = [m for m in model.modules() if _packable(m) and packing_applies(m.weight.device,
                                                                                 _compute_dtype(m.weight))]
    try:
        for m in layers:
            dtype = _compute_dtype(m.weight)
            weight = m.weight.detach().to(dtype)  # autocast's cast of an fp32 weight, once
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)  # (out, in), oneDNN's blocked layout
            bias = None if m.bias is None else m.bias.detach().to(dtype)
            m.forward = lambda rows, w=packed, b=bias, d=dtype: _packed_forward(w, b, d, rows)
        yield bool(layers)
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
