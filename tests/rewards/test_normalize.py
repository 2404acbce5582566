"""The in-thread fast path: cleaning, exact numbers, and parity with math-verify's numeric rule."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vapo_async.rewards.normalize import (
    FastNumber,
    brace_depth,
    clean_answer,
    numbers_equal,
    parse_number,
)


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("$5$", "5"),
        ("\\(5\\)", "5"),
        ("$\\boxed{5}$.", "5"),
        ("\\text{5 dollars}", "5"),
        ("18 dollars", "18"),
        ("$18", "18"),
        ("\\$18.00", "18.00"),
        ("1{,}000", "1,000"),
        ("1\\,000", "1000"),
        ("5 cm.", "5"),
        ("2m", "2m"),  # single-letter "units" may be variables: kept
        ("$5$ and $6$", "$5$ and $6$"),  # two formulas are not one wrapper
        ("\\boxed{1}+\\boxed{2}", "\\boxed{1}+\\boxed{2}"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
    ],
)
def test_clean_answer(raw: str, clean: str) -> None:
    assert clean_answer(raw) == clean


@pytest.mark.parametrize(
    ("text", "value", "is_float"),
    [
        ("42", Fraction(42), False),
        ("-7", Fraction(-7), False),
        ("+3", Fraction(3), False),
        ("0.5", Fraction(1, 2), True),
        (".25", Fraction(1, 4), True),
        ("10.", Fraction(10), True),
        ("1,000", Fraction(1000), False),
        ("1,234,567.5", Fraction(2469135, 2), True),
        ("- 3", Fraction(-3), False),
        ("3/4", Fraction(3, 4), False),
        ("-3/4", Fraction(-3, 4), False),
        ("\\frac{3}{4}", Fraction(3, 4), False),
        ("\\dfrac{-1}{2}", Fraction(-1, 2), False),
        ("-\\tfrac{1}{2}", Fraction(-1, 2), False),
        ("\\frac12", Fraction(1, 2), False),
    ],
)
def test_parse_number(text: str, value: Fraction, is_float: bool) -> None:
    assert parse_number(text) == FastNumber(value, is_float)


@pytest.mark.parametrize(
    "text", ["1,00", "1,2", "x", "3/0", "\\frac{1}{0}", "1e5", "50\\%", "", "9" * 1001]
)
def test_parse_number_declines(text: str) -> None:
    assert parse_number(text) is None


def test_brace_depth() -> None:
    assert brace_depth("a") == 0
    assert brace_depth("\\frac{\\sqrt{2}}{2}") == 2
    assert brace_depth("{}{}{{}}") == 2
    assert brace_depth("}{") == -1
    assert brace_depth("{{") == -1


NUMERIC_PAIRS = [
    ("1/3", "0.333333"),  # math-verify rounds to 6 decimals when one side is a decimal
    ("1/3", "0.3333"),
    ("1/3", "0.3333333"),
    ("18", "18.0"),
    ("18", "18.5"),
    ("\\frac{1}{2}", "0.5"),
    ("1/2", "2/4"),
    ("7", "8"),
    ("-2", "2"),
    ("0.1", "0.10000001"),
    ("0.1", "0.1000005"),
    ("3/7", "\\frac{3}{7}"),
    ("3/7", "0.428571"),
]


@pytest.mark.parametrize(("gold", "pred"), NUMERIC_PAIRS)
def test_fast_path_agrees_with_math_verify(gold: str, pred: str) -> None:
    """Parity with the reference: math-verify itself, run here in the main thread."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def mv(s: str) -> list:
        return parse(f"${s}$", extraction_config=config, parsing_timeout=None)

    reference = verify(mv(gold), mv(pred), timeout_seconds=None)
    ours = numbers_equal(parse_number(gold), parse_number(pred))
    assert ours == reference, f"{gold!r} vs {pred!r}: fast path {ours}, math-verify {reference}"
