"""What a reward may return and how it may fail, whether it is a plain or an `async def` function: numpy and torch
numbers are scores like Python's, and sys.exit() / KeyboardInterrupt inside the reward is the reward's failure
(named, never a timeout) in both kinds."""

import re
import signal

import numpy as np
import pytest
import torch

from forge.core.reward_sources import build_reward_list
from forge.core.scoring import RewardError, score_completions


@pytest.fixture
def forge_sigint_handler():
    """A SIGINT handler other than Python's default is installed, as during GRPOTrainer.train()."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGINT, previous)


def failing_on_b(error, kind):
    """A reward that raises `error` when it scores the completion 'b', plain or async."""
    def plain(prompts, completions, **kwargs):
        if "b" in completions:
            raise error
        return [1.0] * len(completions)

    async def asynchronous(prompts, completions, **kwargs):
        return plain(prompts, completions)

    return plain if kind == "plain" else asynchronous


@pytest.mark.parametrize("error, shown", [
    (SystemExit(0), "SystemExit(0) (sys.exit() inside the reward"),
    (SystemExit("bye"), "SystemExit('bye')"),
    (KeyboardInterrupt(), "KeyboardInterrupt"),
])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("kind", ["plain", "async"])
def test_sys_exit_or_keyboard_interrupt_is_the_same_reward_failure_plain_or_async(error, shown, timeout, kind,
                                                                                  forge_sigint_handler):
    rewards = build_reward_list(failing_on_b(error, kind))
    with pytest.raises(RewardError, match=re.escape(f"raised {shown}") + r".* at step 4, on completion 1") as caught:
        score_completions(rewards, ["p"] * 3, ["a", "b", "c"], {}, step=4, timeout=timeout)
    assert "reward_timeout" not in str(caught.value)
    assert caught.value.__cause__ is error
    scores = score_completions(rewards, ["p"] * 3, ["a", "b", "c"], {}, on_error="score", error_value=-1.0,
                               timeout=timeout)
    assert scores.total.tolist() == [1.0, -1.0, 1.0]
    assert (scores.errors, scores.timeouts) == (1, 0)


def test_the_users_ctrl_c_goes_through_an_async_reward(forge_sigint_handler):
    from forge.run.signals import note_user_interrupt

    async def interrupted(prompts, completions, **kwargs):  # what Forge's signal handler does inside a reward
        note_user_interrupt()
        raise KeyboardInterrupt
    for mode in ("raise", "score"):
        with pytest.raises(KeyboardInterrupt):
            score_completions(build_reward_list(interrupted), ["p"], ["a"], {}, on_error=mode, timeout=30.0)


@pytest.mark.parametrize("score", [
    np.float32(0.5), np.float16(0.5), np.float64(0.5), np.int64(2), np.int8(2), np.uint8(2), np.array(0.5),
    np.array(2, dtype=np.int32), torch.tensor(0.5), torch.tensor(2), torch.tensor(0.5, dtype=torch.bfloat16),
], ids=lambda s: f"{type(s).__name__}-{getattr(s, 'dtype', '')}")
def test_numpy_and_torch_numbers_are_scores(score):
    rewards = build_reward_list(lambda prompts, completions, **kw: [score] * len(completions))
    scores = score_completions(rewards, ["p"] * 2, ["a", "b"], {})
    assert scores.total.tolist() == [float(score)] * 2


@pytest.mark.parametrize("returned", [np.array([0.5, 2.0], dtype=np.float32), np.array([1, 2]),
                                      torch.tensor([0.5, 2.0]), [np.float32(0.5), None]])
def test_a_numpy_array_of_scores_is_a_list_of_scores(returned):
    rewards = build_reward_list(lambda prompts, completions, **kw: returned)
    scores = score_completions(rewards, ["p"] * 2, ["a", "b"], {})
    expected = [0.5 if returned[0] == 0.5 else 1.0, 2.0 if returned[1] is not None else 0.0]
    assert scores.total.tolist() == expected


@pytest.mark.parametrize("flag", [True, np.bool_(True), torch.tensor(True), np.array(True)],
                         ids=["bool", "np.bool_", "bool-tensor", "bool-array"])
def test_a_true_false_score_is_refused_with_what_to_return(flag):
    rewards = build_reward_list(lambda prompts, completions, **kw: [flag] * len(completions))
    with pytest.raises(RewardError, match=r"for completion 0; scores must be int or float: return "
                                          r"float\(\.\.\.\) \(1\.0 / 0\.0\)"):
        score_completions(rewards, ["p"] * 2, ["a", "b"], {})


@pytest.mark.parametrize("returned", [np.array([0.5, 1.0, 2.0]), [np.array([0.5, 1.0])] * 2, ["0.5", "1"]])
def test_arrays_that_are_not_one_score_per_completion_are_refused(returned):
    rewards = build_reward_list(lambda prompts, completions, **kw: returned)
    with pytest.raises(RewardError, match=r"reward 'lambda' returned (3 scores for 2|.+ \(a (ndarray|str)\) for completion 0)"):
        score_completions(rewards, ["p"] * 2, ["a", "b"], {})
