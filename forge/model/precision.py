"""Compute precision: bf16/fp16 autocast over float32 master weights, and where bf16 is fast (GPU, CPU units).

One place decides the dtype of a run: `choose_precision`. Everything else asks it.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from forge.logging.logger import note

# --------------------------------------------------------------------------------------------------
# devices and dtypes
# --------------------------------------------------------------------------------------------------


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None means "cuda" when a GPU is visible, else "cpu"."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """Resolve "auto": float32 on CPU, bfloat16 on a GPU that supports it, float16 on an older GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'")
        return resolved
    device = resolve_device(device)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def cpu_has_bf16_units() -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX-BF16 tiles or AVX512-BF16), and its name.

    Without them (e.g. AVX2-only CPUs) bf16 matmuls are emulated and run 10-25x slower than fp32; with them
    they run several times faster (docs/performance.md: what was measured where). The environment variable
    FORGE_CPU_BF16=0 (or 1) overrides the detection, e.g. to keep `dtype="auto"` at fp32 on every machine of a
    cluster, or of a test suite whose tolerances are fp32's."""
    forced = os.environ.get("FORGE_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"FORGE_CPU_BF16={forced} is set"
    if forced:
        raise ValueError(f"FORGE_CPU_BF16={forced!r}: set it to 0 (treat the CPU as having no bf16 units) or "
                         f"1, or unset it to detect them")
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    if amx:
        return True, "AMX tiles"
    if avx512_bf16:
        return True, "AVX512-BF16"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return False, f"its best vector unit is {capability}"


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This CPU as figures name it: its model name with its family and model numbers, which tell apart CPUs a
    virtual machine shows under one generic name ("AMD EPYC" is family 25 on Zen 4, 26 on Zen 5)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        for line in f:
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's fields only
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


@dataclass(frozen=True)
class Precision:
    """How a run computes. Trainable weights (and AdamW's moments) are always float32 "master" weights;
    `compute` is the dtype of the forward and backward passes and of generation, under torch.autocast when it
    is not float32. Frozen weights (the LoRA base, the full-fine-tuning reference) may be stored in
    `compute`."""

    compute: torch.dtype
    device_type: str  # "cpu" or "cuda"
    reason: str  # why, for the log
    uncast_lora_inputs: bool = False  # `lora_inputs_uncast` under autocast: where it measured faster
    lora_inputs_reason: str = "PEFT casts LoRA inputs to the adapters' dtype (its own behaviour)"

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32

    def autocast(self, model: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """torch.autocast to `compute` (nothing in float32). With `model`, and where it measured faster on
        this device kind (`uncast_lora_inputs`), its LoRA layers also keep their input in the compute
        dtype."""
        if not self.mixed:
            return contextlib.nullcontext()
        return _autocast(self.device_type, self.compute, model if self.uncast_lora_inputs else None)

    def reusable_autocast(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """`autocast(model)` as one object a trainer builds once and enters at each loss pass, one use after
        another (never nested in itself): nothing in float32, a torch.autocast in mixed precision (which
        saves the autocast state it replaces on each entry and restores it on exit), with `model`'s LoRA
        inputs uncast where that measured faster."""
        if not self.mixed:
            return contextlib.nullcontext()
        if not self.uncast_lora_inputs:
            return torch.autocast(self.device_type, dtype=self.compute)
        return _ReusableAutocast(self.device_type, self.compute, model)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype, model: nn.Module | None) -> Iterator[None]:
    with torch.autocast(device_type, dtype=dtype), lora_inputs_uncast(model):
        yield


class _ReusableAutocast:
    """torch.autocast and `lora_inputs_uncast(model)`, entered anew at each use
    (`Precision.reusable_autocast`)."""

    def __init__(self, device_type: str, dtype: torch.dtype, model: nn.Module):
        self.device_type, self.dtype, self.model = device_type, dtype, model
        self._open: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        self._open.append(_autocast(self.device_type, self.dtype, self.model))
        self._open[-1].__enter__()

    def __exit__(self, *exc_info) -> bool | None:
        return self._open.pop().__exit__(*exc_info)


# `lora_inputs_uncast` changes no bit, only the time: on where it measured faster than PEFT's own cast, off
# elsewhere (unmeasured kinds keep PEFT's behaviour). Keyed by (device type, compute dtype, what gives bf16
# its speed); each entry: (on?, the measurement). `python bench/precision.py` measures a new kind (its
# lora_inputs_uncast time ratio; on when below 1).
LORA_INPUTS_UNCAST_MEASURED: dict[tuple[str, torch.dtype, str], tuple[bool, str]] = {
    ("cpu", torch.bfloat16, "AMX tiles"): (
        True, ("0.87x the time of PEFT's cast on an AMX Xeon (SmolLM2-135M LoRA forward+backward, "
               "bench/precision.py)")),
    ("cpu", torch.bfloat16, "AVX512-BF16"): (
        True, ("0.98x the time of PEFT's cast on an AVX512-BF16 AMD EPYC (SmolLM2-135M LoRA "
               "forward+backward, bench/precision.py), and 0.80-0.87x the loss pass's peak memory (no fp32 "
               "copy of each adapted layer's input is kept for backward)")),
}


def choose_lora_input_cast(compute: torch.dtype, device_type: str, units: str) -> tuple[bool, str]:
    """(uncast LoRA inputs?, why): from LORA_INPUTS_UNCAST_MEASURED for this (device, dtype, bf16 units); off
    where nothing was measured."""
    if compute == torch.float32:
        return False, "float32 compute: nothing to cast"
    measured = LORA_INPUTS_UNCAST_MEASURED.get((device_type, compute, units))
    if measured is None:
        return False, (f"LoRA inputs cast as PEFT does: lora_inputs_uncast is not measured on {device_type} "
                       f"{str(compute).removeprefix('torch.')} ({units}); bench/precision.py measures it")
    on, what = measured
    return on, f"lora_inputs_uncast {'on' if on else 'off'}: {what}"


@contextlib.contextmanager
def lora_inputs_uncast(model: nn.Module | None) -> Iterator[None]:
    """Under autocast: stop PEFT's plain LoRA layers from casting their input to the adapters' float32.

    PEFT casts x to lora_A's dtype before B(A(x)); under autocast the matmul casts it straight back to the
    compute dtype, so that round trip (bf16 -> fp32 -> bf16 is exact) changes no bit of the output or the
    gradients, but costs two copies of every adapted layer's input per forward and two more in backward, and
    keeps the fp32 copy for backward: without it a bf16 LoRA forward + backward takes 0.87x the time on an AMX
    Xeon and 0.98x on an AVX512-BF16 AMD EPYC (SmolLM2-135M, 8 x 160 tokens; `python bench/precision.py`), and
    the demo's loss pass 0.80-0.87x the peak memory; `Precision.autocast` applies it where it measured faster
    (LORA_INPUTS_UNCAST_MEASURED). Only plain LoRA on linear layers (no DoRA or other variant, which compute
    more from x); restored on exit."""
    if model is None:
        yield
        return
    from peft.tuners.lora.layer import Linear as LoraLinear

    layers = [m for m in model.modules() if isinstance(m, LoraLinear) and not m.lora_variant
              and getattr(m, "cast_input_dtype_enabled", True)]
    for m in layers:
        m.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.cast_input_dtype_enabled = True


def choose_precision(dtype: str = "auto", device: str | torch.device | None = None) -> Precision:
    """dtype 'float32' / 'bfloat16' / 'float16' as given; 'auto' = bf16 where the hardware runs it fast (a GPU
    that supports it, a CPU with bf16 matrix units), fp32 elsewhere. Whether LoRA inputs stay uncast under
    autocast is decided with it (`choose_lora_input_cast`)."""
    device = resolve_device(device)
    units = "GPU" if device.type == "cuda" else _bf16_units()
    if dtype != "auto":
        compute, reason = resolve_dtype(dtype, device), f"dtype={dtype!r} was asked for"
    elif device.type == "cuda":
        compute, reason = ((torch.bfloat16, "the GPU supports bf16") if torch.cuda.is_bf16_supported() else (
            torch.float32, ("the GPU has no bf16; dtype='float16' (with loss scaling) is faster there but "
                           "must be asked for")))
    else:
        fast, what = cpu_has_bf16_units()
        compute, reason = ((torch.bfloat16, f"the CPU has bf16 matrix units ({what})") if fast else (
            torch.float32, f"the CPU has no bf16 matrix units ({what}): bf16 would be slower"))
    return Precision(compute, device.type, reason, *choose_lora_input_cast(compute, device.type, units))


def _bf16_units() -> str:
    """What runs bf16 matmuls on this CPU, as cpu_has_bf16_units names it (its detection, not the
    override)."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX tiles"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return "no bf16 units"


def as_master_weights(model: nn.Module, precision: Precision, lora: bool) -> nn.Module:
    """Trainable weights in float32, whatever dtype the model came in. Full fine-tuning of a bf16/fp16 model:
    the whole model becomes float32 (updates below 1/256 of a weight would round away in bf16), with a note.
    LoRA: the frozen base stays as it is (or is stored in the compute dtype), the adapters become float32."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    low = sorted({str(p.dtype).removeprefix("torch.") for p in trainable if p.dtype != torch.float32})
    if not lora:
        if low:
            note(f"the model's weights are {', '.join(low)}: training float32 master weights (computing in "
                  f"{str(precision.compute).removeprefix('torch.')}); bf16 weights would lose updates below "
                  f"1/256 of a weight")
        return model.float() if low else model
    if precision.mixed:  # the frozen base in the compute dtype: half the memory, no re-cast per forward
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(precision.compute)
    for p in trainable:
        p.data = p.data.float()
    return model

