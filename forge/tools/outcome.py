"""One tool call's outcome as the text the model reads: the return value (or the exception) turned into text
and cut to length.

`call_tool` runs inside the call's isolation (its thread or its worker process), so everything that can go
wrong while turning a result into text (an int past Python's 4,300-digit str limit, a `__str__` that raises or
blocks, a list nested too deep for JSON, an exception whose own `__str__` raises) happens under the call's
timeout and error handling and costs that call, never the run. The text has no lone surrogate (a str that
cannot be UTF-8, e.g. "\\udcff" from bytes decoded with surrogateescape): each becomes U+FFFD, so a tokenizer
can always read it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = ["call_tool", "describe_error", "readable", "truncate_output"]

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def readable(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (a str without them comes back as it is)."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def truncate_output(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return f"{text[:limit]}... [output truncated: {len(text) - limit} more characters]", True


def call_tool(function: Callable[..., Any], arguments: dict,
              max_output_chars: int) -> tuple[str, str | None, bool]:
    """(text, failure, truncated) of one call: failure is None, or 'error' when the tool raised or its value
    could not be turned into text (the text then says why)."""
    try:
        text, failure = _as_text(function(**arguments)), None
    except BaseException as error:  # noqa: BLE001 - a tool's failure is the model's to read, not the run's
        text, failure = f"error: {describe_error(error)}", "error"
    text, cut = truncate_output(readable(text), max_output_chars)
    return text, failure, cut


def describe_error(error: BaseException) -> str:
    """`Type: message`, also for an exception whose own `__str__` raises."""
    try:
        message = _plain(str(error))
    # BLE001: the message is for the model; its absence must not hide the failure
    except BaseException:  # noqa: BLE001
        message = "<the exception's message could not be shown>"
    return f"{type(error).__name__}: {message}"


def _as_text(value: Any) -> str:
    """A string as it is, anything else as JSON, or its str() when it is not JSON-serialisable. Raises what
    the conversion raises."""
    if isinstance(value, str):
        return _plain(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return _plain(str(value))


def _plain(text: str) -> str:
    """A str subclass as a plain str, so that slicing and len() run str's own code."""
    return str.__str__(text)
