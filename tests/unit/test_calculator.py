"""The calculator tool (tasks/tools/calculator.py): results, precedence, the output format, and every
refusal with the message the model sees."""
from __future__ import annotations

import re

import pytest

from laminar_hpc.tasks.tools.calculator import ToolError, calculate

HINT = "use numbers and + - * / // % ** ( )"


@pytest.mark.parametrize("expression,expected", [
    ("2 + 3", "5"), ("2 - 3", "-1"), ("6 * 7", "42"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 // 2", "-4"),
    ("7 % 3", "1"), ("7 % -3", "-2"), ("2 ** 10", "1024"), ("2 ** -1", "0.5"), ("+5", "5"), ("--5", "5"),
    ("1_000 * 2", "2000"), ("0x1f", "31"), ("1.5 * 4", "6"), ("0.1 + 0.2", "0.30000000000000004"),
    ("1e-7", "1e-07"), ("1e16", "1e+16"), ("-0.0", "0"), ("2.5 ** 2", "6.25"), ("  12  ", "12"),
    ("10 ** 59", "1" + "0" * 59), ("(-1) ** 10 ** 59", "1"), ("2 ** 0.5", "1.4142135623730951"),
])
def test_results(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression,expected", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("2 * 3 ** 2", "18"), ("-2 ** 2", "-4"), ("(-2) ** 2", "4"),
    ("2 ** 3 ** 2", "512"), ("(2 ** 3) ** 2", "64"), ("10 - 4 - 3", "3"), ("100 / 10 / 5", "2"),
    ("2 ** -2 ** 2", "0.0625"), ("1 + 2 * 3 - 4 / 2", "5"), ("((((7))))", "7"),
])
def test_operator_precedence_is_pythons(expression, expected):
    assert calculate(expression) == expected


def test_integral_floats_print_as_integers_only_while_exact():
    assert calculate("6 / 3") == "2" and calculate("-9 / 3") == "-3"
    assert calculate("2.0 ** 52") == "4503599627370496"  # below 2**53: every integer is exact
    assert calculate("2.0 ** 60") == "1.152921504606847e+18"  # above: repr, no invented digits


@pytest.mark.parametrize("expression,what", [
    ("x + 1", "name 'x'"), ("abs(-1)", "a function call"), ("__import__('os')", "a function call"),
    ("(1).real", "attribute access ('.real')"), ("'a' * 3", "a string"), ("b'a'", "a bytes literal"),
    ("True + 1", "a boolean"), ("1j", "a complex number"), ("None", "the constant None"),
    ("f'{1}'", "an f-string"), ("1 < 2", "a comparison or logical operator"),
    ("1 and 2", "a comparison or logical operator"), ("[1, 2]", "a list, tuple, set or dict (one expression only)"),
    ("1, 2", "a list, tuple, set or dict (one expression only)"), ("1 << 2", "operator '<<'"),
    ("1 & 2", "operator '&'"), ("~1", "operator '~'"), ("not 1", "operator 'not'"),
    ("1 if 1 else 2", "the syntax 'IfExp'"), ("lambda: 1", "the syntax 'Lambda'"),
])
def test_anything_but_arithmetic_is_refused_saying_what(expression, what):
    with pytest.raises(ToolError) as e:
        calculate(expression)
    assert str(e.value) == f"calculator: {what} is not allowed; {HINT}"


def test_caret_is_refused_with_a_pointer_to_the_power_operator():
    with pytest.raises(ToolError, match=r"^calculator: operator '\^' is not allowed; for powers use \*\*$"):
        calculate("2 ^ 3")


@pytest.mark.parametrize("expression", ["1 +", "(1", "x = 1", "1; 2", "import os", "1 2"])
def test_unparsable_text_is_refused(expression):
    with pytest.raises(ToolError, match=rf"^calculator: cannot parse .*; {re.escape(HINT)}$"):
        calculate(expression)


@pytest.mark.parametrize("expression", ["1 / 0", "1 // 0", "1 % 0", "1.0 / 0.0", "5 % 0.0", "0 ** -1"])
def test_division_by_zero(expression):
    with pytest.raises(ToolError, match=r"^calculator: division by zero$"):
        calculate(expression)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "2 ** 10 ** 50", "(10 ** 30) ** (10 ** 30)", "-7 ** 999999"])
def test_huge_powers_are_refused_before_they_are_computed(expression):
    # computing any of these would take minutes or exhaust memory: returning at all proves the
    # bound is checked first
    with pytest.raises(ToolError, match=r"^calculator: the result would have about \d+ digits; the limit is 60$"):
        calculate(expression)


def test_the_digit_bound_applies_to_every_integer():
    assert calculate("10 ** 59 - 1") == "9" * 59
    with pytest.raises(ToolError, match=r"^calculator: a number in the calculation has more than 60 digits"):
        calculate("10 ** 59 * 10")
    with pytest.raises(ToolError, match="more than 60 digits"):
        calculate("1" * 61 + " - " + "1" * 61)  # a literal too, even when the result would be small
    assert calculate("2 ** 100", max_result_digits=31) == str(2 ** 100)
    with pytest.raises(ToolError, match="more than 30 digits"):  # 31: the estimate lets it through, the value not
        calculate("2 ** 100", max_result_digits=30)


@pytest.mark.parametrize("expression", ["1.5 ** 10 ** 59", "2 ** 1e300", "1e308 * 10", "-1e308 - 1e308"])
def test_float_overflow_is_refused(expression):
    with pytest.raises(ToolError, match=r"^calculator: the result is too large for a float \(overflow\)$"):
        calculate(expression)


def test_complex_results_are_refused():
    with pytest.raises(ToolError, match="complex number"):
        calculate("(-8) ** (1 / 3)")


def test_expression_length_and_emptiness():
    calculate("1+" * 99 + "1")  # 199 characters
    with pytest.raises(ToolError, match=r"^calculator: the expression is 201 characters long; the limit is 200$"):
        calculate("1+" * 100 + "1")
    with pytest.raises(ToolError, match="the limit is 10$"):
        calculate("1 + 2 + 3 + 4", max_chars=10)
    for blank in ("", "   "):
        with pytest.raises(ToolError, match=r"^calculator: the expression is empty"):
            calculate(blank)
    with pytest.raises(ToolError, match="must be text"):
        calculate(12)  # type: ignore[arg-type]


def test_deep_nesting_is_refused_not_a_crash():
    with pytest.raises(ToolError, match="cannot parse"):
        calculate("(" * 199 + "1" + ")" * 0, max_chars=1000)
    with pytest.raises(ToolError):  # the parser's own nesting limit, reported as a ToolError
        calculate("(" * 400 + "1" + ")" * 400, max_chars=1000)
