"""Tools the policy may call during rollouts: schemas, call formats and running the calls (calls.py), in
threads or worker processes (worker.py), each outcome as text (outcome.py), the built-in calculator
(calculator.py); a namespace sandbox for untrusted Python (sandbox.py, sandbox_init.py)."""

from forge.tools.calls import (
    CallFormat,
    Tool,
    ToolCall,
    ToolResult,
    ToolSettings,
    as_tool,
    as_tools,
    calculator,
    call_format,
    load_tools,
    resolve_format,
    run_calls,
    template_supports_tools,
    truncate_output,
)

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
    "load_tools",
    "resolve_format",
    "run_calls",
    "template_supports_tools",
    "truncate_output",
]
