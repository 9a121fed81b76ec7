"""Random and adversarial model output never crashes an answer extractor, the grader or a built-in reward.

A reward that raises stops a run (on_reward_error='raise'), so every built-in reward must turn any text a
model can write into a finite score in its range. The text strategy mixes plain random unicode with
fragments chosen to break parsers: unclosed and nested tags, `\\boxed{` without its brace, enormous and
malformed numbers, "nan"/"inf", GSM8K `####` markers, control characters and right-to-left marks.
tests/math/test_answers.py already fuzzes extract_final_answer / extract_tagged_answer / extract_answer_line /
parse_number / last_number / answers_match with plain text; this file adds the adversarial fragments, the
remaining extractors, the evaluation grader and every reward.
"""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge.core.reward import (
    ExactMatchReward,
    FormatReward,
    LengthPenaltyReward,
    MathCorrectnessReward,
    NumberReward,
    RewardOutput,
    TagFormatReward,
)
from forge.core.reward_sources import REWARD_REGISTRY, CompositeReward, build_reward_list
from forge.core.scoring import score_completions
from forge.data.answers import (
    answers_match,
    extract_answer_line,
    extract_final_answer,
    extract_tagged_answer,
    first_number,
    last_number,
    parse_number,
)
from forge.data.gsm8k import extract_answer
from forge.eval.metrics import detect_answer_format, extract_formatted_answer, grade, reference_answer

FRAGMENTS = [
    "<answer>", "</answer>", "<think>", "</think>", "<answer><answer>", "</answer></think>", "<ANSWER>",
    "\\boxed{", "\\boxed{\\frac{1}{2}", "}", "{{", "\\frac{", "\\sqrt{-1}", "$", "$$", "Answer:", "answer: ",
    "The answer is", "####", "#### 72", "\n", "\r\n", "\t", "\x00", "\u200f", "\u202e", "\u2212", "\ufeff",
    "1e999999", "-1e-999", "9" * 400, "0x1F", "1,2,3,4", "1,,000", "..5", "-.", "+-3", "50%", "%",
    "nan", "NaN", "inf", "-Infinity", "1/0", "0/0", "3.14.15", "١٢٣", "Ⅻ", "½", "²", "x^2 + 2x", "2**10**10",
    "(((((", ")))))", "\\left(", "\\right)", " ", "   ", "🙂", "a" * 200,
]
ADVERSARIAL_TEXT = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=25).map("".join),
)
REFERENCE = st.one_of(
    st.integers(-10**12, 10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from(["72", "-3", "1,234", "0.5", "\\frac{1}{2}", "x + 1", "Paris", "He ran #### 42", "1e3"]),
    st.text(min_size=1, max_size=20).filter(lambda t: reference_answer(t) != ""),
)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REWARDS_WITH_REFERENCES = [ExactMatchReward(), MathCorrectnessReward(), MathCorrectnessReward(strict=True),
                           MathCorrectnessReward(answer_tag="final")]
REWARDS_WITHOUT = [TagFormatReward(), NumberReward(), LengthPenaltyReward(optimal_length=3, min_length=0,
                                                                          max_length=10),
                   FormatReward(lambda text: "<answer>" in text)]
COMPOSITE = CompositeReward([(reward, 1.0) for reward in REWARDS_WITH_REFERENCES + REWARDS_WITHOUT])


def _is_answer(value) -> bool:
    return value is None or (isinstance(value, str) and value != "")


@FUZZ
@given(ADVERSARIAL_TEXT)
def test_every_extractor_returns_text_or_none(text):
    assert _is_answer(extract_answer(text))  # forge.data.gsm8k
    for extract in (extract_final_answer, extract_tagged_answer, extract_answer_line):
        assert _is_answer(extract(text))
    assert _is_answer(extract_tagged_answer(text, "think"))
    assert first_number(text) is None or isinstance(first_number(text), str)
    assert last_number(text) is None or isinstance(last_number(text), str)
    value = parse_number(text)
    assert value is None or isinstance(value, float)
    for answer_format in ("tag", "answer_line"):
        assert _is_answer(extract_formatted_answer(text, answer_format))
    assert detect_answer_format(text) in ("tag", "answer_line")


@FUZZ
@given(ADVERSARIAL_TEXT, REFERENCE)
def test_grader_never_raises(text, reference):
    assert answers_match(text, reference) in (True, False)
    for answer_format in ("tag", "answer_line"):
        result = grade(text, reference, answer_format)
        assert result.strict_correct in (True, False) and result.soft_correct in (True, False)


def _check_scores(output, count: int, low: float = 0.0, high: float = 1.0) -> None:
    assert isinstance(output, RewardOutput)
    scores = list(output.scores)
    assert len(scores) == count
    assert all(isinstance(s, float) and math.isfinite(s) and low <= s <= high for s in scores), scores


@FUZZ
@given(st.lists(st.tuples(ADVERSARIAL_TEXT, REFERENCE), min_size=1, max_size=4))
def test_every_reward_scores_any_text(pairs):
    completions = [text for text, _ in pairs]
    references = [reference for _, reference in pairs]
    prompts = ["Solve it."] * len(pairs)
    for reward in REWARDS_WITH_REFERENCES:
        _check_scores(reward(prompts, completions, references=references), len(pairs))
    for reward in REWARDS_WITHOUT:
        _check_scores(reward(prompts, completions), len(pairs))
    _check_scores(COMPOSITE(prompts, completions, references=references), len(pairs))


@FUZZ
@given(st.lists(st.tuples(ADVERSARIAL_TEXT, REFERENCE), min_size=1, max_size=4))
def test_registry_rewards_through_the_trainer_scoring_path(pairs):
    """What the trainer does: each CLI-named reward with the dataset's references, on raise-on-error."""
    completions = [text for text, _ in pairs]
    rewards = build_reward_list([factory() for factory in REWARD_REGISTRY.values()])
    scores = score_completions(rewards, ["p"] * len(pairs), completions,
                               {"references": [r for _, r in pairs]}, on_error="raise", timeout=None)
    assert scores.valid.all() and scores.errors == 0 and bool(scores.total.isfinite().all())
