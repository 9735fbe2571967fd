"""A safe arithmetic evaluator: the ``calculator`` tool (never Python's ``eval``).

The expression is parsed with ``ast`` and only numbers, parentheses, unary +/- and the binary
operators + - * / // % ** are walked; names, calls, attributes, subscripts and everything else are
refused. Sizes are bounded before computing, so ``9**9**9`` or a 10,000-digit product is refused
instead of hanging the rollout loop. Results are real numbers: where Python would return a complex
number (``(-8) ** 0.5``) the calculator answers with an error.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 60  # operands and results past this many digits are refused
MAX_EXPONENT = 64

Number = int | float
_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or is too large; the message says which part."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression such as ``"(12 + 7) * 3 / 4"``."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    return _value(tree.body)


def format_number(value: Number) -> str:
    """Integers as integers; other values rounded to 10 significant digits (no exponent noise)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 10 ** MAX_DIGITS:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def _check_size(value: Number) -> Number:
    if isinstance(value, complex):  # Python's ``**`` of a negative base and a fractional exponent
        raise CalculatorError("a negative number to a fractional power has no real value")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) >= 10 ** MAX_DIGITS:
        raise CalculatorError(f"number with more than {MAX_DIGITS} digits")
    return value


def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _value(node.operand)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or
                                            abs(left) > 1 and abs(right) * math.log10(abs(left)) >= MAX_DIGITS):
            raise CalculatorError(f"power too large: {format_number(left)} ** {format_number(right)}")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, TypeError) as e:
            raise CalculatorError(str(e)) from None
    raise CalculatorError(f"'{ast.unparse(node)}' is not allowed (numbers and + - * / // % ** only)")
