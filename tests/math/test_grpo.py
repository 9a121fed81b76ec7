"""GRPO math: advantages, log-probs, k3 KL and every loss variant, checked against hand-derived numbers.

Every expected value below is worked out in the comments next to it, never by calling the code under test.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses import variant_loss

from forge.core.grpo import (
    LOSS_AGGREGATIONS,
    LossNormaliser,
    compute_group_advantages,
    group_reward_std,
    k3_kl,
    masked_mean,
)
from forge.core.logprobs import token_logprobs_from_logits

LOSS_TYPES = sorted(LOSS_AGGREGATIONS)  # bnpo, dapo, dr_grpo, grpo
LN2 = math.log(2.0)

# ----------------------------------------------------------------------------------------------------
# Advantages


def test_advantages_single_group_of_eight():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    # mean = 4/8 = 0.5, every deviation is +-0.5, Bessel std = sqrt(8 * 0.25 / 7) = sqrt(2/7) = 0.534522
    # A = +-0.5 / (0.534522 + 1e-4) = +-0.935239 (the original Forge README quotes ~ +-0.94)
    std = math.sqrt(8 * 0.25 / 7)
    assert std == pytest.approx(0.534522, abs=1e-6)
    a = 0.5 / (std + 1e-4)
    assert a == pytest.approx(0.935239, abs=1e-6)
    expected = torch.tensor([a, a, -a, -a, a, -a, -a, a])
    advantages = compute_group_advantages(rewards, group_size=8)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert advantages.sum().abs() < 1e-6  # centred


def test_two_groups_are_normalised_independently():
    # group 1: [1, 0, 0, 0] mean 0.25, deviations [.75, -.25, -.25, -.25],
    #          Bessel var = (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
    # group 2: [10, 10, 10, 0] mean 7.5, deviations [2.5, 2.5, 2.5, -7.5],
    #          var = (3 * 6.25 + 56.25) / 3 = 25 -> std 5
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 10.0, 10.0, 10.0, 0.0])
    g1 = [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001]  # 1.49970, -0.49990
    g2 = [2.5 / 5.0001, 2.5 / 5.0001, 2.5 / 5.0001, -7.5 / 5.0001]  # 0.49999, -1.49997
    advantages = compute_group_advantages(rewards, group_size=4)
    torch.testing.assert_close(advantages, torch.tensor(g1 + g2), atol=1e-6, rtol=0)
    torch.testing.assert_close(group_reward_std(rewards, 4), torch.tensor([0.5, 5.0]))


def test_equal_rewards_give_exactly_zero():
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 0.0])
    advantages = compute_group_advantages(rewards, group_size=4)
    assert torch.equal(advantages[:4], torch.zeros(4))  # exactly, not approximately
    for scale in ("group", "batch", "none"):
        assert torch.equal(compute_group_advantages(torch.full((6,), 3.0), 3, scale=scale), torch.zeros(6))


def test_batch_scale_uses_the_batch_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    # group means 0.25 and 0.75 -> centred [.75, -.25, -.25, -.25, .25, .25, .25, -.75]
    # batch: mean 0.5, all deviations +-0.5 -> std sqrt(2/7) = 0.534522 shared by every completion
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    expected = centred / (math.sqrt(2 / 7) + 1e-4)  # 0.75 / 0.534622 = 1.402859
    advantages = compute_group_advantages(rewards, group_size=4, scale="batch")
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert advantages[0].item() == pytest.approx(1.402859, abs=1e-5)
    # with the group std (0.5 and 0.5) the same completion would get 0.75 / 0.5001 = 1.49970
    assert compute_group_advantages(rewards, 4)[0].item() == pytest.approx(1.49970, abs=1e-5)


def test_scale_none_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 3.0])
    # Dr. GRPO: A = r - group mean, no division at all; means 0.25 and 2.0
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0, -1.0, 1.0])
    torch.testing.assert_close(compute_group_advantages(rewards, 4, scale="none"), expected, atol=1e-7, rtol=0)


@pytest.mark.parametrize("rewards, group_size", [
    (torch.zeros(7), 4),  # not a multiple of the group size
    (torch.zeros(2, 4), 4),  # 2-D
    (torch.tensor(1.0), 1),  # 0-D
])
def test_bad_reward_shapes_raise(rewards, group_size):
    with pytest.raises(ValueError, match="group_size"):
        compute_group_advantages(rewards, group_size)


# ----------------------------------------------------------------------------------------------------
# Log-probs


@pytest.mark.parametrize("chunk_size", [1, 3, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_log_softmax_gather(chunk_size, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator) * 3  # (B, T, V); 10 positions: chunks of 3 leave 1
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    got = token_logprobs_from_logits(logits, targets, temperature=temperature, chunk_size=chunk_size)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_token_logprobs_hand_values_and_gradient():
    # logits [0, ln 3] -> softmax [1/4, 3/4]: log p(1) = ln 0.75, log p(0) = ln 0.25
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], requires_grad=True)  # (1, 2, 2)
    got = token_logprobs_from_logits(logits, torch.tensor([[1, 0]]), chunk_size=1)
    torch.testing.assert_close(got, torch.tensor([[math.log(0.75), math.log(0.25)]]))
    # d log p(y) / d logit_v = 1[v = y] - p_v: [-0.25, 0.25] for y = 1 and [0.75, -0.75] for y = 0
    got.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25], [0.75, -0.75]]]))
    # temperature 0.5 doubles the logits: [0, ln 9] -> [0.1, 0.9]
    got = token_logprobs_from_logits(logits.detach(), torch.tensor([[1, 0]]), temperature=0.5)
    torch.testing.assert_close(got, torch.tensor([[math.log(0.9), math.log(0.1)]]))


def test_shifted_token_logprobs_mask_prompt_and_padding():
    # one sequence of 5 tokens over a vocabulary of 2: [prompt, prompt, resp, resp, pad]
    # every logit row is [0, ln 3] -> log p(0) = ln 0.25, log p(1) = ln 0.75
    logits = torch.tensor([0.0, math.log(3.0)]).repeat(1, 5, 1)  # (1, 5, 2)
    input_ids = torch.tensor([[1, 0, 1, 0, 0]])
    response_mask = torch.tensor([[0, 0, 1, 1, 0]])
    got = token_logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]) * response_mask[:, 1:]  # (1, 4)
    # entry t scores input_ids[t + 1] under response_mask[t + 1]: [prompt 0 -> 0, ln .75, ln .25, pad -> 0]
    expected = torch.tensor([[0.0, math.log(0.75), math.log(0.25), 0.0]])
    torch.testing.assert_close(got, expected)
    assert got.shape == (1, 4)


def test_masked_mean_per_sequence_and_whole():
    token_logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -100.0, -100.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # (-1 - 2 - 3) / 3 = -2; -4 / 1 = -4 (the -100s are masked); an empty row gives 0, not NaN
    torch.testing.assert_close(masked_mean(token_logprobs, mask, dim=1), torch.tensor([-2.0, -4.0, 0.0]))
    # the whole-tensor masked mean: (-6 - 4) / 4 = -2.5
    torch.testing.assert_close(masked_mean(token_logprobs, mask), torch.tensor(-2.5))


# ----------------------------------------------------------------------------------------------------
# k3 KL


def test_k3_kl_hand_values():
    # d = ref - logp; kl = exp(d) - d - 1
    # logp = ln .5, ref = ln .25: d = ln .5 -> 0.5 - ln 0.5 - 1 = -0.5 + 0.693147 = 0.193147
    # logp = ln .5, ref = ln 1:   d = ln 2  -> 2 - ln 2 - 1 = 1 - 0.693147 = 0.306853
    # logp = 0, ref = -3:         d = -3    -> e^-3 + 3 - 1 = 0.049787 + 2 = 2.049787
    logp = torch.tensor([math.log(0.5), math.log(0.5), 0.0])
    ref = torch.tensor([math.log(0.25), 0.0, -3.0])
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([0.193147, 0.306853, 2.049787]), atol=1e-6, rtol=0)


def test_k3_kl_is_exactly_zero_when_equal():
    logp = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(k3_kl(logp, logp.clone()), torch.zeros(4, 7))


def test_k3_kl_keeps_the_second_order_term_for_close_policies():
    # for small d, exp(d) - d - 1 = d^2 / 2 + d^3 / 6 + ...; d = 1e-3 -> 5.0017e-7, d = 3e-4 -> 4.5e-8
    # (in float32 the naive exp(d) - d - 1 returns 4.77e-7 and 0.0 here, and -6e-8 for d = 4e-8)
    delta = torch.tensor([1e-3, 3e-4, 4e-8])
    expected = torch.tensor([1e-6 / 2 + 1e-9 / 6, 9e-8 / 2, 16e-16 / 2])
    got = k3_kl(torch.zeros(3), delta)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-15)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=16),
    st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=16),
)
def test_k3_kl_is_never_negative(logp, ref):
    n = min(len(logp), len(ref))
    assert (k3_kl(torch.tensor(logp[:n]), torch.tensor(ref[:n])) >= 0).all()


def test_k3_kl_is_never_negative_on_random_tensors():
    generator = torch.Generator().manual_seed(2)
    logp = torch.randn(1000, generator=generator) * 5
    ref = logp + torch.randn(1000, generator=generator) * torch.logspace(-9, 0, 1000)  # tiny to large gaps
    assert (k3_kl(logp, ref) >= 0).all()


# ----------------------------------------------------------------------------------------------------
# The loss on one hand-built batch
#
# B = 2 completions, T = 3 positions; completion 1 has one padded position. clip_epsilon = 0.2 and
# clip_epsilon_high = 0.28 (DAPO clip-higher): the ratio is clipped to [0.8, 1.28]. kl_beta = 0.1.
#
#   row 0: A = +0.5, ratios [1.5, 0.5, 1.1],  d = ref - logp = [ln .5, 0, ln 2]
#   row 1: A = -2.0, ratios [0.5, 1.5, (0.1)], d = [ln 2, ln .5, (5)]        (last position padded)
#
# pg_t = max(-A r, -A clip(r, 0.8, 1.28)):
#   row 0 t0: max(-0.75, -0.64) = -0.64  clipped high (A > 0, r > 1.28)
#   row 0 t1: max(-0.25, -0.40) = -0.25  not clipped (A > 0 only clips above)
#   row 0 t2: max(-0.55, -0.55) = -0.55
#   row 1 t0: max( 1.00,  1.60) =  1.60  clipped low (A < 0, r < 0.8)
#   row 1 t1: max( 3.00,  2.56) =  3.00  not clipped (A < 0 only clips below)
# kl_t = exp(d) - d - 1: kl(ln .5) = 0.193147, kl(0) = 0, kl(ln 2) = 0.306853; kl(ln .5) + kl(ln 2) = 0.5
#   per_t = pg_t + 0.1 kl_t:
#   row 0: [-0.64 + 0.0193147, -0.25, -0.55 + 0.0306853] -> sum = -1.44 + 0.05 = -1.39 over 3 tokens
#   row 1: [ 1.60 + 0.0306853,  3.00 + 0.0193147]        -> sum =  4.60 + 0.05 =  4.65 over 2 tokens

KL_HALF, KL_TWO = 0.5 - math.log(0.5) - 1, 2 - LN2 - 1  # 0.193147, 0.306853


def hand_batch(dtype=torch.float32):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=dtype)
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 0.1]], dtype=dtype)
    deltas = torch.tensor([[math.log(0.5), 0.0, LN2], [LN2, math.log(0.5), 5.0]], dtype=dtype)
    old_logprobs = logprobs - ratios.log()  # logp - old = ln r
    ref_logprobs = logprobs + deltas  # ref - logp = d
    advantages = torch.tensor([0.5, -2.0], dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs.requires_grad_(), old_logprobs, ref_logprobs, advantages, mask


HAND_KW = {"clip_epsilon": 0.2, "clip_epsilon_high": 0.28, "kl_beta": 0.1}

HAND_LOSS = {
    "grpo": (-1.39 / 3 + 4.65 / 2) / 2,  # per-sequence mean, then mean over B = 2: 0.930833
    "bnpo": (-1.39 + 4.65) / 5,  # token mean over 5 tokens: 0.652
    "dapo": (-1.39 + 4.65) / 5,
    "dr_grpo": (-1.39 + 4.65) / (2 * 3),  # / (B * T) with T the padded width: 0.543333
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_hand_batch_loss(loss_type):
    logprobs, old, ref, advantages, mask = hand_batch()
    loss, _ = variant_loss(logprobs, old, ref, advantages, mask, loss_type=loss_type, **HAND_KW)
    assert loss.item() == pytest.approx(HAND_LOSS[loss_type], abs=1e-6)


def test_dr_grpo_uses_the_given_max_completion_length():
    logprobs, old, ref, advantages, mask = hand_batch()
    norm = LossNormaliser(num_sequences=2, num_tokens=5, max_completion_length=4)
    loss, _ = variant_loss(logprobs, old, ref, advantages, mask, loss_type="dr_grpo", normaliser=norm, **HAND_KW)
    assert loss.item() == pytest.approx(3.26 / (2 * 4), abs=1e-6)  # 0.4075


def test_hand_batch_gradient_is_zero_where_clipped():
    logprobs, old, ref, advantages, mask = hand_batch()
    loss, _ = variant_loss(logprobs, old, ref, advantages, mask, loss_type="grpo", **HAND_KW)
    loss.backward()
    # d pg / d logp = -A r where not clipped, 0 where clipped; d kl / d logp = 1 - exp(d);
    # the 'grpo' aggregation divides token t of row i by |o_i| * B: 6 for row 0, 4 for row 1
    expected = torch.tensor([
        [(0 + 0.1 * (1 - 0.5)) / 6,  # clipped high: only the KL term: 0.0083333
         (-0.5 * 0.5 + 0.1 * (1 - 1)) / 6,  # -0.0416667
         (-0.5 * 1.1 + 0.1 * (1 - 2)) / 6],  # -0.1083333
        [(0 + 0.1 * (1 - 2)) / 4,  # clipped low: -0.025
         (2.0 * 1.5 + 0.1 * (1 - 0.5)) / 4,  # 0.7625
         0.0],  # padding
    ])
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=0)


def test_hand_batch_stats():
    logprobs, old, ref, advantages, mask = hand_batch()
    _, stats = variant_loss(logprobs, old, ref, advantages, mask, loss_type="grpo", **HAND_KW)
    # over the 5 real tokens (the padded ratio 0.1 with A < 0 would count as clipped low if not masked)
    assert stats.clip_frac_low.item() == pytest.approx(1 / 5)  # row 1 t0
    assert stats.clip_frac_high.item() == pytest.approx(1 / 5)  # row 0 t0
    assert stats.clip_frac.item() == pytest.approx(2 / 5)
    assert stats.ratio_mean.item() == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5)  # 1.02
    assert stats.kl.item() == pytest.approx((KL_HALF + 0 + KL_TWO + KL_TWO + KL_HALF) / 5, abs=1e-6)  # 0.2
    assert stats.kl.item() == pytest.approx(0.2, abs=1e-6)
    # policy_loss leaves the KL out: (-1.44 / 3 + 4.60 / 2) / 2 = (-0.48 + 2.3) / 2 = 0.91
    assert stats.policy_loss.item() == pytest.approx(0.91, abs=1e-6)
    assert all(not value.requires_grad for value in stats)


def test_symmetric_clip_when_high_is_none():
    logprobs, old, ref, advantages, mask = hand_batch()
    _, stats = variant_loss(logprobs, old, ref, advantages, mask, clip_epsilon=0.2)
    # clip range [0.8, 1.2]: row 0 t0 (1.5, A > 0) clips high, row 1 t0 (0.5, A < 0) clips low
    # pg: row 0 [max(-.75, -.6) = -.6, -.25, -.55] sum -1.4; row 1 [1.6, max(3, 2.4) = 3] sum 4.6
    assert stats.policy_loss.item() == pytest.approx((-1.4 / 3 + 4.6 / 2) / 2, abs=1e-6)  # 0.916667
    assert stats.clip_frac.item() == pytest.approx(2 / 5)


def test_kl_beta_needs_ref_logprobs():
    logprobs, old, _, advantages, mask = hand_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        variant_loss(logprobs, old, None, advantages, mask, kl_beta=0.1)
    _, stats = variant_loss(logprobs, old, None, advantages, mask, kl_beta=0.0)
    assert stats.kl.item() == 0.0


# GSPO: one ratio per sequence, exp(masked mean of logp - old):
#   row 0: (ln 1.5 + ln 0.5 + ln 1.1) / 3 -> r = (1.5 * 0.5 * 1.1) ** (1/3) = 0.825 ** (1/3) = 0.937888
#   row 1: (ln 0.5 + ln 1.5) / 2           -> r = (0.5 * 1.5) ** (1/2) = 0.75 ** 0.5 = 0.866025
#   (the padded ratio 0.1 stays out of the mean). Both inside [0.8, 1.28], so nothing is clipped:
#   pg row 0 = -0.5 * 0.937888 = -0.468944 per token; pg row 1 = 2 * 0.866025 = 1.732051 per token
GSPO_R0, GSPO_R1 = 0.825 ** (1 / 3), 0.75 ** 0.5


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_sequence_level_hand_batch(loss_type):
    logprobs, old, ref, advantages, mask = hand_batch()
    loss, stats = variant_loss(logprobs, old, ref, advantages, mask, loss_type=loss_type,
                            importance_sampling_level="sequence", **HAND_KW)
    row0 = 3 * (-0.5 * GSPO_R0) + 0.1 * 0.5  # three tokens + 0.1 * (kl sum 0.5) = -1.356833
    row1 = 2 * (2.0 * GSPO_R1) + 0.1 * 0.5  # = 3.514102
    expected = {
        "grpo": (row0 / 3 + row1 / 2) / 2,
        "bnpo": (row0 + row1) / 5,
        "dapo": (row0 + row1) / 5,
        "dr_grpo": (row0 + row1) / 6,
    }[loss_type]
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.ratio_mean.item() == pytest.approx((3 * GSPO_R0 + 2 * GSPO_R1) / 5, abs=1e-6)
    assert stats.clip_frac.item() == 0.0


def test_gspo_clips_whole_sequences():
    # row 0: A = +1, ratios [2, 2, 2] -> r = 2 > 1.28, clipped to 1.28: pg = -1.28 per token, gradient 0
    # row 1: A = -1, ratios [0.25, 1] -> r = sqrt(0.25) = 0.5 < 0.8, clipped to 0.8: pg = 0.8, gradient 0
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    old = logprobs.detach() - torch.tensor([[LN2, LN2, LN2], [math.log(0.25), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = variant_loss(logprobs, old, None, torch.tensor([1.0, -1.0]), mask, clip_epsilon_high=0.28,
                            loss_type="bnpo", importance_sampling_level="sequence")
    assert loss.item() == pytest.approx((3 * -1.28 + 2 * 0.8) / 5, abs=1e-6)  # -0.448
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert stats.clip_frac_high.item() == pytest.approx(3 / 5)  # every token of row 0
    assert stats.clip_frac_low.item() == pytest.approx(2 / 5)  # both tokens of row 1
    assert stats.ratio_mean.item() == pytest.approx((3 * 2.0 + 2 * 0.5) / 5)  # 1.4


# ----------------------------------------------------------------------------------------------------
# One update per rollout: old_logprobs = None is REINFORCE with a group baseline
#
# A = [1, -1, 0.5, -0.5], completion lengths |o| = [3, 1, 2, 2], T = 3, B = 4, 8 tokens in all.
# The ratio is exactly 1, so each token's loss is -A_i; d loss / d logp_t = -A_i / normaliser_i.

ONE_STEP_ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])
ONE_STEP_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]])
ONE_STEP = {
    # loss type: (loss, per-row gradient on each real token)
    # grpo: loss = -(1 - 1 + 0.5 - 0.5) / 4 = 0; gradient -A_i / (|o_i| * B)
    "grpo": (0.0, [-1 / (3 * 4), 1 / (1 * 4), -0.5 / (2 * 4), 0.5 / (2 * 4)]),
    # bnpo / dapo: loss = -(1*3 - 1*1 + 0.5*2 - 0.5*2) / 8 = -0.25; gradient -A_i / 8
    "bnpo": (-0.25, [-1 / 8, 1 / 8, -0.5 / 8, 0.5 / 8]),
    "dapo": (-0.25, [-1 / 8, 1 / 8, -0.5 / 8, 0.5 / 8]),
    # dr_grpo: loss = -2 / (4 * 3) = -1/6; gradient -A_i / (B * T) = -A_i / 12
    "dr_grpo": (-2 / 12, [-1 / 12, 1 / 12, -0.5 / 12, 0.5 / 12]),
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_no_old_logprobs_is_the_policy_gradient(loss_type, level):
    # GSPO with ratio exp(mean(logp - sg(logp))) = 1 has d r / d logp_t = 1 / |o_i|, and its aggregation
    # multiplies by |o_i| again for the token means, so the gradient is the same as at token level.
    logprobs = torch.randn(4, 3, generator=torch.Generator().manual_seed(3)).requires_grad_()
    loss, stats = variant_loss(logprobs, None, None, ONE_STEP_ADVANTAGES, ONE_STEP_MASK,
                            loss_type=loss_type, importance_sampling_level=level)
    expected_loss, row_grads = ONE_STEP[loss_type]
    assert loss.item() == pytest.approx(expected_loss, abs=1e-7)
    loss.backward()
    expected_grad = torch.tensor(row_grads)[:, None] * ONE_STEP_MASK
    torch.testing.assert_close(logprobs.grad, expected_grad, atol=1e-7, rtol=0)
    assert stats.ratio_mean.item() == 1.0 and stats.clip_frac.item() == 0.0


def test_no_old_logprobs_with_group_advantages_has_zero_loss():
    advantages = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    # A = [+a, -a, -a, +a] with a = 0.5 / (0.57735 + 1e-4); the 'grpo' loss is -mean(A) = 0
    logprobs = torch.randn(4, 3, generator=torch.Generator().manual_seed(4)).requires_grad_()
    loss, _ = variant_loss(logprobs, None, None, advantages, ONE_STEP_MASK)
    assert abs(loss.item()) < 1e-7


def test_equal_rewards_give_zero_policy_gradient():
    advantages = compute_group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), group_size=4)
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            logprobs = torch.randn(4, 3, generator=torch.Generator().manual_seed(5)).requires_grad_()
            old = logprobs.detach() + 0.3  # ratios != 1 do not matter when A = 0
            loss, _ = variant_loss(logprobs, old, None, advantages, ONE_STEP_MASK, kl_beta=0.0,
                                loss_type=loss_type, importance_sampling_level=level)
            loss.backward()
            assert loss.item() == 0.0
            assert torch.equal(logprobs.grad, torch.zeros(4, 3))


# ----------------------------------------------------------------------------------------------------
# Autograd, masking, micro-batches


def random_batch(seed, dtype=torch.float64, batch=4, length=5):
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, length, generator=generator, dtype=dtype) * 3
    old = logprobs + torch.randn(batch, length, generator=generator, dtype=dtype) * 0.4  # some ratios clip
    ref = logprobs + torch.randn(batch, length, generator=generator, dtype=dtype) * 0.4
    advantages = torch.randn(batch, generator=generator, dtype=dtype)
    lengths = torch.tensor([length, 2, 1, length - 1])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return logprobs, old, ref, advantages, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradcheck(loss_type, level):
    logprobs, old, ref, advantages, mask = random_batch(6)
    logprobs.requires_grad_()

    def loss_of(lp):
        return variant_loss(lp, old, ref, advantages, mask, clip_epsilon=0.2, clip_epsilon_high=0.28, kl_beta=0.05,
                         loss_type=loss_type, importance_sampling_level=level)[0]

    assert torch.autograd.gradcheck(loss_of, (logprobs,))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_positions_change_nothing(loss_type, level):
    logprobs, old, ref, advantages, mask = random_batch(7, dtype=torch.float32)
    kwargs = {"clip_epsilon_high": 0.28, "kl_beta": 0.1, "loss_type": loss_type, "importance_sampling_level": level}

    def loss_and_grad(lp, old_lp, ref_lp):
        lp = lp.clone().requires_grad_()
        loss, stats = variant_loss(lp, old_lp, ref_lp, advantages, mask, **kwargs)
        loss.backward()
        return loss, lp.grad, stats

    loss, grad, stats = loss_and_grad(logprobs, old, ref)
    padding = mask == 0
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(8)) * 3
    loss2, grad2, stats2 = loss_and_grad(torch.where(padding, logprobs + noise, logprobs),
                                         torch.where(padding, old - noise, old),
                                         torch.where(padding, ref + noise, ref))
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-6)
    torch.testing.assert_close(grad2, grad, atol=1e-6, rtol=0)
    assert torch.equal(grad[padding], torch.zeros(int(padding.sum())))
    for value, value2 in zip(stats, stats2):
        assert value2.item() == pytest.approx(value.item(), abs=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_the_full_batch(loss_type, level):
    logprobs, old, ref, advantages, mask = random_batch(9, batch=4, length=5)
    kwargs = {"clip_epsilon_high": 0.28, "kl_beta": 0.05, "loss_type": loss_type, "importance_sampling_level": level}
    # global counts over the whole optimizer batch: 4 sequences, 5 + 2 + 1 + 4 = 12 tokens, T = 5
    norm = LossNormaliser(num_sequences=4, num_tokens=12, max_completion_length=5)
    assert int(mask.sum()) == 12
    full_lp = logprobs.clone().requires_grad_()
    full, _ = variant_loss(full_lp, old, ref, advantages, mask, **kwargs)  # default normaliser = same counts
    full.backward()

    micro_lp = logprobs.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part, _ = variant_loss(micro_lp[rows], old[rows], ref[rows], advantages[rows], mask[rows],
                            normaliser=norm, **kwargs)
        part.backward()  # gradients accumulate as they do over micro-batches
        total = total + part.item()
    assert total == pytest.approx(full.item(), abs=1e-10)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Equal groups are exactly flat; masked samples stay out of the statistics


def _as_the_demo_scores(value: float, weight: float = 1.0) -> torch.Tensor:
    """Eight copies of weight x value accumulated in float32, the way scoring.py sums weighted rewards."""
    return torch.zeros(8) + weight * torch.full((8,), value)


@pytest.mark.parametrize("value", [0.7, 1.1, 100.3])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_of_equal_unrepresentable_rewards_is_exactly_flat(value, scale):
    # 0.7, 1.1 and 100.3 have no exact binary form: a float32 mean of eight copies can differ from the copies by
    # one ulp, which a std of ~6e-8 (or ~7e-6 at 100.3) and eps = 1e-4 would turn into a same-signed advantage.
    rewards = torch.cat([_as_the_demo_scores(value), torch.tensor([1.0, 0.0] * 4)])  # (16,): flat, then mixed
    advantages = compute_group_advantages(rewards, group_size=8, scale=scale)
    assert torch.equal(advantages[:8], torch.zeros(8))
    assert (advantages[8:] != 0).all()
    std = group_reward_std(rewards, 8)
    assert std[0].item() == 0.0 and std[1].item() == pytest.approx(math.sqrt(8 * 0.25 / 7), abs=1e-6)


def test_demo_reward_of_correct_plus_a_tenth_format_is_flat():
    # correctness 1 + 0.1 x format 1, summed in float32 as two weighted components
    rewards = torch.zeros(8) + 1.0 * torch.ones(8) + 0.1 * torch.ones(8)
    assert torch.equal(compute_group_advantages(rewards, 8), torch.zeros(8))
    assert group_reward_std(rewards, 8).item() == 0.0


def test_invalid_samples_are_left_out_of_the_group_statistics():
    # group 1: [1, 0, (5: invalid), 1] -> statistics of [1, 0, 1]: mean 2/3, deviations 1/3, -2/3, 1/3,
    #          Bessel var = (1/9 + 4/9 + 1/9) / 2 = 1/3, std = 0.577350; A = dev / (0.577350 + 1e-4)
    # group 2: [2, 4, 6, 8] all valid: mean 5, var = (9 + 1 + 1 + 9) / 3 = 20/3, std = 2.581989
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    s1, s2 = math.sqrt(1 / 3) + 1e-4, math.sqrt(20 / 3) + 1e-4
    expected = torch.tensor([1 / 3 / s1, -2 / 3 / s1, 0.0, 1 / 3 / s1, -3 / s2, -1 / s2, 1 / s2, 3 / s2])
    torch.testing.assert_close(compute_group_advantages(rewards, 4, valid=valid), expected, atol=1e-6, rtol=0)
    assert compute_group_advantages(rewards, 4, valid=valid)[0].item() == pytest.approx(0.577250, abs=1e-6)
    torch.testing.assert_close(group_reward_std(rewards, 4, valid), torch.tensor([math.sqrt(1 / 3),
                                                                                  math.sqrt(20 / 3)]))
    # scale='none': r - mean of the valid ones; scale='batch': std of the 7 valid rewards
    # valid rewards [1, 0, 1, 2, 4, 6, 8]: sum 22, sum of squares 122, squared deviations 122 - 22**2/7 = 52.857143,
    # Bessel std = sqrt(52.857143 / 6) = 2.968084
    batch_std = 2.968084 + 1e-4
    centred = [1 / 3, -2 / 3, 0.0, 1 / 3, -3.0, -1.0, 1.0, 3.0]
    torch.testing.assert_close(compute_group_advantages(rewards, 4, "none", valid=valid), torch.tensor(centred))
    torch.testing.assert_close(compute_group_advantages(rewards, 4, "batch", valid=valid),
                               torch.tensor(centred) / batch_std, atol=1e-6, rtol=0)


def test_a_group_with_one_valid_sample_has_no_signal():
    rewards = torch.tensor([3.0, float("nan"), float("nan"), float("nan")])
    valid = torch.tensor([True, False, False, False])
    assert torch.equal(compute_group_advantages(rewards, 4, valid=valid), torch.zeros(4))
    assert group_reward_std(rewards, 4, valid).item() == 0.0


def test_dr_grpo_divides_by_every_sampled_completion_even_when_rows_are_masked():
    # Two completions, ratio 1 (old = None): pg_t = -A. Row 0 (A = 1) keeps 3 tokens, row 1 (A = -1) is masked.
    # Dr. GRPO's constant: 2 sampled completions x max_new_tokens 4 = 8, so the loss is -3 / 8 = -0.375;
    # dividing by the 1 kept row instead would give -0.75 and make the normaliser depend on the mask.
    logprobs = torch.zeros(2, 4, requires_grad=True)
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    norm = LossNormaliser(num_sequences=1, num_tokens=3, max_completion_length=4, num_sampled=2)
    loss, _ = variant_loss(logprobs, None, None, advantages, mask, loss_type="dr_grpo", normaliser=norm)
    assert loss.item() == pytest.approx(-0.375, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1 / 8, -1 / 8, -1 / 8, 0.0], [0.0] * 4]))
    # grpo and dapo average over what is kept: 1 row of 3 tokens -> -1
    for loss_type in ("grpo", "dapo"):
        value, _ = variant_loss(logprobs, None, None, advantages, mask, loss_type=loss_type, normaliser=norm)
        assert value.item() == pytest.approx(-1.0, abs=1e-7)
