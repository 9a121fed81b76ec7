"""The reward protocol (BaseReward, RewardOutput, TrainerState, plain functions) and the built-in rewards.

A reward scores a batch of responses: ``reward(prompts, responses, **kwargs) -> RewardOutput``,
one float per response. Dataset columns other than ``prompt`` arrive as keyword arguments
(``reference`` becomes ``references``, see `forge.data.dataset.reward_kwargs`), and each reward
receives only the keyword arguments its signature names (`call_with_accepted_kwargs`), so a user
can write ``def __call__(self, prompts, responses, references)`` without ``**kwargs``.

Plain TRL-style functions ``f(prompts, completions, **kwargs) -> list[float]`` are accepted too
(`FunctionReward`; core/reward_sources.py turns names, paths, reward models and weighted lists into rewards).
Answer extraction and equivalence live in `forge.data.answers`, shared with the evaluation code so that the
training reward and the reported accuracy agree.

A score may be ``None``: the reward does not apply to that sample (e.g. a code reward on a math
prompt). The sample is then scored by the rewards that apply, and left out of the advantage
statistics if none does. A reward may be ``async def`` (a remote judge): the async rewards of a
step run concurrently. A reward that names a ``trainer_state`` parameter receives a `TrainerState`
(the optimizer step, for curricula), as TRL's do. A HuggingFace sequence-classification model (a
reward model) is a reward too (core/reward_sources.py `SequenceClassificationReward`): pass the model, its
hub id or its folder wherever a reward goes.

This module does not check the scores it returns (length, NaN, type): the trainer validates
every reward output in one place. Exceptions raised by a reward propagate unchanged.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from forge.data.answers import (
    extract_final_answer,
    extract_tagged_answer,
    parse_number,
)
from forge.data.dataset import COLUMN_ALIASES
from forge.data.task import grade_math

__all__ = [
    "BaseReward",
    "ExactMatchReward",
    "FormatReward",
    "FunctionReward",
    "LengthPenaltyReward",
    "MathCorrectnessReward",
    "NumberReward",
    "RewardOutput",
    "TagFormatReward",
    "TrainerState",
    "accepted_kwargs",
    "accepted_names",
    "as_output",
    "call_with_accepted_kwargs",
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
    """How the trainer calls it (`CONVENTIONS`): a BaseReward Forge's way, ``reward(prompts, responses,
    ...)``."""

    @abstractmethod
    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        """Score each response to its prompt; return one float per response."""

    def score_inputs(self, inputs: RewardInputs) -> Any:
        """Score a batch as the trainer does, Forge's way: ``self(prompts, completions, **keywords it
        names)``."""
        return call_with_accepted_kwargs(self, inputs.prompts, inputs.completions,
                                         inputs.forge_keywords(named_extras(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ----------------------------------------------------------------------------------------------
# What a reward receives, and the two ways of calling it (docs/rewards.md, docs/from-trl.md)


@dataclass
class RewardInputs:
    """Everything a reward may receive about a batch of N scored completions."""

    prompts: list  # (N,) each a string or chat messages, as the dataset gave it
    completions: list[str]  # (N,) the completions' text
    columns: dict[str, list] = field(default_factory=dict)  # (N,) each: the dataset's other columns by name
    completion_ids: list[list[int]] | None = None  # (N,) each completion's token ids
    trainer_state: TrainerState | None = None  # where the run is
    tool_calls: list[list[dict]] | None = None  # (N,) each completion's tool calls and results (with tools)
    environments: list | None = None  # (N,) each completion's finished environment instance (forge/envs)
    episodes: list | None = None  # (N,) Forge's record of each episode (forge/envs Episode: turns, rewards)
    # name -> the values rewards logged (log_metric)
    logged: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)  # column -> (N,) values rewards logged (log_extra)

    def select(self, indices: Sequence[int]) -> RewardInputs:
        """The same inputs for the completions `indices` only (what rewards log goes to the same place)."""
        pick = (lambda values: None if values is None else [values[i] for i in indices])
        return RewardInputs(pick(self.prompts), pick(self.completions),
                            {k: pick(v) for k, v in self.columns.items()}, pick(self.completion_ids),
                            self.trainer_state, pick(self.tool_calls), pick(self.environments),
                            pick(self.episodes), self.logged, self.extra)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` keyword: a number the step's log shows under `name`, the mean of the values the
        step's rewards logged under it."""
        self.logged.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` keyword: one value per completion of the call, shown with the samples
        (samples.jsonl) as `column`."""
        self.extra.setdefault(column, []).extend(values)

    def forge_keywords(self, named: Collection[str] = ()) -> dict[str, Any]:
        """Forge's keywords: the columns (``reference`` as ``references``), ``tool_calls``, and those of
        ``trainer_state``, ``completion_ids``, ``log_metric`` and ``log_extra`` the reward names (`named`: a
        ``**kwargs`` reward gets the columns, not these)."""
        keywords = {COLUMN_ALIASES.get(k, k): v for k, v in self.columns.items()}
        keywords |= self.rollout_keywords()
        extras = {"trainer_state": self.trainer_state, "completion_ids": self.completion_ids,
                  "log_metric": self.log_metric, "log_extra": self.log_extra}
        return keywords | {k: v for k, v in extras.items() if k in named and v is not None}

    def trl_keywords(self, fn: Callable[..., Any] | None = None) -> dict[str, Any]:
        """TRL's keywords: ``prompts``, ``completions`` (for chat prompts each one a list holding the
        assistant message, as TRL gives them), ``completion_ids``, every column by its own name,
        ``trainer_state``, ``log_metric`` and ``log_extra`` (and ``tool_calls`` with tools); a column also
        under Forge's name (``references``) when `fn` names that."""
        chat = bool(self.prompts) and not isinstance(self.prompts[0], str)
        completions = [[{"role": "assistant", "content": text}] for text in self.completions] if chat \
            else self.completions
        keywords = {"prompts": self.prompts, "completions": completions,
                    "completion_ids": self.completion_ids, **self.columns,
                    "trainer_state": self.trainer_state, "log_metric": self.log_metric,
                    "log_extra": self.log_extra}
        for column, alias in COLUMN_ALIASES.items():
            if column in keywords and fn is not None and names_parameter(fn, alias):
                keywords[alias] = keywords[column]
        return keywords | self.rollout_keywords()

    def rollout_keywords(self) -> dict[str, Any]:
        """``tool_calls`` with tools; ``environments`` and ``episodes`` with an environment."""
        given = {"tool_calls": self.tool_calls, "environments": self.environments, "episodes": self.episodes}
        return {k: v for k, v in given.items() if v is not None}


class Convention(NamedTuple):
    """One way of calling a reward (`BaseReward.score_inputs`, `FunctionReward.score_inputs`): the names it
    supplies besides the dataset's columns, and the call as an error message shows it."""

    supplies: frozenset[str]
    says: str


CONVENTIONS = {
    "forge": Convention(
        frozenset({*COLUMN_ALIASES.values(), "completion_ids", "trainer_state", "log_metric", "log_extra",
                   "tool_calls", "environments", "episodes"}),
        "reward(prompts, completions, **columns) with text completions, `reference` as `references`, and "
        "trainer_state=, completion_ids=, log_metric=, log_extra= if it names them (Forge's convention: "
        "reward_fn=)"),
    "trl": Convention(
        frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                   "tool_calls", "environments", "episodes"}),
        "reward(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns), every "
        "argument by keyword, chat completions as [{'role': 'assistant', 'content': ...}] (TRL's "
        "convention: reward_funcs=)"),
}
"""The two ways Forge calls a reward, chosen once per reward, never per call: a BaseReward, and a function
passed as ``reward_fn=`` (or by `forge train --reward`), Forge's way; a function passed as ``reward_funcs=``,
TRL's way."""


FORGE_POSITIONS = ("prompts", "completions")
"""What Forge's call passes by position, in this order."""


def binds_by_name(fn: Callable[..., Any]) -> bool:
    """Whether Forge's call passes prompts and completions to `fn` by name rather than by position: one of its
    first two parameters is named for another argument of the call (``def f(completions, completion_ids,
    **kwargs)``), so by position each would get the wrong one, as text where ids were meant."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    kinds = inspect.Parameter
    names = [p.name for p in parameters if p.kind is kinds.POSITIONAL_OR_KEYWORD][:2]
    named_for = CONVENTIONS["trl"].supplies | CONVENTIONS["forge"].supplies  # every name a call gives
    return len(names) == 2 and any(name in named_for and name != FORGE_POSITIONS[i]
                                   for i, name in enumerate(names))


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


def call_problem(reward: BaseReward, columns: Sequence[str] | None = None) -> str | None:
    """Why `reward` cannot take the call its convention makes, or None: checked when the trainer is built (the
    call's shape) and again when the dataset is known (`columns`: a required argument no column supplies)."""
    fn = reward.fn if isinstance(reward, FunctionReward) else reward
    convention = CONVENTIONS[reward.convention]
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    takes_more = any(p.kind is kinds.VAR_POSITIONAL for p in parameters)
    if getattr(reward, "by_name", False):  # Forge's call, prompts and completions by name too
        convention = Convention(convention.supplies | set(FORGE_POSITIONS), convention.says)
        required = [p.name for p in parameters if p.default is kinds.empty
                    and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    elif reward.convention == "forge":
        if len(positional) < 2 and not takes_more:
            return (f"it takes {len(positional)} positional argument(s), but Forge calls {convention.says}; "
                    f"pass it as reward_funcs= to have it called as TRL calls rewards, every argument by "
                    f"keyword")
        required = [p.name for p in positional[2:] + [p for p in parameters if p.kind is kinds.KEYWORD_ONLY]
                    if p.default is kinds.empty]
    else:
        if any(p.kind is kinds.POSITIONAL_ONLY and p.default is kinds.empty for p in parameters):
            return (f"it has positional-only arguments, but Forge calls {convention.says}; pass it as "
                    f"reward_fn= to have it called Forge's way, prompts and completions by position")
        required = [p.name for p in parameters if p.default is kinds.empty
                    and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    supplied = set(convention.supplies) | set(columns or ())
    missing = [name for name in required if name not in supplied]
    if columns is None:
        missing = [name for name in missing if name in convention.supplies]  # the rest may be columns
    if missing:
        where = f"; the dataset's columns are {sorted(columns)}" if columns is not None else ""
        return f"it needs {missing}, which nothing supplies{where}; Forge calls {convention.says}"
    return None


# ----------------------------------------------------------------------------------------------
# Calling rewards with the keyword arguments they accept


def accepted_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], positional: int = 2) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` can receive by name after its first `positional` arguments
    (Forge's call gives ``prompts`` and ``responses`` by position; TRL's, positional=0, gives everything by
    keyword); all of them when ``fn`` takes ``**kwargs`` or has no inspectable signature (some builtins)."""
    return _named(kwargs, accepted_names(fn, positional))


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


def _named(kwargs: Mapping[str, Any], names: frozenset[str] | None) -> dict[str, Any]:
    return dict(kwargs) if names is None else {key: value for key, value in kwargs.items() if key in names}


def call_with_accepted_kwargs(
    fn: Callable[..., Any], prompts: list[str], responses: list[str], kwargs: Mapping[str, Any]
) -> Any:
    """``fn(prompts, responses, **accepted_kwargs(fn, kwargs))``: the two by position, so the second parameter
    may be called ``responses`` or ``completions`` (TRL's name), and the keywords its signature names."""
    return fn(prompts, responses, **accepted_kwargs(fn, kwargs))


def as_output(result: Any) -> RewardOutput:
    """A RewardOutput as is; anything else (a list of floats) becomes its ``scores``, unchecked."""
    return result if isinstance(result, RewardOutput) else RewardOutput(scores=result)


def _callable_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name.strip("<>") or "reward"


class FunctionReward(BaseReward):
    """Adapts a plain function that returns a list of floats (or a RewardOutput) to the BaseReward interface,
    called as its `convention` says: 'forge' ``f(prompts, completions, **columns)`` (prompts and completions
    by name to a function whose first parameters are named for other arguments: `binds_by_name`), 'trl' every
    argument by keyword as TRL calls it. Usually built by `as_reward`."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, convention: str = "forge") -> None:
        if convention not in CONVENTIONS:
            raise ValueError(f"convention={convention!r}; choose one of {sorted(CONVENTIONS)}")
        self.fn, self.convention = fn, convention
        self.name = name or _callable_name(fn)
        # the call's shape, read from the signature once: prompts and completions by position or by name
        # (binds_by_name), the keywords it takes, whether it gets trainer_state and completion_ids
        self.by_name = convention == "forge" and binds_by_name(fn)
        self.accepts = accepted_names(fn, positional=0 if convention == "trl" or self.by_name else 2)
        self.named = named_extras(fn)

    def __call__(self, prompts: list, responses: list[str], **kwargs: Any) -> RewardOutput:
        return self.score_inputs(RewardInputs(list(prompts), list(responses), kwargs))

    def score_inputs(self, inputs: RewardInputs) -> Any:
        if self.convention == "trl":  # every argument by keyword
            result = self.fn(**_named(inputs.trl_keywords(self.fn), self.accepts))
        elif self.by_name:  # Forge's keywords, and prompts and completions (text) under their names
            keywords = {"prompts": inputs.prompts, "completions": inputs.completions,
                        **inputs.forge_keywords(self.named)}
            result = self.fn(**_named(keywords, self.accepts))
        else:
            keywords = _named(inputs.forge_keywords(self.named), self.accepts)
            result = self.fn(inputs.prompts, inputs.completions, **keywords)
        if inspect.isawaitable(result):  # an async def reward: the caller awaits it with the other async ones
            return _awaited_output(result)
        return as_output(result)


async def _awaited_output(result: Any) -> RewardOutput:
    return as_output(await result)


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
