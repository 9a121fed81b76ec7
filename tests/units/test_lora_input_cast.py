"""Whether LoRA inputs stay uncast under autocast is decided per device kind by what was measured there."""

import torch

from forge.model.lora import apply_lora
from forge.model.precision import as_master_weights, choose_precision


def _cpu_with(monkeypatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.delenv("FORGE_CPU_BF16", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)


def test_uncast_lora_inputs_where_measured_faster_only(monkeypatch):
    _cpu_with(monkeypatch, amx=True, avx512_bf16=True)
    amx = choose_precision("auto", "cpu")
    assert amx.compute == torch.bfloat16 and amx.uncast_lora_inputs and "0.87x" in amx.lora_inputs_reason
    _cpu_with(monkeypatch, amx=False, avx512_bf16=True)  # AMD EPYC with AVX512-BF16: measured faster and leaner
    epyc = choose_precision("auto", "cpu")
    assert epyc.compute == torch.bfloat16 and epyc.uncast_lora_inputs and "0.98x" in epyc.lora_inputs_reason
    _cpu_with(monkeypatch, amx=False, avx512_bf16=False)  # asked for bf16 without units: never measured
    emulated = choose_precision("bfloat16", "cpu")
    assert not emulated.uncast_lora_inputs and "not measured" in emulated.lora_inputs_reason
    assert not choose_precision("float32", "cpu").uncast_lora_inputs


def test_precision_autocast_leaves_peft_cast_on_where_uncast_is_off(monkeypatch, tiny_model):
    _cpu_with(monkeypatch, amx=False, avx512_bf16=False)  # bf16 asked for where nothing was measured
    precision = choose_precision("bfloat16", "cpu")
    model = as_master_weights(apply_lora(tiny_model, r=4, alpha=8), precision, lora=True)
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers
    with precision.autocast(model):
        assert all(m.cast_input_dtype_enabled for m in layers)
    _cpu_with(monkeypatch, amx=True, avx512_bf16=True)
    with choose_precision("auto", "cpu").autocast(model):
        assert not any(m.cast_input_dtype_enabled for m in layers)
    assert all(m.cast_input_dtype_enabled for m in layers)
