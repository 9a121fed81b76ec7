"""Data: GSM8K prompt/parsing/loaders, the arithmetic task, and dataset loading and validation."""

import ast
import json
import operator
import re
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.core.scoring import reward_kwargs
from forge.data import arithmetic
from forge.data.arithmetic import (
    ALL_KINDS,
    HELDOUT_POOL_SIZE,
    SYSTEM_PROMPT,
    arithmetic_dataset,
    arithmetic_heldout,
    chat_prompt,
    generate_problems,
    heldout_problems,
    plain_prompt,
    train_problems,
)
from forge.data.dataset import (
    BUILTIN_DATASETS,
    builtin_dataset,
    is_chat,
    load_jsonl,
    load_rows,
    validate_rows,
)
from forge.data.gsm8k import (
    FEW_SHOT_EXAMPLES,
    GSM8K_MOCK_PROBLEMS,
    extract_answer,
    few_shot_gsm8k_prompt,
    format_prompt,
    gsm8k_rows_from_records,
    gsm_hard_rows_from_records,
    load_gsm8k,
    load_gsm8k_mock,
    load_gsm_hard,
    parse_gsm8k_answer,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def read_fixture(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


def calc(expression: str) -> float:
    """Evaluate + - * / // and parentheses over numbers, without eval()."""

    def visit(node):
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](visit(node.left), visit(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -visit(node.operand)
        raise ValueError(f"unsupported expression {expression!r}")

    return visit(ast.parse(expression, mode="eval"))


# ----------------------------------------------------------------------------------------------
# GSM8K prompt and answer parsing


def test_format_prompt_exact_string():
    assert format_prompt("What is 2 + {3}?") == (
        "You are a math reasoning assistant. Solve the problem step by step.\n"
        "At the end of your solution, write the final answer on its own line in the format: "
        "Answer: <number>\n"
        "\n"
        "Problem: What is 2 + {3}?\n"
        "\n"
        "Solution:"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2 + 2 = 4\nAnswer: 4", "4"),
        ("Answer: $1,234", "1234"),
        ("Answer: 18 dollars", "18"),
        ("answer: -7", "-7"),
        ("Answer: 1\nlater\nAnswer: 2", "2"),
        ("Answer: 3.5\nthen 99", "3.5"),  # the Answer line beats a later number
        ("**Answer:** 12", "12"),
        ("Answer: twelve", "twelve"),  # a line without a number gives its text
        ("she has 5 apples and eats 2, leaving 3", "3"),
        ("costs $2,500.", "2500"),
        ("no numbers", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("x\n#### -3", "-3"),
        ("first #### 1\nthen #### 2", "2"),
    ],
)
def test_parse_gsm8k_answer(field, expected):
    assert parse_gsm8k_answer(field) == expected


@pytest.mark.parametrize("field", ["no marker 72", "ends with ####  ", None])
def test_parse_gsm8k_answer_errors(field):
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer(field)


def test_gsm8k_rows_from_fixture():
    records = read_fixture("gsm8k_sample.jsonl")
    rows = gsm8k_rows_from_records(records, max_samples=None)
    assert [row["reference"] for row in rows] == ["54", "55", "10000", "107", "15"]
    assert rows[0]["question"] == records[0]["question"]
    assert rows[0]["prompt"] == format_prompt(records[0]["question"])
    assert set(rows[0]) == {"prompt", "reference", "question"}
    assert len(gsm8k_rows_from_records(records, max_samples=2)) == 2
    validate_rows(rows)


def test_gsm8k_fixture_answers_follow_from_their_calculator_annotations():
    """The fixture is real GSM8K format: each <<expr=result>> is right; the last result is the answer."""
    for record in read_fixture("gsm8k_sample.jsonl"):
        annotations = re.findall(r"<<([^=>]+)=([^>]+)>>", record["answer"])
        assert annotations
        for expression, result in annotations:
            assert calc(expression) == float(result)
        assert float(annotations[-1][1]) == float(parse_gsm8k_answer(record["answer"]))


def test_gsm8k_record_errors():
    with pytest.raises(ValueError, match="record 1 needs 'question' and 'answer'"):
        gsm8k_rows_from_records([{"question": "q", "answer": "#### 1"}, {"question": "q"}])


def test_gsm_hard_rows_from_fixture():
    records = read_fixture("gsm_hard_sample.jsonl")
    rows = gsm_hard_rows_from_records(records)
    assert [row["reference"] for row in rows] == ["88140", "22.5", "97531"]
    assert rows[1]["prompt"] == format_prompt(records[1]["input"])
    with pytest.raises(ValueError, match="needs 'input' and 'target'"):
        gsm_hard_rows_from_records([{"question": "q"}])


@pytest.fixture
def fake_datasets(monkeypatch):
    """A stand-in for the `datasets` package that serves the local fixtures."""
    calls = []

    def load_dataset(name, config=None, split="train"):
        calls.append((name, config, split))
        fixture = {
            "openai/gsm8k": "gsm8k_sample.jsonl",
            "reasoning-machines/gsm-hard": "gsm_hard_sample.jsonl",
        }
        return read_fixture(fixture[name])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_load_gsm8k_and_gsm_hard_use_the_hub_ids(fake_datasets):
    rows = load_gsm8k(split="test", max_samples=3)
    assert [row["reference"] for row in rows] == ["54", "55", "10000"]
    assert load_gsm_hard(max_samples=1)[0]["reference"] == "88140"
    assert fake_datasets == [("openai/gsm8k", "main", "test"), ("reasoning-machines/gsm-hard", None, "train")]


def test_load_gsm8k_without_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match=r"pip install forge-rl\[data\]"):
        load_gsm8k()


# The arithmetic behind each mock problem, written independently of the stored answers.
MOCK_SOLUTIONS = [
    "12 + 3 * 5",
    "60 * 3 + 40 * 2",
    "45 - 17 + 8",
    "3 * (24 + 31)",
    "7 * 14 - 38",
    "300 / 25",
    "4 * 23 - 19",
    "15 * 8 - 47",
    "6 * 2 / 8",
    "18 * 27",
    "20 - (3 * 4 + 2 * 2)",
    "500 - 35 * 6",
    "3 * 11 + 5",
    "120 - 120 / 4 - 28",
    "95 // 6",
    "2 * (13 + 7)",
    "4 * 400 * 5",
    "(64 - 64 / 2) / 4",
    "12 * (7 + 5)",
    "250 + 3 * 40 - 75",
]


def test_mock_answers_rederived():
    assert len(GSM8K_MOCK_PROBLEMS) == len(MOCK_SOLUTIONS) == 20
    for (question, answer), solution in zip(GSM8K_MOCK_PROBLEMS, MOCK_SOLUTIONS):
        assert float(answer) == calc(solution), question
        # every number the solution uses appears in the question
        for number in re.findall(r"\d+", solution):
            assert number in question or number in ("2", "4"), (number, question)


def test_load_gsm8k_mock_rows():
    rows = load_gsm8k_mock()
    assert len(rows) == 20 and len({row["question"] for row in rows}) == 20
    assert rows[0] == {
        "prompt": format_prompt(GSM8K_MOCK_PROBLEMS[0][0]),
        "reference": "27",
        "question": GSM8K_MOCK_PROBLEMS[0][0],
    }
    assert len(load_gsm8k_mock(5)) == 5
    assert load_gsm8k_mock(25)[20] == rows[0]  # repeats past 20
    with pytest.raises(ValueError, match="n must be >= 0"):
        load_gsm8k_mock(-1)


def test_few_shot_prompt():
    prompt = few_shot_gsm8k_prompt("How many legs do 3 cats have?")
    assert prompt.startswith("You are a math reasoning assistant.")
    assert prompt.endswith("Problem: How many legs do 3 cats have?\n\nSolution:")
    assert prompt.count("Answer: ") == 4 + 1  # four worked answers plus the instruction line
    assert 1500 < len(prompt) < 2600  # roughly 500 tokens at ~4 characters per token
    assert few_shot_gsm8k_prompt("Q", n_shots=0) == format_prompt("Q")
    with pytest.raises(ValueError, match="n_shots"):
        few_shot_gsm8k_prompt("Q", n_shots=99)


def test_few_shot_examples_are_correct():
    for question, solution, answer in FEW_SHOT_EXAMPLES:
        steps = re.findall(r"(\d+(?: [-+*/] \d+)+) = (\d+)", solution)
        assert steps, solution
        for expression, result in steps:
            assert calc(expression) == float(result), (expression, result)
        assert steps[-1][1] == answer
        assert extract_answer(f"{solution}\nAnswer: {answer}") == answer


# ----------------------------------------------------------------------------------------------
# Arithmetic task


def test_generation_is_deterministic_and_prefix_stable():
    first = generate_problems(60, seed=3)
    assert first == generate_problems(60, seed=3)
    assert generate_problems(30, seed=3) == first[:30]
    assert first != generate_problems(60, seed=4)
    assert heldout_problems(20) == heldout_problems(60)[:20]


def test_each_kind_present_and_balanced():
    problems = generate_problems(60, seed=0)
    counts = {kind: sum(problem.kind == kind for problem in problems) for kind in ALL_KINDS}
    assert counts == {kind: 10 for kind in ALL_KINDS}
    assert {problem.kind for problem in generate_problems(10, seed=0, kinds=["multiply"])} == {"multiply"}


def test_answers_recomputed_from_expressions():
    for problem in generate_problems(600, seed=11) + heldout_problems(60):
        assert calc(problem.expression) == problem.answer, problem
        operands = re.findall(r"\d+", problem.expression)
        if problem.kind != "word" or "//" not in problem.expression:
            assert all(operand in problem.question for operand in operands), problem


def test_kind_properties():
    for problem in generate_problems(600, seed=5):
        numbers = [int(n) for n in re.findall(r"\d+", problem.expression)]
        if problem.kind == "add_carry":
            a, b = numbers
            assert a % 10 + b % 10 >= 10 and 10 <= a <= 999 and 10 <= b <= 99
        elif problem.kind == "subtract":
            assert problem.answer > 0
        elif problem.kind == "negative":
            assert problem.answer < 0
        elif problem.kind == "multiply":
            a, b = numbers
            assert 12 <= a <= 99 and (3 <= b <= 9 or 11 <= b <= 19)
        elif problem.kind == "two_step":
            assert len(numbers) == 3
        # moderate sizes: nothing a small model could not in principle do
        assert abs(problem.answer) < 2000


def test_train_and_heldout_are_disjoint():
    heldout = {problem.question for problem in heldout_problems(HELDOUT_POOL_SIZE)}
    for seed in (0, 1, arithmetic.HELDOUT_SEED):
        train = train_problems(500, seed=seed)
        assert len(train) == 500
        assert not heldout & {problem.question for problem in train}
    few_shot_questions = {message["content"] for message in chat_prompt("x")[1:-1:2]}
    assert not few_shot_questions & heldout
    assert len({problem.question for problem in train_problems(500, seed=0)}) == 500  # no duplicates


def test_generator_errors():
    with pytest.raises(ValueError, match="unknown problem kinds"):
        generate_problems(3, seed=0, kinds=["division"])
    with pytest.raises(ValueError, match="kinds is empty"):
        generate_problems(3, seed=0, kinds=[])
    with pytest.raises(ValueError, match="held-out n"):
        heldout_problems(HELDOUT_POOL_SIZE + 1)


def test_chat_and_plain_prompts():
    messages = chat_prompt("What is 12 + 39?")
    assert [message["role"] for message in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert messages[0]["content"] == SYSTEM_PROMPT
    assert "<think>" in SYSTEM_PROMPT and "<answer>" in SYSTEM_PROMPT
    assert messages[-1] == {"role": "user", "content": "What is 12 + 39?"}
    assert is_chat(messages)
    assert chat_prompt("Q", few_shot=False) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Q"},
    ]
    total_chars = sum(len(message["content"]) for message in messages)
    assert 250 < total_chars < 600  # about 120 tokens
    text = plain_prompt("What is 12 + 39?")
    assert text.startswith(SYSTEM_PROMPT) and text.endswith("Question: What is 12 + 39?\n")


def test_few_shot_replies_are_correct_and_well_formed():
    from forge.core.reward import MathCorrectnessReward, TagFormatReward

    messages = chat_prompt("x")
    replies = [message["content"] for message in messages if message["role"] == "assistant"]
    questions = [message["content"] for message in messages[1:-1] if message["role"] == "user"]
    assert TagFormatReward()(questions, replies).scores == [1.0, 1.0]
    assert MathCorrectnessReward(strict=True)(questions, replies, references=["83", "60"]).scores == [
        1.0,
        1.0,
    ]
    assert calc("36 + 47") == 83 and calc("5 * 12") == 60


def test_arithmetic_rows():
    rows = arithmetic_dataset(12, seed=2)
    assert len(rows) == 12 and set(rows[0]) == {"prompt", "reference", "kind"}
    problems = train_problems(12, seed=2)
    assert [row["reference"] for row in rows] == [str(problem.answer) for problem in problems]
    assert rows[0]["prompt"][-1]["content"] == problems[0].question
    assert isinstance(arithmetic_dataset(3, seed=2, chat=False)[0]["prompt"], str)
    heldout = arithmetic_heldout(60)
    assert len(heldout) == 60 and [row["reference"] for row in heldout] == [
        str(problem.answer) for problem in heldout_problems(60)
    ]
    validate_rows(rows)
    validate_rows(heldout)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 40))
def test_any_seed_gives_correct_distinct_problems(seed, n):
    problems = generate_problems(n, seed)
    assert len(problems) == n == len({problem.question for problem in problems})
    assert all(calc(problem.expression) == problem.answer for problem in problems)


# ----------------------------------------------------------------------------------------------
# load_rows, validate_rows, reward_kwargs


def test_load_rows_from_list_copies_rows():
    source = [{"prompt": "a", "reference": "1"}]
    rows = load_rows(source)
    assert rows == source
    rows[0]["prompt"] = "changed"
    assert source[0]["prompt"] == "a"


def test_load_rows_from_jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "reference": "1"}\n\n{"prompt": "b", "reference": "2"}\n')
    assert load_rows(path) == [{"prompt": "a", "reference": "1"}, {"prompt": "b", "reference": "2"}]
    assert load_rows(str(path)) == load_jsonl(path)


def test_load_rows_from_hf_dataset():
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(
        [{"prompt": "a", "reference": "1"}, {"prompt": "b", "reference": "2"}]
    )
    assert load_rows(dataset) == [{"prompt": "a", "reference": "1"}, {"prompt": "b", "reference": "2"}]
    with pytest.raises(TypeError, match="pass one split"):
        load_rows(datasets.DatasetDict({"train": dataset}))


def test_load_rows_from_any_iterable_of_mappings():
    generator = ({"prompt": f"q{i}", "reference": str(i)} for i in range(3))
    assert [row["prompt"] for row in load_rows(generator)] == ["q0", "q1", "q2"]


def test_builtin_datasets_by_name():
    assert set(BUILTIN_DATASETS) >= {"gsm8k", "gsm8k-mock", "arithmetic", "gsm-hard"}
    assert len(load_rows("gsm8k-mock")) == 20
    assert len(load_rows("gsm8k-mock", n=4)) == 4
    assert load_rows("arithmetic", n=6, seed=1) == arithmetic_dataset(6, seed=1)
    assert builtin_dataset("arithmetic-heldout", n=5) == arithmetic_heldout(5)
    with pytest.raises(ValueError, match="unknown built-in dataset 'nope'"):
        builtin_dataset("nope")


def test_builtin_gsm8k_goes_through_the_loader(fake_datasets):
    assert len(load_rows("gsm8k", max_samples=2)) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\n{"prompt": \n', r"rows\.jsonl, line 2: not valid JSON"),
        ('{"prompt": "a"}\n\n[1, 2]\n', r"rows\.jsonl, line 3: expected a JSON object"),
        ("", "dataset is empty"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_rows(path)


def test_load_rows_unknown_source():
    with pytest.raises(ValueError, match="neither an existing .jsonl file nor a built-in dataset"):
        load_rows("missing.jsonl")
    with pytest.raises(TypeError, match="cannot load rows from int"):
        load_rows(3)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "dataset is empty; give at least one row like {'prompt'"),
        ([{"prompt": "a"}, "b"], "dataset row 1 is a str, not a mapping; expected {'prompt'"),
        (
            [{"question": "a", "reference": "1"}],
            (
                r"dataset row 0 has no 'prompt' key \(keys: \['question', 'reference'\]\); "
                r"expected \{'prompt': str \| list"
            ),
        ),
        (
            [{"prompt": ""}],
            "dataset row 0: 'prompt' is an empty string; it must be a non-empty str or a list",
        ),
        ([{"prompt": "  \n"}], "'prompt' is an empty string"),
        ([{"prompt": 5}], "dataset row 0: 'prompt' has type int"),
        ([{"prompt": None}], "'prompt' has type NoneType"),
        ([{"prompt": []}], "'prompt' is an empty list of messages"),
        ([{"prompt": [{"role": "user"}]}], "'prompt' message 0 is not a {'role': ..., 'content': ...} dict"),
        ([{"prompt": ["hi"]}], "'prompt' message 0 is not a"),
        ([{"prompt": [{"role": "user", "content": 3}]}], "message 0 needs string 'role' and 'content'"),
        (
            [{"prompt": "a", "reference": "1"}, {"prompt": "b"}],
            r"dataset row 1 has columns \['prompt'\] but row 0 has",
        ),
        ([{"prompt": "a", "completions": "x"}], r"columns \['completions'\] clash"),
        ([{"prompt": "a", "reference": "1", "references": "1"}], "both 'reference' and 'references'"),
    ],
)
def test_validate_rows_errors(rows, message):
    with pytest.raises(ValueError, match=message):
        validate_rows(rows)


def test_validate_rows_accepts_good_rows():
    validate_rows([{"prompt": "a", "reference": "1"}, {"prompt": CHAT, "reference": 2}])
    validate_rows([{"prompt": "only a prompt"}])


def test_reward_kwargs_renames_reference():
    rows = [{"prompt": "a", "reference": "1", "kind": "x"}, {"prompt": "b", "reference": "2", "kind": "y"}]
    assert reward_kwargs(rows) == {"references": ["1", "2"], "kind": ["x", "y"]}
    assert reward_kwargs([{"prompt": "a"}]) == {}
    assert reward_kwargs([]) == {}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (CHAT, True),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], True),
        ("text", False),
        ([], False),
        (["text"], False),
        ([{"role": "user"}], False),
        (None, False),
    ],
)
def test_is_chat(prompt, expected):
    assert is_chat(prompt) is expected


# --------------------------------------------------------------------------------------------------
# the data floor


def test_the_data_floor_imports_nothing_from_the_floors_above_it():
    """forge/data is what the rewards, the evaluation and the trainer stand on: its modules import no Forge
    module outside forge.data (forge.core, forge.eval, forge.demo, forge.cli, ...), not even inside a function."""
    files = sorted((Path(__file__).resolve().parents[2] / "forge" / "data").glob("*.py"))
    assert {path.name for path in files} >= {"task.py", "arithmetic.py", "gsm8k.py", "reasoning_gym_tasks.py"}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue  # not an import, or a relative one (inside forge.data)
            for name in names:
                if name == "forge" or name.startswith("forge."):
                    assert name.startswith("forge.data"), f"forge/data/{path.name}, line {node.lineno}: imports {name}"
