"""GSM8K grade-school math: the prompt format, answer parsing, loaders, and an offline mock set.

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems",
https://arxiv.org/abs/2110.14168) stores each solution as worked text whose last line is
``#### <answer>``. Forge asks the model to end with an ``Answer: <number>`` line instead, and
grades it with the shared grader in `forge.data.answers` (also used by the rewards and the
evaluation code). GSM-Hard (Gao et al. 2022, PAL, https://arxiv.org/abs/2211.10435) is the
same questions with larger numbers.

Rows returned by the loaders have the shape Forge trains on:
``{"prompt": str | list[message], "reference": str, "question": str}``.

Two prompt styles. ``chat=False`` (the loaders' default) is `format_prompt`, a
plain-text prompt for base models (the original Forge API's). ``chat=True`` is `chat_prompt`: chat messages
with a system prompt and worked examples as user/assistant turns, answering in
``<think>...</think><answer>N</answer>``, the format the default rewards (``math_correctness``,
``tag_format``) and the evaluation's strict grader read. Every answer is graded by the math tasks' grader
(`forge.data.task.grade_math`), in training and in evaluation. Instruct models need it: on the plain prompt
the packaged SmolLM2-135M-Instruct ends its turn right after "Solution:" on most problems (0% on the
mock set), on the chat prompt it answers every one (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from forge.data.answers import extract_answer_line, first_number, last_number
from forge.data.task import Task, grade_math, math_correctness

__all__ = [
    "CHAT_FEW_SHOT",
    "GSM8K_CHAT_REMINDER",
    "GSM8K_CHAT_SYSTEM_PROMPT",
    "GSM8K_MOCK_PROBLEMS",
    "GSM8K_MOCK_TASK",
    "GSM8K_TASK",
    "GSM_HARD_TASK",
    "chat_prompt",
    "extract_answer",
    "few_shot_gsm8k_prompt",
    "format_prompt",
    "gsm8k_rows_from_records",
    "gsm_hard_rows_from_records",
    "load_gsm8k",
    "load_gsm8k_mock",
    "load_gsm_hard",
    "parse_gsm8k_answer",
]

_INSTRUCTIONS = (
    "You are a math reasoning assistant. Solve the problem step by step.\n"
    "At the end of your solution, write the final answer on its own line in the format: Answer: <number>"
)


def format_prompt(question: str) -> str:
    """The zero-shot GSM8K prompt: instructions, the problem, and an open ``Solution:``."""
    return f"{_INSTRUCTIONS}\n\nProblem: {question}\n\nSolution:"


def extract_answer(text: str | None) -> str | None:
    """The GSM8K answer in a response: the number on the last ``Answer:`` line, else the last
    number anywhere, as canonical text (``"Answer: $1,234"`` -> ``"1234"``). An ``Answer:`` line
    without a number gives its raw text; no line and no number give None."""
    line = extract_answer_line(text)
    if line is not None:
        return first_number(line) or line
    return last_number(text)


def parse_gsm8k_answer(answer_field: str) -> str:
    """The final answer of a GSM8K solution: the text after its last ``####``, commas removed.

    ``"Natalia sold 48/2 = <<48/2=24>>24 clips in May...\\n#### 72"`` -> ``"72"``.
    """
    if not isinstance(answer_field, str) or "####" not in answer_field:
        raise ValueError(
            f"a GSM8K answer must end with '#### <number>'; got {str(answer_field)[-80:]!r}. "
            "Is this the 'main' config of openai/gsm8k?"
        )
    answer = answer_field.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError(f"GSM8K answer has nothing after '####': {answer_field[-80:]!r}")
    return answer


def _prompt(question: str, chat: bool) -> str | list[dict[str, str]]:
    return chat_prompt(question) if chat else format_prompt(question)


def _rows_from_records(records: Iterable[Mapping[str, Any]], max_samples: int | None, name: str,
                       question_key: str, answer_key: str, parse_answer, chat: bool = False) -> list[dict]:
    """Forge rows {"prompt", "reference", "question"} from a math dataset's records."""
    rows = []
    for index, record in enumerate(records):
        if max_samples is not None and len(rows) >= max_samples:
            break
        if question_key not in record or answer_key not in record:
            raise ValueError(f"{name} record {index} needs '{question_key}' and '{answer_key}' keys; "
                             f"got {sorted(record)}")
        question = record[question_key]
        rows.append({"prompt": _prompt(question, chat), "reference": parse_answer(record[answer_key]),
                     "question": question})
    return rows


def gsm8k_rows_from_records(
    records: Iterable[Mapping[str, Any]], max_samples: int | None = None, chat: bool = False
) -> list[dict]:
    """Forge rows from GSM8K records ``{"question": ..., "answer": "... #### 72"}``; ``chat`` picks
    `chat_prompt` over `format_prompt`."""
    return _rows_from_records(records, max_samples, "GSM8K", "question", "answer", parse_gsm8k_answer, chat)


def _number_text(value: Any) -> str:
    """``72.0`` -> ``"72"``; ``2.5`` -> ``"2.5"``; strings pass through stripped."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value).strip()


def gsm_hard_rows_from_records(
    records: Iterable[Mapping[str, Any]], max_samples: int | None = None, chat: bool = False
) -> list[dict]:
    """Forge rows from GSM-Hard records ``{"input": question, "target": number, ...}``."""
    return _rows_from_records(records, max_samples, "GSM-Hard", "input", "target", _number_text, chat)


def _load_hf_split(dataset_id: str, config: str | None, split: str) -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"loading {dataset_id} needs the 'datasets' package: pip install forge-rl[data]"
        ) from error
    return datasets.load_dataset(dataset_id, config, split=split)


def load_gsm8k(split: str = "train", max_samples: int | None = 500, chat: bool = False) -> list[dict]:
    """GSM8K (``openai/gsm8k``, config ``main``) from the Hugging Face hub as Forge rows.

    Needs ``pip install forge-rl[data]`` and network access (or a warm HF cache).
    ``max_samples=None`` keeps every record of the split. ``chat=True`` gives chat-message prompts
    (`chat_prompt`, for instruct models); the default is the plain `format_prompt`.
    """
    return gsm8k_rows_from_records(_load_hf_split("openai/gsm8k", "main", split), max_samples, chat)


def load_gsm_hard(split: str = "train", max_samples: int | None = 500, chat: bool = False) -> list[dict]:
    """GSM-Hard (``reasoning-machines/gsm-hard``) as Forge rows; same shape and ``chat`` as `load_gsm8k`."""
    return gsm_hard_rows_from_records(_load_hf_split("reasoning-machines/gsm-hard", None, split), max_samples,
                                      chat)


# ----------------------------------------------------------------------------------------------
# An offline stand-in for GSM8K: short word problems written for Forge, with their answers.

GSM8K_MOCK_PROBLEMS: tuple[tuple[str, str], ...] = (
    (
        ("Maya has 12 apples. She buys 3 bags with 5 apples in each bag. How many apples does she have now?"),
        "27",
    ),
    (
        (
            "A train travels 60 miles per hour for 3 hours and then 40 miles per hour for 2 hours. How "
            "many miles does it travel in total?"
        ),
        "260",
    ),
    (
        (
            "Tom had 45 marbles. He gave 17 marbles to his sister and then found 8 more. How many "
            "marbles does Tom have?"
        ),
        "36",
    ),
    (
        (
            "A bakery sells muffins for $3 each. On Monday it sold 24 muffins and on Tuesday it sold "
            "31. How many dollars did it earn on those two days?"
        ),
        "165",
    ),
    (
        (
            "There are 7 rows of chairs with 14 chairs in each row. If 38 chairs are taken, how many "
            "chairs are empty?"
        ),
        "60",
    ),
    ("Lena reads 25 pages a day. How many days does she need to finish a book with 300 pages?", "12"),
    (
        ("A farmer has 4 fields. Each field has 23 cows. He sells 19 cows. How many cows does he have left?"),
        "73",
    ),
    (
        (
            "Sam saves $15 every week. After 8 weeks he spends $47 on a game. How much money does he "
            "have left?"
        ),
        "73",
    ),
    ("A pizza is cut into 8 slices. If 6 friends each eat 2 slices, how many pizzas did they eat?", "1.5"),
    ("A school has 18 classes with 27 students each. How many students are in the school?", "486"),
    (
        (
            "Ava bought 3 notebooks for $4 each and 2 pens for $2 each. She paid with a $20 bill. How "
            "much change did she get?"
        ),
        "4",
    ),
    (
        (
            "A tank holds 500 liters of water. It leaks 35 liters each day. How many liters are left "
            "after 6 days?"
        ),
        "290",
    ),
    ("Ben is 3 times as old as his son. His son is 11 years old. How old will Ben be in 5 years?", "38"),
    (
        (
            "A store had 120 shirts. It sold one quarter of them in the morning and 28 in the "
            "afternoon. How many shirts are left?"
        ),
        "62",
    ),
    ("Each box holds 6 eggs. A farm collects 95 eggs. How many boxes can it fill completely?", "15"),
    ("A rectangle is 13 cm long and 7 cm wide. What is its perimeter in centimeters?", "40"),
    ("Mia runs 4 laps of a 400 meter track every day for 5 days. How many meters does she run?", "8000"),
    (
        (
            "A jar has 64 candies. Half are red, and a quarter of the rest are green. How many candies "
            "are green?"
        ),
        "8",
    ),
    (
        (
            "Carlos earns $12 per hour. He works 7 hours on Saturday and 5 hours on Sunday. How much "
            "does he earn over the weekend?"
        ),
        "144",
    ),
    (
        (
            "A library had 250 books. It received 3 boxes of 40 books and gave away 75 books. How many "
            "books does it have now?"
        ),
        "295",
    ),
)
"""(question, answer) pairs; the tests recompute every answer independently."""


def load_gsm8k_mock(n: int = 20, chat: bool = False) -> list[dict]:
    """``n`` rows of hand-written GSM8K-style problems, for offline tests and demos.

    There are 20 distinct problems; for ``n > 20`` they repeat in order. ``chat`` as in `load_gsm8k`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rows = []
    for index in range(n):
        question, answer = GSM8K_MOCK_PROBLEMS[index % len(GSM8K_MOCK_PROBLEMS)]
        rows.append({"prompt": _prompt(question, chat), "reference": answer, "question": question})
    return rows


# ----------------------------------------------------------------------------------------------
# Few-shot prompting (for benchmarks of base models that have not seen the format)

FEW_SHOT_EXAMPLES: tuple[tuple[str, str, str], ...] = (
    (
        (
            "Olivia has 23 stickers. She gives 8 stickers to her friend and then buys 2 packs of stickers. "
            "Each pack has 6 stickers. How many stickers does Olivia have now?"
        ),
        (
            "After giving 8 stickers to her friend, Olivia has 23 - 8 = 15 stickers.\n"
            "Each of the 2 packs holds 6 stickers, so the packs contain 2 * 6 = 12 stickers.\n"
            "Adding the new stickers to the ones she kept, she now has 15 + 12 = 27 stickers."
        ),
        "27",
    ),
    (
        (
            "A bus leaves the station with 42 passengers. At the first stop 15 people get off and 9 "
            "people get on. At the second stop 11 people get off. How many passengers are on the bus now?"
        ),
        (
            "After the first stop the bus carries 42 - 15 + 9 = 36 passengers.\n"
            "At the second stop 11 people leave and nobody gets on.\n"
            "That leaves 36 - 11 = 25 passengers on the bus."
        ),
        "25",
    ),
    (
        (
            "Noah buys 4 books that cost $9 each and one bookmark that costs $3. He pays with a $50 bill. "
            "How much change does he get back?"
        ),
        (
            "First find the cost of the books: 4 books at $9 each cost 4 * 9 = 36 dollars.\n"
            "The bookmark adds $3, so the total price is 36 + 3 = 39 dollars.\n"
            "His change is 50 - 39 = 11 dollars."
        ),
        "11",
    ),
    (
        (
            "A garden has 5 rows of tomato plants with 8 plants in each row. Every plant gives 3 ripe "
            "tomatoes this week. How many ripe tomatoes does the garden give this week?"
        ),
        (
            "The number of plants is the number of rows times the plants in each row.\n"
            "There are 5 * 8 = 40 tomato plants in the garden.\n"
            "So the garden gives 40 * 3 = 120 ripe tomatoes."
        ),
        "120",
    ),
    (
        (
            "Emma walks 2 kilometers to school in the morning and 2 kilometers back home in the afternoon. "
            "How many kilometers does she walk in 5 school days?"
        ),
        (
            "On one school day Emma walks to school and back again.\n"
            "That is 2 + 2 = 4 kilometers each day.\n"
            "Over 5 school days she walks the same distance every day.\n"
            "In total she walks 4 * 5 = 20 kilometers."
        ),
        "20",
    ),
    (
        (
            "A shop has 96 pencils. It puts them into packs of 12 pencils and sells 5 of the packs. "
            "How many packs are left in the shop?"
        ),
        (
            "To find the number of packs, divide the pencils by the pack size.\n"
            "The pencils fill 96 / 12 = 8 packs.\n"
            "The shop sells 5 of those packs.\n"
            "So 8 - 5 = 3 packs are left in the shop."
        ),
        "3",
    ),
    (
        ("Liam is twice as old as his sister. His sister is 7 years old. How old will Liam be in 4 years?"),
        (
            "Twice the sister's age gives Liam's age today.\n"
            "Liam is 2 * 7 = 14 years old now.\n"
            "In 4 years he will be 4 years older than he is today.\n"
            "So he will be 14 + 4 = 18 years old."
        ),
        "18",
    ),
    (
        (
            "A baker makes 150 cookies. She sells 60 cookies in the morning and half of the remaining "
            "cookies in the afternoon. How many cookies are left at the end of the day?"
        ),
        (
            "After the morning sales the baker has 150 - 60 = 90 cookies.\n"
            "In the afternoon she sells half of those, which is 90 / 2 = 45 cookies.\n"
            "The cookies left are the remaining ones minus the afternoon sales.\n"
            "That leaves 90 - 45 = 45 cookies."
        ),
        "45",
    ),
)
"""(question, worked solution, answer) triples for `few_shot_gsm8k_prompt`."""


def few_shot_gsm8k_prompt(question: str, n_shots: int = 4) -> str:
    """A GSM8K prompt with ``n_shots`` worked examples (each ending in ``Answer: N``) before the
    problem, in the same Problem/Solution layout as `format_prompt`. Four shots is about 500 tokens."""
    if not 0 <= n_shots <= len(FEW_SHOT_EXAMPLES):
        raise ValueError(f"n_shots must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {n_shots}")
    shots = "".join(
        f"Problem: {example_question}\n\nSolution: {solution}\nAnswer: {answer}\n\n"
        for example_question, solution, answer in FEW_SHOT_EXAMPLES[:n_shots]
    )
    return f"{_INSTRUCTIONS}\n\n{shots}Problem: {question}\n\nSolution:"


# ----------------------------------------------------------------------------------------------
# Chat prompts (for instruct models)

GSM8K_CHAT_SYSTEM_PROMPT = (
    "You are a math reasoning assistant. Solve the math word problem step by step inside <think> </think>, "
    "then give only the final number inside <answer> </answer>."
)
"""The system message of `chat_prompt`. It asks for the ``<answer>`` tag that the strict grader and the
default rewards read (``math_correctness`` also accepts ``#### N`` and ``Answer: N``)."""

GSM8K_CHAT_REMINDER = ("\n\nReason inside <think> </think>, then write only the final number inside "
                       "<answer> </answer>.")
"""Appended to every user turn of `chat_prompt`: the format request next to the problem."""

CHAT_FEW_SHOT = 2
"""Worked examples `chat_prompt` puts before the problem by default (from `FEW_SHOT_EXAMPLES`)."""


def chat_prompt(question: str, n_shots: int = CHAT_FEW_SHOT) -> list[dict[str, str]]:
    """The GSM8K prompt as chat messages: `GSM8K_CHAT_SYSTEM_PROMPT`, ``n_shots`` worked examples of
    `FEW_SHOT_EXAMPLES` as user/assistant turns (``<think>solution</think>\n<answer>N</answer>``), and
    the problem as the last user message; each user turn ends with `GSM8K_CHAT_REMINDER`. (The reminder
    next to the problem raised the packaged model's format rate on the mock set from 25% to 30% greedy
    and from 10% to 45% at temperature 0.7.)"""
    if not 0 <= n_shots <= len(FEW_SHOT_EXAMPLES):
        raise ValueError(f"n_shots must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {n_shots}")
    messages = [{"role": "system", "content": GSM8K_CHAT_SYSTEM_PROMPT}]
    for example_question, solution, answer in FEW_SHOT_EXAMPLES[:n_shots]:
        messages.append({"role": "user", "content": example_question + GSM8K_CHAT_REMINDER})
        messages.append({"role": "assistant",
                         "content": f"<think>{solution}</think>\n<answer>{answer}</answer>"})
    messages.append({"role": "user", "content": question + GSM8K_CHAT_REMINDER})
    return messages



# ----------------------------------------------------------------------------------------------
# The tasks: rows, held-out rows and the grader (`forge.data.task`). Without ``chat`` the held-out rows
# have the plain `format_prompt`, as the loaders do.


def _gsm8k_heldout(n: int | None = None, chat: bool | None = None, split: str = "test") -> list[dict]:
    """GSM8K's held-out rows: the ``split`` split (test), all of it unless n."""
    return load_gsm8k(split=split, max_samples=n, chat=bool(chat))


def _gsm_hard_heldout(n: int | None = None, chat: bool | None = None, split: str = "test") -> list[dict]:
    """GSM-Hard's held-out rows: its only split ("train"), all of it unless n."""
    return load_gsm_hard(split="train", max_samples=n, chat=bool(chat))


def _gsm8k_mock_heldout(n: int | None = None, chat: bool | None = None, split: str = "test") -> list[dict]:
    """The mock set's 20 problems (n of them, repeating past 20); it has one split."""
    return load_gsm8k_mock(20 if n is None else n, chat=bool(chat))


GSM8K_TASK = Task("gsm8k", rows=load_gsm8k, heldout=_gsm8k_heldout, grade=grade_math, reward=math_correctness)
GSM8K_MOCK_TASK = Task("gsm8k-mock", rows=load_gsm8k_mock, heldout=_gsm8k_mock_heldout, grade=grade_math,
                       reward=math_correctness)
GSM_HARD_TASK = Task("gsm-hard", rows=load_gsm_hard, heldout=_gsm_hard_heldout, grade=grade_math,
                     reward=math_correctness)
