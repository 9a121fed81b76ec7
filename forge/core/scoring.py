"""Turn completions into rewards: call each reward, check what it returned, weight and sum, handle failures.

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
started together and awaited concurrently (one event loop in a helper thread), each under reward_timeout,
with the same error rules as the others.

A timed-out call keeps running in a daemon thread (Python cannot kill a thread); for code that may
never return, run it in a subprocess with `forge.tools.sandbox.run_python`, which is killed on its timeout.

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

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.core.advantages import weighted_reward_sum
from forge.core.engine_rollout import generate_on_engine
from forge.core.reward import BaseReward, FunctionReward, RewardInputs, call_problem
from forge.core.reward_sources import SequenceClassificationReward, as_reward, is_model_and_tokenizer
from forge.core.rollout import SamplingSettings, generate
from forge.data.dataset import dataset_columns
from forge.run.loop import StepFailed
from forge.run.rng import capture_rng_state, restore_rng_state
from forge.run.signals import reraise_user_interrupt
from forge.run.step_stats import completion_metrics
from forge.tools.calls import ToolSettings


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


def build_reward_list(
    reward_fn: Any, weights: Sequence[float] | None = None, convention: str = "forge"
) -> list[tuple[str, BaseReward, float]]:
    """One reward, or a list of rewards (weighted by `weights`), as (unique name, reward, weight); plain
    functions are called by `convention` (forge.core.reward.CONVENTIONS). A reward whose signature cannot take
    that call is an error here, before any model work."""
    is_list = isinstance(reward_fn, (list, tuple)) and not is_model_and_tokenizer(reward_fn)
    rewards = list(reward_fn) if is_list else [reward_fn]
    if not rewards:
        raise ValueError("reward_fn is empty; pass a reward (e.g. ExactMatchReward()) or a list of them")
    weights = list(weights) if weights is not None else [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(rewards)} reward functions")
    named, seen = [], {}
    for reward, weight in zip(rewards, weights):
        if is_model_and_tokenizer(reward):
            reward = SequenceClassificationReward(*reward)
        if not callable(reward) and not isinstance(reward, str):
            raise TypeError(f"reward {reward!r} is not callable; pass a BaseReward, f(prompts, completions), "
                            f"or a reward model (its hub id, folder, or (model, tokenizer))")
        wrapped = as_reward(reward, convention)
        name = getattr(wrapped, "name", None) or type(wrapped).__name__
        problem = call_problem(wrapped)
        if problem:
            raise TypeError(f"reward '{name}': {problem}")
        seen[name] = seen.get(name, 0) + 1
        named.append((name if seen[name] == 1 else f"{name}_{seen[name]}", wrapped, float(weight)))
    return named


class RewardTimeout(Exception):
    """A reward call ran past reward_timeout."""


def _call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """Run fn, waiting at most `timeout` seconds; works from any thread (no signals).

    The call runs in a daemon thread, so a reward that never returns cannot keep the process alive at
    exit; it does keep running (and using a CPU) in the background until it returns."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread below
            outcome["error"] = error

    worker = threading.Thread(target=target, name="forge-reward", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout(f"no result after {timeout}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _settle(awaitables: list, timeout: float | None) -> list[tuple[bool, Any]]:
    """Await every awaitable concurrently, each under `timeout`: [(True, value) or (False, exception)].

    One event loop in a helper thread, so this works where a loop already runs (a notebook)."""
    async def caught(awaitable) -> tuple[bool, Any]:
        try:
            return True, await awaitable
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - SystemExit/KeyboardInterrupt too, which end the loop
            return False, error  # handed back to the caller, who applies the error rules

    async def one(awaitable) -> tuple[bool, Any]:
        task = asyncio.ensure_future(caught(awaitable))
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            return False, RewardTimeout(f"no result after {timeout}s")
        return task.result()

    async def every() -> list:
        return list(await asyncio.gather(*(one(a) for a in awaitables)))

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(every())
        except BaseException as error:  # noqa: BLE001 - the loop itself failed: every reward of it failed so
            outcome["error"] = error

    worker = threading.Thread(target=target, name="forge-async-rewards", daemon=True)
    worker.start()
    worker.join(None if timeout is None else timeout + 10)  # a coroutine that blocks its loop cannot time out
    if "value" in outcome:
        return outcome["value"]
    return [(False, outcome.get("error") or RewardTimeout(f"no result after {timeout}s"))] * len(awaitables)


def _outcome(settled: tuple[bool, Any]) -> Any:
    ok, value = settled
    if not ok:
        raise value
    return value


def _call_reward(fn: Callable[[], Any], timeout: float | None) -> Any:
    """fn(), under reward_timeout in a helper thread when there is one; then awaited if the reward is
    async."""
    result = fn() if timeout is None else _call_with_timeout(fn, timeout)
    if inspect.isawaitable(result):
        return _outcome(_settle([result], timeout)[0])
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
    (forge.core.reward.CONVENTIONS: Forge's gives `reference` as `references` and trainer_state only to a
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
    asynchronous = [(name, reward) for name, reward, _ in rewards if is_async_reward(reward)]
    # started first
    settled = _settle_async_rewards(asynchronous, inputs, rules.timeout) if asynchronous else {}
    valid = torch.ones(n, dtype=torch.bool)
    components, metadata, applies = {}, {}, {}
    errors = timeouts = 0
    for name, reward, _ in rewards:
        call, failed, timed_out = _caller(reward, inputs), 0, 0
        try:
            output = _outcome(settled[name]) if name in settled else _call_reward(call, rules.timeout)
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


def is_async_reward(reward: Any) -> bool:
    """True for an ``async def`` reward (a coroutine function, or an object whose ``__call__`` is one)."""
    target = reward.fn if isinstance(reward, FunctionReward) else reward
    if inspect.iscoroutinefunction(target):
        return True
    return callable(target) and inspect.iscoroutinefunction(type(target).__call__)


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
    settled = dict(zip(pending, _settle([started[name][1] for name in pending], timeout))) if pending else {}
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


def check_reward_columns(rewards: list[tuple[str, BaseReward, float]], rows: list[dict]) -> None:
    """A reward argument that neither its calling convention nor a dataset column supplies is an error before
    the first step, naming the columns there are."""
    columns = list(dataset_columns(rows[:1]))
    for name, reward, _ in rewards:
        problem = call_problem(reward, columns)
        if problem:
            raise ValueError(f"reward '{name}': {problem}")


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


def reward_metrics(scores: Scores) -> dict:
    """reward, reward_std and each reward's rewards/<name>/mean and /std (TRL's names) over the valid samples
    (a reward's own over those it applies to), NaN where there are none."""
    def mean_std(values: torch.Tensor) -> tuple[float, float]:
        return (float(values.mean()) if values.numel() else float("nan"),
                float(values.std()) if values.numel() > 1 else 0.0)

    metrics = dict(zip(("reward", "reward_std"), mean_std(scores.total[scores.valid])))
    for name, values in scores.components.items():
        applies = scores.valid & scores.applies.get(name, torch.ones_like(scores.valid))
        metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = mean_std(values[applies])
    return metrics


def greedy_reward_evaluator(rewards: list, config, tools: ToolSettings | None = None, engine=None):
    """The trainer's default evaluator: one greedy completion per held-out row, scored by the run's own
    rewards, in TRL's names (reward, reward_std, rewards/<name>/mean and /std, completions/*; n: the rows;
    GRPOTrainer.evaluate adds the eval_ prefix), with the run's tools when it has them, on the run's
    vLLM `engine` when it has one (forge/core/engine_rollout.py). The global RNG state is restored afterwards,
    so evaluating mid-run does not change later samples."""

    @torch.no_grad()
    def evaluate(model, tokenizer, rows: list[dict], *, max_new_tokens: int, max_prompt_length: int) -> dict:
        rng_state, was_training = capture_rng_state(), model.training
        model.eval()
        settings, prompts = SamplingSettings(max_new_tokens, do_sample=False), [row["prompt"] for row in rows]
        completions, ids, calls, episodes, truncated = [], [], [], [], []
        for start in range(0, len(rows), 32):
            chunk, chunk_rows = prompts[start:start + 32], rows[start:start + 32]
            rollout = generate(model, tokenizer, chunk, 1, settings, max_prompt_length,
                               config.truncate_prompts, config.share_prompt_prefix, tools=tools,
                               rows=chunk_rows) if engine is None \
                else generate_on_engine(engine, tokenizer, chunk, 1, settings, max_prompt_length,
                                        config.truncate_prompts, tools=tools, rows=chunk_rows)
            completions += rollout.completions
            ids += completion_token_ids(rollout)
            truncated.append(rollout.truncated.float())
            calls += rollout_tool_calls(rollout) or []
            episodes += rollout.episodes or []
        scores = score_completions(rewards, prompts, completions, dataset_columns(rows),
                                   on_error=config.on_reward_error, error_value=config.reward_error_value,
                                   timeout=config.reward_timeout, completion_ids=ids,
                                   tool_calls=calls if tools is not None else None,
                                   environments=[e.environment for e in episodes] if episodes else None,
                                   episodes=episodes or None)
        restore_rng_state(rng_state)
        model.train(was_training)
        lengths = torch.tensor([float(len(one)) for one in ids])  # (N,)
        return {**reward_metrics(scores), **completion_metrics(lengths, torch.cat(truncated)), "n": len(rows)}

    return evaluate
