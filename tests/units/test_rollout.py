"""Batched generation and completion log-probs on the tiny offline model.

The reference for every fast path is the obvious slow one: one prompt at a time, no padding, no cache,
the whole sequence through plain model(...).
"""

import math

import pytest
import torch
from completion_masks import completion_mask_from_ids
from peft import LoraConfig, get_peft_model

from forge.core.logprobs import completion_logprobs
from forge.core.rollout import (
    SamplingSettings,
    eos_ids,
    generate,
    sample_next_token,
    tokenize_prompts,
)
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

PAD, EOS = 0, 2  # the tiny tokenizer: <pad> = 0, <s> = 1, </s> = 2
GREEDY = SamplingSettings(max_new_tokens=6, do_sample=False)

# Token counts under the tiny tokenizer (no BOS is added): 9, 6, 5, 4 and 2 tokens. The seed-0 tiny model
# answers PROMPT_5 with EOS straight away, and none of the others within 8 greedy tokens.
PROMPT_9, PROMPT_6, PROMPT_5, PROMPT_4, PROMPT_2 = "What is 12 + 7?", "3 times 4", "the total", "Answer: 19", "yes"


class EosAtPosition(torch.nn.Module):
    """Wraps a causal LM so that the token following absolute position `position` is EOS.

    A completion of a prompt of L tokens puts completion token j at position L + j, predicted by the
    logits at position L + j - 1, so EOS lands at completion index j = position + 1 - L: prompts of
    different lengths stop at different steps, which exercises dropping finished rows.
    """

    def __init__(self, model, eos_id, position):
        super().__init__()
        self.model, self.eos_id, self.position = model, eos_id, position
        self.generation_config = model.generation_config

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        out = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        positions = position_ids[:, -out.logits.shape[1]:]  # (n, k) positions of the kept logits
        out.logits[..., self.eos_id] += (positions == self.position).to(out.logits.dtype) * 1e4
        return out


@torch.no_grad()
def reference_greedy(model, prompt_ids, max_new_tokens, eos_id):
    """One unpadded prompt, the full sequence through the model at every step, no cache."""
    ids = list(prompt_ids)
    completion = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits
        token = int(logits[0, -1].argmax())
        completion.append(token)
        ids.append(token)
        if token == eos_id:
            break
    return completion


def reference_logprobs(model, prompt, completion, temperature=1.0):
    """log_softmax of plain model(prompt + completion) logits, for one unpadded row, (T,)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature  # (T, V)
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def real_prompt(rollout, row):
    """The unpadded prompt of completion `row`."""
    p = int(rollout.prompt_index[row])
    return rollout.prompt_ids[p][rollout.prompt_mask[p].bool()].tolist()


# ----------------------------------------------------------------------------------------------------
# Prompts


def test_tokenize_prompts_left_pads(tiny_tokenizer):
    ids, mask = tokenize_prompts(tiny_tokenizer, [PROMPT_5, PROMPT_2], max_prompt_length=100)
    five, two = tiny_tokenizer(PROMPT_5)["input_ids"], tiny_tokenizer(PROMPT_2)["input_ids"]
    assert ids.tolist() == [five, [PAD, PAD, PAD] + two]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_over_long_prompt_names_max_prompt_length(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"prompt 1 has 9 tokens, over max_prompt_length=4") as error:
        tokenize_prompts(tiny_tokenizer, [PROMPT_2, PROMPT_9], max_prompt_length=4)
    assert "truncate_prompts='left'" in str(error.value)  # says what to do


def test_truncate_left_keeps_the_last_tokens(tiny_tokenizer):
    full = tiny_tokenizer(PROMPT_9)["input_ids"]
    ids, mask = tokenize_prompts(tiny_tokenizer, [PROMPT_9, PROMPT_2], max_prompt_length=4, truncate="left")
    assert ids.tolist() == [full[-4:], [PAD, PAD] + tiny_tokenizer(PROMPT_2)["input_ids"]]
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]


def test_chat_prompt_without_template_is_a_clear_error():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tokenize_prompts(tokenizer, [[{"role": "user", "content": "hi"}]], max_prompt_length=100)


def test_empty_prompt_is_an_error(tiny_tokenizer):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        tokenize_prompts(tiny_tokenizer, [PROMPT_2, ""], max_prompt_length=100)


def test_chat_prompts_use_the_template(tiny_tokenizer):
    short = [{"role": "user", "content": "yes"}]
    long = [{"role": "system", "content": "Solve step by step."}, {"role": "user", "content": PROMPT_9}]
    ids, mask = tokenize_prompts(tiny_tokenizer, [short, long], max_prompt_length=100)
    # the tiny template: <|role|>content</s> per message, then <|assistant|>
    long_ids = tiny_tokenizer("<|system|>Solve step by step.</s><|user|>What is 12 + 7?</s><|assistant|>",
                              add_special_tokens=False)["input_ids"]
    short_ids = tiny_tokenizer("<|user|>yes</s><|assistant|>", add_special_tokens=False)["input_ids"]
    assert ids[1].tolist() == long_ids
    assert ids[0, mask[0].bool()].tolist() == short_ids
    assert int(mask[0].sum()) == len(short_ids) < len(long_ids)


# ----------------------------------------------------------------------------------------------------
# Completion masks


def test_completion_mask_from_positions():
    ids = torch.tensor([
        [5, 2, 0, 0],  # EOS at 1 then pad
        [2, 0, 0, 0],  # EOS first
        [5, 6, 7, 8],  # no EOS: truncated, all 1
        [5, 6, 7, 2],  # EOS in the last slot
        [5, 2, 6, 2],  # only the first EOS counts
    ])
    expected = [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert completion_mask_from_ids(ids, [EOS]).tolist() == expected


def test_completion_mask_when_pad_is_eos():
    # pad == eos == 2: the padding after EOS looks like more EOS tokens; the mask must still keep the first
    ids = torch.tensor([[5, 2, 2, 2], [2, 2, 2, 2], [5, 6, 7, 8]])
    assert completion_mask_from_ids(ids, [2]).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_completion_mask_with_several_stop_ids():
    ids = torch.tensor([[5, 9, 2, 0], [5, 6, 2, 9]])
    assert completion_mask_from_ids(ids, [2, 9]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


def test_eos_ids_include_the_generation_config(tiny_model, tiny_tokenizer):
    assert eos_ids(tiny_tokenizer) == [EOS]
    tiny_model.generation_config.eos_token_id = [EOS, 7]
    assert eos_ids(tiny_tokenizer, tiny_model) == [EOS, 7]


# ----------------------------------------------------------------------------------------------------
# Sampling


def test_sample_next_token_greedy_top_k_top_p():
    logits = torch.tensor([[0.2, 0.5, 0.3, -1.0], [3.0, 2.0, 1.0, 0.0]])
    assert sample_next_token(logits, GREEDY).tolist() == [1, 0]
    torch.manual_seed(0)
    # top_k = 2 keeps the two largest logits of each row: {1, 2} and {0, 1}
    top_k = SamplingSettings(temperature=1.0, top_k=2)
    draws = torch.stack([sample_next_token(logits, top_k) for _ in range(300)])  # (300, 2)
    assert set(draws[:, 0].tolist()) == {1, 2} and set(draws[:, 1].tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_over_p():
    # probabilities [0.2, 0.5, 0.3] (unsorted on purpose). Sorted: 0.5, 0.3, 0.2 with probability mass
    # before each of 0, 0.5, 0.8. top_p = 0.6 drops a token once the mass before it is >= 0.6:
    # keep 0.5 (token 1) and 0.3 (token 2), drop 0.2 (token 0).
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log()
    torch.manual_seed(0)
    draws = {int(sample_next_token(logits, SamplingSettings(temperature=1.0, top_p=0.6))) for _ in range(300)}
    assert draws == {1, 2}
    # top_p = 0.4 < 0.5: only the most likely token is left
    draws = {int(sample_next_token(logits, SamplingSettings(temperature=1.0, top_p=0.4))) for _ in range(50)}
    assert draws == {1}


def sampling_distribution(logits, settings, monkeypatch):
    """The probabilities sample_next_token hands to torch.multinomial."""
    seen = []

    def fake_multinomial(probs, num_samples):
        seen.append(probs.clone())
        return probs.argmax(dim=-1, keepdim=True)

    monkeypatch.setattr(torch, "multinomial", fake_multinomial)
    sample_next_token(logits, settings)
    return seen[0]


def test_sampling_distribution_with_temperature_top_k_top_p(monkeypatch):
    # logits [0, ln 3]: softmax [1/4, 3/4]; at temperature 0.5 the logits double to [0, ln 9]: [0.1, 0.9]
    two = torch.tensor([[0.0, math.log(3.0)]])
    probs = sampling_distribution(two, SamplingSettings(temperature=1.0), monkeypatch)
    torch.testing.assert_close(probs, torch.tensor([[0.25, 0.75]]))
    probs = sampling_distribution(two, SamplingSettings(temperature=0.5), monkeypatch)
    torch.testing.assert_close(probs, torch.tensor([[0.1, 0.9]]))
    # top_k = 2 on [3, 2, 1, 0]: softmax over [3, 2] = [e / (e + 1), 1 / (e + 1)] = [0.731059, 0.268941]
    probs = sampling_distribution(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), SamplingSettings(temperature=1.0, top_k=2),
                                  monkeypatch)
    torch.testing.assert_close(probs, torch.tensor([[0.731059, 0.268941, 0.0, 0.0]]))
    # top_p = 0.6 on probabilities [0.2, 0.5, 0.3]: keep 0.5 and 0.3, renormalised: [0, 0.625, 0.375]
    probs = sampling_distribution(torch.tensor([[0.2, 0.5, 0.3]]).log(), SamplingSettings(temperature=1.0, top_p=0.6),
                                  monkeypatch)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.625, 0.375]]))


# ----------------------------------------------------------------------------------------------------
# Generation


def test_greedy_matches_the_one_prompt_reference_with_early_stops(tiny_model, tiny_tokenizer):
    # EOS forced after position 10: the 9-token prompt stops at completion index 10 + 1 - 9 = 2, the 6-token
    # prompt at index 5 (the last slot: a full mask but not truncated), the 4-token prompt never (index 7 > 5:
    # truncated); the 5-token prompt ends with EOS at index 0 on its own.
    model = EosAtPosition(tiny_model, EOS, position=10)
    prompts = [PROMPT_5, PROMPT_9, PROMPT_6, PROMPT_4]
    for share in (True, False):
        rollout = generate(model, tiny_tokenizer, prompts, group_size=2, settings=GREEDY, share_prompt_prefix=share)
        assert rollout.completion_ids.shape == (8, 6)  # N = 4 prompts x 2, T = max_new_tokens
        for row in range(8):
            expected = reference_greedy(model, real_prompt(rollout, row), 6, EOS)
            assert rollout.completion_ids[row].tolist() == expected + [PAD] * (6 - len(expected))
        assert rollout.completion_ids[:, 0].tolist()[:2] == [EOS, EOS]
        assert rollout.completion_ids[2, 2] == EOS and rollout.completion_ids[4, 5] == EOS
        assert not bool((rollout.completion_ids[6:] == EOS).any())
        assert rollout.completion_mask.tolist() == (
            [[1, 0, 0, 0, 0, 0]] * 2 + [[1, 1, 1, 0, 0, 0]] * 2 + [[1] * 6] * 2 + [[1] * 6] * 2)
        assert rollout.truncated.tolist() == [False] * 6 + [True] * 2
        assert rollout.completion_lengths.tolist() == [1, 1, 3, 3, 6, 6, 6, 6]
        assert rollout.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        texts = [tiny_tokenizer.decode(rollout.completion_ids[r, :n], skip_special_tokens=True)
                 for r, n in enumerate(rollout.completion_lengths.tolist())]
        assert rollout.completions == texts and rollout.completions[0] == ""


def test_pad_equal_to_eos():
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == EOS
    model, _ = build_tiny_model(tokenizer, seed=0)
    rollout = generate(EosAtPosition(model, EOS, position=10), tokenizer, [PROMPT_9, PROMPT_6, PROMPT_4, PROMPT_5],
                       group_size=1, settings=GREEDY)
    # prompt padding is EOS too, and only the mask tells it apart
    assert rollout.prompt_ids[3, :4].tolist() == [EOS] * 4 and rollout.prompt_mask[3, :4].tolist() == [0] * 4
    # rows 0 and 3 stop early and are padded with EOS: the mask ends at the first one
    assert rollout.completion_ids[0, 2:].tolist() == [EOS] * 4 and rollout.completion_ids[3].tolist() == [EOS] * 6
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6, [1] * 6, [1, 0, 0, 0, 0, 0]]
    assert rollout.truncated.tolist() == [False, False, True, False]


def test_max_new_tokens_is_respected(tiny_model, tiny_tokenizer):
    for max_new_tokens in (1, 4):
        settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=1.0)
        rollout = generate(tiny_model, tiny_tokenizer, [PROMPT_9, PROMPT_2], 3, settings)
        assert rollout.completion_ids.shape == (6, max_new_tokens)
        assert bool((rollout.completion_lengths <= max_new_tokens).all())


def test_shared_prefix_equals_unshared_for_greedy_and_sampling(tiny_model, tiny_tokenizer):
    # plain prompts of different lengths, with EOS likely enough (+3 on its logit) that sampled rows of one
    # group stop at different steps; sampling draws the same random numbers in both modes
    eos_bias = 3.0 * (torch.arange(len(tiny_tokenizer)) == EOS)  # (V,)
    hook = tiny_model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + eos_bias)
    try:
        prompts = [PROMPT_9, PROMPT_2, PROMPT_6]
        results = {}
        for settings in (GREEDY, SamplingSettings(max_new_tokens=8, temperature=1.0)):
            for share in (True, False):
                torch.manual_seed(3)
                results[settings.do_sample, share] = generate(tiny_model, tiny_tokenizer, prompts, 4, settings,
                                                              share_prompt_prefix=share)
        for do_sample in (False, True):
            shared, unshared = results[do_sample, True], results[do_sample, False]
            assert torch.equal(shared.completion_ids, unshared.completion_ids)
            assert torch.equal(shared.completion_mask, unshared.completion_mask)
        lengths = results[True, True].completion_lengths
        assert len(set(lengths.tolist())) > 2  # rows really did finish at different steps
    finally:
        hook.remove()


def test_greedy_matches_hf_generate_with_left_padding(tiny_model, tiny_tokenizer):
    tiny_model.eval()
    for prompts in ([PROMPT_9], [PROMPT_9, PROMPT_2]):
        rollout = generate(tiny_model, tiny_tokenizer, prompts, 1, GREEDY)
        hf = tiny_model.generate(input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_mask, do_sample=False,
                                 max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS)
        assert torch.equal(rollout.completion_ids, hf[:, rollout.prompt_ids.shape[1]:])


def test_chat_prompts_of_different_lengths(tiny_model, tiny_tokenizer):
    prompts = [[{"role": "user", "content": "yes"}],
               [{"role": "system", "content": "Solve step by step."}, {"role": "user", "content": PROMPT_9}]]
    shared = generate(tiny_model, tiny_tokenizer, prompts, 2, GREEDY)
    unshared = generate(tiny_model, tiny_tokenizer, prompts, 2, GREEDY, share_prompt_prefix=False)
    assert torch.equal(shared.completion_ids, unshared.completion_ids)
    for row in range(4):
        assert shared.completion_ids[row].tolist() == reference_greedy(tiny_model, real_prompt(shared, row), 6, EOS)


def test_seeded_sampling_repeats_and_top_k_1_or_tiny_top_p_is_greedy(tiny_model, tiny_tokenizer):
    prompts = [PROMPT_9, PROMPT_2]
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(generate(tiny_model, tiny_tokenizer, prompts, 4, settings).completion_ids)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    greedy = generate(tiny_model, tiny_tokenizer, prompts, 4, GREEDY).completion_ids
    assert not torch.equal(runs[0], greedy)  # sampling at temperature 1 on a random model is not greedy
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = generate(tiny_model, tiny_tokenizer, prompts, 4,
                           SamplingSettings(max_new_tokens=6, temperature=0.9, **narrow)).completion_ids
        assert torch.equal(sampled, greedy), narrow


# ----------------------------------------------------------------------------------------------------
# Completion log-probs


def logprob_batch(tokenizer):
    """Two prompts (9 and 2 tokens); 5 completions of 4 tokens with different lengths (EOS, then pad)."""
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [PROMPT_9, PROMPT_2], max_prompt_length=100)
    completion_ids = torch.tensor([
        [70, 89, EOS, PAD],  # prompt 0, length 3
        [263, 310, 304, 226],  # prompt 0, length 4 (truncated)
        [94, EOS, PAD, PAD],  # prompt 1, length 2
        [57, 84, 82, EOS],  # prompt 1, length 4
        [EOS, PAD, PAD, PAD],  # prompt 1, length 1
    ])
    prompt_index = torch.tensor([0, 0, 1, 1, 1])
    return prompt_ids, prompt_mask, completion_ids, prompt_index


def logprobs_and_grads(model, batch, share, rows=None, temperature=1.0):
    prompt_ids, prompt_mask, completion_ids, prompt_index = batch
    if rows is not None:
        completion_ids, prompt_index = completion_ids[rows], prompt_index[rows]
    model.zero_grad()
    logprobs = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, prompt_index,
                                   temperature=temperature, chunk_size=3, share_prompt_prefix=share)
    mask = completion_mask_from_ids(completion_ids, [EOS])
    weights = torch.linspace(-1.0, 2.0, logprobs.numel()).view_as(logprobs)  # a loss that weighs every token
    (logprobs * weights * mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logprobs.detach(), grads


def assert_same(a, b):
    (values_a, grads_a), (values_b, grads_b) = a, b
    torch.testing.assert_close(values_a, values_b, atol=1e-5, rtol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_completion_logprobs_match_a_plain_forward_per_row(tiny_model, tiny_tokenizer):
    batch = logprob_batch(tiny_tokenizer)
    prompt_ids, prompt_mask, completion_ids, prompt_index = batch
    for temperature in (1.0, 0.7):
        for share in (True, False):
            with torch.no_grad():
                got = completion_logprobs(tiny_model, prompt_ids, prompt_mask, completion_ids, prompt_index,
                                          temperature=temperature, share_prompt_prefix=share)
                for row in range(5):
                    p = int(prompt_index[row])
                    prompt = prompt_ids[p][prompt_mask[p].bool()].tolist()
                    expected = reference_logprobs(tiny_model, prompt, completion_ids[row].tolist(), temperature)
                    torch.testing.assert_close(got[row], expected, atol=1e-5, rtol=0)


def test_greedy_rollout_logprobs_are_the_argmax_log_softmax(tiny_model, tiny_tokenizer):
    rollout = generate(tiny_model, tiny_tokenizer, [PROMPT_9, PROMPT_6], 2, GREEDY)
    with torch.no_grad():
        got = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                  rollout.prompt_index)
        for row in range(4):
            prompt, completion = real_prompt(rollout, row), rollout.completion_ids[row].tolist()
            logits = tiny_model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
            log_softmax = torch.log_softmax(logits, dim=-1)  # (T, V)
            expected = log_softmax.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
            torch.testing.assert_close(got[row], expected, atol=1e-5, rtol=0)
            # greedy picked the most likely token at every step
            torch.testing.assert_close(got[row], log_softmax.max(dim=-1).values, atol=1e-5, rtol=0)


def test_a_rollout_trains_though_its_loop_ran_in_inference_mode(tiny_model, tiny_tokenizer):
    """The decode loop runs under torch.inference_mode; what it hands back is ordinary tensors, so the loss pass
    can take gradients through them (an inference tensor saved for backward raises), and the loop's switch
    changes no token or log-prob."""
    from forge.core import rollout as rollout_module

    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    noise = torch.rand(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rollout = generate(tiny_model, tiny_tokenizer, [PROMPT_9, PROMPT_6], 2, settings, noise=noise)
    fields = [rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
              rollout.sampler_logprobs, rollout.prompt_index]
    assert not any(t.is_inference() for t in fields)
    logprobs = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                   rollout.prompt_index)
    (logprobs * rollout.completion_mask).sum().backward()
    assert all(p.grad is not None for p in tiny_model.parameters() if p.requires_grad)
    tiny_model.zero_grad()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_module, "INFERENCE_MODE", False)
        plain = generate(tiny_model, tiny_tokenizer, [PROMPT_9, PROMPT_6], 2, settings, noise=noise)
    assert torch.equal(plain.completion_ids, rollout.completion_ids)
    assert torch.equal(plain.sampler_logprobs, rollout.sampler_logprobs)


def test_shared_and_unshared_logprobs_and_gradients_agree(tiny_model, tiny_tokenizer):
    batch = logprob_batch(tiny_tokenizer)
    assert_same(logprobs_and_grads(tiny_model, batch, share=True), logprobs_and_grads(tiny_model, batch, share=False))


@pytest.mark.parametrize("rows", [[1, 2], [2, 4], [0]])
def test_micro_batch_holding_part_of_a_group(tiny_model, tiny_tokenizer, rows):
    # [1, 2] straddles both groups; [2, 4] holds only the short prompt (its leading padding columns are
    # dropped in the shared path); [0] is a single completion
    batch = logprob_batch(tiny_tokenizer)
    full_values, _ = logprobs_and_grads(tiny_model, batch, share=False)
    shared = logprobs_and_grads(tiny_model, batch, share=True, rows=rows)
    assert_same(shared, logprobs_and_grads(tiny_model, batch, share=False, rows=rows))
    torch.testing.assert_close(shared[0], full_values[rows], atol=1e-5, rtol=0)


def test_lora_shared_and_unshared_agree(tiny_model, tiny_tokenizer):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(tiny_model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # lora_B starts at 0; randomise it so the adapter changes the outputs
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    batch = logprob_batch(tiny_tokenizer)
    shared = logprobs_and_grads(model, batch, share=True)
    assert_same(shared, logprobs_and_grads(model, batch, share=False))
    assert set(shared[1]) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in name for name in shared[1]) and len(shared[1]) == 2 * 2 * 2  # A, B x q, v x 2 layers
    assert any(float(g.abs().max()) > 0 for g in shared[1].values())
    with torch.no_grad(), model.disable_adapter():
        base = completion_logprobs(model, *batch)
    assert float((base - shared[0]).abs().max()) > 1e-3  # the adapter matters
    # and a micro-batch of part of a group
    assert_same(logprobs_and_grads(model, batch, share=True, rows=[2, 4]),
                logprobs_and_grads(model, batch, share=False, rows=[2, 4]))


def test_generation_prefill_gathers_the_last_position_the_loss_pass_slices(tiny_model, tiny_tokenizer):
    """Generation's prefill keeps the last position by index (LAST_POSITION: one contiguous row into the output
    layer), the loss pass by slice (logits_to_keep=1): both give the last position's logits, with and without a
    shared template prefix."""
    from forge.model.decode_plan import padded_positions, prefill
    from forge.model.kv_cache import LAST_POSITION

    template = "You are a math reasoning assistant. Solve the problem step by step. Problem: "
    tiny_model.eval()
    for prompts in ([PROMPT_9, PROMPT_4, PROMPT_2], [template + PROMPT_9, template + PROMPT_2]):
        ids, mask = tokenize_prompts(tiny_tokenizer, prompts, 10_000)  # (P, L)
        with torch.no_grad():
            full = tiny_model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask)).logits
            _, gathered = prefill(tiny_model, ids, mask, last_position=LAST_POSITION)  # (P, V)
            _, sliced = prefill(tiny_model, ids, mask)  # (P, V)
        assert gathered.shape == sliced.shape == (len(prompts), full.shape[-1])
        torch.testing.assert_close(gathered, sliced, rtol=0, atol=1e-5)
        torch.testing.assert_close(gathered, full[:, -1], rtol=0, atol=1e-5)


def test_shared_template_prefix_is_computed_once_and_changes_nothing(tiny_model, tiny_tokenizer):
    """Prompts built from one long template: the common prefix is laid out first and computed once;
    greedy ids and log-probs (values and gradients) equal the one-prompt-at-a-time computation."""
    from forge.core.rollout import tokenize_prompts
    from forge.model.decode_plan import MIN_SHARED_PREFIX

    template = "You are a math reasoning assistant. Solve the problem step by step. Problem: "
    prompts = [template + "What is 12 + 7?", template + "Tom has 5 apples and buys 3 more?"]
    ids, mask = tokenize_prompts(tiny_tokenizer, prompts, 10_000)
    shared = int((ids == ids[:1]).all(0).long().cumprod(0).sum())
    assert shared >= MIN_SHARED_PREFIX
    assert mask[:, :shared].all()  # padding sits after the prefix, before each prompt's own tokens

    tiny_model.eval()
    settings = SamplingSettings(max_new_tokens=6, do_sample=False)
    batched = generate(tiny_model, tiny_tokenizer, prompts, 2, settings)
    for i, prompt in enumerate(prompts):
        alone = generate(tiny_model, tiny_tokenizer, [prompt], 2, settings)
        assert torch.equal(batched.completion_ids[2 * i:2 * i + 2], alone.completion_ids)

    def logprobs_and_grad(rollout, share):
        tiny_model.zero_grad()
        values = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                     rollout.prompt_index, share_prompt_prefix=share)
        (values * rollout.completion_mask).sum().backward()
        return values.detach(), [p.grad.clone() for p in tiny_model.parameters()]

    shared_values, shared_grads = logprobs_and_grad(batched, True)
    plain_values, plain_grads = logprobs_and_grad(batched, False)
    assert torch.allclose(shared_values, plain_values, atol=1e-5)
    for a, b in zip(shared_grads, plain_grads):
        assert torch.allclose(a, b, atol=1e-5)
    for i, prompt in enumerate(prompts):  # and equal to each prompt laid out on its own
        alone = generate(tiny_model, tiny_tokenizer, [prompt], 2, settings)
        alone_values, _ = logprobs_and_grad(alone, False)
        assert torch.allclose(shared_values[2 * i:2 * i + 2], alone_values, atol=1e-5)
