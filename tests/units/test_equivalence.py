"""The speed-ups keep the math: the trainer's loss and gradients are the same with and without them.

Three computations of one optimizer step's loss and gradients on the tiny model, for full fine-tuning and
LoRA, every loss aggregation, with and without the KL term, with and without masking (truncated
completions, a NaN reward, a dropped flat group):

    optimised        GRPOTrainer.step with share_prompt_prefix=True (the prompt and a template shared by
                     all prompts run once, their cache expanded), micro-batches that split groups, and a
                     log-softmax chunk smaller than a completion
    straightforward  GRPOTrainer.step with share_prompt_prefix=False, one micro-batch, one huge chunk
    by hand          each completion alone: unpadded prompt + completion through plain model(...), then the
                     advantages (Python's statistics module) and the loss of each aggregation written out
                     in the test, so an error in Forge's own advantage or loss code cannot cancel out

The rollouts are built by hand (patched in for the trainer's `_generate`), so every step sees the same
completions: prompts of different lengths in one batch, some with a common chat template and some with
nothing in common, and completions that stop at different positions or run to max_new_tokens. Gradients
are captured where the optimizer would step, so nothing moves between the three.
"""

import copy
import math
import statistics
import types

import pytest
import torch
from completion_masks import completion_mask_from_ids

from forge import GRPOConfig, GRPOTrainer
from forge.core.rollout import Rollout, render_prompt, tokenize_prompts
from forge.data.arithmetic import chat_prompt
from forge.model.tiny import build_tiny_model

GROUP, MAX_NEW = 4, 6
TEMPERATURE = 0.7
# Two rollouts of two prompts each: chat prompts sharing a long template, then plain prompts sharing nothing.
PROMPTS = [
    [chat_prompt("What is 12 + 7?"), chat_prompt("Kim has 14 cards and gets 9 more. How many cards now?")],
    ["Answer: 19", "Solve step by step. 3 times 4 is the total number of apples"],
]
# EOS position per completion (None: runs to MAX_NEW without EOS), 8 completions per rollout.
EOS_AT = [[0, 3, None, 5, 1, None, 2, 4], [None, 2, 5, 0, 3, None, 1, 4]]
REWARDS = [[1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25], [0.0, 1.0, 0.0, 0.0, 2.0, 0.5, 1.0, 0.0]]


def hand_rollouts(tokenizer) -> list[Rollout]:
    generator = torch.Generator().manual_seed(1)
    rollouts = []
    for prompts, eos_at in zip(PROMPTS, EOS_AT):
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length=10**6)
        completion_ids = torch.randint(6, len(tokenizer), (len(eos_at), MAX_NEW), generator=generator)
        for row, position in enumerate(eos_at):
            if position is not None:
                completion_ids[row, position] = tokenizer.eos_token_id
                completion_ids[row, position + 1:] = tokenizer.pad_token_id
        completion_mask = completion_mask_from_ids(completion_ids, [tokenizer.eos_token_id])
        truncated = torch.tensor([position is None for position in eos_at])
        texts = [f"completion {i}" for i in range(len(eos_at))]
        rollouts.append(Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, GROUP, texts))
    return rollouts


# The same rollouts with masking: a NaN reward (masked, out of its group's statistics), a group of equal
# rewards that no float holds exactly (dropped as flat), and truncated completions (masked).
MASKED_REWARDS = [[1.0, 0.0, float("nan"), 0.0, 0.7, 0.7, 0.7, 0.7], [0.0, 1.0, 0.0, 0.0, 2.0, 0.5, 1.0, 0.0]]
MASKING = {"mask_truncated_completions": True, "drop_zero_std_groups": True, "on_reward_error": "score"}


def make_trainer(base_model, tokenizer, tmp_path, optimised: bool, mode: str, loss_type: str, kl_beta: float,
                 gradient_checkpointing: bool = False, masked: bool = False):
    config = GRPOConfig(
        gradient_checkpointing=gradient_checkpointing,
        group_size=GROUP, prompts_per_step=2, gradient_accumulation_steps=2, max_new_tokens=MAX_NEW,
        temperature=TEMPERATURE, loss_type=loss_type, kl_beta=kl_beta, max_grad_norm=0.0,
        use_lora=mode == "lora", lora_r=4, lora_alpha=8, output_dir=str(tmp_path / ("fast" if optimised else "slow")),
        share_prompt_prefix=optimised, micro_batch_size=3 if optimised else 0,
        logprob_chunk_size=5 if optimised else 10**9, **(MASKING if masked else {}),
    )
    rollouts, rewards = iter(hand_rollouts(tokenizer)), iter(MASKED_REWARDS if masked else REWARDS)

    def reward(prompts, completions, **kwargs):
        return next(rewards)

    trainer = GRPOTrainer(copy.deepcopy(base_model), tokenizer, reward_fn=reward, config=config)
    # Move the policy away from the reference (LoRA B starts at 0; the full-model reference is a copy of the
    # start), identically in both trainers, so the KL term and every LoRA gradient are non-trivial.
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in trainer.trainable:
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    trainer.generate = lambda prompts, rows=None: next(rollouts)
    captured = {}

    def capture_gradients(optimizer):
        for name, parameter in trainer.model.named_parameters():
            if parameter.requires_grad:
                captured[name] = parameter.grad.detach().clone()

    trainer.optimizer.step = types.MethodType(capture_gradients, trainer.optimizer)  # gradients as the optimizer would see them; weights stay put
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)  # train() makes one
    return trainer, captured


def rows():
    return [{"prompt": prompt, "reference": "0"} for prompts in PROMPTS for prompt in prompts]


def _row_logprobs(network, ids, prompt_length: int, completion) -> torch.Tensor:
    """log p of each completion token of one unpadded sequence ids (1, Lp + n), (n,)."""
    logits = network(input_ids=ids).logits[0, prompt_length - 1:-1] / TEMPERATURE  # (n, V)
    return torch.log_softmax(logits.float(), dim=-1).gather(1, completion[:, None]).squeeze(1)  # (n,)


def hand_advantages(rewards: list[float], truncated: list[bool], masked: bool) -> tuple[list[float], list[bool]]:
    """DeepSeekMath's A_i = (r_i - mean) / (std + 1e-4) per group, with Python's statistics module; with masking,
    NaN rewards leave the statistics, flat groups and truncated completions leave the loss."""
    advantages, kept = [], []
    for start in range(0, len(rewards), GROUP):
        group = rewards[start:start + GROUP]
        finite = [r for r in group if math.isfinite(r)]
        mean, std = statistics.fmean(finite), statistics.stdev(finite)
        flat = len(set(finite)) == 1
        for i, r in enumerate(group):
            ok = math.isfinite(r)
            advantages.append((r - mean) / (std + 1e-4) if ok and not flat else 0.0)
            kept.append(not masked or (ok and not flat and not truncated[start + i]))
    return advantages, kept


def hand_loss(per_row: list[tuple[torch.Tensor, torch.Tensor | None, float]], kept: list[bool], kl_beta: float,
              loss_type: str) -> torch.Tensor:
    """The one-update GRPO loss written out: ratio = exp(logp - stopgrad(logp)) = 1 sits inside the clip range, so
    pg_t = -A * ratio_t; kl_t = exp(ref - logp) - (ref - logp) - 1; then each paper's aggregation."""
    sums, lengths = [], []
    for (logprobs, ref, advantage), keep in zip(per_row, kept):
        if not keep:
            continue
        per_token = -advantage * torch.exp(logprobs - logprobs.detach())  # (n,)
        if kl_beta > 0:
            per_token = per_token + kl_beta * (torch.exp(ref - logprobs) - (ref - logprobs) - 1)
        sums.append(per_token.sum())
        lengths.append(per_token.numel())
    if loss_type == "grpo":  # 1/|kept| sum_i 1/|o_i| sum_t
        return sum(total / n for total, n in zip(sums, lengths)) / len(sums)
    if loss_type == "dapo":  # sum over every kept token / their number
        return sum(sums) / sum(lengths)
    assert loss_type == "dr_grpo"  # constant: every sampled completion x max_new_tokens
    return sum(sums) / (len(per_row) * MAX_NEW)


def by_hand(trainer, tokenizer, kl_beta: float, loss_type: str, masked: bool = False):
    """Loss and gradients with each completion run alone on its unpadded prompt; no Forge math involved."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    per_row, kept = [], []
    for rollout, prompts, rewards in zip(hand_rollouts(tokenizer), PROMPTS, MASKED_REWARDS if masked else REWARDS):
        advantages, keep = hand_advantages(rewards, rollout.truncated.tolist(), masked)
        kept.extend(keep)
        for row in range(rollout.completion_ids.shape[0]):
            prompt = prompts[row // GROUP]
            prompt_tokens = tokenizer(render_prompt(tokenizer, prompt),
                                      add_special_tokens=isinstance(prompt, str))["input_ids"]
            length = int(rollout.completion_mask[row].sum())
            completion = rollout.completion_ids[row, :length]
            ids = torch.cat([torch.tensor(prompt_tokens), completion])[None]  # (1, Lp + length)
            logprobs = _row_logprobs(model, ids, len(prompt_tokens), completion)
            ref = None
            if kl_beta > 0:
                with torch.no_grad():
                    if trainer.is_lora:
                        with model.disable_adapter():
                            ref = _row_logprobs(model, ids, len(prompt_tokens), completion)
                    else:
                        ref = _row_logprobs(trainer.reference_model, ids, len(prompt_tokens), completion)
            per_row.append((logprobs, ref, advantages[row]))
    loss = hand_loss(per_row, kept, kl_beta, loss_type)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_optimised_update_equals_straightforward_and_by_hand(tmp_path, tiny_tokenizer, mode, loss_type, kl_beta,
                                                             masked):
    base, _ = build_tiny_model(tiny_tokenizer, seed=0)
    fast, fast_grads = make_trainer(base, tiny_tokenizer, tmp_path, True, mode, loss_type, kl_beta, masked=masked)
    slow, slow_grads = make_trainer(base, tiny_tokenizer, tmp_path, False, mode, loss_type, kl_beta, masked=masked)

    fast_loss = fast.step(rows())["loss"]
    slow_loss = slow.step(rows())["loss"]
    hand_loss_value, hand_grads = by_hand(fast, tiny_tokenizer, kl_beta, loss_type, masked)

    assert fast_grads.keys() == slow_grads.keys() == hand_grads.keys() and fast_grads
    assert any(g.abs().max() > 1e-4 for g in hand_grads.values())  # the comparison is not between zeros
    assert fast_loss == pytest.approx(slow_loss, rel=1e-5, abs=1e-7)
    assert fast_loss == pytest.approx(hand_loss_value, rel=1e-5, abs=1e-7)
    for name, expected in hand_grads.items():
        scale = expected.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(fast_grads[name] / scale, expected / scale, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(slow_grads[name] / scale, expected / scale, rtol=0, atol=1e-5, msg=name)


def test_the_masked_batch_masks_what_it_claims(tiny_tokenizer):
    """The masked case drops one group as flat, one NaN sample and the truncated completions, and keeps rows."""
    kept = [k for rollout, rewards in zip(hand_rollouts(tiny_tokenizer), MASKED_REWARDS)
            for k in hand_advantages(rewards, rollout.truncated.tolist(), True)[1]]
    assert 4 <= sum(kept) < len(kept) - 4


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients(tmp_path, tiny_tokenizer, mode):
    """gradient_checkpointing=True: every decoder layer that ran under autograd runs once more (in backward), the
    prompt still once per group (the loss pass keeps its cache), and the loss and gradients are the same."""
    base, _ = build_tiny_model(tiny_tokenizer, seed=0)
    plain, plain_grads = make_trainer(base, tiny_tokenizer, tmp_path / "plain", True, mode, "grpo", 0.1)
    checkpointed, checkpointed_grads = make_trainer(base, tiny_tokenizer, tmp_path / "ckpt", True, mode, "grpo",
                                                    0.1, gradient_checkpointing=True)
    calls = {}
    for name, trainer in (("plain", plain), ("checkpointed", checkpointed)):
        counts = {"all": 0, "grad": 0, "prompt_rows": []}
        model = trainer.model.get_base_model() if mode == "lora" else trainer.model
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda *a, counts=counts: counts.update(
                all=counts["all"] + 1, grad=counts["grad"] + torch.is_grad_enabled()))
        trainer.step(rows())
        calls[name] = counts
    # The same sampling in both runs; the checkpointed one runs each layer call made under autograd again.
    assert calls["plain"]["grad"] > 0
    assert calls["checkpointed"]["all"] == calls["plain"]["all"] + calls["plain"]["grad"]
    assert checkpointed_grads.keys() == plain_grads.keys() and plain_grads
    assert not any(m.training for m in checkpointed.model.modules())  # back in eval mode: dropout stays off
    for name, expected in plain_grads.items():
        scale = expected.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(checkpointed_grads[name] / scale, expected / scale, rtol=0, atol=1e-5, msg=name)


def test_checkpointed_layers_keep_the_shared_prompt(tiny_model, tiny_tokenizer):
    """Under checkpointing the loss pass runs each prompt once (not once per completion), with the same log-probs
    and gradients as without, including prompts whose common template is computed once (prefill)."""
    from forge.core.logprobs import checkpointed_layers, completion_logprobs

    rollout = hand_rollouts(tiny_tokenizer)[0]  # chat prompts: a shared template, different lengths
    rows_seen, results = [], []
    tiny_model.model.layers[0].register_forward_pre_hook(
        lambda module, args: rows_seen.append(args[0].shape[0]) if torch.is_grad_enabled() else None)
    for enabled in (False, True):
        tiny_model.zero_grad(set_to_none=True)
        rows_seen.clear()
        with checkpointed_layers(tiny_model, enabled):
            values = completion_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                         rollout.prompt_index)
        (values * torch.linspace(-1, 1, values.shape[1])).sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in tiny_model.named_parameters()},
                        list(rows_seen)))
    (plain, plain_grads, plain_rows), (ckpt, ckpt_grads, ckpt_rows) = results
    prompts = rollout.prompt_ids.shape[0]
    assert max(plain_rows[:-1]) <= prompts and plain_rows[-1] == rollout.completion_ids.shape[0], plain_rows
    assert ckpt_rows[:len(plain_rows)] == plain_rows  # forward as without checkpointing, then the recomputations
    torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_batch_exercises_what_it_claims(tiny_tokenizer):
    """Prompts of different lengths in a rollout, a shared chat template, completions of different lengths."""
    chat, plain = hand_rollouts(tiny_tokenizer)
    for rollout in (chat, plain):
        lengths = rollout.prompt_mask.sum(dim=1)
        assert lengths.min() < lengths.max()
        assert len(set(rollout.completion_lengths.tolist())) >= 4
        assert rollout.truncated.any() and not rollout.truncated.all()
    shared = (chat.prompt_ids == chat.prompt_ids[:1]).all(dim=0).long().cumprod(0).sum()
    assert shared >= 8  # long enough for the shared-template prefill
    assert plain.prompt_ids[0, 0] != plain.prompt_ids[1, 0] or not plain.prompt_mask[:, 0].all()


# ----------------------------------------------------------------------------------------------------
# The decode cache written in place (forge/model/kv_cache.py) gives the same tokens as the growing one


def test_preallocated_decode_cache_samples_the_same_tokens(monkeypatch, tiny_model, tiny_tokenizer):
    import forge.model.decode_plan as decode_plan_module
    from forge.core.rollout import SamplingSettings, generate

    # +3 on the EOS logit: rows of one group stop at different steps, so finished rows leave the cache
    eos_bias = 3.0 * (torch.arange(len(tiny_tokenizer)) == tiny_tokenizer.eos_token_id)  # (V,)
    tiny_model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + eos_bias)
    prompts = [chat_prompt("What is 12 + 7?"), chat_prompt("What is 3 * 4?"), "Answer: 19", "yes"]
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0)
    results = {}
    for preallocate in (True, False):
        if not preallocate:
            monkeypatch.setattr(decode_plan_module, "preallocated",  # the growing cache, repeated for the groups
                                lambda cache, capacity, repeats=1: cache.batch_repeat_interleave(repeats) or cache)
        for share in (True, False):
            torch.manual_seed(5)
            results[preallocate, share] = generate(tiny_model, tiny_tokenizer, prompts, 4, settings,
                                                   share_prompt_prefix=share)
    for share in (True, False):
        assert torch.equal(results[True, share].completion_ids, results[False, share].completion_ids)
    lengths = results[True, True].completion_lengths
    assert len(set(lengths.tolist())) > 3 and lengths.max() == settings.max_new_tokens


def test_preallocated_layer_writes_in_place_and_matches_a_growing_cache(tiny_model, tiny_tokenizer):
    from forge.model.kv_cache import CACHE_ARG, DynamicLayer, preallocated, returned_cache

    if DynamicLayer is None:
        pytest.skip("this transformers version has no cache layer objects")
    ids = torch.tensor(tiny_tokenizer("What is 12 + 7?")["input_ids"])[None].repeat(3, 1)  # (3, L)
    with torch.no_grad():
        growing = returned_cache(tiny_model(input_ids=ids, use_cache=True))
        fixed = preallocated(returned_cache(tiny_model(input_ids=ids, use_cache=True)), ids.shape[1] + 4)
        buffers = [layer.key_buffer.data_ptr() for layer in fixed.layers]
        for step in range(3):
            token = torch.full((3, 1), 7 + step)
            position = torch.full((3, 1), ids.shape[1] + step)
            expected = tiny_model(input_ids=token, position_ids=position, use_cache=True, **{CACHE_ARG: growing})
            got = tiny_model(input_ids=token, position_ids=position, use_cache=True, **{CACHE_ARG: fixed})
            torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
        assert [layer.key_buffer.data_ptr() for layer in fixed.layers] == buffers  # no copy per decode step
        assert fixed.get_seq_length() == growing.get_seq_length() == ids.shape[1] + 3
        fixed.batch_select_indices(torch.tensor([0, 2]))
        growing.batch_select_indices(torch.tensor([0, 2]))
        for mine, theirs in zip(fixed.layers, growing.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
