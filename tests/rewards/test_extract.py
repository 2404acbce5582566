"""Answer extraction: DAPO's `Answer:` line, last `\\boxed{}` with nesting, GSM8K `####`."""

from __future__ import annotations

import time

import pytest

from vapo_async.rewards.extract import (
    ANSWER_LINE,
    BOXED,
    GSM8K,
    answer_line,
    extract_answer,
    gsm8k_answer,
    last_boxed,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2 + 3 = 5.\nAnswer: 5", "5"),
        ("Answer: 4\nno wait\nAnswer: 7", "7"),  # the last match
        ("answer:   12  ", "12"),  # DAPO's (?i) and stripping
        ("ANSWER : -3", "-3"),
        ("Answer:\n9", "9"),  # DAPO's \s* after the colon crosses the newline
        ("The final answer: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
        ("Answer:", None),
        ("Answer:   ", None),
        ("no marker here", None),
    ],
)
def test_answer_line(text: str, expected: str | None) -> None:
    got = answer_line(text)
    assert (got.answer if got else None) == expected


def test_answer_line_reads_only_the_last_300_characters() -> None:
    # DAPO's grader reads solution_str[-300:]: a marker 301+ characters before the end is invisible.
    text = "Answer: 3\n" + "x" * 300
    assert answer_line(text) is None
    assert answer_line(text, tail_chars=400).answer == "3"
    # the marker must lie inside the window; a match starting at len - 300 is found
    text = "Answer: 8" + "y" * 291  # 300 characters in all
    assert answer_line(text).answer == "8" + "y" * 291


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        ("\\boxed{ 7 }", "7"),
        ("\\fbox{8}", "8"),
        ("\\boxed 5$.", "5"),  # verl accepts "\boxed 5"
        ("\\boxed{5", None),  # unbalanced: unformatted
        ("\\boxed{}", None),
        ("\\boxed", None),
        ("\\boxedx", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    got = last_boxed(text)
    assert (got.answer if got else None) == expected
    if got is not None:
        assert got.kind == BOXED and not got.too_long


def test_boxed_longer_than_cap_is_too_long_not_scanned_to_the_end() -> None:
    got = last_boxed("\\boxed{" + "1" * 600 + "}", max_chars=512)
    assert got is not None and got.too_long and got.answer == ""
    # exactly at the cap still extracts
    assert last_boxed("\\boxed{" + "1" * 512 + "}", max_chars=512).answer == "1" * 512


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $18.\n#### 18", "18"),
        ("#### 1,000\nextra text", "1,000"),
        ("#### 3\n#### 4", "4"),
        ("####", None),
        ("no hashes", None),
    ],
)
def test_gsm8k(text: str, expected: str | None) -> None:
    got = gsm8k_answer(text)
    assert (got.answer if got else None) == expected


def test_the_marker_starting_last_wins() -> None:
    assert extract_answer("\\boxed{5}\nAnswer: 6").answer == "6"
    assert extract_answer("Answer: 6\nactually \\boxed{7}").kind == BOXED
    # "Answer: \boxed{5}": the box starts after the Answer marker, its content is the answer
    got = extract_answer("Answer: $\\boxed{5}$")
    assert (got.answer, got.kind) == ("5", BOXED)
    assert extract_answer("#### 3\nAnswer: 4").kind == ANSWER_LINE
    assert extract_answer("Answer: 4\n#### 3").kind == GSM8K


def test_formats_restrict_markers() -> None:
    assert extract_answer("\\boxed{5}", formats=(ANSWER_LINE,)) is None
    assert extract_answer("\\boxed{5}\nAnswer: 6", formats=(BOXED,)).answer == "5"
    with pytest.raises(ValueError, match="unknown answer formats \\['latex'\\]"):
        extract_answer("x", formats=("latex",))


def test_one_megabyte_response_is_linear_time() -> None:
    big = "{" * 500_000 + "\\boxed{" * 10 + "x" * 500_000
    t0 = time.perf_counter()
    for text in (big, big + "\nAnswer: 5", "\\boxed{" + "{" * 1_000_000):
        extract_answer(text)
    elapsed = time.perf_counter() - t0
    assert extract_answer(big + "\nAnswer: 5").answer == "5"
    assert extract_answer("\\boxed{" + "{" * 1_000_000).too_long
    assert elapsed < 0.5, f"extraction of 3 MB took {elapsed:.3f} s"
