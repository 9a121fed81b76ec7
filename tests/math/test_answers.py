"""The shared grader: number parsing, final-answer extraction, answer equivalence."""

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge.data.answers import (
    HAVE_MATH_VERIFY,
    answers_match,
    extract_answer_line,
    extract_final_answer,
    extract_tagged_answer,
    first_number,
    last_number,
    parse_number,
)

needs_math_verify = pytest.mark.skipif(not HAVE_MATH_VERIFY, reason="math-verify not installed")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42.0),
        ("1,234", 1234.0),
        ("1,234,567.5", 1234567.5),
        ("$18", 18.0),
        ("$18.50", 18.5),
        ("-$5", -5.0),
        ("$-5", -5.0),
        ("50%", 50.0),
        ("12 apples", 12.0),
        ("5 cm", 5.0),
        ("\u22123", -3.0),
        ("+4", 4.0),
        ("3.25", 3.25),
        (".5", 0.5),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("5/0", 5.0),  # a zero denominator is ignored rather than dividing by zero
        ("the answer is 7", 7.0),
        ("10 - 5", 10.0),  # first number; a minus after a space and digit is not a sign
        ("abc", None),
        ("", None),
        ("-", None),
        ("$", None),
        ("1" * 400, None),  # too large for a float
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_parse_number_rejects_non_strings():
    assert parse_number(None) is None
    assert parse_number(12) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "first", "last"),
    [
        ("It costs $1,200 then 3.5 more", "1200", "3.5"),
        ("from 3-4 to \u22127", "3", "-7"),
        ("no digits", None, None),
        ("x 3/4", "3/4", "3/4"),
        ("<<48/2=24>>24", "48/2", "24"),
    ],
)
def test_first_and_last_number(text, first, last):
    assert first_number(text) == first
    assert last_number(text) == last


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # 1. answer tag: the last one wins, unclosed runs to the end, case-insensitive tag
        ("<think>2+2</think><answer>4</answer>", "4"),
        ("<answer>1</answer> then <answer> 2 </answer>", "2"),
        ("<think>hmm</think><answer>17", "17"),
        ("<ANSWER>9</ANSWER>", "9"),
        ("<answer>x = 5</answer>", "x = 5"),
        ("<answer>  </answer> so 8", "8"),  # an empty tag falls through to later rules
        # 2. boxed, with nested braces; the tag beats it
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{3} and later \\boxed{5}", "5"),
        ("\\boxed{3} then \\boxed{unclosed", "3"),
        ("<answer>7</answer> \\boxed{8}", "7"),
        # 3. Answer: line, last one, case-insensitive, markdown bold, value on the next line
        ("Answer: 18 dollars\nanything 99", "18 dollars"),
        ("answer: 1\nFinal Answer: 2", "2"),
        ("**Answer:** 12", "12"),
        ("**Answer**: 13", "13"),
        ("Answer:\n\n 33", "33"),
        ("\\boxed{4}\nAnswer: 5", "4"),
        # 4. GSM8K #### line
        ("48/2 = 24\n#### 72", "72"),
        # 5. last number
        ("a 3 b 4.5 c", "4.5"),
        ("costs $1,200.", "1200"),
        ("nothing here", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_final_answer_custom_tag():
    assert extract_final_answer("<sol>6</sol> 7", answer_tag="sol") == "6"
    assert extract_final_answer("<answer>6</answer> 7", answer_tag="sol") == "7"  # other tags are just text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>42</answer>", "42"),
        ("<answer>1</answer><answer>2</answer>", "2"),
        ("<answer>42", None),  # strict: must be closed
        ("<answer> </answer>", None),
        ("<ANSWER>42</ANSWER>", None),  # strict: exact tag name
        ("Answer: 42", None),
        ("", None),
    ],
)
def test_extract_tagged_answer(text, expected):
    assert extract_tagged_answer(text, "answer") == expected


def test_extract_answer_line_none_without_line():
    assert extract_answer_line("just 5") is None
    assert extract_answer_line(None) is None


@pytest.mark.parametrize(
    ("predicted", "reference", "expected"),
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1,000", "1000", True),
        ("$1,000.00", "1000", True),
        ("72 apples", "72", True),
        ("50%", "50", True),
        ("\u22123", "-3", True),
        ("0.5", "1/2", True),
        ("71", "72", False),
        ("72", "-72", False),
        ("3x", "3", False),
        (None, "72", False),
        ("", "72", False),
        ("72", "", False),
        ("72", 72, True),
        ("2.5", 2.5, True),
        ("0.3333333", "1/3", True),  # within the 1e-6 relative tolerance
        ("0.33", "1/3", False),
        ("1000001", "1000000", False),  # whole numbers must be equal
    ],
)
def test_answers_match_numeric(predicted, reference, expected):
    assert answers_match(predicted, reference) is expected


@needs_math_verify
@pytest.mark.parametrize(
    ("predicted", "reference", "expected"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("\\frac{3}{4}", "3/4", True),
        ("x = 5", "5", True),
        ("\\sqrt{2}", "\\sqrt{2}", True),
        ("2^{10}", "1024", True),
        ("\\frac{1}{3}", "0.5", False),
        ("seventy-two", "72", False),
        ("9^{9^{9^{9}}}", "10", False),  # screened out instead of being evaluated for hours
    ],
)
def test_answers_match_symbolic(predicted, reference, expected):
    assert answers_match(predicted, reference) is expected


@needs_math_verify
def test_answers_match_off_the_main_thread():
    """math-verify's signal-based timeout fails off the main thread; the grader must still work."""
    results = []
    worker = threading.Thread(target=lambda: results.append(answers_match("\\frac{1}{2}", "0.5")))
    worker.start()
    worker.join(timeout=30)
    assert results == [True]


ADVERSARIAL = [
    "answer" + " " * 100_000,
    "Answer:" * 15_000,
    "1," * 50_000,
    "1,111" * 20_000,
    "<answer>" * 15_000,
    "</answer><answer>" * 6_000,
    "\\boxed{" * 15_000,
    "{" * 100_000,
    "-" * 100_000,
    "9" * 100_000,
    "#### " * 20_000,
    "\u2212$" * 50_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=lambda text: repr(text[:12]))
def test_extractors_are_fast_on_adversarial_text(text):
    start = time.perf_counter()
    extract_final_answer(text)
    extract_tagged_answer(text)
    parse_number(text)
    last_number(text)
    answers_match(text, "1")
    answers_match("1", text)
    assert time.perf_counter() - start < 2.0


_TEXT = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="<>/answerthink{}\\boxed0123456789.,$-+:#* \n\u2212%", max_size=300),
)
_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(_TEXT)
def test_extractors_never_raise(text):
    for answer in (extract_final_answer(text), extract_tagged_answer(text), extract_answer_line(text)):
        assert answer is None or (isinstance(answer, str) and answer == answer.strip() and answer)
    value = parse_number(text)
    assert value is None or isinstance(value, float)
    assert last_number(text) is None or isinstance(last_number(text), str)


@_FUZZ
@given(_TEXT, st.one_of(st.text(max_size=30), st.integers(-1000, 1000)))
def test_answers_match_never_raises(predicted, reference):
    assert answers_match(predicted, reference) in (True, False)


@_FUZZ
@given(st.integers(-(10**9), 10**9))
def test_numbers_round_trip(value):
    formatted = f"{value:,}"
    assert parse_number(formatted) == float(value)
    assert answers_match(formatted, str(value))
    assert extract_final_answer(f"so the total is {formatted}.") == str(value)
