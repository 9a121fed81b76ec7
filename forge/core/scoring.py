"""Turn completions into rewards: hand each reward what it receives, call it the way its convention says,
check what it returned, weight and sum, handle failures.

What a reward receives (`RewardInputs`): the prompts and completions, the dataset's other columns by name
(`reference` as `references` in Forge's convention), each completion's token ids, and with tools or an
environment the calls and episodes. How it is called: a `BaseReward` Forge's way, ``reward(prompts,
completions, **the keywords its signature names)``; a plain function through `FunctionReward`, Forge's way
or TRL's (`CONVENTIONS`), its signature read once when it is wrapped. Rewards from names, paths, reward models
and weighted lists, and the checks of a reward's signature, are core/reward_sources.py's.

A reward is user code, so it is treated as untrusted in one sense: whatever it does wrong (raises, hangs,
returns NaN, a wrong count or a non-number) is caught here and reported with the reward's name and the
sample, never turned silently into a zero. `on_error="score"` gives failing samples a fixed score
instead and counts them, so a long run can go on past one odd completion:

    the reward ...     on_error='raise'                         on_error='score'
    raises             RewardError: reward, step, row, text     reward_error_value, counted in `errors`
    hangs              RewardError after reward_timeout         reward_error_value, counted in `timeouts`
    returns NaN / inf  RewardError                              masked from the loss, counted in `nonfinite`
    returns a wrong count or a non-number: always a RewardError (a bug in the reward, not one sample)

A score of None means the reward does not apply to that sample: it is left out of that reward (the total is
the weighted sum over the rewards that apply; `Scores.applies`), and a sample no reward applies to gets
advantage 0 and stays out of the group statistics (`Scores.scored`). `async def` rewards of a step are
started together and awaited concurrently, each under reward_timeout, with the same error rules as the others
(the helper thread and event loop are core/reward_timeouts.py's).

A score is a Python int or float, or a numpy / torch number (np.float32, np.int64, a 0-d array or tensor); a
list of scores may also be a 1-d array or tensor. A bool is refused: a yes/no score is returned as 1.0 / 0.0.

`sys.exit()` (SystemExit) or a KeyboardInterrupt raised inside a reward, plain or `async def`, is a reward
failure like any other exception, so it can never end a run silently (`os._exit()` can: `forge train` runs the
training in a child process it watches, forge/run/supervisor.py). A real Ctrl-C is told apart by who raised
it: Forge's SIGINT/SIGTERM handler calls `note_user_interrupt()` right before it raises KeyboardInterrupt, and
that one goes through untouched. Where no handler of Forge's is installed (Python's default SIGINT handler),
every KeyboardInterrupt is taken for the user's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from forge.core.grpo import weighted_reward_sum
from forge.core.reward import (
    BaseReward,
    RewardOutput,
    TrainerState,
    accepted_names,
    named_extras,
    names_parameter,
)
from forge.core.reward_timeouts import RewardTimeout, call_with_timeout, settle, value_of
from forge.run.loop import StepFailed
from forge.run.signals import reraise_user_interrupt


class RewardError(StepFailed):
    """A reward function failed; the message names the reward, the sample and what to do."""


# What reward code may raise that counts as a failure of the reward (a user's Ctrl-C is re-raised, see below).
REWARD_FAILURES = (Exception, SystemExit, KeyboardInterrupt)


@dataclass
class Scores:
    """Rewards of one rollout batch."""

    total: torch.Tensor  # (N,) weighted sum of the components that apply (advantages.weighted_reward_sum)
    components: dict[str, torch.Tensor]  # name -> (N,) raw component scores
    valid: torch.Tensor  # (N,) bool, False where a reward returned NaN/inf (masked from the loss)
    errors: int = 0  # samples scored reward_error_value because a reward raised
    timeouts: int = 0  # reward calls that ran past the timeout
    nonfinite: int = 0  # samples masked from the loss because a reward returned NaN/inf
    metadata: dict[str, Any] = field(default_factory=dict)
    applies: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (N,) bool, False: returned None
    # name -> values the rewards' log_metric gave
    logged: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)  # column -> (N,) values the rewards' log_extra gave
    # (N,) bool: at least one reward applies to the sample (else: advantage 0, out of the statistics);
    # computed once when the Scores are built (__post_init__)
    scored: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if len(self.applies) < len(self.components):  # a reward absent from `applies` applies everywhere
            self.scored = torch.ones_like(self.valid)
        else:
            self.scored = torch.stack(list(self.applies.values()), dim=1).any(dim=1)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(components (N, K), applies (N, K)) in reward order, for multi_reward_advantages."""
        names = list(self.components)
        applies = [self.applies.get(k, torch.ones_like(self.valid)) for k in names]
        return torch.stack([self.components[k] for k in names], dim=1), torch.stack(applies, dim=1)


def _call_reward(fn: Callable[[], Any], timeout: float | None) -> Any:
    """fn(), under reward_timeout in a helper thread when there is one; then awaited if the reward is
    async."""
    result = fn() if timeout is None else call_with_timeout(fn, timeout)
    if inspect.isawaitable(result):
        return value_of(settle([result], timeout)[0])
    return result


def _as_scores(output: Any, name: str, expected: int, where: str = "") -> tuple[list[float | None], dict]:
    """Check a reward's return value: RewardOutput or a list of numbers (or None: does not apply), one per
    completion; the scores come back as floats, a None as None."""
    scores = getattr(output, "scores", output)
    metadata = getattr(output, "metadata", None) or {}
    if hasattr(scores, "tolist") and not isinstance(scores, (list, tuple)):  # a tensor or numpy array
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise RewardError(f"reward '{name}' returned {scores!r:.80} (a {type(scores).__name__}){where}; it "
                          f"must return a RewardOutput or a list of {expected} floats")
    if len(scores) != expected:
        raise RewardError(f"reward '{name}' returned {len(scores)} scores for {expected} completions{where}; "
                          f"return exactly one score per completion")
    values = []
    for i, value in enumerate(scores):
        if value is None:  # the reward does not apply to this sample
            values.append(None)
            continue
        if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy/torch scalar or 0-d array
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ": return float(...) (1.0 / 0.0) for a yes/no score" if isinstance(value, bool) else ""
            raise RewardError(f"reward '{name}' returned {value!r} (a {type(value).__name__}) for completion "
                              f"{i}{where}; scores must be int or float{hint}")
        values.append(float(value))
    return values, metadata


@dataclass(frozen=True)
class FailureRules:
    """What a failing reward call turns into (the table in this module's docstring), and how errors name
    it."""

    on_error: str = "raise"  # 'raise' or 'score'
    error_value: float = 0.0  # the score of a failing sample under on_error='score'
    timeout: float | None = None  # reward_timeout, seconds
    where: str = ""  # " at step k", for messages
    row_index: list[int] | None = None  # (N,) each completion's dataset row, for messages


def score_completions(
    rewards: list[tuple[str, BaseReward, float]], prompts: list, completions: list[str],
    columns: dict[str, list], *, on_error: str = "raise", error_value: float = 0.0,
    timeout: float | None = None, step: int | None = None, row_index: list[int] | None = None,
    trainer_state: Any = None, completion_ids: list[list[int]] | None = None,
    tool_calls: list[list[dict]] | None = None, environments: list | None = None,
    episodes: list | None = None,
) -> Scores:
    """Score N completions with every reward; prompts, completion_ids, tool_calls and each column have N
    entries.

    columns: the dataset's other columns by their own names. Each reward is called the way its convention says
    (`CONVENTIONS`: Forge's gives `reference` as `references` and trainer_state only to a
    reward that names it; TRL's gives every argument by keyword). row_index (N,) names each completion's
    dataset row in error messages."""
    inputs = RewardInputs(list(prompts), list(completions), columns, completion_ids, trainer_state,
                          tool_calls, environments, episodes)
    where = f" at step {step}" if step is not None else ""
    return score_batch(rewards, inputs, FailureRules(on_error, error_value, timeout, where, row_index))


def score_batch(rewards: list[tuple[str, BaseReward, float]], inputs: RewardInputs,
                rules: FailureRules) -> Scores:
    """Score the N completions of `inputs` with every reward, under the failure rules (score_completions and
    score_rollout build both): the async rewards started first and awaited together, then reward by reward,
    its scores checked, the samples it does not apply to and the non-finite ones marked."""
    n = len(inputs.completions)
    asynchronous = [(name, reward) for name, reward, _ in rewards if reward.is_async]
    # started first
    settled = _settle_async_rewards(asynchronous, inputs, rules.timeout) if asynchronous else {}
    valid = torch.ones(n, dtype=torch.bool)
    components, metadata, applies = {}, {}, {}
    errors = timeouts = 0
    for name, reward, _ in rewards:
        call, failed, timed_out = _caller(reward, inputs), 0, 0
        try:
            output = value_of(settled[name]) if name in settled else _call_reward(call, rules.timeout)
            values, meta = _as_scores(output, name, n, rules.where)  # (N,): a float, or None: does not apply
        except RewardError:  # a bad return value: always raised
            raise
        except REWARD_FAILURES as error:  # the reward's own code failed: what the failure rules make of it
            values, meta, failed, timed_out = _under_failure_rules(name, error, call, n, rules, inputs)
        errors, timeouts = errors + failed, timeouts + timed_out
        components[name], applied, finite = _component(name, values, rules, inputs.completions)  # (N,) each
        valid &= finite
        if not applied.all():
            applies[name] = applied
        if meta:
            metadata[name] = meta
    nonfinite = int((~valid).sum())
    scores = Scores(torch.zeros(n), components, valid, errors, timeouts, nonfinite, metadata, applies,
                    inputs.logged, inputs.extra)
    scores.total = weighted_reward_sum(*scores.stacked(), [weight for _, _, weight in rewards])  # (N,)
    return scores


def _caller(reward: BaseReward, inputs: RewardInputs) -> Callable:
    """call(indices=None): the reward on every completion, or on the completions `indices` only."""
    return lambda indices=None: reward.score_inputs(inputs if indices is None else inputs.select(indices))


def _settle_async_rewards(rewards: list, inputs: RewardInputs, timeout: float | None) -> dict[str, tuple]:
    """name -> (ok, value or exception) of each async reward (name, reward): all started together, then
    awaited concurrently."""
    started: dict[str, tuple[bool, Any]] = {}
    for name, reward in rewards:
        try:
            started[name] = (True, _caller(reward, inputs)())
        except REWARD_FAILURES as error:  # raised before its first await
            started[name] = (False, error)
    pending = [name for name, (ok, _) in started.items() if ok]
    settled = dict(zip(pending, settle([started[name][1] for name in pending], timeout))) if pending else {}
    settled.update({name: outcome for name, outcome in started.items() if not outcome[0]})
    return settled


def _under_failure_rules(name: str, error: BaseException, call: Callable, n: int, rules: FailureRules,
                         inputs: RewardInputs) -> tuple[list[float | None], dict, int, int]:
    """A failed reward call: a RewardError that names the sample (on_error='raise'), or error_value for the
    failing samples, counted (on_error='score'); a user's Ctrl-C goes through untouched."""
    if isinstance(error, RewardTimeout):
        if rules.on_error != "score":
            raise RewardError(f"reward '{name}' took longer than reward_timeout={rules.timeout}s"
                              f"{rules.where}; raise the timeout, make the reward faster, or set "
                              f"on_reward_error='score' (such calls then score reward_error_value, counted "
                              f"in rewards/timeouts)") from None
        return [rules.error_value] * n, {}, 0, 1
    reraise_user_interrupt(error)
    if rules.on_error != "score":
        culprit = _first_failing_sample(call, n, rules.timeout)
        raise RewardError(_describe_failure(name, error, inputs.prompts, inputs.completions, culprit,
                                            rules.where, rules.row_index)) from error
    values, errors = _sample_by_sample(name, call, n, rules)
    return values, {}, errors, 0


def _sample_by_sample(name: str, call: Callable, n: int,
                      rules: FailureRules) -> tuple[list[float | None], int]:
    """(values (N,), errors): the reward on each completion alone, the failing ones scoring error_value."""
    values, errors = [], 0
    for i in range(n):
        try:
            values.append(_as_scores(_call_reward(lambda i=i: call([i]), rules.timeout), name, 1)[0][0])
        except REWARD_FAILURES as error:  # counted in rewards/errors, never silent
            reraise_user_interrupt(error)
            values.append(rules.error_value)
            errors += 1
    return values, errors


def _component(name: str, values: list[float | None], rules: FailureRules,
               completions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(component (N,) float32, 0 where the reward does not apply; applies (N,) bool: it returned a number;
    finite (N,) bool)."""
    applies = torch.tensor([value is not None for value in values], dtype=torch.bool)  # (N,)
    component = torch.tensor([0.0 if value is None else value for value in values], dtype=torch.float32)
    finite = torch.isfinite(component)  # (N,)
    if not finite.all():
        component = _masked_nonfinite(name, values, component, finite, rules, completions)
    return component, applies, finite


def _masked_nonfinite(name: str, values: list[float | None], component: torch.Tensor, finite: torch.Tensor,
                      rules: FailureRules, completions: list[str]) -> torch.Tensor:
    """A NaN/inf score: a RewardError, or under on_error='score' its sample scored 0 (and masked from the
    loss by `finite`)."""
    bad = int((~finite).nonzero()[0])
    if rules.on_error != "score":
        row = f" (dataset row {rules.row_index[bad]})" if rules.row_index else ""
        raise RewardError(f"reward '{name}' returned {values[bad]} for completion {bad}{row}{rules.where} "
                          f"({completions[bad][:200]!r}); return finite numbers, or set "
                          f"on_reward_error='score' to mask such samples from the loss")
    return torch.where(finite, component, torch.zeros_like(component))


def _first_failing_sample(call: Callable, n: int, timeout: float | None = None) -> int:
    """Index of the first completion the reward fails on when scored alone (0 if none fails alone)."""
    for i in range(n):
        try:
            _call_reward(lambda i=i: call([i]), timeout)
        except REWARD_FAILURES as error:  # we are only locating the failure
            reraise_user_interrupt(error)
            return i
    return 0


def _describe_failure(name, error, prompts, completions, index, where, row_index) -> str:
    row = f" (dataset row {row_index[index]})" if row_index else ""
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, SystemExit):  # str(SystemExit(0)) is just "0"
        detail = f"SystemExit({error.code!r}) (sys.exit() inside the reward; return scores instead)"
    return (f"reward '{name}' raised {detail}{where}, on completion {index}{row} "
            f"({completions[index][:200]!r}) of prompt {str(prompts[index])[:120]!r}. Fix the reward, or "
            f"set on_reward_error='score' to give failing samples reward_error_value and go on.")


def score_rollout(rewards: list, rows: list[dict], rollout, config, *, step: int,
                  trainer_state) -> tuple[Scores | None, RewardError | None]:
    """Score a rollout of these dataset rows (G completions each) under the run's failure settings: every
    row's other columns, each completion's token ids, with tools each completion's calls, and with an
    environment its instances and episodes reach the rewards. A completion whose environment could not run is
    masked (not valid). Returns (scores, None), or (None, the RewardError) when a reward failed: the trainer
    raises it once it knows whether a reward failed in any process, so all of them stop at the same point."""
    prompts, columns, row_ids = per_completion(rows, config.group_size)
    inputs = RewardInputs(prompts, list(rollout.completions), columns, trainer_state=trainer_state,
                          **rollout_inputs(rollout))
    rules = FailureRules(config.on_reward_error, config.reward_error_value, config.reward_timeout,
                         f" at step {step}", row_ids)
    try:
        scores = score_batch(rewards, inputs, rules)
    except RewardError as error:
        return None, error
    scores.valid &= ~rollout.failed
    return scores, None


def rollout_inputs(rollout) -> dict:
    """What a rollout hands the rewards besides prompts and completions: each completion's token ids, and with
    tools its calls, with an environment its instances and episodes (RewardInputs' fields, score_completions'
    keywords)."""
    return {"completion_ids": completion_token_ids(rollout), "tool_calls": rollout_tool_calls(rollout),
            "environments": rollout.environments, "episodes": rollout.episodes}


def per_completion(rows: list[dict], group_size: int) -> tuple[list, dict[str, list], list[int]]:
    """The rows' prompts, other columns and row ids, each repeated for the group_size completions of its
    row."""
    prompts = [row["prompt"] for row in rows for _ in range(group_size)]
    columns = {k: [v for v in values for _ in range(group_size)]
               for k, values in dataset_columns(rows).items()}
    row_ids = [row.get("_row", i) for i, row in enumerate(rows) for _ in range(group_size)]
    return prompts, columns, row_ids


def completion_token_ids(rollout) -> list[list[int]]:
    """(N,) each completion's tokens (sampled, and fed tool results), without the padding after it."""
    return [ids[:n] for ids, n in zip(rollout.completion_ids.tolist(), rollout.completion_lengths.tolist())]


def rollout_tool_calls(rollout) -> list[list[dict]] | None:
    """(N,) each completion's tool calls and results, in order; None for a rollout without tools."""
    if rollout.tool_calls is None:
        return None
    return [[result.as_dict() for result in calls] for calls in rollout.tool_calls]


# ----------------------------------------------------------------------------------------------
# What a reward receives: the dataset's other columns, and what the rollout made (docs/rewards.md)


COLUMN_ALIASES = {"reference": "references"}
"""Dataset columns that Forge's reward convention passes under another name (the built-in rewards take
`references`); the one table of the rename."""


def dataset_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Every column except ``prompt`` and ``_private`` ones as a list over rows, under its own name."""
    if not rows:
        return {}
    return {column: [row[column] for row in rows] for column in rows[0]
            if column != "prompt" and not column.startswith("_")}


def reward_kwargs(rows: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """`dataset_columns` keyed by Forge's reward keyword names (`COLUMN_ALIASES`: ``reference`` ->
    ``references``)."""
    return {COLUMN_ALIASES.get(column, column): values for column, values in dataset_columns(rows).items()}


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


# ----------------------------------------------------------------------------------------------
# The two ways of calling a reward (docs/rewards.md, docs/from-trl.md); a plain function as a reward


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
        # an async def function, or an object whose __call__ is one: awaited with the step's other async ones
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)

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


def _named(kwargs: Mapping[str, Any], names: frozenset[str] | None) -> dict[str, Any]:
    return dict(kwargs) if names is None else {key: value for key, value in kwargs.items() if key in names}


def as_output(result: Any) -> RewardOutput:
    """A RewardOutput as is; anything else (a list of floats) becomes its ``scores``, unchecked."""
    return result if isinstance(result, RewardOutput) else RewardOutput(scores=result)


async def _awaited_output(result: Any) -> RewardOutput:
    return as_output(await result)
