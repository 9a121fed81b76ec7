"""Find the final answer in a model's response and decide whether it equals a reference.

This module is the single grader shared by the rewards (`forge.core.reward`) and the evaluation
code, so the training signal and the reported accuracy cannot drift apart (the nanochat habit of
letting the task own its grader).

Everything here is pure Python over strings and never raises on any input text: a model can
write anything, and a malformed response must score 0, not crash a training step. The regular
expressions are written so that their running time stays linear in the length of the text (no
nested quantifiers that could backtrack), which the tests check on 100k-character inputs.

Equivalence (`answers_match`) first compares plain numbers directly ("1,234" == "1234.0"), then
falls back to Hugging Face's math-verify (https://github.com/huggingface/Math-Verify) for
symbolic answers such as ``\\frac{1}{2}`` or ``x = 5`` when the package is installed
(``pip install forge-rl[math]``).
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

try:  # math-verify is optional: without it only numeric answers can be compared.
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
    from math_verify.errors import TimeoutException as _MathVerifyTimeout

    HAVE_MATH_VERIFY = True
except ImportError:  # pragma: no cover - exercised only where math-verify is absent
    HAVE_MATH_VERIFY = False

__all__ = [
    "HAVE_MATH_VERIFY",
    "answers_match",
    "extract_answer_line",
    "extract_final_answer",
    "extract_tagged_answer",
    "first_number",
    "last_number",
    "normalize_number_text",
    "parse_number",
    "readable_reference",
    "reference_answer",
]

# A number as people write it in answers: optional sign (ASCII or U+2212 minus), optional
# currency sign, digits with optional thousands separators, optional decimals, and an optional
# "/denominator" for simple fractions. The sign only counts when it does not follow a word
# character, so "3-4" reads as 3 and 4 rather than 3 and -4.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])(?P<sign>[-+\u2212]))?"
    r"\$?"
    r"(?P<body>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/(?P<den>\d+(?:\.\d+)?))?"
)

# "Answer: 42", "**Final answer:** 42", "answer : 42" - the text after the colon, on one line.
_ANSWER_LINE = re.compile(r"answer(?:\*\*)?[^\S\n]*[:\uff1a](?P<rest>[^\n]*)", re.IGNORECASE)
_HASHES = re.compile(r"####(?P<rest>[^\n]*)")
_BOXED = "\\boxed{"

# Inputs to math-verify are capped: real final answers are short, and sympy can take
# arbitrarily long on adversarial expressions.
_MAX_SYMBOLIC_CHARS = 300
_SYMBOLIC_TIMEOUT_S = 3
_POWER_OPERATORS = re.compile(r"\^|\*\*|!")
_LONG_DIGIT_RUN = re.compile(r"\d{4}")


def normalize_number_text(match: re.Match[str]) -> str:
    """Canonical text of a matched number: no currency sign, no thousands separators,
    ASCII minus, no leading plus. ``"-$1,234.50"`` -> ``"-1234.50"``, ``"3 / 4"`` -> ``"3/4"``."""
    sign = "-" if match.group("sign") in ("-", "\u2212") else ""
    text = sign + match.group("body").replace(",", "")
    if match.group("den") is not None:
        text += "/" + match.group("den")
    return text


def _match_value(match: re.Match[str]) -> float | None:
    """Numeric value of a matched number, or None when it is not a finite float."""
    value = float(match.group("body").replace(",", ""))
    if match.group("den") is not None:
        denominator = float(match.group("den"))
        if denominator != 0.0:
            value /= denominator
    if match.group("sign") in ("-", "\u2212"):
        value = -value
    return value if math.isfinite(value) else None


def parse_number(text: str | None) -> float | None:
    """The value of the first number written in ``text``, or None if there is none.

    Meant for short answer strings: ``"1,234"`` -> 1234.0, ``"$18.50"`` -> 18.5, ``"50%"`` -> 50.0,
    ``"12 apples"`` -> 12.0, ``"\u22123"`` -> -3.0, ``"+4"`` -> 4.0, ``"3/4"`` -> 0.75.
    Numbers too large for a float (hundreds of digits) count as no number.
    """
    if not isinstance(text, str):
        return None
    match = _NUMBER.search(text)
    return None if match is None else _match_value(match)


def first_number(text: str | None) -> str | None:
    """Canonical text (see `normalize_number_text`) of the first number in ``text``, or None."""
    if not isinstance(text, str):
        return None
    match = _NUMBER.search(text)
    return None if match is None else normalize_number_text(match)


def last_number(text: str | None) -> str | None:
    """Canonical text (see `normalize_number_text`) of the last number in ``text``, or None."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None else normalize_number_text(last)


def _tag_blocks(text: str, tag: str, ignore_case: bool) -> tuple[str | None, bool]:
    """Content after the last opening ``<tag>`` and whether a closing ``</tag>`` ended it.

    Tags are found by literal search (an escaped pattern has no quantifiers), so the cost is
    linear in ``len(text)``.
    """
    flags = re.IGNORECASE if ignore_case else 0
    last_open = None
    for last_open in re.finditer(re.escape(f"<{tag}>"), text, flags):
        pass
    if last_open is None:
        return None, False
    close = re.compile(re.escape(f"</{tag}>"), flags).search(text, last_open.end())
    if close is None:
        return text[last_open.end() :], False
    return text[last_open.end() : close.start()], True


def extract_tagged_answer(text: str | None, tag: str = "answer") -> str | None:
    """Stripped content of the last closed ``<tag>...</tag>`` block (exact, case-sensitive tag
    name), or None when there is no such block or it is empty. Used for strict grading."""
    if not isinstance(text, str):
        return None
    content, closed = _tag_blocks(text, tag, ignore_case=False)
    if content is None or not closed:
        return None
    return content.strip() or None


def _boxed_content(text: str, max_tries: int = 4) -> str | None:
    r"""Content of the last balanced ``\boxed{...}`` (nested braces allowed).

    Only the last few occurrences are tried so that pathological inputs stay linear.
    """
    search_end = len(text)
    for _ in range(max_tries):
        start = text.rfind(_BOXED, 0, search_end)
        if start < 0:
            return None
        depth = 1
        position = start + len(_BOXED)
        while position < len(text):
            char = text[position]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    content = text[start + len(_BOXED) : position].strip()
                    if content:
                        return content
                    break
            position += 1
        search_end = start
    return None


def extract_answer_line(text: str | None) -> str | None:
    """Text after the last ``Answer:`` (case-insensitive, "Final answer:" too), stripped of
    markdown bold. When nothing follows the colon on that line, the next non-empty line is taken
    instead ("Answer:\\n42"). None when there is no such line."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _ANSWER_LINE.finditer(text):
        pass
    if last is None:
        return None
    rest = last.group("rest").strip().strip("*").strip()
    if rest:
        return rest
    for line in text[last.end() :].split("\n", 3)[:3]:
        line = line.strip().strip("*").strip()
        if line:
            return line
    return None


def completion_text(completion: Any) -> str:
    """A completion as text: a string as is; a list of chat messages (TRL's conversational completions,
    ``[{"role": "assistant", "content": ...}]``) as the content of its assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion if m.get("role", "assistant") == "assistant")


def extract_final_answer(text: str | None, answer_tag: str = "answer") -> str | None:
    r"""The final answer written in ``text`` as a stripped string, or None if there is none.

    Looks, in this order, for:
      1. the content of the last ``<answer>...</answer>`` block (tag name ``answer_tag``, any
         letter case), or everything after a last ``<answer>`` that was never closed;
      2. the last ``\boxed{...}`` (nested braces are balanced);
      3. the last ``Answer: ...`` line (case-insensitive, also "Final answer:");
      4. the last ``#### ...`` line (the GSM8K reference format);
      5. the last number anywhere in the text.
    Empty candidates (``<answer></answer>``) fall through to the next rule.
    """
    if not isinstance(text, str):
        return None
    content, _closed = _tag_blocks(text, answer_tag, ignore_case=True)
    if content is not None and content.strip():
        return content.strip()
    boxed = _boxed_content(text)
    if boxed is not None:
        return boxed
    line = extract_answer_line(text)
    if line is not None:
        return line
    hashes = None
    for hashes in _HASHES.finditer(text):
        pass
    if hashes is not None and hashes.group("rest").strip():
        return hashes.group("rest").strip()
    return last_number(text)


def _plain_number(text: str) -> float | None:
    """Value of ``text`` when it is just a number (with optional ``$``, ``%``, a trailing unit
    word after a space, or a final period), otherwise None. ``"3x"`` is not a plain number."""
    stripped = text.strip().rstrip(".").strip()
    match = _NUMBER.match(stripped)
    if match is None:
        return None
    rest = stripped[match.end() :]
    if rest and not (rest.strip() == "%" or (rest[0].isspace() and rest.strip().replace(" ", "").isalpha())):
        return None
    return _match_value(match)


def _numbers_equal(a: float, b: float) -> bool:
    """Whole numbers must be equal; otherwise a relative tolerance of 1e-6 absorbs rounding
    ("0.333333" vs "1/3") without letting 1000001 pass for 1000000."""
    if a.is_integer() and b.is_integer():
        return a == b
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _safe_for_symbolic(text: str) -> bool:
    """Whether ``text`` is short and free of power towers that could make sympy run for hours.

    One power/factorial with small operands (``x^2``, ``2^{10}``, ``5!``) is allowed;
    ``9^{9^{9}}`` or ``2^{100000}`` are not.
    """
    if len(text) > _MAX_SYMBOLIC_CHARS:
        return False
    operators = len(_POWER_OPERATORS.findall(text))
    return operators == 0 or (operators == 1 and _LONG_DIGIT_RUN.search(text) is None)


def _as_latex(text: str) -> str:
    """Wrap a bare answer in ``$...$`` so math-verify reads it as LaTeX (``\\frac12`` etc.)."""
    return text if "$" in text or "\\(" in text or "\\[" in text else f"${text}$"


def _math_verify_equal(predicted: str, reference: str) -> bool:
    """math-verify's verdict; False when it cannot parse either side or gives up.

    math-verify enforces its time limits with ``signal.alarm``, which only works on the main
    thread, so the limit is used there and switched off elsewhere (the `_safe_for_symbolic`
    screen bounds the work instead).
    """
    timeout = _SYMBOLIC_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = _mv_parse(_as_latex(reference), parsing_timeout=timeout)
        target = _mv_parse(_as_latex(predicted), parsing_timeout=timeout)
        if not gold or not target:
            return False
        return bool(_mv_verify(gold, target, timeout_seconds=timeout))
    except _MathVerifyTimeout:  # a BaseException subclass, so it is named explicitly
        return False
    except Exception:  # noqa: BLE001 - sympy raises many exception types on odd input; each means "no match"
        return False


def reference_answer(reference: str | float) -> str:
    """The reference as answer text; a GSM8K-style solution ("... #### 72") becomes its final answer "72"."""
    text = str(reference)
    return (text.rsplit("####", 1)[1] if "####" in text else text).strip()


def readable_reference(reference: Any) -> bool:
    """Whether the math grader can read ``reference`` as an answer: a number in it (after a GSM8K "####"), or
    LaTeX math (``$``, ``\\``). Free text ("Paris", "positive") cannot be read: every response would be graded
    wrong against it."""
    if reference is None:
        return False
    text = reference_answer(reference)
    return parse_number(text) is not None or "$" in text or "\\" in text


def answers_match(predicted: str | None, reference: str | float) -> bool:
    """Whether a predicted final answer equals the reference answer. Never raises.

    When both sides are plain numbers ("1,234", "$18", "72 apples", "0.5") they are compared
    numerically (whole numbers exactly, others with a relative tolerance of 1e-6) and that
    verdict is final. Otherwise, when
    math-verify is installed, it decides symbolic equivalence (``\\frac{1}{2}`` vs ``0.5``,
    ``x = 5`` vs ``5``); without math-verify non-numeric answers match only as identical text.
    """
    if not isinstance(predicted, str) or not predicted.strip():
        return False
    reference_text = str(reference).strip()
    if not reference_text:
        return False
    predicted_value, reference_value = _plain_number(predicted), _plain_number(reference_text)
    if predicted_value is not None and reference_value is not None:
        return _numbers_equal(predicted_value, reference_value)
    if predicted.strip() == reference_text:
        return True
    if HAVE_MATH_VERIFY and _safe_for_symbolic(predicted) and _safe_for_symbolic(reference_text):
        return _math_verify_equal(predicted.strip(), reference_text)
    return False
