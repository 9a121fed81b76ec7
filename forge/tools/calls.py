"""Tools a policy may call during a rollout: the tool wrapper, the two call formats, and running the calls.

A tool is a plain Python function with type hints and a Google-style docstring; its JSON schema comes from
`transformers.utils.get_json_schema`, the way chat templates describe tools. Calls run in parallel daemon
threads, each with a timeout. Whatever goes wrong (the tool raises, hangs, returns megabytes, the model
writes a malformed call or names an unknown tool) becomes an error *text* that the model reads as the result
and is counted; it never stops the run.

Two call formats (CallFormat, `call_format`):
    text      for models without a tool chat template: the model writes `<calc>745 * 48</calc>` (the tag is
              the tool's `text_tag`, default its name) and Forge appends `<result>35760</result>`.
    template  for chat templates that take `tools=` (Qwen2.5-style): the model writes
              `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and Forge appends what the template
              renders for the end of the assistant turn, a `tool` role message holding the result, and the
              start of the next assistant turn.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forge.tools.calculator import calculator
from forge.tools.outcome import call_tool, truncate_output
from forge.tools.worker import ToolWorkers
from forge.user_code import import_named_module, import_problem

if TYPE_CHECKING:
    import torch

# ----------------------------------------------------------------------------------------------------
# Tools


@dataclass(frozen=True)
class Tool:
    """A callable the model may use: its name, JSON schema (for chat templates) and text-protocol tag."""

    function: Callable[..., Any]
    name: str
    schema: dict
    text_tag: str  # the text protocol's <tag>...</tag>

    @property
    def parameters(self) -> list[str]:
        return list(self.schema["function"]["parameters"].get("properties", {}))


def as_tool(tool: Callable[..., Any] | Tool) -> Tool:
    """A Tool for a typed, docstringed function (or a Tool, unchanged). Raises with what to add otherwise."""
    if isinstance(tool, Tool):
        return tool
    if not callable(tool):
        raise TypeError(f"a tool must be a function, got {type(tool).__name__}")
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        schema = get_json_schema(tool)
    except (DocstringParsingException, TypeHintParsingException) as error:
        raise ValueError(
            f"tool {getattr(tool, '__name__', tool)!r}: {error}. A tool needs a type hint on every "
            f"argument and a docstring with an 'Args:' section describing each one"
        ) from None
    name = schema["function"]["name"]
    return Tool(tool, name, schema, getattr(tool, "text_tag", name))


def as_tools(tools: Sequence[Callable[..., Any] | Tool] | None) -> list[Tool]:
    out = [as_tool(t) for t in tools or []]
    for kind, key in (("name", lambda t: t.name), ("text tag", lambda t: t.text_tag)):
        keys = [key(t) for t in out]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two tools share a {kind}: {keys}; give each tool its own")
    return out


# ----------------------------------------------------------------------------------------------------
# Calls and results


@dataclass
class ToolCall:
    """One call as the model wrote it."""

    text: str  # the call's text, markers included
    name: str | None  # the tool named (None when it could not be read)
    arguments: dict | None  # None when malformed
    error: str | None = None  # why the call is malformed


@dataclass
class ToolResult:
    """One call's outcome: what the model reads back, and what went wrong if anything."""

    call: ToolCall
    output: str  # the text given to the model (an error text on failure), after truncation
    failure: str | None = None  # None | 'malformed' | 'unknown_tool' | 'error' | 'timeout'
    truncated: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict:
        """What rewards (`tool_calls=`) and samples.jsonl see."""
        return {"name": self.call.name, "arguments": self.call.arguments, "call": self.call.text,
                "output": self.output, "failure": self.failure, "truncated": self.truncated}


ISOLATIONS = ("thread", "process")


@dataclass
class ToolSettings:
    """How a rollout uses tools: which tools, which call format, and the limits (GRPOConfig's tool block)."""

    tools: list[Tool]
    format: str = "text"  # 'text' | 'template' (resolved from 'auto' by `resolve_format`)
    max_calls: int | None = 4  # calls per completion (None: no limit); a further call ends it there
    timeout: float = 10.0  # seconds per call
    max_output_chars: int = 1000  # a longer output keeps its start and says it was cut
    max_episode_tokens: int | None = None  # tokens per completion, sampled and fed; None: the model's context
    isolation: str = "thread"  # 'thread' | 'process': where a call runs (see run_calls)
    memory_mb: int = 1024  # with isolation='process': the most memory a tool worker process may use
    workers: ToolWorkers | None = field(default=None, repr=False, compare=False)  # the worker processes

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"tool_isolation must be 'thread' or 'process', got {self.isolation!r}")
        if self.isolation == "process" and self.workers is None:  # refuses a tool no worker can load
            self.workers = ToolWorkers({t.name: t.function for t in self.tools}, self.memory_mb)

    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    @classmethod
    def of_run(cls, tools: Sequence[Callable[..., Any] | Tool], config, tokenizer) -> ToolSettings:
        """A run's tools under its GRPOConfig's tool block ('auto' format resolved for this tokenizer). With
        tool_isolation='process' one worker starts now, so tools it cannot load stop the run
        before it starts."""
        settings = cls(as_tools(tools), resolve_format(config.tool_format, tokenizer),
                       config.max_tool_calling_iterations, config.tool_timeout, config.max_tool_output_chars,
                       config.max_episode_tokens, config.tool_isolation, config.tool_memory_mb)
        if settings.workers is not None:
            settings.workers.check()
        return settings


def _bind(tool: Tool, arguments: dict) -> str | None:
    """None when the arguments fit the tool's signature, else why not."""
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as error:
        return f"bad arguments for {tool.name}: {error}"
    return None


def run_calls(calls: Sequence[ToolCall], settings: ToolSettings,
              toolboxes: Sequence[dict[str, Tool]] | None = None) -> list[ToolResult]:
    """Run a round of calls in parallel, each with `settings.timeout` seconds; never raises
    for what a tool does.

    The tool runs, and its value (or exception) is turned into text (`outcome.call_tool`), inside the call's
    isolation: with settings.isolation='thread' a daemon thread of this process, abandoned when it outlives
    its timeout (Python cannot kill a thread; as a daemon it does not keep the process alive, but it keeps
    running and holding the GIL); with 'process' a worker process (forge/tools/worker.py) under a memory
    limit, killed and replaced when it outlives its timeout. toolboxes: each call's own tools by name (an
    environment's methods, bound to that completion's instance); default `settings.tools` for every call. A
    toolbox tool that is not one of `settings.tools` runs in a thread in either mode (its state lives
    in this process)."""
    results: list[ToolResult | None] = [None] * len(calls)
    boxes: list[dict] = [{} for _ in calls]
    threads: list[tuple[int, threading.Thread, float]] = []
    in_workers: list[int] = []
    portable = {t.name: t for t in settings.tools} if settings.workers is not None else {}
    for i, call in enumerate(calls):
        tools = settings.by_name() if toolboxes is None else toolboxes[i]
        problem, failure = call.error, "malformed"
        if problem is None and call.name not in tools:
            problem, failure = f"no tool named {call.name!r}; the tools are {sorted(tools)}", "unknown_tool"
        if problem is None:
            problem = _bind(tools[call.name], call.arguments or {})
        if problem is not None:
            results[i] = ToolResult(call, f"error: {problem}", failure)
            continue
        if portable.get(call.name) is tools[call.name]:
            in_workers.append(i)
            continue

        def work(box=boxes[i], function=tools[call.name].function, arguments=call.arguments or {}):
            box["outcome"] = call_tool(function, arguments, settings.max_output_chars)

        thread = threading.Thread(target=work, daemon=True, name=f"forge-tool-{call.name}")
        threads.append((i, thread, time.perf_counter()))
        thread.start()
    deadline = time.perf_counter() + settings.timeout
    if in_workers:
        outcomes = settings.workers.run([(calls[i].name, calls[i].arguments or {}) for i in in_workers],
                                        settings.timeout, settings.max_output_chars)
        for i, (text, failure, cut, seconds) in zip(in_workers, outcomes):
            results[i] = ToolResult(calls[i], text, failure, cut, seconds)
    for i, thread, started in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
        stateful = toolboxes is not None and toolboxes[i].get(calls[i].name) not in settings.tools
        results[i] = _thread_result(calls[i], thread, boxes[i].get("outcome"), time.perf_counter() - started,
                                    settings.timeout, stateful)
    return results  # type: ignore[return-value]


def _thread_result(call: ToolCall, thread: threading.Thread, outcome: tuple | None, seconds: float,
                   timeout: float, stateful: bool) -> ToolResult:
    """A thread's call once its deadline has passed: its outcome, or abandoned (said once per tool)."""
    if thread.is_alive():
        _say_abandoned(call.name, timeout, stateful)
        return ToolResult(call, f"error: the call took longer than {timeout:g} s and was abandoned",
                          "timeout", seconds=seconds)
    if outcome is None:  # the thread died outside the tool's own error handling
        return ToolResult(call, "error: the call ended without a result", "error", seconds=seconds)
    text, failure, cut = outcome
    return ToolResult(call, text, failure, cut, seconds)


_abandoned: set[str] = set()  # tools whose abandoned thread was announced (once per tool and process)


def _say_abandoned(name: str, timeout: float, stateful: bool) -> None:
    """Warn, once per tool, that a call abandoned at its timeout runs on in its thread; `stateful`: an
    environment's method (its state lives in the trainer, so it always runs in a thread)."""
    if name in _abandoned:
        return
    _abandoned.add(name)
    way_out = (
        "an environment's method runs in the trainer, where its state is: make it return in time, or run "
        "its slow work in a subprocess"
        if stateful
        else "set tool_isolation='process', where such a call's worker is killed"
    )
    warnings.warn(
        f"tool {name} ran past tool_timeout={timeout:g} s and keeps running in a thread (Python cannot "
        f"stop one): while it runs it takes CPU and, in Python code, the GIL from the training; {way_out} "
        f"(docs/tools.md)",
        RuntimeWarning,
        stacklevel=3,
    )


# ----------------------------------------------------------------------------------------------------
# Call formats: where a call ends in the model's text, how to read it, what to append after it


@dataclass(frozen=True)
class CallFormat:
    """A call protocol as data. `closers`: text that ends a call; `parse(segment)`: the call that the model
    text `segment` (since the last tool result) ends with; `render(result)`: the text appended after it."""

    kind: str
    closers: tuple[str, ...]
    parse: Callable[[str], ToolCall | None]
    render: Callable[[ToolResult], str]
    stops_at_eos: bool = True  # EOS ends the completion
    extra: dict = field(default_factory=dict)


MAX_CALL_DEPTH = 64  # the most nested JSON arrays and objects a call may hold (deeper: a malformed call)


def _too_deep(text: str) -> str | None:
    """Why the JSON `text` is refused before parsing (it nests deeper than MAX_CALL_DEPTH, where json.loads
    would recurse to a RecursionError and the tools, the logs and rewards after it too), else None."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_CALL_DEPTH:
                return f"the call nests deeper than {MAX_CALL_DEPTH} levels of JSON arrays and objects"
        elif char in "]}":
            depth -= 1
    return None


def _json(text: str) -> tuple[Any, str | None]:
    """(value, None) for JSON text, or (None, why not): not JSON, or nested too deep."""
    problem = _too_deep(text)
    if problem is not None:
        return None, problem
    try:
        return json.loads(text), None
    except (json.JSONDecodeError, RecursionError) as error:
        return None, f"not JSON ({error})"


def _parse_text_call(segment: str, tools: list[Tool]) -> ToolCall | None:
    """`... <calc>745 * 48</calc>` -> ToolCall('calculator', {'expression': '745 * 48'})."""
    for tool in tools:
        close = f"</{tool.text_tag}>"
        if not segment.endswith(close):
            continue
        opening = f"<{tool.text_tag}>"
        start = segment.rfind(opening)
        text = segment[start:] if start >= 0 else segment[-len(close):]
        if start < 0:
            return ToolCall(text, tool.name, None, f"{close} without an opening {opening}")
        argument = segment[start + len(opening):-len(close)].strip()
        names = tool.parameters
        if len(names) == 1:
            return ToolCall(text, tool.name, {names[0]: argument})
        arguments, problem = _json(argument)  # several parameters: the tag holds a JSON object of them
        if problem is not None:
            return ToolCall(text, tool.name, None, f"{opening} of a tool with parameters {names} must hold a "
                            f"JSON object ({problem})")
        if not isinstance(arguments, dict):
            return ToolCall(text, tool.name, None, f"{opening} must hold a JSON object of {names}")
        return ToolCall(text, tool.name, arguments)
    return None


def _parse_template_call(segment: str) -> ToolCall | None:
    """`<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>`."""
    if not segment.endswith("</tool_call>"):
        return None
    start = segment.rfind("<tool_call>")
    if start < 0:
        return ToolCall(segment[-len("</tool_call>"):], None, None,
                        "</tool_call> without an opening <tool_call>")
    text = segment[start:]
    body = text[len("<tool_call>"):-len("</tool_call>")].strip()
    payload, problem = _json(body)
    if problem is not None:
        return ToolCall(text, None, None, f"the call is {problem}; write "
                        '{"name": <tool>, "arguments": {...}}')
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(text, None, None, 'a call is a JSON object {"name": <tool>, "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        parsed, problem = _json(arguments)
        if problem is not None and problem.startswith("the call nests"):
            return ToolCall(text, payload["name"], None, problem)
        arguments = arguments if problem is not None else parsed
    if not isinstance(arguments, dict):
        return ToolCall(text, payload["name"], None, '"arguments" must be a JSON object')
    return ToolCall(text, payload["name"], arguments)


_ASSISTANT, _RESULT = "FORGE_ASSISTANT_TEXT_4d1c", "FORGE_TOOL_RESULT_9e2b"


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a `tools` list and renders `tool` messages."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template and "tool" in template and "<tool_call>" in template


def _template_wrapper(tokenizer) -> tuple[str, str]:
    """(before, after): the text the chat template puts between the end of an assistant message's text and a
    tool result, and between the result and the next assistant message's text."""
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]
    without = tokenizer.apply_chat_template(turn, tokenize=False)
    with_tool = tokenizer.apply_chat_template(turn + [{"role": "tool", "content": _RESULT}], tokenize=False,
                                              add_generation_prompt=True)
    if not with_tool.startswith(without.rstrip()) or _RESULT not in with_tool or _ASSISTANT not in without:
        raise ValueError("this chat template does not render a tool message after an assistant turn; use "
                         "tool_format='text'")
    rendered = with_tool[with_tool.index(_ASSISTANT) + len(_ASSISTANT):]
    before, after = rendered.split(_RESULT, 1)
    return before, after


def resolve_format(requested: str, tokenizer) -> str:
    if requested == "auto":
        return "template" if template_supports_tools(tokenizer) else "text"
    if requested == "template" and not template_supports_tools(tokenizer):
        raise ValueError("tool_format='template' but the tokenizer's chat template takes no tools "
                         "(no <tool_call> in it); use tool_format='text' with worked examples in the prompt")
    return requested


def call_format(kind: str, tools: list[Tool], tokenizer=None) -> CallFormat:
    """The CallFormat of `kind` ('text' or 'template') for these tools."""
    if kind == "text":
        return CallFormat("text", tuple(f"</{t.text_tag}>" for t in tools),
                          lambda segment: _parse_text_call(segment, tools),
                          lambda result: f"<result>{result.output}</result>")
    if kind == "template":
        before, after = _template_wrapper(tokenizer)
        return CallFormat("template", ("</tool_call>",), _parse_template_call,
                          lambda result: f"{before}{result.output}{after}")
    raise ValueError(f"tool_format must be 'auto', 'text' or 'template', got {kind!r}")


def closing_token_ids(tokenizer, closers: Sequence[str]) -> torch.Tensor:
    """(V,) bool: tokens whose text holds the last character of a closer. Only after one of those can a call
    have just ended, so the row's text is decoded only then."""
    import torch  # here, not at the top: a tool worker process imports this module and must start light

    cached = getattr(tokenizer, "_forge_closing_ids", None)
    last_chars = "".join(sorted({c[-1] for c in closers}))
    if cached is not None and cached[0] == last_chars:
        return cached[1]
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    table = torch.tensor([any(ch in piece for ch in last_chars) for piece in pieces])
    try:
        tokenizer._forge_closing_ids = (last_chars, table)
    except AttributeError:
        pass
    return table


def ended_call(tokenizer, fmt: CallFormat, segment_ids: list[int]):
    """(call, overflow) when the segment's last token completes a closer, else (None, ''). overflow: the text
    of that token after the closer (BPE may merge a closer with what follows, e.g. '><')."""
    text = tokenizer.decode(segment_ids, skip_special_tokens=True)
    before = len(tokenizer.decode(segment_ids[:-1], skip_special_tokens=True))
    for closer in fmt.closers:
        end = text.rfind(closer) + len(closer)
        if end >= len(closer) and end > before:  # the closer ends inside the last token
            call = fmt.parse(text[:end])
            if call is not None:
                return call, text[end:]
    return None, ""


def load_object(item: str, what: str, kind: str = "function") -> Any:
    """`module:name` or `path/to/file.py:name` -> that callable (`what` names the flag in messages, e.g.
    "--tools entry 'x:y'", `kind` what it should be); ValueError saying what to write when it is not there."""
    import importlib.util
    from pathlib import Path

    module_name, _, name = item.strip().rpartition(":")
    if not module_name or not name:
        raise ValueError(f"{what}: write module:{kind} (or path/to/file.py:{kind})")
    if module_name.endswith(".py"):
        if not Path(module_name).is_file():
            raise ValueError(f"{what}: no file {module_name}")
        loaded = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        try:
            module = import_named_module(module_name)  # the current folder first
        except ImportError as error:
            raise ValueError(f"{what}: {import_problem(error, module_name)}") from None
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{what}: {module_name} has no {kind} {name}")  # noqa: TRY004 - a bad flag
    return getattr(module, name)


def load_tools(spec: str) -> list[Callable[..., Any]]:
    """`module:function,module:function` (or a bare `calculator`) -> the functions, for
    `forge train --tools`."""
    return [calculator if item == "calculator" else load_object(item, f"--tools entry {item!r}")
            for item in (part.strip() for part in spec.split(",") if part.strip())]


__all__ = [
    "CallFormat",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSettings",
    "as_tool",
    "as_tools",
    "calculator",
    "call_format",
    "closing_token_ids",
    "ended_call",
    "load_tools",
    "resolve_format",
    "run_calls",
    "template_supports_tools",
    "truncate_output",
]
