"""Environments: per-episode state that the model's actions change, so what it reads next
depends on what it did.

An environment is a class; Forge makes one instance per completion (G per prompt, never shared), so a group's
episodes are independent. The protocol is TRL's `environment_factory`, accepted as it is:

    class Guess:                                    # any class, or a factory: a callable
                                                    # returning an instance
        def reset(self, **row) -> str | None:       # the dataset row; may return the opening observation
            self.secret = int(row["secret"])
        def guess(self, number: int) -> str:        # public, typed, docstringed methods are the tools
            \"\"\"Guess the hidden number.

            Args:
                number: the guess
            \"\"\"
            return "higher" if number < self.secret else "lower" if number > self.secret else "correct"
        def get_reward(self) -> float: ...          # optional: the environment scores its episode

- `reset(**row)` receives the row's columns it names (all of them when it takes **kwargs). A returned string
  is appended to the prompt (to the last message of a chat prompt): the group's completions share one prompt,
  so an episode that opens with another text than its group's first one is a failed episode.
- Every public method but `reset` and `get_reward` is a tool (schema from its type hints and docstring, as for
  tools), called through the same call formats, isolation and timeouts (forge/tools/calls.py `run_calls`);
  `async def` methods are awaited. A method may return Forge's `Observation(text, reward=, done=)`: a per-turn
  reward (`Episode.rewards`; `episode_return` sums them) and the end of the episode (the text is fed, then
  the completion ends).
- Rewards receive the finished instances as `environments=` and Forge's records as `episodes=`; a class with
  `get_reward` is also a reward of its own (named after the class, weight 1), as in TRL. A failed episode's
  entry in `environments=` is None and its `episodes=` entry says why (`Episode.failure`).

An environment that raises, hangs or returns what cannot be read costs its completion, never the run: a
failing call is an error text the model reads and counts in the tools/* failures; a factory or `reset` that
fails, or a method whose Observation's reward is not a number, makes a failed episode (`Episode.failure`, one
line naming the class and the method), which samples nothing more and is left out of the loss and the group
statistics. Failed episodes are counted each step (env/failed_episodes, env/timed_out_episodes), marked in
samples.jsonl (`episode_failure`), and the run-health alarm `episodes_failing` goes off when most of a step's
episodes failed. Text from an environment reaches the tokenizer with lone surrogates replaced (U+FFFD). Before
the run, one instance is built to read its tools, under the same timeout (tool_timeout) and error handling; a
factory that fails there stops the run with one line. Environments are built from the rows at every step,
never saved: a resumed run rebuilds them, so an environment whose state depends only on its
row resumes bitwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from forge.tools.calls import Tool, ToolCall, ToolSettings, as_tool, load_object, run_calls
from forge.tools.outcome import describe_error

RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools


@dataclass(frozen=True)
class Observation:
    """What an environment's method may return instead of plain text: the text fed to the model, a per-turn
    reward, and whether the episode is over (the text is still fed; the completion then ends)."""

    text: str
    reward: float | None = None
    done: bool = False


@dataclass
class Episode:
    """One completion's episode, as Forge records it while the environment runs."""

    environment: Any = None  # the instance (None when the factory failed)
    opening: str | None = None  # what reset returned, as text (None: nothing)
    turns: int = 0  # calls answered
    rewards: list[float] = field(default_factory=list)  # per-turn rewards, in order
    done: bool = False  # the environment ended the episode (Observation.done)
    failure: str | None = None  # why the episode could not run (factory or reset raised, hung, ...), one line
    timed_out: bool = False  # the failure: building or resetting the instance took longer than tool_timeout
    toolbox: dict[str, Tool] = field(default_factory=dict, repr=False)  # this instance's methods, as tools
    # turn -> its Observation's reward, done
    outbox: dict[int, dict] = field(default_factory=dict, repr=False)

    @property
    def total_reward(self) -> float | None:
        return sum(self.rewards) if self.rewards else None


def environment_methods(environment: Any) -> list[str]:
    """The public methods of an environment's class that are tools (TRL's rule: functions defined on the
    class, not starting with '_', other than reset and get_reward)."""
    names = [name for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
             if not name.startswith("_") and name not in RESERVED]
    return sorted(names)


def as_text(value: Any) -> str:
    """What a method returned, as the text fed to the model (inside the call's isolation: a value that cannot
    be turned into text raises here, in the call's thread, and is the model's error to read)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _resolved(value: Any) -> Any:
    # an async method: run in the call's thread
    return asyncio.run(value) if inspect.isawaitable(value) else value


@dataclass
class EnvironmentSettings:
    """How a rollout runs environments: the factory, the tools a probe instance exposes (with any standalone
    tools; their format and limits are the run's tool block: `tools.max_calls` is the turn limit)."""

    factory: Callable[[], Any]
    tools: ToolSettings  # schemas and text tags of the methods (+ standalone tools), format, limits
    standalone: list[Tool] = field(default_factory=list)

    @classmethod
    def of(cls, factory: Callable[[], Any], settings: ToolSettings) -> EnvironmentSettings:
        """Probe one instance for its methods (built under settings.timeout, as an episode's is).
        `settings.tools` are standalone tools every episode also has."""
        if not callable(factory):
            raise TypeError(f"environment_factory must be a class or a callable returning an instance, got "
                            f"{type(factory).__name__}")
        built: dict = {}
        with warnings.catch_warnings():  # a probe past its timeout is said below, as the refusal
            warnings.simplefilter("ignore", RuntimeWarning)
            (result,) = run_calls(
                [ToolCall("probe", "probe", {})],
                settings,
                toolboxes=[{"probe": Tool(lambda: _build(factory, built), "probe", {}, "probe")}],
            )
        name, method = _factory_name(factory)
        if result.failure is not None:
            failed = (
                f"did not return within tool_timeout={settings.timeout:g} s"
                if result.failure == "timeout"
                else f"raised {result.output.removeprefix('error: ')}"
            )
            raise ValueError(
                f"environment_factory {name}: {method} {failed}; Forge builds one instance before the "
                f"run to read its tools, so the factory must build one quickly without a dataset row "
                f"(do slow set-up in reset)"
            )
        probe = built["instance"]
        if not callable(getattr(probe, "reset", None)):
            raise TypeError(
                f"environment {type(probe).__name__} has no reset method; define reset(self, **row) "
                f"(it may return the opening observation)"
            )
        methods = [as_tool(getattr(probe, name)) for name in environment_methods(probe)]
        if not methods and not settings.tools:
            raise ValueError(
                f"environment {type(probe).__name__} has no public method for the model to call; "
                f"give it a typed, docstringed method (its tools)"
            )
        return cls(factory, dataclasses.replace(settings, tools=settings.tools + methods),
                   list(settings.tools))

    def start(self, rows: Sequence[dict], group_size: int) -> list[Episode]:
        """One episode per completion (rows[i] opens episodes i*G..(i+1)*G-1): build each instance and reset
        it with its row, all in parallel under the tool timeout; a failure marks the episode, never raises."""
        episodes = [Episode() for _ in range(len(rows) * group_size)]
        calls, boxes, built = [], [], [{} for _ in episodes]  # built[n]: what episode n's call got to
        for n, episode in enumerate(episodes):
            row = dict(rows[n // group_size])
            calls.append(ToolCall("reset", "reset", {"row": row}))
            boxes.append({"reset": Tool(self._opener(built[n]), "reset", {}, "reset")})
        _, builder = _factory_name(self.factory)
        for episode, result, got in zip(episodes, run_calls(calls, self.tools, toolboxes=boxes), built):
            # a call abandoned at its timeout writes on in `got`, no one reads it
            if result.failure is not None:
                method = f"{type(got['instance']).__name__}.reset" if "instance" in got else builder
                episode.failure = f"{method}: {result.output}"
                episode.timed_out = result.failure == "timeout"
                continue
            episode.environment = got["instance"]
            # as read: cut, no lone surrogate
            episode.opening = None if got["opening"] is None else result.output
            if episode.failure is None:
                episode.toolbox = {t.name: t for t in self.standalone} | {
                    t.name: Tool(self._method(episode, t.name), t.name, t.schema, t.text_tag)
                    for t in self.tools.tools if t not in self.standalone}
        for start in range(0, len(episodes), group_size):  # a group shares its prompt, so its opening too
            group = episodes[start:start + group_size]
            first = next((e.opening for e in group if e.failure is None), None)
            for episode in group:
                if episode.failure is None and episode.opening != first:
                    episode.environment = None
                    episode.failure = (
                        f"reset opened with {str(episode.opening)[:80]!r}, its group with "
                        f"{str(first)[:80]!r}; the completions of a row share their prompt, so "
                        f"reset must open the same way for the same row"
                    )
        return episodes

    def _opener(self, built: dict) -> Callable[..., str]:
        factory = self.factory

        def open_episode(row: dict) -> str:
            environment = _build(factory, built)
            reset = environment.reset
            parameters = inspect.signature(reset).parameters.values()
            takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
            named = {p.name for p in parameters}
            observation = _resolved(reset(**{k: v for k, v in row.items() if takes_all or k in named}))
            built["opening"] = None if observation is None else as_text(observation)
            return built["opening"] or ""

        return open_episode

    @staticmethod
    def _method(episode: Episode, name: str) -> Callable[..., str]:
        # the class's: an instance attribute cannot shadow it
        method = getattr(type(episode.environment), name)
        where = f"{type(episode.environment).__name__}.{name}"

        def call(**arguments) -> str:
            turn = episode.turns  # read before the call: a late, abandoned call writes to a turn no one reads
            value = _resolved(method(episode.environment, **arguments))
            if isinstance(value, Observation):
                episode.outbox[turn] = {"done": bool(value.done), **_reward_of(value, where)}
                return as_text(value.text)
            return as_text(value)

        call.__signature__ = inspect.signature(method.__get__(episode.environment))
        return call

    @staticmethod
    def settle(episode: Episode, failed: bool) -> None:
        """After a call of the episode was answered: count the turn, keep its reward and whether it ended (a
        reward that is not a number fails the episode)."""
        observation = None if failed else episode.outbox.pop(episode.turns, None)
        episode.turns += 1
        if observation is None:
            return
        if observation.get("problem"):
            episode.failure, episode.environment, episode.done = observation["problem"], None, True
            return
        if observation["reward"] is not None:
            episode.rewards.append(observation["reward"])
        episode.done = episode.done or observation["done"]


def _build(factory: Callable[[], Any], built: dict) -> Any:
    """factory(), kept in `built["instance"]` (so a caller knows how far the call got)."""
    built["instance"] = factory()
    return built["instance"]


def _factory_name(factory: Callable[[], Any]) -> tuple[str, str]:
    """(the factory's name, the method that builds an instance): ('Guess', 'Guess.__init__') for a class."""
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    return name, f"{name}.__init__" if isinstance(factory, type) else name


def _reward_of(observation: Observation, where: str) -> dict:
    """{'reward': float or None} for an Observation's reward, or {'problem': the episode's failure} when it is
    not a number (run inside the call's isolation: a __float__ that raises or hangs costs the call)."""
    reward = observation.reward
    if reward is None:
        return {"reward": None}
    problem = f"{where} returned Observation(reward={reward!r:.60}); a reward is a number or None"
    if isinstance(reward, (str, bytes)) or not hasattr(type(reward), "__float__"):
        return {"problem": problem}
    try:
        return {"reward": float(reward)}
    except (TypeError, ValueError, RuntimeError) as error:
        return {"problem": f"{problem} ({describe_error(error)})"}


def with_opening(prompt: Any, opening: str | None) -> Any:
    """The prompt with the opening observation appended (to the last message's content for chat prompts)."""
    if not opening:
        return prompt
    if isinstance(prompt, str):
        return prompt + opening
    last = prompt[-1]
    return [*prompt[:-1], {**last, "content": last["content"] + opening}]


def episode_return(prompts: list, completions: list, episodes: list[Episode] | None = None,
                   **kwargs) -> list[float | None]:
    """A reward: the sum of each episode's per-turn rewards (None where the episode gave none)."""
    if episodes is None:
        raise ValueError("episode_return needs a run with an environment (environment_factory=...)")
    return [episode.total_reward for episode in episodes]


def environment_reward(factory: Callable[[], Any]) -> Callable[..., list[float | None]] | None:
    """TRL's `get_reward`: when the environment's class defines it, a reward (named after the class) that asks
    each finished episode for its score; None for a class without it. Failed episodes are not scored."""
    cls = factory if isinstance(factory, type) else type(factory())
    if not callable(getattr(cls, "get_reward", None)):
        return None

    def reward(prompts, completions, episodes=None, **kwargs) -> list[float | None]:
        return [
            None if e.failure is not None or e.environment is None else _resolved(e.environment.get_reward())
            for e in episodes
        ]

    reward.__name__ = cls.__name__
    return reward


def load_environment(spec: str) -> Callable[[], Any]:
    """`module:Class` or `path/to/file.py:Class` -> the class (any factory), for `forge train
    --environment`."""
    return load_object(spec, f"--environment {spec!r}", kind="Class")


def rollout_tools(
    tools: Sequence[Callable[..., Any] | Tool] | None,
    environment_factory: Callable[[], Any] | None,
    config,
    tokenizer,
) -> ToolSettings | EnvironmentSettings | None:
    """What a run's rollouts use: its tools under GRPOConfig's tool block, or its environment (with those
    tools too); None for a run with neither."""
    if environment_factory is None:
        return ToolSettings.of_run(tools, config, tokenizer) if tools else None
    return EnvironmentSettings.of(environment_factory, ToolSettings.of_run(tools or [], config, tokenizer))


def env_rewards(reward_fn: Any, environment_factory: Callable[[], Any] | None,
                weights: Sequence[float] | None = None) -> tuple[Any, list[float] | None]:
    """(rewards, weights): the run's rewards, and the environment's own (`environment_reward`) after them with
    weight 1 when its class has `get_reward`."""
    own = None if environment_factory is None else environment_reward(environment_factory)
    if own is None:
        return reward_fn, None if weights is None else list(weights)
    # (a tuple may be a reward model)
    rewards = [*(reward_fn if isinstance(reward_fn, list) else [reward_fn]), own]
    return rewards, None if weights is None else [*weights, 1.0]


__all__ = ["EnvironmentSettings", "Episode", "Observation", "as_text", "env_rewards", "environment_methods",
           "environment_reward", "episode_return", "load_environment", "rollout_tools", "with_opening"]
