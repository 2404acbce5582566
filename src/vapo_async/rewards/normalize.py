"""Cheap answer normalisation and the exact fast path for plain numbers.

Most answers in this project are integers (the synthetic task, GSM8K, AIME, DAPO-Math-17k), and a
generator scores thousands of samples per minute, so numbers are compared here in the calling thread
(microseconds) and only other answers go to math-verify (see ``verify.py``).

The fast path mirrors math-verify 0.9's numeric rule (``grader.sympy_numeric_eq``): when either side
is written with a decimal point both are rounded to ``float_rounding`` (6) decimals and compared;
otherwise integers and fractions compare exactly. Departures (deliberate):
- ``1,000`` (groups of exactly three digits) and ``1{,}000`` are read as one thousand, and spaces
  inside a number are ignored (``1 000``); math-verify may read such strings as tuples.
- A short list of unit words after a number (``18 dollars``, ``5 cm``) and a leading dollar sign
  are dropped, as DAPO's / Minerva's ``normalize_final_answer`` does.
- Two answers whose normalised strings are identical are equal, even if math-verify cannot parse
  them.
- Rounding a tie at the 7th decimal uses Python's round-half-even; sympy's rule may differ there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

# Longest digit string the fast path converts (Python refuses int() of more than 4300 digits).
MAX_NUMBER_DIGITS = 1000

_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_COMMAND_WRAP = re.compile(r"^\\(?:boxed|fbox|text|textbf|mathrm|mathbf)\{(.*)\}$", re.DOTALL)
_SPACING = re.compile(r"\\[!,;: ]|\\quad|\\qquad")
_UNITS = re.compile(
    r"(?<=\d)\s*(?:\\text\{\s*)?(?:dollars?|cents?|degrees?|units?|cm|centimeters?|meters?|km|"
    r"kilometers?|inches|inch|feet|foot|ft|miles?|mph|hours?|minutes?|seconds?|days?|weeks?|"
    r"years?|pounds?|lbs?|kg|grams?)\.?(?:\s*\})?$",
    re.IGNORECASE,
)
_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SLASH = re.compile(r"^([+-]?)(\d+)/(\d+)$")
_LATEX_FRAC = re.compile(r"^([+-]?)\\[dt]?frac(?:\{([+-]?\d+)\}\{(\d+)\}|(\d)(\d))$")


@dataclass(frozen=True, slots=True)
class FastNumber:
    """A plain number read exactly."""

    value: Fraction
    """Exact value."""
    is_float: bool
    """Written with a decimal point (math-verify then compares after rounding)."""


def _unwrap_once(s: str) -> str:
    for left, right in _WRAPPERS:
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            inner = s[len(left) : len(s) - len(right)]
            if left not in inner and right not in inner:  # "$5$ and $6$" is not one wrapper
                return inner.strip()
    m = _COMMAND_WRAP.match(s)
    if m is not None and brace_depth(m.group(1)) >= 0:
        return m.group(1).strip()
    return s.rstrip(".").strip()


def clean_answer(s: str) -> str:
    """Strip math delimiters, ``\\boxed``/``\\text`` wrappers, spacing, units and a final period."""
    s = s.strip()
    for _ in range(4):  # a few layers: "$\\boxed{5}$." -> "5"
        unwrapped = _unwrap_once(s)
        if unwrapped == s:
            break
        s = unwrapped
    s = _SPACING.sub("", s).replace("{,}", ",").replace("\\$", "")
    if s.startswith("$") and "$" not in s[1:]:  # a dollar sign, not a math delimiter
        s = s[1:]
    s = _UNITS.sub("", s)
    return s.strip().rstrip(".").strip()


def brace_depth(s: str) -> int:
    """Deepest ``{`` nesting in ``s``; -1 when the braces do not balance."""
    depth = deepest = 0
    for c in s:
        if c == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif c == "}":
            depth -= 1
            if depth < 0:
                return -1
    return deepest if depth == 0 else -1


def parse_number(s: str) -> FastNumber | None:
    """Cleaned ``s`` as an integer, decimal, ``a/b`` or ``\\frac{a}{b}``; None otherwise."""
    s = "".join(s.split())
    if not s or sum(c.isdigit() for c in s) > MAX_NUMBER_DIGITS:
        return None
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _DECIMAL.match(s):
        return FastNumber(Fraction(s), "." in s)
    m = _SLASH.match(s) or _LATEX_FRAC.match(s)
    if m is None:
        return None
    sign, num, den = m.group(1), m.group(2), m.group(3)
    if num is None:  # \frac12
        num, den = m.group(4), m.group(5)
    if int(den) == 0:
        return None
    value = Fraction(int(num), int(den))
    return FastNumber(-value if sign == "-" else value, False)


def numbers_equal(a: FastNumber, b: FastNumber, float_rounding: int = 6) -> bool:
    """math-verify's numeric equality on plain numbers (rounded when either is a decimal)."""
    if a.is_float or b.is_float:
        return round(a.value, float_rounding) == round(b.value, float_rounding)
    return a.value == b.value
