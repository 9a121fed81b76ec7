"""The decode's shared-prompt attention (forge/model/kv_cache.py) against torch's own attention over the
repeated cache, and the decode loop with it against the decode loop that repeats each prompt per row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge.core import rollout as rollout_module
from forge.core.rollout import SamplingSettings, generate
from forge.model import kv_cache
from forge.model.kv_cache import SharedPrefixLayer
from forge.model.decode_plan import DecodePlan


def reference_attention(
    query, prompt_keys, prompt_values, prompt_mask, own_keys, own_values, rows, group_size
):
    """torch's scaled_dot_product_attention over [the row's prompt, repeated | its own tokens], GQA heads repeated."""
    groups = rows // group_size  # (n,)
    keys = torch.cat([prompt_keys[groups], own_keys], dim=2)  # (n, H_kv, Lp + t, D)
    values = torch.cat([prompt_values[groups], own_values], dim=2)
    repeat = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)  # (n, H, L, D)
    allowed = torch.cat(
        [prompt_mask[groups].bool(), torch.ones(len(rows), own_keys.shape[2], dtype=torch.bool)], 1
    )
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=allowed[:, None, None, :]
    )  # (n, H, 1, D)
    return out.transpose(1, 2)  # (n, 1, H, D)


@pytest.mark.parametrize("leaving", [False, True])
def test_attend_equals_attention_over_the_repeated_prompt(leaving):
    torch.manual_seed(0)
    prompts, group, kv_heads, heads, length, dim, own = 3, 4, 2, 6, 7, 16, 5
    keys, values = torch.randn(prompts, kv_heads, length, dim), torch.randn(prompts, kv_heads, length, dim)
    prompt_mask = torch.ones(prompts, length, dtype=torch.long)
    prompt_mask[1, :3] = 0  # left padding
    prompt_mask[2, :1] = 0
    layer = SharedPrefixLayer(keys, values, prompt_mask, group, capacity=own + 1)
    own_keys, own_values = (
        torch.randn(prompts * group, kv_heads, own, dim),
        torch.randn(prompts * group, kv_heads, own, dim),
    )
    for t in range(own):
        layer.update(own_keys[:, :, t : t + 1], own_values[:, :, t : t + 1])
    rows = torch.arange(prompts * group)
    if leaving:  # rows 1, 4..7 (all of group 1) and 10 finished
        keep = torch.tensor([0, 2, 3, 8, 9, 11])
        layer.batch_select_indices(keep)
        rows, own_keys, own_values = rows[keep], own_keys[keep], own_values[keep]
    query = torch.randn(len(rows), heads, 1, dim)
    expected = reference_attention(query, keys, values, prompt_mask, own_keys, own_values, rows, group)
    got = layer.attend(query, dim**-0.5)
    assert got.shape == expected.shape == (len(rows), 1, heads, dim)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_attend_in_bf16_rounds_fp32_attention_once():
    torch.manual_seed(1)
    keys, values = torch.randn(2, 1, 9, 8).bfloat16(), torch.randn(2, 1, 9, 8).bfloat16()
    layer = SharedPrefixLayer(keys, values, torch.ones(2, 9, dtype=torch.long), 2, capacity=2)
    own_k, own_v = torch.randn(4, 1, 1, 8).bfloat16(), torch.randn(4, 1, 1, 8).bfloat16()
    layer.update(own_k, own_v)
    query = torch.randn(4, 2, 1, 8).bfloat16()
    expected = reference_attention(
        query.float(),
        keys.float(),
        values.float(),
        torch.ones(2, 9),
        own_k.float(),
        own_v.float(),
        torch.arange(4),
        2,
    ).bfloat16()
    got = layer.attend(query, 8**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2**-7)


def counting_attend(monkeypatch) -> list:
    calls = []
    attend = SharedPrefixLayer.attend

    def counted(self, query, scaling):
        calls.append(query.shape[0])
        return attend(self, query, scaling)

    monkeypatch.setattr(SharedPrefixLayer, "attend", counted)
    return calls


PROMPTS = ["12 + 7 =", "a much longer prompt about 3 * 4 and 5", "hi", "3 - 1 ="]
REPEATED = DecodePlan("eager")  # each row its own copy of its prompt


@pytest.mark.parametrize("do_sample", [False, True])
def test_decode_with_the_shared_prompt_equals_the_repeated_prompt(
    tiny_model, tiny_tokenizer, monkeypatch, do_sample
):
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0, do_sample=do_sample)
    noise = torch.rand(len(PROMPTS) * 3, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    calls = counting_attend(monkeypatch)
    shared = generate(tiny_model, tiny_tokenizer, PROMPTS, 3, settings, noise=noise)
    assert calls and calls[0] == len(PROMPTS) * 3  # every decode step attended over the shared prompts
    assert tiny_model.config._attn_implementation != kv_cache.NAME  # the model's attention is given back
    repeated = generate(tiny_model, tiny_tokenizer, PROMPTS, 3, settings, noise=noise, plan=REPEATED)
    assert torch.equal(shared.completion_ids, repeated.completion_ids)
    assert torch.equal(shared.completion_mask, repeated.completion_mask)
    torch.testing.assert_close(shared.sampler_logprobs, repeated.sampler_logprobs, atol=1e-5, rtol=0)


def test_rows_leaving_the_batch_keep_their_groups(tiny_model, tiny_tokenizer, monkeypatch):
    """Greedy decoding with an early stop token: rows finish at different steps and the rest still match."""
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0, do_sample=True)
    noise = torch.rand(len(PROMPTS) * 4, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    eos = tiny_tokenizer.eos_token_id
    monkeypatch.setattr(rollout_module, "eos_ids", lambda tokenizer, model=None: [eos, 7, 11, 19, 23])
    calls = counting_attend(monkeypatch)
    shared = generate(tiny_model, tiny_tokenizer, PROMPTS, 4, settings, noise=noise)
    assert len(set(calls)) > 1  # rows left the batch while decoding
    repeated = generate(tiny_model, tiny_tokenizer, PROMPTS, 4, settings, noise=noise, plan=REPEATED)
    assert torch.equal(shared.completion_ids, repeated.completion_ids)
    torch.testing.assert_close(shared.sampler_logprobs, repeated.sampler_logprobs, atol=1e-5, rtol=0)


def test_soft_capped_attention_decodes_on_the_repeated_prompt(tiny_model, tiny_tokenizer, monkeypatch):
    calls = counting_attend(monkeypatch)
    monkeypatch.setattr(tiny_model.config, "attn_logit_softcapping", 50.0, raising=False)
    generate(tiny_model, tiny_tokenizer, PROMPTS[:2], 2, SamplingSettings(max_new_tokens=4, do_sample=False))
    assert calls == []
