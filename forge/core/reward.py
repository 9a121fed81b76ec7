"""The reward protocol (BaseReward, RewardOutput, TrainerState) and the built-in rewards.

A reward scores a batch of responses: ``reward(prompts, responses, **kwargs) -> RewardOutput``,
one float per response. Dataset columns other than ``prompt`` arrive as keyword arguments
(``reference`` becomes ``references``, see `forge.core.scoring.reward_kwargs`), and each reward
receives only the keyword arguments its signature names (`call_with_accepted_kwargs`), so a user
can write ``def __call__(self, prompts, responses, references)`` without ``**kwargs``.

Plain TRL-style functions ``f(prompts, completions, **kwargs) -> list[float]`` are accepted too
(core/scoring.py `FunctionReward`, which also holds what a reward receives and the two ways of calling it;
core/reward_sources.py turns names, paths, reward models and weighted lists into rewards). Answer extraction
and equivalence live in `forge.data.answers`, shared with the evaluation code so that the training reward and
the reported accuracy agree.

A score may be ``None``: the reward does not apply to that sample (e.g. a code reward on a math
prompt). The sample is then scored by the rewards that apply, and left out of the advantage
statistics if none does. A reward may be ``async def`` (a remote judge): the async rewards of a
step run concurrently. A reward that names a ``trainer_state`` parameter receives a `TrainerState`
(the optimizer step, for curricula), as TRL's do. A HuggingFace sequence-classification model (a
reward model) is a reward too (core/reward_sources.py `SequenceClassificationReward`): pass the model, its
hub id or its folder wherever a reward goes.

This module does not check the scores it returns (length, NaN, type): the trainer validates
every reward output in one place (core/scoring.py). Exceptions raised by a reward propagate unchanged.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forge.data.answers import (
    extract_final_answer,
    extract_tagged_answer,
    parse_number,
)
from forge.data.task import grade_math

__all__ = [
    "BaseReward",
    "ExactMatchReward",
    "FormatReward",
    "LengthPenaltyReward",
    "MathCorrectnessReward",
    "NumberReward",
    "RewardOutput",
    "TagFormatReward",
    "TrainerState",
    "accepted_kwargs",
    "accepted_names",
    "call_with_accepted_kwargs",
    "named_extras",
    "names_parameter",
]


@dataclass
class RewardOutput:
    """What a reward returns for a batch of B responses."""

    scores: list[float | None]
    """One score per response, in the order the responses were given; None = this reward does not apply.
    (B,)"""
    metadata: dict[str, Any] | None = None
    """Anything worth logging next to the scores, e.g. per-component scores of a CompositeReward."""


@dataclass(frozen=True)
class TrainerState:
    """What a reward with a ``trainer_state`` parameter receives: where the run is (as TRL's TrainerState)."""

    global_step: int
    """Optimizer steps finished before the step being scored (0 while scoring the first)."""
    max_steps: int
    """Optimizer steps this run will take in all."""
    device: Any = None
    """The policy's device; reward models run there."""


def _snake_case(class_name: str) -> str:
    """``"ExactMatchReward"`` -> ``"exact_match"``; ``"MyReward"`` -> ``"my"``."""
    if class_name.endswith("Reward") and len(class_name) > len("Reward"):
        class_name = class_name[: -len("Reward")]
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", class_name).lower()


class BaseReward(ABC):
    """Base class for rewards. Subclasses implement ``__call__(prompts, responses, ...)``.

    ``name`` is used as the logging key. It defaults to the class name in snake case without the
    ``Reward`` suffix (``ExactMatchReward`` -> ``exact_match``); set ``self.name = ...`` or a
    class attribute ``name = ...`` to choose another.
    """

    @property
    def name(self) -> str:
        return self.__dict__.get("_name") or _snake_case(type(self).__name__)

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    convention = "forge"
    """How the trainer calls it (core/scoring.py `CONVENTIONS`): a BaseReward Forge's way, ``reward(prompts,
    responses, ...)``."""

    is_async = False
    """Whether a call returns an awaitable (``async def __call__``), read from the class once, when it is
    defined; the trainer awaits the async rewards of a step together."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.is_async = inspect.iscoroutinefunction(cls.__call__)

    @abstractmethod
    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        """Score each response to its prompt; return one float per response."""

    def score_inputs(self, inputs) -> Any:
        """Score a batch (core/scoring.py RewardInputs) as the trainer does, Forge's way: ``self(prompts,
        completions, **keywords it names)``."""
        return call_with_accepted_kwargs(self, inputs.prompts, inputs.completions,
                                         inputs.forge_keywords(named_extras(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ----------------------------------------------------------------------------------------------
# Calling rewards with the keyword arguments they accept


def named_extras(fn: Callable[..., Any]) -> frozenset[str]:
    """Which of ``trainer_state``, ``completion_ids``, ``log_metric`` and ``log_extra`` Forge's call gives
    `fn`: those its signature names."""
    return frozenset(name for name in ("trainer_state", "completion_ids", "log_metric", "log_extra")
                     if names_parameter(fn, name))


def names_parameter(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn``'s signature names a parameter `name` (``**kwargs`` does not name one): only a reward
    that names ``trainer_state`` receives it (a ``**kwargs`` reward gets the dataset columns and nothing
    else)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters and parameters[name].kind is not inspect.Parameter.VAR_KEYWORD


def accepted_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], positional: int = 2) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` can receive by name after its first `positional` arguments
    (Forge's call gives ``prompts`` and ``responses`` by position; TRL's, positional=0, gives everything by
    keyword); all of them when ``fn`` takes ``**kwargs`` or has no inspectable signature (some builtins)."""
    names = accepted_names(fn, positional)
    return dict(kwargs) if names is None else {key: value for key, value in kwargs.items() if key in names}


def accepted_names(fn: Callable[..., Any], positional: int = 2) -> frozenset[str] | None:
    """The names ``fn`` can receive by keyword after its first `positional` arguments (`accepted_kwargs`);
    None: any name."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    if any(p.kind is kinds.VAR_KEYWORD for p in parameters):
        return None
    positional_kinds = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    by_position = [p.name for p in parameters if p.kind in positional_kinds]
    by_name = {p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    return frozenset(by_name - set(by_position[:positional]))


def call_with_accepted_kwargs(
    fn: Callable[..., Any], prompts: list[str], responses: list[str], kwargs: Mapping[str, Any]
) -> Any:
    """``fn(prompts, responses, **accepted_kwargs(fn, kwargs))``: the two by position, so the second parameter
    may be called ``responses`` or ``completions`` (TRL's name), and the keywords its signature names."""
    return fn(prompts, responses, **accepted_kwargs(fn, kwargs))


# ----------------------------------------------------------------------------------------------
# Built-in rewards


def _resolve_references(
    reward_name: str, init_references: Sequence[Any] | None, references: Sequence[Any] | None, count: int
) -> list[str]:
    """References from the call (preferred) or from construction, as strings, one per response.

    A reference written in the GSM8K solution format ("... #### 72") is reduced to "72".
    """
    chosen = references if references is not None else init_references
    if chosen is None:
        raise ValueError(
            f"{reward_name} needs reference answers: give the dataset a 'reference' column "
            f"(passed to rewards as references=...) or pass references=[...] when constructing it"
        )
    if isinstance(chosen, str):
        raise TypeError(f"{reward_name}: references must be a list with one entry per response, not a str")
    chosen = list(chosen)
    if len(chosen) != count:
        raise ValueError(
            f"{reward_name} got {len(chosen)} references for {count} responses; "
            f"give one reference per response (repeat each prompt's reference for its group)"
        )
    resolved = []
    for index, reference in enumerate(chosen):
        text = str(reference) if reference is not None else ""
        if "####" in text:
            text = text.rsplit("####", 1)[1]
        text = text.strip()
        if not text:
            raise ValueError(f"{reward_name}: reference {index} is empty; every row needs a reference answer")
        resolved.append(text)
    return resolved


class ExactMatchReward(BaseReward):
    """1.0 when the reference text appears in the response (ignoring letter case), else 0.0.

    References come from the ``references`` keyword at call time (the dataset's ``reference``
    column) or, failing that, from the constructor. A reference in the GSM8K solution format
    ("... #### 72") counts as its final answer ("72"); an empty reference is an error.
    """

    def __init__(self, references: Sequence[Any] | None = None) -> None:
        self.references = list(references) if references is not None else None

    def __call__(
        self, prompts: list[str], responses: list[str], references: Sequence[Any] | None = None, **kwargs: Any
    ) -> RewardOutput:
        expected = _resolve_references(self.name, self.references, references, len(responses))
        scores = [
            1.0 if reference.casefold() in str(response).casefold() else 0.0
            for reference, response in zip(expected, responses)
        ]
        return RewardOutput(scores=scores)


class FormatReward(BaseReward):
    """1.0 when ``format_fn(response)`` is truthy, else 0.0."""

    def __init__(self, format_fn: Callable[[str], Any]) -> None:
        if not callable(format_fn):
            raise TypeError(f"FormatReward needs a function response -> bool, got {type(format_fn).__name__}")
        self.format_fn = format_fn

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        return RewardOutput(scores=[1.0 if self.format_fn(response) else 0.0 for response in responses])


class LengthPenaltyReward(BaseReward):
    """A tent over the word count: 1.0 at ``optimal_length`` words, falling linearly to 0.0 at
    ``min_length`` and at ``max_length``, and 0.0 outside ``[min_length, max_length]``."""

    def __init__(self, optimal_length: int = 200, min_length: int = 50, max_length: int = 500) -> None:
        if not 0 <= min_length <= optimal_length <= max_length:
            raise ValueError(
                "LengthPenaltyReward needs 0 <= min_length <= optimal_length <= max_length; got "
                f"min_length={min_length}, optimal_length={optimal_length}, max_length={max_length}"
            )
        self.optimal_length = optimal_length
        self.min_length = min_length
        self.max_length = max_length

    def score(self, word_count: int) -> float:
        """The tent function at ``word_count``."""
        if word_count == self.optimal_length:
            return 1.0
        if word_count < self.min_length or word_count > self.max_length:
            return 0.0
        if word_count < self.optimal_length:
            return (word_count - self.min_length) / (self.optimal_length - self.min_length)
        return (self.max_length - word_count) / (self.max_length - self.optimal_length)

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        return RewardOutput(scores=[self.score(len(str(response).split())) for response in responses])


class MathCorrectnessReward(BaseReward):
    """1.0 when the response's final answer equals the reference answer, else 0.0.

    The answer is found by `forge.data.answers.extract_final_answer` (answer tag, then
    ``\\boxed{}``, ``Answer:`` line, ``####``, last number), or with ``strict=True`` only inside a
    closed ``<answer_tag>...</answer_tag>`` block. It is judged by the math tasks' grader
    (`forge.data.task.grade_math`, which their evaluation uses too): numeric comparison for plain numbers,
    math-verify for symbolic answers when installed.
    ``metadata["extracted_answers"]`` holds what was extracted from each response (None if nothing).
    """

    def __init__(self, answer_tag: str = "answer", strict: bool = False) -> None:
        self.answer_tag = answer_tag
        self.strict = strict

    def extract(self, response: str) -> str | None:
        if self.strict:
            return extract_tagged_answer(response, self.answer_tag)
        return extract_final_answer(response, self.answer_tag)

    def __call__(
        self, prompts: list[str], responses: list[str], references: Sequence[Any] | None = None, **kwargs: Any
    ) -> RewardOutput:
        expected = _resolve_references(self.name, None, references, len(responses))
        extracted = [self.extract(response) for response in responses]
        scores = [grade_math(answer, ref) for answer, ref in zip(extracted, expected)]  # the math tasks' own
        return RewardOutput(scores=scores, metadata={"extracted_answers": extracted})


class TagFormatReward(BaseReward):
    """Partial credit for the ``<think>...</think><answer>...</answer>`` format.

    0.25 each for: an opening think tag; a closed think block with non-blank content; an opening
    answer tag; a closed answer block with non-blank content. The total is capped at 0.75 when the
    answer opens before the think block, when any tag appears more than once, or when non-blank
    text follows ``</answer>``. Tag names are matched exactly (case-sensitive), as the prompt
    asks for them.
    """

    def __init__(self, think_tag: str = "think", answer_tag: str = "answer") -> None:
        self.think_tag = think_tag
        self.answer_tag = answer_tag

    @staticmethod
    def _closed_block_has_content(response: str, open_tag: str, close_tag: str) -> bool:
        start = response.find(open_tag)
        if start < 0:
            return False
        end = response.find(close_tag, start + len(open_tag))
        return end >= 0 and bool(response[start + len(open_tag) : end].strip())

    def score(self, response: str) -> float:
        """The partial-credit score of one response."""
        think_open, think_close = f"<{self.think_tag}>", f"</{self.think_tag}>"
        answer_open, answer_close = f"<{self.answer_tag}>", f"</{self.answer_tag}>"
        score = 0.25 * sum(
            (
                think_open in response,
                self._closed_block_has_content(response, think_open, think_close),
                answer_open in response,
                self._closed_block_has_content(response, answer_open, answer_close),
            )
        )
        think_at, answer_at = response.find(think_open), response.find(answer_open)
        out_of_order = think_at >= 0 and answer_at >= 0 and answer_at < think_at
        repeated = any(
            response.count(tag) > 1 for tag in (think_open, think_close, answer_open, answer_close)
        )
        answer_end = response.rfind(answer_close)
        trailing_text = answer_end >= 0 and bool(response[answer_end + len(answer_close) :].strip())
        if out_of_order or repeated or trailing_text:
            score = min(score, 0.75)
        return score

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        return RewardOutput(scores=[self.score(str(response)) for response in responses])


class NumberReward(BaseReward):
    """1.0 when a number can be read from the response's final answer (see
    `extract_final_answer`), else 0.0. A weak shaping signal: "end with a number"."""

    def __init__(self, answer_tag: str = "answer") -> None:
        self.answer_tag = answer_tag

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        scores = [
            1.0 if parse_number(extract_final_answer(response, self.answer_tag)) is not None else 0.0
            for response in responses
        ]
        return RewardOutput(scores=scores)
