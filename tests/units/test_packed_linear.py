"""Linear layers on weights packed once per generation (forge/model/packed_linear.py): the same bits as F.linear
where packing is on (bf16 on a CPU with AMX or AVX512-BF16), and the layers as they were after the generation.

The packing logic (which layers, sibling products, restoring them) is tested with packing forced on, in bf16 where
oneDNN packs bf16 and in fp32 on a CPU where it does not (AVX2 only), so it is tested on every kind."""

import contextlib

import pytest
import torch
from torch import nn

from forge.core.rollout import SamplingSettings, generate
from forge.model import packed_linear
from forge.model.packed_linear import packed_linears, packing_applies

PACKED_HERE = packing_applies(torch.device("cpu"), torch.bfloat16)
PROMPTS = ["What is 2 + 3?", "Name a color:", "Count to five:"]


def packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (it needs AVX512 or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


FORCED = torch.bfloat16 if packs_bf16() else torch.float32  # the dtype the logic tests force packing in
OTHER = torch.float32 if FORCED == torch.bfloat16 else torch.bfloat16


def computing(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Layers of fp32 weights computing in `dtype`: bf16 under autocast, fp32 as they are."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast("cpu", dtype=dtype)


def assert_same_bits_where_packed(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-equal where packing applies; elsewhere it is not measured and the kernels may round differently."""
    if PACKED_HERE:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected)


def sampled_bf16(model, tokenizer):
    """4 sampled completions of each of PROMPTS under bf16 autocast, with fixed sampling noise."""
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0)
    noise = torch.rand(len(PROMPTS) * 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return generate(model, tokenizer, PROMPTS, 4, settings, noise=noise)


def test_layers_are_packed_only_without_grad_in_a_measured_dtype_and_restored_after(monkeypatch):
    monkeypatch.setattr(packed_linear, "packing_applies", lambda device, dtype: dtype == FORCED)
    layer = nn.Linear(8, 4)  # fp32 weight and bias: under bf16 autocast both are cast, once
    model = nn.Sequential(layer)
    rows = torch.randn(3, 2, 8)  # (n, L, in)
    with torch.no_grad(), computing(OTHER), packed_linears(model) as packed:
        assert not packed  # another compute dtype, nothing measured
    with computing(FORCED), packed_linears(model) as packed:
        assert not packed  # gradients on: training's forward is never packed
    with torch.no_grad(), computing(FORCED):
        expected = layer(rows)  # (3, 2, 4)
        with packed_linears(model) as packed:
            assert packed and "forward" in layer.__dict__
            got = layer(rows)
    assert "forward" not in layer.__dict__  # the class's forward again
    assert got.dtype == expected.dtype == FORCED and got.shape == (3, 2, 4)
    assert_same_bits_where_packed(got, expected)


@pytest.mark.skipif(not PACKED_HERE, reason="packing applies where it measured bit-equal: bf16 on AMX or AVX512-BF16 CPUs")
def test_generation_on_packed_weights_samples_the_same_tokens_and_logprobs(tiny_model, tiny_tokenizer, monkeypatch):
    tiny_model.eval()
    packed_calls = []
    real = packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward", lambda *a: packed_calls.append(1) or real(*a))
    packed = sampled_bf16(tiny_model, tiny_tokenizer)
    assert packed_calls  # the linear layers ran packed
    monkeypatch.setattr(packed_linear, "PACKED_LINEAR_MEASURED", {})
    plain = sampled_bf16(tiny_model, tiny_tokenizer)
    assert torch.equal(packed.completion_ids, plain.completion_ids)
    assert torch.equal(packed.sampler_logprobs, plain.sampler_logprobs)
    assert all("forward" not in m.__dict__ for m in tiny_model.modules())


class Block(nn.Module):
    """Llama-style siblings: q/k/v read one input, gate/up another; o reads its own."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16, bias=bias), nn.Linear(16, 8), nn.Linear(16, 8)
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x), self.gate_proj(x), self.up_proj(x), self.o_proj(x)]


@pytest.mark.parametrize("alpha", [None, 8, 6])  # no LoRA; scaling 2 (folded into B); scaling 1.5
def test_sibling_layers_run_as_one_product_with_each_layers_own_bits(monkeypatch, alpha):
    """q/k/v and gate/up (with or without a LoRA adapter each) as one packed product, and a lone LoRA layer with
    its A, give every layer's output of the layers packed one by one (the adapters through PEFT's layer); a call
    with other rows computes them again; the layers are restored."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(packed_linear, "packing_applies", lambda device, dtype: dtype == FORCED)
    torch.manual_seed(0)
    model = nn.Sequential(Block(bias=True))
    lora = alpha is not None
    if lora:
        config = LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "o_proj"],
                            init_lora_weights=False)
        model = get_peft_model(model, config).eval()
    block = next(m for m in model.modules() if isinstance(m, Block))
    rows, other = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    products = []
    real = packed_linear._Siblings._all
    monkeypatch.setattr(packed_linear._Siblings, "_all", lambda self, x: products.append(1) or real(self, x))
    with torch.no_grad(), computing(FORCED):
        monkeypatch.setattr(packed_linear, "FUSED", False)  # every layer packed on its own
        with packed_linears(model) as packed:
            assert packed
            expected, expected_other = block(rows), block(other)
        assert not products
        monkeypatch.setattr(packed_linear, "FUSED", True)
        with packed_linears(model) as packed:
            assert packed
            got = block(rows)
            assert len(products) == 2 + lora  # one product for q/k/v, one for gate/up (and one for o's LoRA)
            got_other = block(other)
            assert len(products) == 2 * (2 + lora)
    assert all("forward" not in m.__dict__ for m in model.modules())
    for a, b in zip(got + got_other, expected + expected_other):
        assert a.dtype == b.dtype == FORCED and a.shape == b.shape
        assert_same_bits_where_packed(a, b)


@pytest.mark.skipif(not PACKED_HERE, reason="packing applies where it measured bit-equal: bf16 on AMX or AVX512-BF16 CPUs")
def test_generation_with_sibling_products_samples_the_same_tokens_and_logprobs(tiny_model, tiny_tokenizer, monkeypatch):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_model, config).eval()
    products = []
    real = packed_linear._Siblings._all
    monkeypatch.setattr(packed_linear._Siblings, "_all", lambda self, x: products.append(1) or real(self, x))
    fused = sampled_bf16(model, tiny_tokenizer)
    assert products
    monkeypatch.setattr(packed_linear, "FUSED", False)
    per_layer = sampled_bf16(model, tiny_tokenizer)
    assert torch.equal(fused.completion_ids, per_layer.completion_ids)
    assert torch.equal(fused.sampler_logprobs, per_layer.sampler_logprobs)
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.skipif(FORCED != torch.bfloat16, reason="oneDNN packs no bf16 weight on this CPU (AVX2 only), so "
                    "no bf16 layer is ever packed here")
def test_fp32_adapters_on_a_bf16_base_keep_peft_s_own_way(monkeypatch):
    """Without autocast PEFT runs fp32 adapters of a bf16 layer in fp32: such layers are not put into one bf16
    product, and give the bits PEFT gives."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(packed_linear, "packing_applies", lambda device, dtype: dtype == torch.bfloat16)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    model = get_peft_model(nn.Sequential(Block()).to(torch.bfloat16), config).eval()  # adapters stay fp32
    block = next(m for m in model.modules() if isinstance(m, Block))
    assert block.q_proj.lora_A["default"].weight.dtype == torch.float32
    rows = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = block(rows)
        with packed_linears(model):
            got = block(rows)
            assert "forward" not in block.q_proj.__dict__ and "forward" not in block.o_proj.__dict__
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
