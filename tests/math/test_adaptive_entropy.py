"""Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy), against values worked out by hand."""

import math

import pytest

from forge import GRPOConfig
from forge.core.grpo import EntropyControl
from forge.core.loss_variants import adapted_entropy_coef, applied_entropy_coef


@pytest.mark.parametrize(("coef", "entropy", "expected"), [
    (0.01, 0.10, 0.015),   # at or below the target 0.2: up by delta 0.005
    (0.01, 0.20, 0.015),   # exactly at the target counts as below
    (0.01, 0.30, 0.005),   # above: down by delta
    (0.998, 0.10, 1.0),    # 1.003 held at the ceiling 1.0
    (0.002, 0.30, 0.0),    # -0.003 held at the floor 0.0
])
def test_the_coefficient_moves_by_delta_toward_the_target_within_its_bounds(coef, entropy, expected):
    assert adapted_entropy_coef(coef, entropy, target=0.2, delta=0.005, low=0.0, high=1.0) == pytest.approx(expected)


@pytest.mark.parametrize(("last", "expected"), [(None, 0.0), (0.3, 0.0), (0.2, 0.05), (0.1, 0.05)])
def test_the_bonus_acts_only_while_the_last_entropy_is_at_or_below_the_target(last, expected):
    assert applied_entropy_coef(0.05, last, target=0.2) == expected


def test_a_run_of_steps_applies_the_coefficient_of_the_step_before():
    # entropies 0.5, 0.1, 0.1, 0.5 with coef 0.01, target 0.2, delta 0.005:
    #   step 1 applies 0 (no entropy known yet),      then 0.5 > 0.2: coef 0.005
    #   step 2 applies 0 (0.5 was above the target),  then 0.1:       coef 0.010
    #   step 3 applies 0.010,                         then 0.1:       coef 0.015
    #   step 4 applies 0.015,                         then 0.5:       coef 0.010
    control = EntropyControl(0.01, adaptive=True, target=0.2, delta=0.005)
    applied = []
    for entropy in (0.5, 0.1, 0.1, 0.5):
        applied.append(control.applied)
        control = control.observed(entropy)
    assert applied == pytest.approx([0.0, 0.0, 0.010, 0.015])
    assert control.coef == pytest.approx(0.010) and control.last_entropy == 0.5
    assert control.observed(math.nan) == control and control.observed(None) == control  # a skipped step


def test_a_fixed_coefficient_is_applied_from_the_first_step_and_never_moves():
    control = GRPOConfig(entropy_coef=0.02).entropy_control
    assert control.applied == 0.02 and control.observed(0.0).applied == 0.02


def test_trl_names_and_bad_bounds():
    config = GRPOConfig(use_adaptive_entropy=True, entropy_target=0.3, entropy_coef_delta=0.01)
    assert config.adaptive_entropy and config.entropy_control == EntropyControl(0.0, True, 0.3, 0.01, 0.0, 1.0)
    with pytest.raises(ValueError, match="entropy_coef_min <= entropy_coef_max"):
        GRPOConfig(adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1).validate()
