"""The calculator tool: safe arithmetic on numbers, parsed with `ast` and evaluated by a small
interpreter (never `eval`), so a model's tool call can compute but cannot run code.

    calculate("2 + 3 * 4")      # "14"
    calculate("7 / 2")          # "3.5"
    calculate("6 / 3")          # "2"   (an integral float prints without ".0", see below)
    calculate("2 ** -1")        # "0.5"
    calculate("x + 1")          # ToolError: calculator: name 'x' is not allowed; use numbers and ...
    calculate("9 ** 9 ** 9")    # ToolError: the result would have about 369693100 digits (refused at once)

Allowed: int and float literals (`1_000`, `0x1f`, `1e3` too), `+ - * / // % **`, unary `+ -`,
parentheses, with Python's precedence (`**` binds tighter than unary minus and groups to the
right: `-2 ** 2` is -4, `2 ** 3 ** 2` is 512). Everything else (names, calls, attributes,
strings, comparisons, `^`...) raises `ToolError` saying what is not allowed.

Bounds, so no expression can take long or print a huge number: at most `max_chars` characters,
and every integer along the way (literals too) has at most `max_result_digits` digits. A power
is checked *before* it is computed: its digit count is estimated from the logarithms, which is
why `9 ** 9 ** 9` is refused in microseconds. Floats keep their fixed size; one that overflows
(or turns inf/nan) is refused.

The result text: an int as its plain digits ("-12"); a float in Python's shortest round-trip form
(repr: "0.30000000000000004", "1e-07"), except that an integral float of magnitude below 2**53
(exactly representable) prints as an integer ("2", not "2.0"): the answer a model quotes then
matches an integer answer, and no precision is lost. Larger integral floats keep repr ("1e+20").
"""
from __future__ import annotations

import ast
import math
import operator

from laminar_hpc.tasks.tools.episode import ToolError  # the package's one class of a tool's refusal

_HINT = "use numbers and + - * / // % ** ( )"

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# operators Python parses that the calculator refuses, named as the user wrote them
_REFUSED_OPS = {
    ast.BitXor: "'^'", ast.BitAnd: "'&'", ast.BitOr: "'|'", ast.LShift: "'<<'",
    ast.RShift: "'>>'", ast.MatMult: "'@'", ast.Invert: "'~'", ast.Not: "'not'",
}
_EXACT_FLOAT_INT = 2 ** 53  # integral floats below this print as integers without losing digits


def _refuse(what: str) -> ToolError:
    hint = "for powers use **" if what == "operator '^'" else _HINT  # '^' is xor in Python, a power to people
    return ToolError(f"calculator: {what} is not allowed; {hint}")


def _describe(node: ast.AST) -> str:
    """What a refused node is, in the words of the expression."""
    if isinstance(node, ast.Name):
        return f"name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return f"attribute access ('.{node.attr}')"
    if isinstance(node, ast.Constant):
        kind = {str: "a string", bytes: "a bytes literal", bool: "a boolean", complex: "a complex number"}
        return kind.get(type(node.value), f"the constant {node.value!r}")
    if isinstance(node, ast.JoinedStr):
        return "an f-string"
    if isinstance(node, (ast.Compare, ast.BoolOp)):
        return "a comparison or logical operator"
    if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
        return "a list, tuple, set or dict (one expression only)"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in _REFUSED_OPS:
        return f"operator {_REFUSED_OPS[type(node.op)]}"
    return f"the syntax {type(node).__name__!r}"


class _Evaluator:
    def __init__(self, max_digits: int):
        self.max_digits = max_digits
        self.int_bound = 10 ** max_digits  # ints must stay below this in magnitude

    def check(self, value: int | float) -> int | float:
        if isinstance(value, complex):  # e.g. (-8) ** 0.5
            raise ToolError("calculator: the result is a complex number (a fractional power of a negative "
                            "number); only real results are supported")
        if isinstance(value, int) and abs(value) >= self.int_bound:
            raise ToolError(f"calculator: a number in the calculation has more than {self.max_digits} digits "
                            "(the limit)")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("calculator: the result is too large for a float (overflow)")
        return value

    def eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is refused
            return self.check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                self.check_power(left, right)
            try:
                return self.check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("calculator: division by zero") from None
            except OverflowError:
                raise ToolError("calculator: the result is too large for a float (overflow)") from None
        raise _refuse(_describe(node))

    def check_power(self, base: int | float, exp: int | float) -> None:
        """Refuse an integer power whose result would exceed the digit bound, before computing it
        (a float power is computed in constant time and overflows by itself)."""
        if not (isinstance(base, int) and isinstance(exp, int)) or exp <= 0 or abs(base) <= 1:
            return
        digits = exp * math.log10(abs(base))  # the result has floor(digits) + 1 digits
        # one digit of slack for the float estimate: `check` then bounds the computed value exactly
        if digits >= self.max_digits + 1:
            raise ToolError(f"calculator: the result would have about {int(digits) + 1} digits; the limit is "
                            f"{self.max_digits}")


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_FLOAT_INT:
        return str(int(value))  # "2" for 2.0; -0.0 -> "0"
    return repr(value)


def calculate(expression: str, *, max_chars: int = 200, max_result_digits: int = 60) -> str:
    """The value of an arithmetic expression as text; `ToolError` (a message for the model) when the
    expression is refused or cannot be computed within the bounds."""
    if not isinstance(expression, str):
        raise ToolError(f"calculator: the expression must be text, got {type(expression).__name__}")
    if len(expression) > max_chars:
        raise ToolError(f"calculator: the expression is {len(expression)} characters long; the limit is "
                        f"{max_chars}")
    if not expression.strip():
        raise ToolError(f"calculator: the expression is empty; {_HINT}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        detail = e.msg if isinstance(e, SyntaxError) else str(e) or type(e).__name__
        raise ToolError(f"calculator: cannot parse {expression.strip()!r}: {detail}; {_HINT}") from None
    return _format(_Evaluator(max_result_digits).eval(tree.body))


__all__ = ["ToolError", "calculate"]
