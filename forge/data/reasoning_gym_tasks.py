"""reasoning-gym's procedural tasks as Forge rows, graded by each task's own ``score_answer``.

reasoning-gym (https://github.com/open-thought/reasoning-gym, ``pip install forge-rl[reasoning-gym]``)
generates verifiable problems on the fly: ``reasoning_gym.create_dataset(NAME, size=..., seed=...)``
gives entries ``{"question": str, "answer": str, "metadata": {...}}``, and the dataset's
``score_answer(answer, entry) -> float`` grades an answer in [0, 1] (1.0 = right; some tasks give
partial credit, e.g. the default scorer pays ``len(oracle) / len(answer)`` when the oracle is a
substring of the answer).

The task owns its data and its grader (`REASONING_GYM_TASK`, see `forge.data.task`). Each row keeps its
entry and the task's config, and both the training reward (`ReasoningGymReward`) and the evaluation grader
(`task_scorer`, used by `forge.eval.evaluate`) call `grade_reasoning_gym`, i.e. the same ``score_answer`` on
the same extracted answer:

  * the reward pays the score of the final answer (soft: `extract_final_answer`; with ``strict=True``
    only a closed ``<answer>`` block counts);
  * evaluation counts a sample as correct when that score is 1.0 (strict: the ``<answer>`` block,
    soft: the final answer anywhere) and reports the mean soft score as ``task_score``.

Training rows and held-out rows come from different seeds (`HELDOUT_SEED` for held-out), and the
training rows are checked question by question against the held-out pool: a training problem whose
question is in the pool is skipped. (reasoning-gym draws problem ``idx`` of seed ``s`` with
``Random(s + idx)``, so nearby seeds would share problems; the text check catches that and any
coincidence of small problems.)

This module is not called ``reasoning_gym.py``, which would shadow the package.
"""

from __future__ import annotations

import ast
import difflib
import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from forge.data.answers import completion_text, extract_final_answer, extract_tagged_answer
from forge.data.task import Task

__all__ = [
    "HELDOUT_POOL_SIZE",
    "HELDOUT_SEED",
    "REASONING_GYM_TASK",
    "RG_PREFIX",
    "SYSTEM_PROMPT",
    "ReasoningGymReward",
    "available_tasks",
    "check_task",
    "grade_reasoning_gym",
    "load_reasoning_gym_spec",
    "parse_reasoning_gym_spec",
    "reasoning_gym_dataset",
    "reasoning_gym_heldout",
    "score_answer_for",
    "task_scorer",
]

RG_PREFIX = "reasoning-gym:"
"""Dataset names ``reasoning-gym:NAME`` (training rows) and ``reasoning-gym:NAME@heldout``."""

HELDOUT_SEED = 20240917
"""Seed of the held-out problems; training seeds are small numbers (0 by default)."""
HELDOUT_POOL_SIZE = 200
"""Training rows skip every question of this many held-out problems, so `reasoning_gym_heldout(n)`
is disjoint from training for any ``n <= HELDOUT_POOL_SIZE``."""

SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, "
    "then give only the final answer inside <answer> </answer>, in the format the problem asks for."
)
"""System message of the chat prompts (and the first paragraph of the plain ones)."""

_COLUMNS = ("rg_task", "rg_config", "rg_entry")
"""The columns a reasoning-gym row carries besides prompt / reference / question: the task name, its
config as JSON text, and the entry itself (what ``score_answer`` reads)."""


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(
            "reasoning-gym tasks need the 'reasoning-gym' package: pip install forge-rl[reasoning-gym] "
            "(or pip install reasoning-gym)"
        ) from error
    return reasoning_gym


def available_tasks() -> list[str]:
    """Every task name registered in reasoning-gym, sorted."""
    _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(name: str) -> None:
    """Raise a ValueError naming close matches when ``name`` is not a reasoning-gym task."""
    tasks = available_tasks()
    if name in tasks:
        return
    close = difflib.get_close_matches(name, tasks, n=5, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close
            else f"there are {len(tasks)} tasks, e.g. {', '.join(tasks[:8])}")
    raise ValueError(f"unknown reasoning-gym task '{name}'; {hint} (all names: "
                     "reasoning_gym.factory.DATASETS)")


def _config_text(config: Mapping[str, Any] | None) -> str:
    config = dict(config or {})
    for key in ("seed", "size"):
        if key in config:
            raise ValueError(f"pass {key} as its own argument, not inside config")
    return json.dumps(config, sort_keys=True)


@lru_cache(maxsize=64)
def _task_dataset(name: str, config_text: str, seed: int, size: int):
    """A reasoning-gym dataset object (cached: creating one can take a moment)."""
    reasoning_gym = _import_reasoning_gym()
    check_task(name)
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_text))


@lru_cache(maxsize=64)
def _scorer_dataset(name: str, config_text: str):
    """The dataset whose ``score_answer`` grades a row of task ``name`` with this config. Scoring reads
    the entry and the config, never the seed or size, so one small dataset serves every row."""
    return _task_dataset(name, config_text, 0, 1)


def score_answer_for(
    answer: str | None, task: str, entry: Mapping[str, Any], config: str | Mapping | None = None
) -> float:
    """The task's own ``score_answer(answer, entry)`` as a float in [0, 1]; 0.0 for no answer.

    ``config`` is the task config (JSON text as stored in a row's ``rg_config``, or a dict). An exception
    inside the task's scorer counts as 0.0: a model can write anything, and an odd answer must score 0,
    not stop a training step.
    """
    if not isinstance(answer, str) or not answer.strip():
        return 0.0
    config_text = config if isinstance(config, str) else _config_text(config)
    dataset = _scorer_dataset(task, config_text)
    try:
        score = float(dataset.score_answer(answer.strip(), dict(entry)))
    except Exception:  # noqa: BLE001 - any failure of a task's scorer on model text means "not right"
        return 0.0
    return score if 0.0 <= score <= 1.0 else 0.0


def grade_reasoning_gym(
    answer: str | None,
    reference: Any = None,
    *,
    rg_task: str,
    rg_entry: Mapping[str, Any],
    rg_config: str | Mapping | None = None,
    **columns: Any,
) -> float:
    """The grader of reasoning-gym rows: the task's own ``score_answer`` on ``answer`` (`score_answer_for`).
    It reads the row's entry and config, not its reference; other columns are not read."""
    return score_answer_for(answer, rg_task, rg_entry, rg_config)


def task_scorer(row: Mapping[str, Any]):
    """For a reasoning-gym row, ``answer -> score`` with `grade_reasoning_gym`; None for other rows.
    The evaluation code calls this, so it grades exactly as `ReasoningGymReward` pays."""
    if not all(column in row for column in _COLUMNS):
        return None
    return lambda answer: grade_reasoning_gym(answer, **row)


# ----------------------------------------------------------------------------------------------
# Prompts and rows


def chat_prompt(question: str, example: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
    """Chat messages: `SYSTEM_PROMPT`, optionally one solved example of the same task (its question, and
    ``<answer>its answer</answer>`` as the assistant's reply, to show the answer's format), then the
    question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if example is not None:
        messages.append({"role": "user", "content": str(example["question"])})
        messages.append({"role": "assistant", "content": f"<answer>{example['answer']}</answer>"})
    messages.append({"role": "user", "content": question})
    return messages


def plain_prompt(question: str, example: Mapping[str, Any] | None = None) -> str:
    """The same prompt as one string, for models without a chat template."""
    parts = [SYSTEM_PROMPT, ""]
    if example is not None:
        parts += [f"Question: {example['question']}", f"<answer>{example['answer']}</answer>", ""]
    parts.append(f"Question: {question}")
    return "\n".join(parts) + "\n"


_EXAMPLE_SEED = HELDOUT_SEED + 10_000_000
"""Seed of the solved example shown in prompts (a third seed, far from training and held-out)."""


@lru_cache(maxsize=64)
def _example(name: str, config_text: str) -> dict:
    return dict(_task_dataset(name, config_text, _EXAMPLE_SEED, 1)[0])


@lru_cache(maxsize=16)
def _heldout_pool(name: str, config_text: str, pool_size: int) -> tuple[dict, ...]:
    dataset = _task_dataset(name, config_text, HELDOUT_SEED, pool_size)
    return tuple(dict(dataset[index]) for index in range(pool_size))


def _json_safe_entry(entry: Mapping[str, Any]) -> dict:
    """The entry as plain JSON data (tuples become lists, like after a round trip through a JSONL file)."""
    return json.loads(json.dumps(dict(entry), default=str))


def _rows(name: str, config_text: str, entries: Sequence[Mapping[str, Any]], chat: bool, few_shot: bool
          ) -> list[dict]:
    example = _example(name, config_text) if few_shot else None
    prompt = chat_prompt if chat else plain_prompt
    rows = []
    for entry in entries:
        question = str(entry["question"])
        answer = entry.get("answer")
        rows.append({
            "prompt": prompt(question, example),
            "reference": "" if answer is None else str(answer),
            "question": question,
            "rg_task": name,
            "rg_config": config_text,
            "rg_entry": _json_safe_entry(entry),
        })
    return rows


def reasoning_gym_dataset(name: str, size: int = 200, seed: int = 0, chat: bool = True,
                          config: Mapping[str, Any] | None = None, few_shot: bool = True,
                          heldout_pool: int = HELDOUT_POOL_SIZE) -> list[dict]:
    """``size`` training rows of task ``name`` from ``create_dataset(name, seed=seed, ...)``.

    Rows: ``{"prompt", "reference", "question", "rg_task", "rg_config", "rg_entry"}``; the prompt is chat
    messages (`chat_prompt`) or a string (`plain_prompt`), with one solved example of the task unless
    ``few_shot=False``. ``config`` holds the task's own settings (e.g. ``{"max_terms": 3}`` for
    ``chain_sum``). Problems whose question is among the first ``heldout_pool`` held-out problems are
    skipped (and more are drawn), so the rows are disjoint from `reasoning_gym_heldout`.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if seed == HELDOUT_SEED:
        raise ValueError(f"seed {HELDOUT_SEED} is the held-out seed; train on another seed")
    config_text = _config_text(config)
    heldout = {str(entry["question"]) for entry in _heldout_pool(name, config_text, heldout_pool)}
    heldout.add(str(_example(name, config_text)["question"]))
    budget = 2 * size + 100
    dataset = _task_dataset(name, config_text, seed, budget)
    entries, skipped = [], 0
    for index in range(budget):
        entry = dataset[index]
        if str(entry["question"]) in heldout:
            skipped += 1
            continue
        entries.append(entry)
        if len(entries) == size:
            break
    if len(entries) < size:
        raise ValueError(
            f"reasoning-gym task '{name}' gave only {len(entries)} training problems disjoint from its "
            f"held-out set in {budget} draws ({skipped} were held-out questions): the task has few distinct "
            "problems with this config; ask for fewer rows or widen the task's config"
        )
    return _rows(name, config_text, entries, chat, few_shot)


def reasoning_gym_heldout(name: str, n: int = 50, chat: bool = True, config: Mapping[str, Any] | None = None,
                          few_shot: bool = True, heldout_pool: int = HELDOUT_POOL_SIZE) -> list[dict]:
    """The first ``n`` held-out rows of task ``name`` (seed `HELDOUT_SEED`), in the shape of
    `reasoning_gym_dataset` and disjoint from any of its training sets."""
    if not 1 <= n <= heldout_pool:
        raise ValueError(f"held-out n must be between 1 and heldout_pool={heldout_pool}, got {n}")
    config_text = _config_text(config)
    return _rows(name, config_text, _heldout_pool(name, config_text, heldout_pool)[:n], chat, few_shot)


def _config_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string


def parse_reasoning_gym_spec(spec: str) -> tuple[str, dict[str, Any], str]:
    """``"reasoning-gym:NAME[:KEY=VALUE,...][@SPLIT]"`` -> ``(NAME, config, SPLIT)``.

    ``"reasoning-gym:chain_sum"`` -> ``("chain_sum", {}, "train")``;
    ``"reasoning-gym:chain_sum:max_terms=2,max_digits=2@heldout"`` ->
    ``("chain_sum", {"max_terms": 2, "max_digits": 2}, "heldout")``. Values are Python literals (numbers,
    True/False, quoted strings) or bare words (strings); ``@test`` means ``@heldout``.
    """
    if not spec.startswith(RG_PREFIX):
        raise ValueError(
            f"a reasoning-gym dataset name looks like '{RG_PREFIX}NAME[:KEY=VALUE,...][@heldout]', "
            f"got '{spec}'"
        )
    rest, _, split = spec[len(RG_PREFIX):].partition("@")
    name, _, config_text = rest.partition(":")
    split = split or "train"
    if split == "test":
        split = "heldout"
    if not name:
        raise ValueError(f"'{spec}' names no task; e.g. '{RG_PREFIX}chain_sum'")
    if split not in ("train", "heldout"):
        raise ValueError(f"'{spec}': the split after '@' must be 'train' or 'heldout', got '{split}'")
    config: dict[str, Any] = {}
    for item in (part.strip() for part in config_text.split(",") if part.strip()):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"'{spec}': task settings are KEY=VALUE pairs separated by commas, got '{item}'")
        config[key.strip()] = _config_value(value.strip())
    return name, config, split


def load_reasoning_gym_spec(spec: str, *, split: str | None = None, n: int | None = None, **kwargs: Any
                            ) -> list[dict]:
    """Rows for a ``reasoning-gym:NAME[:KEY=VALUE,...][@SPLIT]`` name. ``split`` (when the name has no
    ``@``) picks training rows or held-out ones; ``n`` is the number of rows (200 for training, 50 held-out
    by default); the KEY=VALUE pairs are the task's config; other keyword arguments (``seed``, ``chat``,
    ``few_shot``) go to the loader."""
    name, config, named_split = parse_reasoning_gym_spec(spec)
    if "@" not in spec and split is not None:
        named_split = "heldout" if split in ("heldout", "test", "validation", "eval") else "train"
    check_task(name)
    if config:
        kwargs["config"] = {**config, **(kwargs.get("config") or {})}
    try:
        if named_split == "heldout":
            kwargs.pop("seed", None)
            return reasoning_gym_heldout(name, n=50 if n is None else n, **kwargs)
        return reasoning_gym_dataset(name, size=200 if n is None else n, **kwargs)
    except TypeError as error:  # an unknown config key: the task's config dataclass refuses it
        raise ValueError(f"'{spec}': {error}; see the task's config class in "
                         "reasoning_gym.factory.DATASETS") from None
    except AssertionError as error:  # the task's config validate() asserts its settings
        raise ValueError(
            f"'{spec}': the task refuses these settings ({error or 'a check failed'}); change the "
            f"KEY=VALUE pairs (the task's config class in reasoning_gym.factory.DATASETS lists "
            f"them)"
        ) from None


# ----------------------------------------------------------------------------------------------
# The reward, and the task


class ReasoningGymReward:
    """The task's own ``score_answer`` on the response's final answer, as the reward (partial credit
    included): `grade_reasoning_gym` of each response. Rows must come from `reasoning_gym_dataset` (they carry
    ``rg_task``, ``rg_config``, ``rg_entry``). ``strict=True`` reads only a closed ``<answer>`` block (the
    eval's strict grade); the default reads `extract_final_answer` (the eval's soft grade).

    A plain callable returning one float per response, as Forge takes any function reward; it is logged as
    ``rewards/reasoning_gym``. It is the default reward of ``forge train --dataset reasoning-gym:NAME``, next
    to ``tag_format:0.1``.
    """

    name = "reasoning_gym"

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.__name__ = self.name  # Forge names a function reward after its __name__

    def extract(self, response: str) -> str | None:
        return extract_tagged_answer(response) if self.strict else extract_final_answer(response)

    def __call__(self, prompts: list, completions: list, rg_task: Sequence[str] | None = None,
                 rg_entry: Sequence[Mapping] | None = None, rg_config: Sequence[str] | None = None,
                 **kwargs: Any) -> list[float]:
        responses = [completion_text(c) for c in completions]  # text, or TRL's chat completions
        if rg_task is None or rg_entry is None:
            raise ValueError("reasoning_gym reward needs rows from a reasoning-gym task (columns rg_task, "
                             "rg_entry, rg_config); load the data as 'reasoning-gym:NAME'")
        if not (len(rg_task) == len(rg_entry) == len(responses)):
            raise ValueError(
                f"reasoning_gym reward got {len(responses)} responses but {len(rg_task)} tasks and "
                f"{len(rg_entry)} entries"
            )
        configs = rg_config if rg_config is not None else ["{}"] * len(responses)
        return [
            grade_reasoning_gym(self.extract(str(response)), rg_task=task, rg_entry=entry, rg_config=config)
            for response, task, entry, config in zip(responses, rg_task, rg_entry, configs)
        ]

    def __repr__(self) -> str:
        return f"ReasoningGymReward(strict={self.strict})"


def _heldout_rows(spec: str, n: int | None = None, chat: bool | None = None, split: str = "heldout"
                  ) -> list[dict]:
    """The held-out rows of ``spec`` (50 unless n), chat prompts unless told otherwise;
    ``split`` is ignored."""
    return load_reasoning_gym_spec(spec, split="heldout", n=n, chat=True if chat is None else chat)


REASONING_GYM_TASK = Task("reasoning-gym", rows=load_reasoning_gym_spec, heldout=_heldout_rows,
                          grade=grade_reasoning_gym, reward=ReasoningGymReward())
"""reasoning-gym's tasks, graded by their own ``score_answer``. A family: its loaders take the dataset name
(``reasoning-gym:NAME[:KEY=VALUE,...]``) first; `forge.data.dataset.task_for` binds it."""
