"""The algorithm catalogue: CISPO, SAPO, dual-clip / two-sided clip, k1/k2/k3, RLOO, REINFORCE++-baseline, GDPO,
rewards that do not apply, token entropy, top-entropy masking, entropy bonus and sampler importance sampling.

Every expected value is worked out in a comment from the paper's formula with plain `math`, never by calling the
Forge function under test. Value and gradient wherever the variant has a gradient.
"""

import math

import pytest
import torch
from losses import variant_loss

from forge.core.config import GRPOConfig
from forge.core.grpo import (
    LossNormaliser,
    LossSettings,
    compute_group_advantages,
    multi_reward_advantages,
    weighted_reward_sum,
)
from forge.core.logprobs import token_logprobs_from_logits
from forge.core.loss_variants import high_entropy_mask, rollout_importance_weights
from forge.run.step_stats import logprob_gap

LN = math.log


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def loss_and_grad(logprobs, old, advantages, mask=None, ref=None, **kwargs):
    logprobs = leaf(logprobs)
    old = None if old is None else torch.tensor(old, dtype=torch.float64)
    ref = None if ref is None else torch.tensor(ref, dtype=torch.float64)
    mask = torch.ones(logprobs.shape) if mask is None else torch.tensor(mask, dtype=torch.float64)
    loss, stats = variant_loss(logprobs, old, ref, torch.tensor(advantages, dtype=torch.float64), mask, **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad, stats


# ----------------------------------------------------------------------------------------------------
# CISPO (MiniMax-M1 eq. 4-5): loss_t = -sg(min(r_t, 1 + eps_high)) * A * logp_t, token mean


def test_cispo_value_and_gradient_keep_every_token():
    # row 0: A = 2, ratios 1.5 and 6.0 (cap 1 + 4.0 = 5): weights 1.5, 5.0; logp = ln .5, ln .25
    # row 1: A = -1, ratios 0.1 and 1.0: weights 0.1 (no lower bound: the token keeps its gradient), 1.0
    lp = [[LN(0.5), LN(0.25)], [LN(0.5), LN(0.5)]]
    old = [[LN(0.5) - LN(1.5), LN(0.25) - LN(6.0)], [LN(0.5) - LN(0.1), LN(0.5)]]
    settings = LossSettings(clip_epsilon_high=4.0, loss_type="cispo")
    loss, grad, stats = loss_and_grad(lp, old, [2.0, -1.0], settings=settings)
    per_token = [-1.5 * 2 * LN(0.5), -5.0 * 2 * LN(0.25), -0.1 * -1 * LN(0.5), -1.0 * -1 * LN(0.5)]
    assert loss == pytest.approx(sum(per_token) / 4)  # 3.794981: the token mean over 4 tokens
    assert loss == pytest.approx(3.794981, abs=1e-6)
    # d loss / d logp_t = -w_t * A / 4; the weight is stop-gradient, so no term through the ratio
    expected = torch.tensor([[-1.5 * 2 / 4, -5.0 * 2 / 4], [0.1 / 4, 1.0 / 4]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    assert stats.clip_frac_high.item() == pytest.approx(1 / 4)  # only the ratio 6.0 was over the cap
    # the hard clip would have dropped row 1 token 0 (ratio 0.1 < 0.8 with A < 0): gradient exactly 0 there
    _, clip_grad, _ = loss_and_grad(lp, old, [2.0, -1.0], loss_type="bnpo", clip_epsilon_high=4.0)
    assert clip_grad[1, 0].item() == 0.0


def test_cispo_on_policy_is_the_policy_gradient():
    # old = None: r = 1 <= cap, w = 1, loss = -A * mean(logp); gradient -A / 2 per token
    _, grad, _ = loss_and_grad([[LN(0.3), LN(0.6)]], None, [1.5], loss_type="cispo")
    torch.testing.assert_close(grad, torch.tensor([[-0.75, -0.75]], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# SAPO (eq. 5-6): loss_t = -f(r_t) A, f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau_pos = 1.0 for A > 0, 1.05 else


def test_sapo_value_and_gradient():
    # row 0: A = +1, r = 1.5, tau = 1.0: f = sigmoid(0.5) * 4 = 2.489837; loss -2.489837
    #        df/dlogp = 4 sigmoid(1 - sigmoid) * r (tau cancels) = 4 * 0.622459 * 0.377541 * 1.5 = 1.410022
    # row 1: A = -1, r = 0.5, tau = 1.05: f = sigmoid(-0.525) * 4 / 1.05 = 0.371684 * 3.809524 = 1.415939
    #        df/dlogp = 4 * 0.371684 * 0.628316 * 0.5 = 0.467070
    # per-sequence mean over 2 completions of 1 token: loss = (-2.489837 + 1.415939) / 2, gradients / 2
    lp = [[LN(0.3)], [LN(0.3)]]
    old = [[LN(0.3) - LN(1.5)], [LN(0.3) - LN(0.5)]]
    loss, grad, _ = loss_and_grad(lp, old, [1.0, -1.0], loss_type="sapo")
    s0, s1 = sigmoid(0.5), sigmoid(-0.525)
    assert loss == pytest.approx((-s0 * 4 + s1 * 4 / 1.05) / 2)
    assert loss == pytest.approx((-2.489837 + 1.415939) / 2, abs=1e-6)
    expected = torch.tensor([[-4 * s0 * (1 - s0) * 1.5 / 2], [4 * s1 * (1 - s1) * 0.5 / 2]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    assert expected[0, 0].item() == pytest.approx(-1.410022 / 2, abs=1e-6)


def test_sapo_temperatures_are_settings():
    # tau_pos = 2: f(1.5) = sigmoid(1.0) * 4 / 2 = 0.731059 * 2 = 1.462117
    settings = LossSettings(loss_type="sapo", sapo_temperature_pos=2.0)
    loss, _, _ = loss_and_grad([[0.0]], [[-LN(1.5)]], [1.0], settings=settings)
    assert loss == pytest.approx(-sigmoid(1.0) * 2)


def test_sapo_on_policy_is_the_policy_gradient():
    # f'(1) = 4 * sigmoid(0) * (1 - sigmoid(0)) = 1, so the gradient is -A / |o| per token
    _, grad, _ = loss_and_grad([[LN(0.2), LN(0.9)]], None, [-2.0], loss_type="sapo")
    torch.testing.assert_close(grad, torch.tensor([[1.0, 1.0]], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# Dual-clip (Ye et al. eq. 5) / two-sided clip (INTELLECT-2): for A < 0, min(max(-A r, -A clip(r)), -A c)


def test_negative_advantage_ratio_cap():
    # A = -1, ratios 5.0, 2.0; A = +1, ratio 5.0. c = 3, eps 0.2:
    #   r = 5, A < 0: max(5, 1.2) = 5 -> min(5, 3) = 3, gradient 0 (capped)
    #   r = 2, A < 0: max(2, 1.2) = 2 < 3 -> 2, gradient -A r = 2
    #   r = 5, A > 0: max(-5, -1.2) = -1.2 (the ordinary clip), gradient 0; the cap does not apply
    # one token per row, per-sequence mean over 3 rows: loss (3 + 2 - 1.2) / 3, gradient [0, 2/3, 0]
    lp = [[0.0], [0.0], [0.0]]
    old = [[-LN(5.0)], [-LN(2.0)], [-LN(5.0)]]
    loss, grad, stats = loss_and_grad(lp, old, [-1.0, -1.0, 1.0], settings=LossSettings(negative_ratio_cap=3.0))
    assert loss == pytest.approx((3 + 2 - 1.2) / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0], [2 / 3], [0.0]], dtype=torch.float64))
    assert stats.clip_frac_capped.item() == pytest.approx(1 / 3)
    # without the cap the r = 5, A < 0 token costs 5 and pushes with gradient 5
    loss_off, grad_off, _ = loss_and_grad(lp, old, [-1.0, -1.0, 1.0])
    assert loss_off == pytest.approx((5 + 2 - 1.2) / 3)
    assert grad_off[0, 0].item() == pytest.approx(5 / 3)


def test_delta_and_clip_ratio_c_are_the_same_bound():
    # TRL's delta: -min(min(r, delta) A, clip(r) A); for r = 5, A = -1, delta = 3: -min(-3, -1.2) = 3, as dual-clip
    assert LossSettings.from_config(GRPOConfig(delta=3.0)).negative_ratio_cap == 3.0
    assert LossSettings.from_config(GRPOConfig(clip_ratio_c=3.0)).negative_ratio_cap == 3.0
    assert LossSettings.from_config(GRPOConfig(delta=4.0, clip_ratio_c=3.0)).negative_ratio_cap == 3.0
    assert LossSettings.from_config(GRPOConfig()).negative_ratio_cap is None


# ----------------------------------------------------------------------------------------------------
# KL estimators of KL(pi_theta || pi_ref), d = logp - ref (joschu.net/blog/kl-approx.html)


@pytest.mark.parametrize(("estimator", "value", "slope"), [
    ("k1", LN(2), 1.0),  # d = ln 2 = 0.693147; d/dlogp = 1
    ("k2", LN(2) ** 2 / 2, LN(2)),  # d^2 / 2 = 0.240227; d/dlogp = d = 0.693147
    ("k3", 0.5 + LN(2) - 1, 0.5),  # exp(-d) + d - 1 = 0.193147; d/dlogp = 1 - exp(-d) = 0.5
])
def test_kl_estimators(estimator, value, slope):
    # logp = ln .5, ref = ln .25; A = 0 so the loss is beta * kl alone (beta = 1, one token)
    settings = LossSettings(kl_beta=1.0, kl_loss_type=estimator)
    loss, grad, stats = loss_and_grad([[LN(0.5)]], None, [0.0], ref=[[LN(0.25)]], settings=settings)
    assert loss == pytest.approx(value)
    assert stats.kl.item() == pytest.approx(value)
    assert grad.item() == pytest.approx(slope)


# ----------------------------------------------------------------------------------------------------
# Advantages


def test_rloo_is_the_leave_one_out_baseline():
    # group [3, 1, 0, 0]: r_i - mean of the other three
    #   3 - 1/3 = 8/3; 1 - 3/3 = 0; 0 - 4/3 = -4/3 (twice)
    advantages = compute_group_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0]), 4, scale="rloo")
    torch.testing.assert_close(advantages, torch.tensor([8 / 3, 0.0, -4 / 3, -4 / 3]))
    # sample 3 left out (valid False): the others leave one out of three: 3 - 0.5, 1 - 1.5, 0 - 2
    valid = torch.tensor([True, True, True, False])
    advantages = compute_group_advantages(torch.tensor([3.0, 1.0, 0.0, 7.0]), 4, scale="rloo", valid=valid)
    torch.testing.assert_close(advantages, torch.tensor([2.5, -0.5, -2.0, 0.0]))


def test_reinforce_plus_plus_baseline_divides_by_the_batch_std_of_the_differences():
    # groups [1, 0] and [3, 3]: r - group mean = [0.5, -0.5, 0, 0]; their batch std (Bessel, n = 4, mean 0):
    # sqrt((0.25 + 0.25) / 3) = sqrt(1/6) = 0.408248; A = 0.5 / (0.408248 + 1e-4) = 1.224445
    advantages = compute_group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2,
                                          scale="reinforce_plus_plus_baseline")
    a = 0.5 / (math.sqrt(1 / 6) + 1e-4)
    torch.testing.assert_close(advantages, torch.tensor([a, -a, 0.0, 0.0]))
    assert a == pytest.approx(1.224445, abs=1e-6)
    # the 'batch' scale divides by the std of the raw rewards instead: sqrt(((-.75)^2 + 1.75^2 + 2 * 1.25^2) / 3)
    raw_std = math.sqrt((0.75 ** 2 + 1.75 ** 2 + 2 * 1.25 ** 2) / 3)  # 1.5
    assert compute_group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale="batch")[0].item() == \
        pytest.approx(0.5 / (raw_std + 1e-4))


def test_normalize_then_sum_normalises_each_reward_then_the_batch():
    # GDPO eq. 4-6, two groups of 2, rewards c (correct) and l (length), weights 1 and 1, eps 1e-4:
    #   c: [1, 0 | 1, 1]: group 1 std 1/sqrt2 -> +-0.5 / (0.707107 + 1e-4); group 2 flat -> 0
    #   l: [10, 20 | 30, 50]: -+5 / (7.071068 + 1e-4); -+10 / (14.142136 + 1e-4)
    #   sum, then (sum - batch mean) / (batch std (Bessel) + 1e-4)
    c0 = 0.5 / (1 / math.sqrt(2) + 1e-4)
    l1, l2 = 5 / (10 / math.sqrt(2) + 1e-4), 10 / (20 / math.sqrt(2) + 1e-4)
    summed = [c0 - l1, -c0 + l1, -l2, l2]
    mean = sum(summed) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in summed) / 3)
    expected = torch.tensor([(x - mean) / (std + 1e-4) for x in summed])
    components = torch.tensor([[1.0, 10.0], [0.0, 20.0], [1.0, 30.0], [1.0, 50.0]])
    advantages = multi_reward_advantages(components, None, [1.0, 1.0], 2, aggregation="normalize_then_sum")
    torch.testing.assert_close(advantages, expected)
    # summing first lets the length reward decide alone: [11, 20 | 31, 51] -> the correct answer gets A < 0
    summed_first = multi_reward_advantages(components, None, [1.0, 1.0], 2)
    assert summed_first[0].item() < 0 < advantages[0].item() + 1e-3  # GDPO: ~0 instead of -0.707


def test_sum_then_normalize_is_todays_advantage():
    components = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    weights = [1.0, 0.1]
    total = torch.zeros(4)
    for k, w in enumerate(weights):  # how scoring.py sums: reward by reward in float32
        total += w * components[:, k]
    assert torch.equal(weighted_reward_sum(components, torch.ones(4, 2, dtype=torch.bool), weights), total)
    assert torch.equal(multi_reward_advantages(components, None, weights, 4), compute_group_advantages(total, 4))


def test_rewards_that_do_not_apply():
    # G = 4, weights [1, 0.5]; r1 = [1, 0, 1, None], r2 = [None, 1, 1, None]
    # totals over what applies: [1, 0.5, 1.5, -]; sample 3 has no reward: advantage 0, out of the statistics
    # mean of [1, 0.5, 1.5] = 1, centred [0, -0.5, 0.5], Bessel std sqrt(0.5 / 2) = 0.5
    components = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    applies = torch.tensor([[True, False], [True, True], [True, True], [False, False]])
    advantages = multi_reward_advantages(components, applies, [1.0, 0.5], 4)
    torch.testing.assert_close(advantages, torch.tensor([0.0, -0.5 / 0.5001, 0.5 / 0.5001, 0.0]))
    # GDPO: r1 over samples 0-2 = [1, 0, 1]: mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 2) = 0.577350;
    # r2 over samples 1-2 = [1, 1]: flat -> 0. Sample 3 stays exactly 0.
    gdpo = multi_reward_advantages(components, applies, [1.0, 0.5], 4, aggregation="normalize_then_sum")
    assert gdpo[3].item() == 0.0
    s = 1 / 3 / (math.sqrt(1 / 3) + 1e-4)  # r1's advantage of samples 0 and 2; sample 1 gets -2 s
    summed = [s, -2 * s, s]
    std = math.sqrt(sum(x ** 2 for x in summed) / 2)  # batch mean 0
    torch.testing.assert_close(gdpo[:3], torch.tensor([x / (std + 1e-4) for x in summed]))


# ----------------------------------------------------------------------------------------------------
# Entropy


def test_entropy_comes_out_of_the_chunked_log_softmax():
    # V = 4 uniform: H = ln 4 = 1.386294. V = 2 (pad with -1e4) p = [.25, .75]:
    #   H = .25 ln 4 + .75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # temperature 2 on [0, ln 3]: p ~ [1, sqrt3] = [0.366025, 0.633975], H = 0.656806
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, LN(3), -1e4, -1e4]]], dtype=torch.float64)
    targets = torch.tensor([[0, 1]])
    logprobs, entropy = token_logprobs_from_logits(logits, targets, chunk_size=1, with_entropy=True)
    torch.testing.assert_close(entropy, torch.tensor([[LN(4), 0.25 * LN(4) + 0.75 * LN(4 / 3)]]))
    torch.testing.assert_close(logprobs, torch.tensor([[LN(0.25), LN(0.75)]]))
    p = [1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))]
    _, hot = token_logprobs_from_logits(logits, targets, temperature=2.0, with_entropy=True)
    assert hot[0, 1].item() == pytest.approx(-sum(q * LN(q) for q in p), abs=1e-6)
    assert hot[0, 1].item() == pytest.approx(0.656806, abs=1e-6)


def test_entropy_gradient_only_when_asked():
    # dH/dz_v = -p_v (ln p_v + H): p = [.25, .75], H = 0.562335 -> [0.205990, -0.205990]
    logits = torch.tensor([[[0.0, LN(3)]]], requires_grad=True)
    _, entropy = token_logprobs_from_logits(logits, torch.tensor([[1]]), with_entropy=True, entropy_grad=True)
    entropy.sum().backward()
    h = 0.25 * LN(4) + 0.75 * LN(4 / 3)
    expected = torch.tensor([[[-0.25 * (LN(0.25) + h), -0.75 * (LN(0.75) + h)]]])
    torch.testing.assert_close(logits.grad, expected)
    assert expected[0, 0, 0].item() == pytest.approx(0.205990, abs=1e-6)
    _, logged = token_logprobs_from_logits(logits, torch.tensor([[1]]), with_entropy=True)
    assert not logged.requires_grad  # logging keeps nothing alive for backward


def test_high_entropy_mask_keeps_the_top_quantile():
    # entropies 0.1, 0.5, 0.9, 1.3 (+ a padded 9.0): the 0.5 quantile of the four, linear, is 0.5 + 0.5 * 0.4 = 0.7
    entropy = torch.tensor([[0.1, 0.5, 9.0], [0.9, 1.3, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[False, False, False], [True, True, False]]
    assert high_entropy_mask(entropy, mask, 0.0).tolist() == [[False, False, False], [False, True, False]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == [[True, True, False], [True, True, False]]


def test_top_entropy_quantile_sends_the_gradient_through_high_entropy_tokens_only():
    # on-policy, A = [1, 1], grpo per-sequence mean over 2 completions of 2 tokens: -A / (2 * 2) = -0.25 per
    # kept token; q = 0.5 keeps row 1 only (entropies 0.9, 1.3 vs 0.1, 0.5)
    entropy = torch.tensor([[0.1, 0.5], [0.9, 1.3]], dtype=torch.float64)
    settings = LossSettings(top_entropy_quantile=0.5)
    _, grad, stats = loss_and_grad([[LN(0.5)] * 2] * 2, None, [1.0, 1.0], settings=settings, entropy=entropy)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]], dtype=torch.float64))
    assert stats.entropy.item() == pytest.approx((0.1 + 0.5 + 0.9 + 1.3) / 4)
    with pytest.raises(ValueError, match="entropies"):
        loss_and_grad([[0.0]], None, [1.0], settings=settings)


def test_entropy_bonus():
    # loss -= coef * sum(H * mask) / num_tokens: coef 0.1 over 3 real tokens -> -0.1 * (1 + 2 + 3) / 3 = -0.2;
    # dloss/dH = -0.1 / 3 on real tokens, 0 on padding. A = 0, so the policy term is 0.
    entropy = torch.tensor([[1.0, 2.0], [3.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    logprobs = torch.zeros(2, 2, requires_grad=True)
    loss, _ = variant_loss(logprobs, None, None, torch.zeros(2), mask, entropy=entropy,
                        settings=LossSettings(entropy_coef=0.1, loss_type="bnpo"))
    loss.backward()
    assert loss.item() == pytest.approx(-0.2)
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]]))


def test_entropy_bonus_sums_over_micro_batches():
    # the bonus divides by the optimizer batch's token count, so two halves add up to the whole
    entropy = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    mask = torch.ones(2, 2)
    settings = LossSettings(entropy_coef=0.5, loss_type="bnpo")
    norm = LossNormaliser(2.0, 4.0, 2)
    whole, _ = variant_loss(torch.zeros(2, 2), None, None, torch.zeros(2), mask, entropy=entropy, settings=settings,
                         normaliser=norm)
    halves = sum(variant_loss(torch.zeros(1, 2), None, None, torch.zeros(1), mask[i:i + 1], entropy=entropy[i:i + 1],
                           settings=settings, normaliser=norm)[0] for i in range(2))
    assert whole.item() == pytest.approx(-0.5 * 11 / 4)
    assert halves.item() == pytest.approx(whole.item())


# ----------------------------------------------------------------------------------------------------
# Sampler importance sampling: w = pi_old / pi_sampler, truncated (min(w, C)) or masked (0 where w > C)


SAMPLER_OLD = [[LN(0.5), LN(0.5), 0.0], [LN(0.5), LN(0.5), 0.0]]
# row 0: old - sampler = ln 2, ln 4 -> w = 2, 4 (sequence: 8); row 1: ln 0.5, ln 1.5 -> 0.5, 1.5 (sequence 0.75)
SAMPLER = [[LN(0.25), LN(0.125), 5.0], [LN(1.0), LN(1 / 3), -5.0]]  # the third column is padding
SAMPLER_MASK = [[1, 1, 0], [1, 1, 0]]


@pytest.mark.parametrize(("mode", "expected"), [
    ("token_truncate", [[2.0, 3.0], [0.5, 1.5]]),  # min(w, 3)
    ("token_mask", [[2.0, 0.0], [0.5, 1.5]]),  # 0 where w > 3
    ("sequence_truncate", [[3.0, 3.0], [0.75, 0.75]]),  # min(8, 3), min(0.75, 3)
    ("sequence_mask", [[0.0, 0.0], [0.75, 0.75]]),  # 8 > 3: the whole completion
])
def test_rollout_importance_weights(mode, expected):
    old, sampler = torch.tensor(SAMPLER_OLD), torch.tensor(SAMPLER)
    weights = rollout_importance_weights(old, sampler, torch.tensor(SAMPLER_MASK), mode, 3.0)
    torch.testing.assert_close(weights[:, :2], torch.tensor(expected))
    # in the loss (on-policy, A = 1, grpo: 2 completions x 2 tokens): gradient -w / 4 per token
    settings = LossSettings(rollout_is=mode, rollout_is_threshold=3.0)
    _, grad, stats = loss_and_grad(SAMPLER_OLD, None, [1.0, 1.0], mask=SAMPLER_MASK, settings=settings,
                                   sampler_logprobs=sampler.double())
    torch.testing.assert_close(grad[:, :2], -torch.tensor(expected, dtype=torch.float64) / 4)
    assert stats.rollout_is_weight_mean.item() == pytest.approx(sum(map(sum, expected)) / 4)


def test_rollout_is_needs_sampler_logprobs_and_is_off_by_default():
    with pytest.raises(ValueError, match="sampler"):
        loss_and_grad([[0.0]], None, [1.0], settings=LossSettings(rollout_is="token_truncate"))
    assert rollout_importance_weights(torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), "none", 3.0) is None


def test_logprob_gap():
    # |[-1, -2] - [-1.5, -2]| over the first two tokens (third is padding): mean 0.25, max 0.5
    mean, largest = logprob_gap(torch.tensor([[-1.0, -2.0, 9.0]]), torch.tensor([[-1.5, -2.0, 0.0]]),
                                torch.tensor([[1, 1, 0]]))
    assert (mean, largest) == (0.25, 0.5)


# ----------------------------------------------------------------------------------------------------
# Settings and config


def test_default_settings_reproduce_the_legacy_keywords_exactly():
    generator = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(4, 5, generator=generator) * 3
    old = logprobs - 0.3 * torch.randn(4, 5, generator=generator)
    ref = logprobs - 0.2 * torch.randn(4, 5, generator=generator)
    advantages, mask = torch.randn(4, generator=generator), torch.ones(4, 5)
    config = GRPOConfig()
    legacy, _ = variant_loss(logprobs, old, ref, advantages, mask, clip_epsilon=0.2, clip_epsilon_high=0.2, kl_beta=0.01)
    from_config = LossSettings.from_config(config)
    settings, _ = variant_loss(logprobs, old, ref, advantages, mask, settings=from_config)
    assert torch.equal(legacy, settings)


@pytest.mark.parametrize(("changes", "message"), [
    ({"delta": 1.1}, "delta=1.1 must be > 1 + clip_epsilon_high"),
    ({"clip_ratio_c": 0.9}, "clip_ratio_c=0.9 must be > 1"),
    ({"loss_type": "cispo", "delta": 4.0}, "cap the clipped objective"),
    ({"sapo_temperature_neg": 0.0}, "sapo_temperature_pos and sapo_temperature_neg must be > 0"),
    ({"kl_loss_type": "k4"}, "kl_loss_type='k4'; choose one of ['k1', 'k2', 'k3']"),
    ({"multi_objective_aggregation": "max"}, "multi_objective_aggregation='max'"),
    ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "none"}, "leave scale_rewards"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5 must be in [0, 1]"),
    ({"entropy_coef": math.inf}, "entropy_coef=inf must be a finite number"),
    ({"rollout_is": "token"}, "rollout_is='token'; choose one of"),
    ({"rollout_is_threshold": 0.5}, "rollout_is_threshold=0.5 must be >= 1"),
])
def test_bad_catalogue_settings_are_rejected(changes, message):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**changes).validate()
    assert message in str(error.value)


def test_every_catalogue_value_validates():
    for changes in ({"loss_type": "cispo", "clip_epsilon_high": 4.0}, {"loss_type": "sapo"}, {"delta": 4.0},
                    {"clip_ratio_c": 3.0}, {"kl_loss_type": "k1"}, {"kl_loss_type": "k2"},
                    {"scale_rewards": "rloo"}, {"scale_rewards": "reinforce_plus_plus_baseline"},
                    {"multi_objective_aggregation": "normalize_then_sum"}, {"top_entropy_quantile": 0.2},
                    {"entropy_coef": 0.01}, {"rollout_is": "sequence_mask", "rollout_is_threshold": 2.0}):
        GRPOConfig(**changes).validate()


def test_entropy_bonus_with_the_top_quantile_acts_on_the_high_entropy_tokens():
    # entropies 1, 2 | 3, 5 (all four tokens in the loss); top_entropy_quantile 0.5 keeps the tokens at or above
    # the 0.5 quantile of {1, 2, 3, 5} = 2.5: 3 and 5. The bonus is their mean, (3 + 5) / 2 = 4, times 0.1, so
    # d loss / d H = -0.1 / 2 on each of them and 0 on the others (the policy term is 0: zero advantages).
    entropy = torch.tensor([[1.0, 2.0], [3.0, 5.0]], requires_grad=True)
    mask = torch.ones(2, 2)
    loss, _ = variant_loss(torch.zeros(2, 2), None, None, torch.zeros(2), mask, entropy=entropy,
                           settings=LossSettings(entropy_coef=0.1, top_entropy_quantile=0.5, loss_type="bnpo"))
    assert loss.item() == pytest.approx(-0.1 * 4.0)
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[0.0, 0.0], [-0.05, -0.05]]))


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V3.2: the bias-corrected KL and the off-policy sequence mask


def test_bias_corrected_kl_weights_the_kl_by_the_ratio():
    # one token: logp = ln .5, old = ln .25 (ratio 2), ref = ln .25: k3 = e^(ref - logp) - (ref - logp) - 1
    # = 0.5 + ln 2 - 1 = 0.193147; zero advantage, so the loss is beta x ratio x k3 = 0.1 x 2 x 0.193147.
    # d/dlogp (ratio x k3) = ratio x k3 + ratio x (1 - e^(ref - logp)) = 0.386294 + 2 x 0.5 = 1.386294, x beta.
    for corrected, value, grad in ((True, 0.1 * 2 * 0.193147, 0.1386294), (False, 0.1 * 0.193147, 0.05)):
        loss, g, _ = loss_and_grad([[LN(0.5)]], [[LN(0.25)]], [0.0], ref=[[LN(0.25)]],
                                   settings=LossSettings(kl_beta=0.1, loss_type="bnpo", kl_bias_correction=corrected))
        assert loss == pytest.approx(value, abs=1e-6)
        assert g[0, 0].item() == pytest.approx(grad, abs=1e-6)


def test_off_policy_sequence_mask_drops_stale_negative_completions():
    # two one-token completions, A = +1 and -1, logp = ln .5 (ratio 1 with no old log-probs); the sampler gave
    # both ln .9: gap ln .9 - ln .5 = 0.5878. Threshold 0.5: the negative one is dropped, loss (-1 + 0) / 2;
    # threshold 0.6 keeps both, loss (-1 + 1) / 2 = 0. d loss / d logp = -A x ratio / 2 where kept.
    sampler = torch.tensor([[LN(0.9)], [LN(0.9)]], dtype=torch.float64)
    for threshold, value, grad in ((0.5, -0.5, [[-0.5], [0.0]]), (0.6, 0.0, [[-0.5], [0.5]])):
        loss, g, _ = loss_and_grad([[LN(0.5)], [LN(0.5)]], None, [1.0, -1.0], sampler_logprobs=sampler,
                                   settings=LossSettings(loss_type="bnpo", off_policy_mask_threshold=threshold))
        assert loss == pytest.approx(value, abs=1e-9)
        torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64))


def test_the_config_carries_both_knobs_and_trls_name():
    config = GRPOConfig(use_bias_correction_kl=True, off_policy_mask_threshold=0.5)
    settings = LossSettings.from_config(config)
    assert settings.kl_bias_correction and settings.off_policy_mask_threshold == 0.5
    assert not LossSettings.from_config(GRPOConfig()).kl_bias_correction
