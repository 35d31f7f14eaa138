"""Built-in tools: ``calculator`` (safe arithmetic) and ``python`` (a program in the sandbox).

``calculator`` evaluates an arithmetic expression by walking its syntax tree: numbers, ``+ - * /
// % **``, parentheses and the functions ``abs round min max sqrt``; nothing else is evaluated
(no names, attributes, calls of other functions or comprehensions), and operands are bounded so
that ``9 ** 9 ** 9`` is refused instead of eating the CPU. Made for reasoning-gym's ``chain_sum``
style tasks ("8 - 2 + 13 =").

``python`` runs a program with ``libs.rewards.sandbox.run_python`` (wall time, CPU, memory and
process limits, no network) and returns what it printed.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300
MAX_INT_DIGITS = 400

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its numbers are out of bounds."""


def _check(x):
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise CalculatorError(f"not a number: {x!r}")
    if (isinstance(x, int) and abs(x) >= 10**MAX_INT_DIGITS) or (isinstance(x, float) and abs(x) > MAX_MAGNITUDE):
        raise CalculatorError("number too large")
    return x


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(b) > MAX_EXPONENT or (abs(a) > 1 and abs(b) * math.log10(abs(a)) > 300)
        ):
            raise CalculatorError("exponent too large")
        try:
            return _check(_BINARY[type(node.op)](a, b))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("number too large") from exc
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
        and node.args
    ):
        try:
            return _check(_FUNCTIONS[node.func.id](*[_eval(a) for a in node.args]))
        except (TypeError, ValueError) as exc:
            raise CalculatorError(f"{node.func.id}: {exc}") from exc
    raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError if it is not one or out of bounds."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().rstrip("="), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an expression: {exc.msg}") from exc
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value, e.g. "8 - 2 * (3 + 1)" gives "0".

    Args:
        expression: Numbers, + - * / // % **, parentheses and the functions abs, round, min, max, sqrt.
    """
    return str(evaluate(expression))


PYTHON_WALL_S = 5.0


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, a few seconds) and return what it printed.

    Args:
        code: The program; print the values you want to see.
    """
    from libs.rewards.sandbox import SandboxLimits, run_python

    res = run_python(code, limits=SandboxLimits(wall_s=PYTHON_WALL_S))
    if res.ok:
        return res.stdout
    return f"{res.status}: {(res.stderr or res.stdout)[-2000:]}"
