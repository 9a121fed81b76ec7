"""Grading one response, and the sample-based metrics built on top: strict/soft accuracy, pass@k, maj@k.

Two graders, both built on `forge.data.answers` (the same answer extraction and equivalence test the
training rewards use, so a reported accuracy and the reward the model was trained on cannot disagree
about what "correct" means):

  strict  the answer must sit where the prompt asked for it, and be right. For "tag" prompts that is the
          last closed ``<answer>...</answer>`` block; for "answer_line" prompts, the text after the last
          ``Answer:`` (`extract_answer_line`, as the GSM8K task reads it). A right number written
          anywhere else is not strictly correct.
  soft    only the final answer counts, wherever it is (`extract_final_answer`: answer tag, then
          \\boxed{}, then an "Answer:" line, then "####", then the last number in the text).

pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1 (https://arxiv.org/abs/2107.03374): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), the chance that a random subset of k samples holds a correct one.
maj@k is the accuracy of the most common answer among k samples (self-consistency, Wang et al. 2022,
https://arxiv.org/abs/2203.11171).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from forge.data.answers import (
    answers_match,
    extract_answer_line,
    extract_final_answer,
    extract_tagged_answer,
    parse_number,
    reference_answer,  # noqa: F401 - importable from here as before it moved to forge.data.answers
)
from forge.data.task import grade_math

ANSWER_FORMATS = ("tag", "answer_line")

CORRECT = "CORRECT"
WRONG_ANSWER = "WRONG ANSWER"
NO_ANSWER = "NO ANSWER EXTRACTED"
UNPARSEABLE = "UNPARSEABLE"
STATUSES = (CORRECT, WRONG_ANSWER, NO_ANSWER, UNPARSEABLE)

# --------------------------------------------------------------------------------------------------
# pass@k and majority vote
# --------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, eq. 1).

    Computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n; got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples; draw at least k samples per problem")
    if n - c < k:  # every k-subset holds at least one correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """The most common answer (None entries ignored), or None when there is none.

    Answers are grouped by the shared grader, `answers_match`, so "1,000", "1000" and "$1000.00" count as
    one answer. Each group is represented by its first member; a tie goes to the group seen first.
    """
    groups: list[list[str]] = []  # each group: equivalent answers in order of appearance
    for answer in answers:
        if answer is None or not str(answer).strip():
            continue
        for group in groups:
            if answers_match(answer, group[0]):
                group.append(answer)
                break
        else:
            groups.append([answer])
    if not groups:
        return None
    return max(groups, key=len)[0]  # max keeps the first of equal lengths, i.e. the earliest group


# --------------------------------------------------------------------------------------------------
# grading one response
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grade:
    """The verdict on one response.

    `status` describes the strict grade: CORRECT, WRONG ANSWER (a number in the required place, but not the
    reference), UNPARSEABLE (something in the required place that holds no number, e.g. "<answer>forty
    two</answer>", and does not match the reference) or NO ANSWER EXTRACTED (nothing in the required place).
    """

    answer: str | None  # the answer in the required format (None when absent)
    soft_answer: str | None  # the final answer wherever it is (extract_final_answer)
    strict_correct: bool  # answer in the required format and equal to the reference
    soft_correct: bool  # soft_answer equal to the reference
    format_ok: bool  # an answer was found in the required format
    status: str  # one of STATUSES, for the strict grade

    def to_dict(self) -> dict:
        return asdict(self)


def detect_answer_format(prompt: str | Sequence[dict]) -> str:
    """"tag" when the prompt (text or chat messages) asks for an <answer> tag, else "answer_line"."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = "\n".join(str(message.get("content", "")) for message in prompt)
    return "tag" if "<answer>" in text else "answer_line"


def extract_formatted_answer(text: str | None, answer_format: str) -> str | None:
    """The answer written in the required format: the <answer> tag or the "Answer:" line."""
    if answer_format == "tag":
        return extract_tagged_answer(text, "answer")
    if answer_format == "answer_line":
        return extract_answer_line(text)
    raise ValueError(f"unknown answer_format {answer_format!r}; use one of {ANSWER_FORMATS}")


def grade(response: str, reference: str | float, answer_format: str) -> Grade:
    """Grade one response against the reference answer, strictly and softly. Never raises on odd text.

    Both verdicts are the math tasks' grader, `forge.data.task.grade_math`: the soft one on the final answer
    is what their training reward (`math_correctness`, as `MathCorrectnessReward()`) pays, and for "tag"
    prompts the strict one is what `MathCorrectnessReward(strict=True)` pays. Rows of a task with its own
    grader (reasoning-gym) are graded again with it by `forge.eval.evaluate`.
    """
    answer = extract_formatted_answer(response, answer_format)
    soft_answer = extract_final_answer(response)
    strict_correct = grade_math(answer, reference) == 1.0
    soft_correct = grade_math(soft_answer, reference) == 1.0
    if answer is None:
        status = NO_ANSWER
    elif strict_correct:
        status = CORRECT
    elif parse_number(answer) is None:
        status = UNPARSEABLE
    else:
        status = WRONG_ANSWER
    return Grade(answer, soft_answer, strict_correct, soft_correct, answer is not None, status)
