"""Tools the policy may call during rollouts: schemas, call formats, isolated execution (calls.py); a Python
sandbox (sandbox.py)."""

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

__all__ = ["CallFormat", "Tool", "ToolCall", "ToolResult", "ToolSettings", "as_tool", "as_tools", "calculator",
           "call_format", "load_tools", "resolve_format", "run_calls", "template_supports_tools", "truncate_output"]
