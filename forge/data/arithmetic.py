"""A seeded generator of small arithmetic problems, with a fixed held-out set and chat prompts.

The task exists so that a GRPO run on a small model (SmolLM2-135M-Instruct) shows a measurable
change in minutes on a CPU: the numbers are sized so that such a model gets some problems right
before training (about 11% of the first 36 held-out problems, greedy, with `chat_prompt`; measured
on the packaged Q4_1 GGUF), which leaves room both to improve and to get a learning signal (GRPO
learns nothing from a group in which every sample scores the same).

Six kinds of problem, generated round-robin so each is equally represented:

    add_carry   2-3 digit addition whose units column carries          "What is 47 + 38?"
    subtract    a - b with a > b, usually with a borrow                "What is 83 - 47?"
    negative    a - b with a < b                                       "What is 23 - 58?"
    multiply    two-digit times one-digit (sometimes 11-19)            "What is 23 * 7?"
    two_step    two operations                                         "What is (12 + 7) * 4?"
    word        one-step word problems with names and objects

Every problem also stores the arithmetic as a Python ``expression``, so tests can recompute the
answer independently of the generator.
The held-out set is a fixed seed's first problems; training problems skip every question of a
larger held-out pool and the two few-shot examples, so train and held-out never overlap.
Answers are graded by the math tasks' grader (`forge.data.task.grade_math`), in training and in evaluation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from forge.data.task import Task, grade_math, math_correctness

__all__ = [
    "ALL_KINDS",
    "ARITHMETIC_TASK",
    "HELDOUT_POOL_SIZE",
    "HELDOUT_SEED",
    "SYSTEM_PROMPT",
    "ArithmeticProblem",
    "arithmetic_dataset",
    "arithmetic_heldout",
    "chat_prompt",
    "generate_problems",
    "heldout_problems",
    "plain_prompt",
    "train_problems",
]


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: the question shown to the model and its integer answer."""

    question: str
    answer: int
    kind: str
    expression: str
    """A Python expression equal to ``answer`` (for checking), e.g. ``"(12 + 7) * 4"``."""


def _add_carry(rng: random.Random) -> tuple[str, str, int]:
    while True:
        a = rng.randint(10, 99) if rng.random() < 0.7 else rng.randint(100, 999)
        b = rng.randint(10, 99)
        if a % 10 + b % 10 >= 10:
            return f"What is {a} + {b}?", f"{a} + {b}", a + b


def _subtract(rng: random.Random) -> tuple[str, str, int]:
    while True:
        a = rng.randint(30, 99) if rng.random() < 0.7 else rng.randint(100, 300)
        b = rng.randint(10, min(a - 1, 99))
        if a % 10 < b % 10 or rng.random() < 0.2:  # mostly problems that need a borrow
            return f"What is {a} - {b}?", f"{a} - {b}", a - b


def _negative(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(10, 60)
    b = rng.randint(a + 5, 99)
    return f"What is {a} - {b}?", f"{a} - {b}", a - b


def _multiply(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(12, 99)
    b = rng.randint(3, 9) if rng.random() < 0.75 else rng.randint(11, 19)
    return f"What is {a} * {b}?", f"{a} * {b}", a * b


def _two_step(rng: random.Random) -> tuple[str, str, int]:
    form = rng.randrange(4)
    if form == 0:
        a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 9)
        expression, answer = f"({a} + {b}) * {c}", (a + b) * c
    elif form == 1:
        a, b, c = rng.randint(3, 15), rng.randint(2, 9), rng.randint(1, 40)
        expression, answer = f"{a} * {b} - {c}", a * b - c
    elif form == 2:
        a, b, c = rng.randint(3, 15), rng.randint(2, 9), rng.randint(2, 40)
        expression, answer = f"{a} * {b} + {c}", a * b + c
    else:
        a = rng.randint(15, 50)
        b, c = rng.randint(2, a - 3), rng.randint(2, 9)
        expression, answer = f"({a} - {b}) * {c}", (a - b) * c
    return f"What is {expression}?", expression, answer


_NAMES = (
    "Ali",
    "Bea",
    "Carl",
    "Dana",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kim",
    "Leo",
    "Mia",
    "Nia",
    "Omar",
    "Pia",
)
_OBJECTS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells")


def _word(rng: random.Random) -> tuple[str, str, int]:
    name, objects = rng.choice(_NAMES), rng.choice(_OBJECTS)
    form = rng.randrange(4)
    if form == 0:
        a, b = rng.randint(12, 60), rng.randint(12, 60)
        question = f"{name} has {a} {objects} and gets {b} more. How many {objects} does {name} have now?"
        return question, f"{a} + {b}", a + b
    if form == 1:
        a = rng.randint(30, 99)
        b = rng.randint(11, a - 5)
        question = (
            f"{name} has {a} {objects} and gives {b} of them away. How many {objects} does {name} have left?"
        )
        return question, f"{a} - {b}", a - b
    if form == 2:
        a, b = rng.randint(3, 9), rng.randint(6, 15)
        question = (
            f"{name} buys {a} boxes with {b} {objects} in each box. How many {objects} is that in total?"
        )
        return question, f"{a} * {b}", a * b
    share, friends = rng.randint(3, 12), rng.randint(2, 8)
    total = share * friends
    question = (
        f"{name} shares {total} {objects} equally among {friends} friends. "
        f"How many {objects} does each friend get?"
    )
    return question, f"{total} // {friends}", share


_GENERATORS: dict[str, Callable[[random.Random], tuple[str, str, int]]] = {
    # kind -> draw(rng) -> (question, expression, answer)
    "add_carry": _add_carry,
    "subtract": _subtract,
    "negative": _negative,
    "multiply": _multiply,
    "two_step": _two_step,
    "word": _word,
}
ALL_KINDS: tuple[str, ...] = tuple(_GENERATORS)

HELDOUT_SEED = 20240917
"""Seed of the fixed held-out set."""
HELDOUT_POOL_SIZE = 600
"""Training problems avoid this many held-out problems, so `heldout_problems(n)` is disjoint
from training for any ``n <= HELDOUT_POOL_SIZE``."""

# ----------------------------------------------------------------------------------------------
# Prompts

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Think step by step inside <think> </think>, "
    "then give only the final number inside <answer> </answer>."
)

_FEW_SHOT: tuple[tuple[str, str], ...] = (
    ("What is 36 + 47?", "<think>36 + 47 = 83</think>\n<answer>83</answer>"),
    (
        "Sam has 5 bags with 12 marbles in each bag. How many marbles does Sam have?",
        "<think>5 * 12 = 60</think>\n<answer>60</answer>",
    ),
)
"""Two worked (question, reply) examples in the think/answer format. Each shows one step: with a
two-step example, SmolLM2-135M copied the second step onto every problem ("35 + 19 = 54, 54 - 19
= 27") and scored about 2% on the held-out set; with these it scores about 11% (greedy)."""


def chat_prompt(question: str, few_shot: bool = True) -> list[dict[str, str]]:
    """Chat messages: the system prompt, (with ``few_shot``) two worked user/assistant exchanges,
    and the question as the last user message. About 120 tokens with the examples."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if few_shot:
        for example_question, reply in _FEW_SHOT:
            messages.append({"role": "user", "content": example_question})
            messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": question})
    return messages


def plain_prompt(question: str, few_shot: bool = True) -> str:
    """The same prompt as one string, for models without a chat template."""
    parts = [SYSTEM_PROMPT, ""]
    if few_shot:
        for example_question, reply in _FEW_SHOT:
            parts += [f"Question: {example_question}", reply, ""]
    parts.append(f"Question: {question}")
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------
# Problem sets


def generate_problems(
    n: int, seed: int, kinds: Sequence[str] = ALL_KINDS, exclude: Collection[str] = ()
) -> list[ArithmeticProblem]:
    """``n`` distinct problems drawn with ``random.Random(seed)``, kinds taken in turn.

    The same arguments always give the same list, and a smaller ``n`` gives a prefix of a larger
    one. Questions in ``exclude`` and the few-shot examples are skipped.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not kinds:
        raise ValueError(f"kinds is empty; choose from {ALL_KINDS}")
    unknown = [kind for kind in kinds if kind not in _GENERATORS]
    if unknown:
        raise ValueError(f"unknown problem kinds {unknown}; choose from {ALL_KINDS}")
    rng = random.Random(seed)
    skip = set(exclude) | {question for question, _ in _FEW_SHOT}
    problems: list[ArithmeticProblem] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"could not find {n} distinct problems of kinds {list(kinds)}; ask for fewer")
        kind = kinds[len(problems) % len(kinds)]
        question, expression, answer = _GENERATORS[kind](rng)
        if question in skip:
            continue
        skip.add(question)
        problems.append(ArithmeticProblem(question, answer, kind, expression))
    return problems


@lru_cache(maxsize=1)
def _heldout_pool() -> tuple[ArithmeticProblem, ...]:
    return tuple(generate_problems(HELDOUT_POOL_SIZE, HELDOUT_SEED))


def heldout_problems(n: int = 60) -> list[ArithmeticProblem]:
    """The fixed held-out set: the first ``n`` problems of seed `HELDOUT_SEED` (all kinds)."""
    if not 0 <= n <= HELDOUT_POOL_SIZE:
        raise ValueError(f"held-out n must be between 0 and {HELDOUT_POOL_SIZE}, got {n}")
    return list(_heldout_pool()[:n])


def train_problems(n: int, seed: int = 0, kinds: Sequence[str] = ALL_KINDS) -> list[ArithmeticProblem]:
    """``n`` training problems for ``seed``, none of whose questions is in the held-out pool."""
    return generate_problems(n, seed, kinds, exclude={problem.question for problem in _heldout_pool()})


def _rows(problems: Sequence[ArithmeticProblem], chat: bool) -> list[dict]:
    return [
        {
            "prompt": chat_prompt(problem.question) if chat else plain_prompt(problem.question),
            "reference": str(problem.answer),
            "kind": problem.kind,
        }
        for problem in problems
    ]


def arithmetic_dataset(n: int = 200, seed: int = 0, chat: bool = True) -> list[dict]:
    """Training rows ``{"prompt", "reference", "kind"}``; the prompt is chat messages
    (`chat_prompt`) or a string (`plain_prompt`)."""
    return _rows(train_problems(n, seed), chat)


def arithmetic_heldout(n: int = 60, chat: bool = True) -> list[dict]:
    """Held-out rows in the same shape as `arithmetic_dataset`, disjoint from any training set."""
    return _rows(heldout_problems(n), chat)


def _heldout_rows(n: int | None = None, chat: bool | None = None, split: str = "test") -> list[dict]:
    """What `forge eval --data arithmetic` grades: the first n (60) problems of the fixed held-out set, chat
    prompts unless told otherwise; there is one split."""
    return arithmetic_heldout(60 if n is None else n, chat=True if chat is None else chat)


ARITHMETIC_TASK = Task("arithmetic", rows=arithmetic_dataset, heldout=_heldout_rows, grade=grade_math,
                       reward=math_correctness)
"""The arithmetic task: `arithmetic_dataset` rows, the fixed held-out set, graded as numbers."""
