"""The built-in calculator tool: arithmetic parsed with `ast`, never eval.

It imports nothing heavy, so a tool worker process (tool_isolation='process') that runs it starts fast."""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30  # bigger numbers (inputs, intermediate or final results) are refused


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64
                                             or (abs(left) > 1 and right * math.log10(abs(left)) > 30)):
            raise ValueError("power too large")
        value = _BINARY[type(node.op)](left, right)
    else:
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("number too large")
    return value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "745 * 48" or "(12 + 30) / 7"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()!r} as arithmetic") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".10g")


calculator.text_tag = "calc"  # the text protocol writes <calc>745 * 48</calc>

__all__ = ["MAX_EXPRESSION_CHARS", "MAX_MAGNITUDE", "calculator"]
