"""benchmarks/base_errors.py: the line classifier on hand-written responses."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import base_errors as E  # noqa: E402

from vapo_async.data.synthetic import Step, SyntheticProblem  # noqa: E402

# start 58; (1) drops 7 -> 51; (2) lends 5 to Eve -> 46
PROBLEM = SyntheticProblem(question="q", answer=46, solution="", start=58,
                           steps=(Step("drops", 7), Step("lends", 5, "Eve")))


def test_clean_solution_is_right_in_every_class() -> None:
    text = "Start: 58\n(1) drops -7: 58 - 7 = 51\n(2) lends -5: 51 - 5 = 46\nAnswer: 46"
    counts, flags = E.classify(text, PROBLEM)
    assert counts == {"lines": 2, **dict.fromkeys(E.LINE_KEYS, 2), "sign_right_plain": 1, "plain_lines": 1,
                      "sign_right_exchange": 1, "exchange_lines": 1}
    assert flags == {"one_line_per_event": True}


def test_each_kind_of_error_lands_in_its_class() -> None:
    # line 1 copies the wrong verb ("picks", a gain) and signs it consistently: 58 + 7 = 65 (verb
    # wrong, sign wrong for "drops" but right for "picks", arithmetic right);
    # line 2 copies "lends" but operand 4, starts from 65 (chained), writes 65 - 4 = 62 (wrong
    # arithmetic: 61); then an extra line for an event the problem does not have (not counted).
    text = "Start: 58\n(1) picks +7: 58 + 7 = 65\n(2) lends -4: 65 - 4 = 62\n(3) finds +2: 62 + 2 = 64\nAnswer: 64"
    counts, flags = E.classify(text, PROBLEM)
    assert counts == {"lines": 2, "verb_copied": 1, "operand_copied": 1, "sign_right_for_true_verb": 1,
                      "sign_right_for_written_verb": 2, "arithmetic_right": 1, "chained": 2,
                      "sign_right_plain": 0, "plain_lines": 1, "sign_right_exchange": 1, "exchange_lines": 1}
    assert flags == {"one_line_per_event": False}  # 3 lines for 2 events
