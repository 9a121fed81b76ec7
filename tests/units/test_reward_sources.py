"""Reward sources: rewards that do not apply (None), async rewards, the trainer's step, and reward models."""

import asyncio
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from forge.core.grpo import compute_group_advantages, multi_reward_advantages, weighted_reward_sum
from forge.core.reward import BaseReward, RewardOutput, TrainerState
from forge.core.reward_sources import SequenceClassificationReward, as_reward, build_reward_list
from forge.core.scoring import RewardError, score_completions

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]


def score(rewards, weights=None, **kwargs):
    return score_completions(build_reward_list(rewards, weights), PROMPTS, COMPLETIONS, {}, **kwargs)


# ----------------------------------------------------------------------------------------------------
# None: the reward does not apply


def code_reward(prompts, completions):
    return [1.0, None, 0.0, None]  # applies to samples 0 and 2 only


def length_reward(prompts, completions):
    return [float(len(c)) for c in completions]  # 1, 2, 3, 4


def test_none_leaves_the_sample_out_of_that_reward():
    scores = score([code_reward, length_reward], weights=[2.0, 0.5])
    # totals over the rewards that apply: 2 * 1 + 0.5 * 1 = 2.5; 0.5 * 2 = 1; 2 * 0 + 0.5 * 3 = 1.5; 0.5 * 4 = 2
    torch.testing.assert_close(scores.total, torch.tensor([2.5, 1.0, 1.5, 2.0]))
    assert scores.applies["code_reward"].tolist() == [True, False, True, False]
    assert "length_reward" not in scores.applies  # applied everywhere
    assert scores.valid.all() and scores.nonfinite == 0  # None is not a NaN: nothing is masked from the loss
    assert scores.scored.all()
    components, applies = scores.stacked()
    assert torch.equal(weighted_reward_sum(components, applies, [2.0, 0.5]), scores.total)  # bit for bit


def test_a_sample_no_reward_applies_to_gets_advantage_zero_and_leaves_the_statistics():
    scores = score(code_reward)
    assert scores.scored.tolist() == [True, False, True, False]
    components, applies = scores.stacked()
    advantages = multi_reward_advantages(components, applies, [1.0], 4, valid=scores.valid)
    # the statistics of samples 0 and 2 only: [1, 0] -> mean 0.5, std 1/sqrt2: +-0.5 / (0.707107 + 1e-4)
    a = 0.5 / (2 ** -0.5 + 1e-4)
    torch.testing.assert_close(advantages, torch.tensor([a, 0.0, -a, 0.0]))
    # counting the two unscored samples as reward 0 would have given another answer
    assert not torch.allclose(compute_group_advantages(scores.total, 4), advantages)


def test_none_after_a_failure_is_still_does_not_apply():
    def flaky(prompts, completions):
        if len(prompts) > 1:
            raise ValueError("batch")
        return [None] if completions[0] == "bb" else [1.0]

    scores = score(flaky, on_error="score")
    assert scores.applies["flaky"].tolist() == [True, False, True, True]
    assert scores.errors == 0


def test_nan_is_still_an_error():
    with pytest.raises(RewardError, match="returned nan"):
        score(lambda p, c: [1.0, float("nan"), 0.0, 0.0])


# ----------------------------------------------------------------------------------------------------
# async rewards


def make_judge(delay, calls):
    async def judge(prompts, completions):
        calls.append(time.perf_counter())
        await asyncio.sleep(delay)
        return [float(len(c)) for c in completions]
    return judge


def test_async_rewards_run_concurrently():
    calls = []
    judges = [make_judge(0.4, calls), make_judge(0.4, calls), make_judge(0.4, calls)]
    started = time.perf_counter()
    scores = score(judges)
    elapsed = time.perf_counter() - started
    torch.testing.assert_close(scores.total, torch.tensor([3.0, 6.0, 9.0, 12.0]))
    assert elapsed < 0.9, f"three 0.4 s judges took {elapsed:.2f} s: not concurrent"  # one after another: 1.2 s


def test_async_reward_objects_and_sync_rewards_mix():
    class Judge(BaseReward):
        async def __call__(self, prompts, responses, **kwargs):
            await asyncio.sleep(0)
            return RewardOutput([0.5] * len(responses))

    scores = score([Judge(), length_reward])
    torch.testing.assert_close(scores.total, torch.tensor([1.5, 2.5, 3.5, 4.5]))


def test_async_reward_timeout_follows_the_rules():
    slow = make_judge(5.0, [])
    started = time.perf_counter()
    with pytest.raises(RewardError, match="took longer than reward_timeout=0.2s"):
        score(slow, timeout=0.2)
    assert time.perf_counter() - started < 2.0
    scores = score([slow, length_reward], timeout=0.2, on_error="score", error_value=-1.0)
    assert scores.timeouts == 1
    torch.testing.assert_close(scores.components["judge"], torch.full((4,), -1.0))


def test_async_reward_errors_name_the_sample():
    async def picky(prompts, completions):
        await asyncio.sleep(0)
        if "ccc" in completions:
            raise ValueError("cannot judge ccc")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"raised ValueError: cannot judge ccc, on completion 2"):
        score(picky)
    scores = score(picky, on_error="score", error_value=0.0)
    assert scores.errors == 1
    assert scores.components["picky"].tolist() == [1.0, 1.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------------
# the trainer's step


def test_rewards_that_ask_for_trainer_state_receive_it():
    seen = []

    def curriculum(prompts, completions, trainer_state):
        seen.append(trainer_state.global_step)
        return [min(1.0, trainer_state.global_step / trainer_state.max_steps)] * len(completions)

    state = TrainerState(global_step=5, max_steps=10)
    scores = score([curriculum, length_reward], trainer_state=state)
    assert scores.components["curriculum"].tolist() == [0.5] * 4
    assert seen == [5]
    with pytest.raises(RewardError, match="curriculum"):  # no state given: the reward's own TypeError, named
        score(curriculum)


def test_only_rewards_that_name_trainer_state_receive_it():
    seen = []

    def columns(prompts, completions, **kwargs):  # **kwargs means "the dataset columns": lists, one per sample
        seen.append(sorted(kwargs))
        return [0.0] * len(completions)

    score(columns, trainer_state=TrainerState(global_step=1, max_steps=2))
    assert seen == [[]]


# ----------------------------------------------------------------------------------------------------
# reward models


@pytest.fixture
def classifier(tiny_tokenizer):
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tiny_tokenizer.pad_token_id)
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config)


def one_by_one(model, tokenizer, texts):
    """Each text alone (no padding), through the classifier: the value the batched reward must match."""
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_reward_model_scores_batched_without_gradient(classifier, tiny_tokenizer):
    prompts = ["What is 12 + 7?", "What is 3 + 4?", "Solve", "Tom has 5 apples"]
    completions = ["Answer: 19", "7", "<think> 3 times 4 is 12 </think> <answer> 12 </answer>", "8"]
    reward = SequenceClassificationReward(classifier, tiny_tokenizer, batch_size=3)
    output = reward(prompts, completions)
    expected = one_by_one(classifier, tiny_tokenizer, [p + c for p, c in zip(prompts, completions)])
    assert output.scores == pytest.approx(expected, abs=1e-5)  # padding and batching change nothing
    assert len(set(output.scores)) == 4  # a random head still tells the texts apart
    assert not any(p.requires_grad for p in classifier.parameters())


def test_reward_model_chat_prompts_use_the_chat_template(classifier, tiny_tokenizer):
    reward = SequenceClassificationReward(classifier, tiny_tokenizer)
    chat = [{"role": "user", "content": "What is 12 + 7?"}]
    text, special = reward.text(chat, "19")
    assert text == "<|user|>What is 12 + 7?</s><|assistant|>19</s>" and not special


def test_reward_models_go_wherever_a_reward_goes(classifier, tiny_tokenizer, tmp_path):
    direct = SequenceClassificationReward(classifier, tiny_tokenizer)(PROMPTS, COMPLETIONS).scores
    from_tuple = score((classifier, tiny_tokenizer))
    assert from_tuple.total.tolist() == pytest.approx(direct, abs=1e-6)
    classifier.save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    from_folder = score(str(tmp_path / "rm"))
    assert from_folder.total.tolist() == pytest.approx(direct, abs=1e-6)
    assert list(from_folder.components) == ["rm"]
    assert isinstance(as_reward(classifier.__class__.from_pretrained(tmp_path / "rm")), SequenceClassificationReward)


def test_reward_model_follows_the_policy_device(classifier, tiny_tokenizer):
    reward = SequenceClassificationReward(classifier, tiny_tokenizer)
    scores = reward(PROMPTS, COMPLETIONS, trainer_state=TrainerState(0, 1, device=torch.device("cpu"))).scores
    assert len(scores) == 4 and next(classifier.parameters()).device.type == "cpu"


def test_reward_model_errors(classifier, tiny_model, tiny_tokenizer):
    with pytest.raises(TypeError, match="not a sequence-classification model"):
        SequenceClassificationReward(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError, match="label_index=3"):
        SequenceClassificationReward(classifier, tiny_tokenizer, label_index=3)
    with pytest.raises(ValueError, match="pass it"):
        SequenceClassificationReward(classifier)


def test_a_reward_class_by_path_is_instantiated_whatever_its_base(tmp_path):
    """`--reward module:Class` gives the class's default instance, for a plain callable class (the reasoning-gym
    reward) as for a BaseReward subclass."""
    from forge.core.reward_sources import load_reward_from_path

    reward = load_reward_from_path("forge.data.reasoning_gym_tasks:ReasoningGymReward")
    assert reward.name == "reasoning_gym"
    with pytest.raises(ValueError, match="rg_task"):  # it is the reward itself, called with the samples
        reward(["p"], ["<answer>1</answer>"])
    path = tmp_path / "my_reward.py"
    path.write_text("class Shout:\n    def __call__(self, prompts, completions, **kwargs):\n"
                    "        return [float(c.isupper()) for c in completions]\n")
    assert load_reward_from_path(f"{path}:Shout")(["p", "p"], ["HI", "hi"]).scores == [1.0, 0.0]


def test_a_reward_class_that_cannot_be_built_is_one_line_naming_it(tmp_path, capsys):
    from forge.cli import main

    path = tmp_path / "broken_reward.py"
    path.write_text("class NeedsADatabase:\n    def __init__(self):\n        raise RuntimeError('no database')\n\n"
                    "    def __call__(self, prompts, completions, **kwargs):\n        return [0.0] * len(completions)\n")
    assert main(["train", "--model", "nowhere-model-needed", "--reward", f"{path}:NeedsADatabase",
                 "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (f"forge: error: reward '{path}:NeedsADatabase': NeedsADatabase() raised RuntimeError: no database; a "
            f"reward class given by name is built with no arguments") in err
