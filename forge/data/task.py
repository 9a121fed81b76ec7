"""What a task is: its rows, its held-out rows, and the one grader its training reward and
its evaluation share.

As in nanochat's ``tasks/``, a task owns both its data and its grader, so the reward a model is trained on and
the accuracy it is measured by cannot drift apart. Grading has two halves:

  extraction  where the answer is in a completion, the same for every task (`forge.data.answers`): the final
              answer anywhere (`extract_final_answer`: what the reward pays, and the evaluation's soft
              grade), or the answer where the prompt asked for it (the evaluation's strict grade);
  judgement   whether that answer is right: the task's ``grade(answer, reference, **columns) -> float`` in
              [0, 1], 1.0 = right. The task's reward is ``grade`` of each completion's final answer; the
              evaluation counts an answer as correct when ``grade`` gives it 1.0.

The math tasks (arithmetic, GSM8K, GSM-Hard, the GSM8K mock set) share `grade_math` and `math_correctness`,
defined here; reasoning-gym's tasks grade with their own ``score_answer``
(`forge.data.reasoning_gym_tasks`). Each task module declares its `Task`;
`forge.data.dataset.TASKS` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forge.data.answers import answers_match, completion_text, extract_final_answer, reference_answer

__all__ = ["Task", "grade_math", "math_correctness"]


@dataclass(frozen=True)
class Task:
    """A built-in task: where its rows come from and how an answer to it is graded."""

    name: str
    """Its dataset name: ``forge train --dataset NAME``, ``forge eval --data NAME``, ``load_rows(NAME)``."""
    rows: Callable[..., list[dict]]
    """Training rows ``{"prompt", "reference", ...}``; keyword arguments go to the task's loader
    (n, seed, chat...)."""
    heldout: Callable[..., list[dict]]
    """Held-out rows, ``heldout(n=None, chat=None, split="test")``; None means the task's own default (how
    many problems, chat messages or plain text) and tasks with one split ignore ``split``."""
    grade: Callable[..., float]
    """``grade(answer, reference, **columns) -> float`` in [0, 1], 1.0 = right: the task's judgement of an
    extracted answer (None: none was found). ``columns`` are the row's other columns, e.g. a
    reasoning-gym entry."""
    reward: Callable[..., list[float]]
    """The training reward, ``reward(prompts, completions, references, **columns) -> list[float]``: `grade` of
    each completion's final answer. A plain callable named for the logs (``rewards/<name>``)."""


def grade_math(answer: str | None, reference: Any, **columns: Any) -> float:
    """The math tasks' grader: 1.0 when ``answer`` equals the reference's final answer (`answers_match`:
    numbers compared as numbers, symbolic answers with math-verify; a GSM8K-style "... #### 72" counts as
    "72"), else 0.0. Other columns are not read."""
    return float(answers_match(answer, reference_answer(reference)))


def math_correctness(
    prompts: Sequence[Any],
    completions: Sequence[str],
    references: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float]:
    """The math tasks' training reward: `grade_math` of each completion's final answer
    (`extract_final_answer`), the same scores as ``forge.core.reward.MathCorrectnessReward()``."""
    if references is None:
        raise ValueError("math_correctness needs reference answers: give the dataset a 'reference' column")
    for index, reference in enumerate(references):
        if reference is None or not reference_answer(reference):
            raise ValueError(f"math_correctness: reference {index} is empty; every row needs "
                             "a reference answer")
    return [grade_math(extract_final_answer(completion_text(completion)), reference)
            for completion, reference in zip(completions, references, strict=True)]
