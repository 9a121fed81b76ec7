"""Linear layers on weights packed once per generation (forge/model/packed_linear.py): the same bits as F.linear
where packing is on (bf16 on a CPU with AMX or AVX512-BF16), and the layers as they were after the generation."""

import pytest
import torch
from torch import nn

from forge.core.rollout import SamplingSettings, generate
from forge.model import packed_linear
from forge.model.packed_linear import packed_linears, packing_applies

PACKED_HERE = packing_applies(torch.device("cpu"), torch.bfloat16)


def test_layers_are_packed_only_without_grad_in_a_measured_dtype_and_restored_after(monkeypatch):
    monkeypatch.setattr(packed_linear, "packing_applies", lambda device, dtype: dtype == torch.bfloat16)
    layer = nn.Linear(8, 4)  # fp32 weight and bias: under bf16 autocast both are cast, once
    model = nn.Sequential(layer)
    rows = torch.randn(3, 2, 8)  # (n, L, in)
    with torch.no_grad(), packed_linears(model) as packed:
        assert not packed  # fp32 compute, nothing measured
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model) as packed:
        assert not packed  # gradients on: training's forward is never packed
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(rows)  # (3, 2, 4) bf16
        with packed_linears(model) as packed:
            assert packed and "forward" in layer.__dict__
            got = layer(rows)
    assert "forward" not in layer.__dict__  # the class's forward again
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == (3, 2, 4)
    if PACKED_HERE:
        assert torch.equal(got, expected)
    else:  # packing is not measured here: the kernels may round differently
        torch.testing.assert_close(got, expected)


@pytest.mark.skipif(not PACKED_HERE, reason="packing applies where it measured bit-equal: bf16 on AMX or AVX512-BF16 CPUs")
def test_generation_on_packed_weights_samples_the_same_tokens_and_logprobs(tiny_model, tiny_tokenizer, monkeypatch):
    tiny_model.eval()
    prompts = ["What is 2 + 3?", "Name a color:", "Count to five:"]
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0)
    noise = torch.rand(len(prompts) * 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    packed_calls = []
    real = packed_linear._packed_forward
    monkeypatch.setattr(packed_linear, "_packed_forward", lambda *a: packed_calls.append(1) or real(*a))

    def rollout():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate(tiny_model, tiny_tokenizer, prompts, 4, settings, noise=noise)

    packed = rollout()
    assert packed_calls  # the linear layers ran packed
    monkeypatch.setattr(packed_linear, "PACKED_LINEAR_MEASURED", {})
    plain = rollout()
    assert torch.equal(packed.completion_ids, plain.completion_ids)
    assert torch.equal(packed.sampler_logprobs, plain.sampler_logprobs)
    assert all("forward" not in m.__dict__ for m in tiny_model.modules())
