"""Rewards: tables of real scores, including malformed, empty, adversarial and very long outputs."""

import math
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge.core.reward import (
    BaseReward,
    ExactMatchReward,
    FormatReward,
    LengthPenaltyReward,
    MathCorrectnessReward,
    NumberReward,
    RewardOutput,
    TagFormatReward,
    accepted_kwargs,
    call_with_accepted_kwargs,
)
from forge.core.reward_sources import (
    REWARD_REGISTRY,
    CompositeReward,
    as_reward,
    build_reward,
    load_reward_from_path,
)
from forge.core.scoring import FunctionReward

LONG = "word " * 100_000


def scores_of(reward, responses, **kwargs):
    return reward(["p"] * len(responses), responses, **kwargs).scores


# ----------------------------------------------------------------------------------------------
# BaseReward, RewardOutput


def test_base_reward_is_abstract():
    with pytest.raises(TypeError):
        BaseReward()  # type: ignore[abstract]


def test_default_names_are_snake_case_without_suffix():
    assert ExactMatchReward().name == "exact_match"
    assert MathCorrectnessReward().name == "math_correctness"
    assert TagFormatReward().name == "tag_format"
    assert LengthPenaltyReward().name == "length_penalty"

    class Reward(BaseReward):
        def __call__(self, prompts, responses):
            return RewardOutput([0.0] * len(responses))

    assert Reward().name == "reward"


def test_name_can_be_set_on_instance_or_class():
    reward = NumberReward()
    reward.name = "has_number"
    assert reward.name == "has_number"

    class Named(BaseReward):
        name = "custom"

        def __call__(self, prompts, responses):
            return RewardOutput([1.0] * len(responses))

    assert Named().name == "custom"


def test_reward_output_defaults():
    output = RewardOutput(scores=[1.0])
    assert output.metadata is None


# ----------------------------------------------------------------------------------------------
# ExactMatchReward


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        ("The answer is Paris.", "paris", 1.0),
        ("PARIS", "Paris", 1.0),
        ("Lyon", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("42", 42, 1.0),
        ("it is 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K-format reference
        (LONG + "paris", "Paris", 1.0),
    ],
)
def test_exact_match(response, reference, expected):
    assert scores_of(ExactMatchReward(), [response], references=[reference]) == [expected]


def test_exact_match_references_at_init_and_call_time_overrides():
    reward = ExactMatchReward(references=["a", "b"])
    assert scores_of(reward, ["a", "x"]) == [1.0, 0.0]
    assert scores_of(reward, ["a", "x"], references=["z", "x"]) == [0.0, 1.0]


@pytest.mark.parametrize(
    ("references", "message"),
    [
        (None, "needs reference answers"),
        (["a"], "got 1 references for 2 responses"),
        (["a", ""], "reference 1 is empty"),
    ],
)
def test_exact_match_errors(references, message):
    with pytest.raises(ValueError, match=message):
        ExactMatchReward()(["p", "p"], ["a", "b"], references=references)


def test_exact_match_rejects_a_single_string():
    with pytest.raises(TypeError, match="one entry per response"):
        ExactMatchReward()(["p"], ["a"], references="a")


# ----------------------------------------------------------------------------------------------
# FormatReward, NumberReward, LengthPenaltyReward


def test_format_reward():
    reward = FormatReward(lambda response: response.endswith("."))
    assert scores_of(reward, ["Done.", "Done", ""]) == [1.0, 0.0, 0.0]
    assert reward.name == "format"
    with pytest.raises(TypeError, match="needs a function"):
        FormatReward("not callable")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<answer>12</answer>", 1.0),
        ("so it is 3.5", 1.0),
        ("Answer: $1,200", 1.0),
        ("Answer: twelve", 0.0),  # the final answer is "twelve": no number
        ("<answer>unsure</answer> 5", 0.0),
        ("no digits at all", 0.0),
        ("", 0.0),
        (LONG, 0.0),
    ],
)
def test_number_reward(response, expected):
    assert scores_of(NumberReward(), [response]) == [expected]


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (0, 0.0),
        (49, 0.0),
        (50, 0.0),
        (125, 0.5),  # halfway from min 50 to optimal 200
        (200, 1.0),
        (350, 0.5),  # halfway from optimal 200 to max 500
        (500, 0.0),
        (501, 0.0),
        (100_000, 0.0),
    ],
)
def test_length_penalty_tent(words, expected):
    assert scores_of(LengthPenaltyReward(), [" ".join(["w"] * words)]) == [pytest.approx(expected)]


def test_length_penalty_degenerate_tent_and_validation():
    flat = LengthPenaltyReward(optimal_length=10, min_length=10, max_length=10)
    assert [flat.score(n) for n in (9, 10, 11)] == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="min_length <= optimal_length <= max_length"):
        LengthPenaltyReward(optimal_length=600, min_length=50, max_length=500)
    with pytest.raises(ValueError, match="min_length <= optimal_length"):
        LengthPenaltyReward(optimal_length=20, min_length=30, max_length=500)


# ----------------------------------------------------------------------------------------------
# MathCorrectnessReward


@pytest.mark.parametrize(
    ("response", "reference", "lenient", "strict"),
    [
        ("<think>6*7</think><answer>42</answer>", "42", 1.0, 1.0),
        ("<answer>42.0</answer>", "42", 1.0, 1.0),
        ("<answer>$1,000</answer>", "1000", 1.0, 1.0),
        ("<answer>41</answer>", "42", 0.0, 0.0),
        ("so the answer is 42", "42", 1.0, 0.0),  # strict needs the tag
        ("Answer: 42", "42", 1.0, 0.0),
        ("\\boxed{42}", "42", 1.0, 0.0),
        ("<answer>42", "42", 1.0, 0.0),  # unclosed tag: only lenient mode reads it
        ("<answer>-5</answer>", "-5", 1.0, 1.0),
        ("<answer>5</answer>", "-5", 0.0, 0.0),
        ("", "42", 0.0, 0.0),
        ("<answer></answer>", "42", 0.0, 0.0),
        ("<answer>forty-two</answer>", "42", 0.0, 0.0),
        ("<<<<answer>>>>42<</answer>", "42", 0.0, 0.0),
        (LONG + "<answer>42</answer>", "42", 1.0, 1.0),
        ("<answer>42</answer>", "#### 42", 1.0, 1.0),
    ],
)
def test_math_correctness(response, reference, lenient, strict):
    assert scores_of(MathCorrectnessReward(), [response], references=[reference]) == [lenient]
    assert scores_of(MathCorrectnessReward(strict=True), [response], references=[reference]) == [strict]


def test_math_correctness_symbolic_and_metadata():
    output = MathCorrectnessReward()(
        ["p", "p"], ["<answer>\\frac{1}{2}</answer>", "nothing"], references=["0.5", "1"]
    )
    from forge.data.answers import HAVE_MATH_VERIFY

    assert output.scores == [1.0 if HAVE_MATH_VERIFY else 0.0, 0.0]
    assert output.metadata == {"extracted_answers": ["\\frac{1}{2}", None]}


def test_math_correctness_custom_tag_and_missing_references():
    reward = MathCorrectnessReward(answer_tag="final", strict=True)
    assert scores_of(reward, ["<final>7</final>", "<answer>7</answer>"], references=["7", "7"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="needs reference answers"):
        reward(["p"], ["<final>7</final>"])


# ----------------------------------------------------------------------------------------------
# TagFormatReward


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("", 0.0),
        ("just text 42", 0.0),
        ("<think>", 0.25),
        ("<think></think>", 0.25),  # opened but empty
        ("<think>  \n</think>", 0.25),
        ("<think>reason</think>", 0.5),
        ("<answer>", 0.25),
        ("<answer>42</answer>", 0.5),
        ("<think>reason", 0.25),
        ("<think>reason</think><answer>", 0.75),
        ("<think></think><answer>42</answer>", 0.75),
        ("<think>reason</think><answer></answer>", 0.75),
        ("<think>reason</think>\n<answer>42</answer>", 1.0),
        ("<think>reason</think><answer>42</answer>\n  ", 1.0),  # trailing whitespace is fine
        ("  <think>a\nb</think> between <answer>x</answer>", 1.0),
        # capped at 0.75
        ("<think>reason</think><answer>42</answer> and more", 0.75),
        ("<answer>42</answer><think>reason</think>", 0.75),
        ("<think>a</think><think>b</think><answer>42</answer>", 0.75),
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.75),
        ("<think>a</think></think><answer>1</answer>", 0.75),
        ("<answer>42</answer><think>", 0.75),  # out of order, already at 0.75
        # the cap never raises a lower score
        ("<answer>42</answer> trailing", 0.5),
        ("<think><think>", 0.25),
        # wrong case is not the requested tag
        ("<THINK>a</THINK><ANSWER>1</ANSWER>", 0.0),
        (LONG, 0.0),
        ("<think>" + LONG + "</think><answer>1</answer>", 1.0),
    ],
)
def test_tag_format_partial_credit(response, expected):
    assert scores_of(TagFormatReward(), [response]) == [expected]


def test_tag_format_custom_tags():
    reward = TagFormatReward(think_tag="MYTHINK", answer_tag="MYANSWER")
    assert scores_of(reward, ["<MYTHINK>a</MYTHINK><MYANSWER>1</MYANSWER>"]) == [1.0]
    assert scores_of(reward, ["<think>a</think><answer>1</answer>"]) == [0.0]


# ----------------------------------------------------------------------------------------------
# Keyword forwarding, as_reward


class PositionalOnlyUserReward(BaseReward):
    """A user reward without **kwargs, written as the README shows."""

    def __call__(self, prompts, responses):
        return RewardOutput(scores=[float(len(response)) for response in responses])


class ReferencesUserReward(BaseReward):
    def __call__(self, prompts, responses, references):
        return RewardOutput(scores=[1.0 if r == ref else 0.0 for r, ref in zip(responses, references)])


def test_accepted_kwargs_by_signature():
    given_kwargs = {"references": [1], "kind": ["x"]}

    def no_kwargs(prompts, completions):
        return []

    def named(prompts, completions, references):
        return []

    def keyword_only(prompts, completions, *, kind=None):
        return []

    def var_kwargs(prompts, completions, **kwargs):
        return []

    def takes_prompts_name(prompts, references, **unused):
        return []

    assert accepted_kwargs(no_kwargs, given_kwargs) == {}
    assert accepted_kwargs(named, given_kwargs) == {"references": [1]}
    assert accepted_kwargs(keyword_only, given_kwargs) == {"kind": ["x"]}
    assert accepted_kwargs(var_kwargs, given_kwargs) == given_kwargs
    assert accepted_kwargs(PositionalOnlyUserReward(), given_kwargs) == {}
    assert accepted_kwargs(ReferencesUserReward(), given_kwargs) == {"references": [1]}
    assert accepted_kwargs(ExactMatchReward(), given_kwargs) == given_kwargs


def test_call_with_accepted_kwargs_passes_positionally():
    def trl_style(prompts, completions, references):
        return [float(c == r) for c, r in zip(completions, references)]

    result = call_with_accepted_kwargs(
        trl_style, ["p", "p"], ["a", "b"], {"references": ["a", "a"], "kind": [1, 2]}
    )
    assert result == [1.0, 0.0]


def test_as_reward_wraps_functions_and_keeps_rewards():
    reward = ExactMatchReward()
    assert as_reward(reward) is reward

    def my_score(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    wrapped = as_reward(my_score)
    assert isinstance(wrapped, FunctionReward)
    assert wrapped.name == "my_score"
    assert wrapped(["p"], ["r"], references=["x"]) == RewardOutput(scores=[0.5])

    def returns_output(prompts, responses):
        return RewardOutput(scores=[1.0], metadata={"k": 1})

    assert as_reward(returns_output)(["p"], ["r"], references=["x"]).metadata == {"k": 1}
    assert as_reward(lambda prompts, completions: [0.0]).name == "lambda"


def test_as_reward_errors():
    with pytest.raises(TypeError, match="not an instance"):
        as_reward(ExactMatchReward)
    with pytest.raises(TypeError, match="must be a BaseReward or a function"):
        as_reward(3)  # type: ignore[arg-type]


def test_exceptions_from_user_rewards_propagate():
    def broken(prompts, completions):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        as_reward(broken)(["p"], ["r"])
    with pytest.raises(RuntimeError, match="boom"):
        CompositeReward([(broken, 1.0)])(["p"], ["r"])


def test_outputs_are_not_validated_here():
    """NaN and wrong lengths pass through a FunctionReward untouched: the trainer validates them."""
    output = as_reward(lambda prompts, completions: [math.nan, 1.0, 2.0])(["p"], ["r"])
    assert len(output.scores) == 3 and math.isnan(output.scores[0])


# ----------------------------------------------------------------------------------------------
# CompositeReward


def test_composite_weights_are_normalised():
    composite = CompositeReward([(TagFormatReward(), 3.0), (MathCorrectnessReward(), 1.0)])
    responses = [
        "<think>a</think><answer>7</answer>",  # tag 1.0, math 1.0 -> 0.75*1 + 0.25*1 = 1.0
        "<think>a</think><answer>8</answer>",  # tag 1.0, math 0.0 -> 0.75
        "7",  # tag 0.0, math 1.0 -> 0.25
        "<answer>8",  # tag 0.25, math 0.0 -> 0.1875
    ]
    output = composite(["p"] * 4, responses, references=["7"] * 4)
    assert output.scores == pytest.approx([1.0, 0.75, 0.25, 0.1875])
    assert output.metadata["components"] == {
        "tag_format": [1.0, 1.0, 0.0, 0.25],
        "math_correctness": [1.0, 0.0, 1.0, 0.0],
    }
    assert output.metadata["weights"] == {"tag_format": 0.75, "math_correctness": 0.25}
    assert output.metadata["component_metadata"]["math_correctness"]["extracted_answers"] == [
        "7",
        "8",
        "7",
        "8",
    ]


def test_composite_forwards_only_accepted_kwargs():
    composite = CompositeReward(
        [(PositionalOnlyUserReward(), 1.0), (ReferencesUserReward(), 1.0), (ExactMatchReward(), 2.0)]
    )
    output = composite(["p", "p"], ["ab", "c"], references=["ab", "x"], kind=["k", "k"])
    # positional: [2, 1]; references: [1, 0]; exact match: [1, 0] -> (2+1+2)/4, (1+0+0)/4
    assert output.scores == pytest.approx([1.25, 0.25])
    assert list(output.metadata["components"]) == ["positional_only_user", "references_user", "exact_match"]


def test_composite_duplicate_names_get_suffixes():
    composite = CompositeReward([(NumberReward(), 1.0), (NumberReward(), 1.0), (NumberReward(), 1.0)])
    assert composite.component_names == ["number", "number_2", "number_3"]


def test_composite_accepts_plain_functions_and_nests():
    def half(prompts, completions):
        return [0.5] * len(completions)

    inner = CompositeReward([(half, 1.0)])
    outer = CompositeReward([(inner, 1.0), (lambda prompts, completions: [1.0] * len(completions), 1.0)])
    output = outer(["p"], ["r"])
    assert output.scores == pytest.approx([0.75])
    assert output.metadata["component_metadata"]["composite"]["components"] == {"half": [0.5]}


@pytest.mark.parametrize(
    ("components", "error", "message"),
    [
        ([], ValueError, "at least one"),
        ([(NumberReward(), -1.0)], ValueError, "must be finite and >= 0"),
        ([(NumberReward(), math.nan)], ValueError, "must be finite and >= 0"),
        ([(NumberReward(), math.inf)], ValueError, "must be finite and >= 0"),
        ([(NumberReward(), 0.0)], ValueError, "sum to 0"),
        ([NumberReward()], TypeError, "pair"),
    ],
)
def test_composite_construction_errors(components, error, message):
    with pytest.raises(error, match=message):
        CompositeReward(components)


def test_composite_reports_a_component_with_the_wrong_number_of_scores():
    composite = CompositeReward([(lambda prompts, completions: [1.0], 1.0)])
    with pytest.raises(ValueError, match="returned 1 scores for 2 responses"):
        composite(["p", "p"], ["a", "b"])


# ----------------------------------------------------------------------------------------------
# Registry and import paths


def test_registry_builds_every_reward_with_defaults():
    for name in REWARD_REGISTRY:
        assert isinstance(build_reward(name), BaseReward)
    assert build_reward("math_correctness", strict=True).strict is True
    with pytest.raises(ValueError, match="unknown reward 'nope'.*exact_match"):
        build_reward("nope")


def test_load_reward_from_module_and_file(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        from forge.core.reward import BaseReward, RewardOutput

        def short(prompts, completions, **kwargs):
            return [1.0 if len(c) < 5 else 0.0 for c in completions]

        class Always(BaseReward):
            def __call__(self, prompts, responses):
                return RewardOutput([1.0] * len(responses))
        """
    )
    (tmp_path / "my_rewards.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward_from_path("my_rewards:short")(["p"], ["abc"]).scores == [1.0]
        assert load_reward_from_path("my_rewards.short")(["p"], ["abcdef"]).scores == [0.0]
        assert load_reward_from_path("my_rewards:Always").name == "always"
        assert load_reward_from_path(f"{tmp_path / 'my_rewards.py'}:short")(["p"], ["a"]).scores == [1.0]
        with pytest.raises(AttributeError, match="no attribute 'missing'"):
            load_reward_from_path("my_rewards:missing")
        with pytest.raises(ModuleNotFoundError):
            load_reward_from_path("no_such_module_xyz:fn")
        with pytest.raises(FileNotFoundError):
            load_reward_from_path(f"{tmp_path / 'absent.py'}:fn")
        with pytest.raises(ValueError, match="module:function"):
            load_reward_from_path("plainname")
    finally:
        sys.modules.pop("my_rewards", None)


# ----------------------------------------------------------------------------------------------
# Fuzz: no built-in reward raises on any response text

_RESPONSES = st.lists(
    st.one_of(
        st.text(max_size=200), st.text(alphabet="<>/thinkanswer{}\\boxed0123456789.,$-: \n", max_size=200)
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_RESPONSES)
def test_builtin_rewards_never_raise(responses):
    prompts = ["p"] * len(responses)
    references = ["42"] * len(responses)
    rewards = [
        ExactMatchReward(),
        MathCorrectnessReward(),
        MathCorrectnessReward(strict=True),
        TagFormatReward(),
        NumberReward(),
        LengthPenaltyReward(),
        CompositeReward([(MathCorrectnessReward(), 1.0), (TagFormatReward(), 0.1)]),
    ]
    for reward in rewards:
        scores = reward(prompts, responses, references=references).scores
        assert len(scores) == len(responses)
        assert all(0.0 <= score <= 1.0 for score in scores)
