"""Final-answer extraction from a model response: `Answer:` line, `\\boxed{...}`, GSM8K `#### N`.

Every function here runs in time linear in the response length with small constants (``str.rfind``
and one bounded regex over the tail), so a 1 MB response costs about a millisecond.

Departures from the reference graders (deliberate):
- DAPO reads only the last 300 characters and takes the last ``Answer:`` match
  (``(?i)Answer\\s*:\\s*([^\\n]+)``); we do the same, but also accept ``\\boxed{}`` and ``#### N``
  and, when several markers are present, take the one that starts last in the response.
- A ``\\boxed{`` whose closing brace is not found within ``max_chars`` characters is reported as
  ``too_long`` (formatted but never correct) instead of being scanned to the end of the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSWER_LINE = "answer_line"
BOXED = "boxed"
GSM8K = "gsm8k"
ALL_FORMATS = (ANSWER_LINE, BOXED, GSM8K)

# DAPO's pattern (see PAPER.md, "DAPO-Math-17k format"): \s* after the colon may cross a newline.
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass(frozen=True, slots=True)
class Extraction:
    """The final answer found in a response."""

    answer: str
    """Extracted answer text, stripped (empty when ``too_long``)."""
    kind: str
    """Which marker produced it: ``answer_line``, ``boxed`` or ``gsm8k``."""
    start: int
    """Character offset of the marker in the response (the latest marker wins)."""
    too_long: bool = False
    """The answer exceeded ``max_chars``; it is formatted but scored as wrong."""


def answer_line(text: str, tail_chars: int = 300) -> Extraction | None:
    """Last ``Answer: ...`` match within the last ``tail_chars`` characters (DAPO's grader)."""
    offset = max(0, len(text) - tail_chars)
    last = None
    for last in _ANSWER_RE.finditer(text, offset):  # noqa: B007 - only the last match is used
        pass
    if last is None:
        return None
    answer = last.group(1).strip()
    if not answer:
        return None
    return Extraction(answer=answer, kind=ANSWER_LINE, start=last.start())


def _match_brace(text: str, open_pos: int, max_chars: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``.

    -1 when it lies beyond ``max_chars`` characters; None when the text ends first (unbalanced).
    """
    depth = 0
    stop = min(len(text), open_pos + max_chars + 2)
    for i in range(open_pos, stop):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1 if stop < len(text) else None


def last_boxed(text: str, max_chars: int = 512) -> Extraction | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included.

    ``\\boxed 5`` (a single token after a space) is accepted too, as in verl's grader.
    """
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    pos = start + len(command)
    if pos < len(text) and text[pos] == "{":
        end = _match_brace(text, pos, max_chars)
        if end is None:
            return None
        if end < 0:
            return Extraction(answer="", kind=BOXED, start=start, too_long=True)
        answer = text[pos + 1 : end].strip()
    elif pos < len(text) and text[pos] == " ":
        token = text[pos + 1 : pos + 2 + max_chars].split(maxsplit=1)
        answer = token[0].rstrip("$.") if token else ""
        if len(answer) > max_chars:
            return Extraction(answer="", kind=BOXED, start=start, too_long=True)
    else:
        return None
    if not answer:
        return None
    return Extraction(answer=answer, kind=BOXED, start=start)


def gsm8k_answer(text: str, max_chars: int = 512) -> Extraction | None:
    """Rest of the line after the last ``####`` (GSM8K's reference solutions end ``#### N``)."""
    start = text.rfind("####")
    if start < 0:
        return None
    line_end = text.find("\n", start, start + 4 + max_chars + 1)
    if line_end < 0:
        line_end = len(text)
    if line_end - (start + 4) > max_chars:
        return Extraction(answer="", kind=GSM8K, start=start, too_long=True)
    answer = text[start + 4 : line_end].strip()
    if not answer:
        return None
    return Extraction(answer=answer, kind=GSM8K, start=start)


def extract_answer(
    text: str,
    formats: tuple[str, ...] | list[str] = ALL_FORMATS,
    tail_chars: int = 300,
    max_chars: int = 512,
) -> Extraction | None:
    """The final answer of ``text`` under the accepted ``formats``; the marker starting last wins.

    Returns None when no accepted marker holds a non-empty answer (the response is unformatted).
    """
    unknown = set(formats) - set(ALL_FORMATS)
    if unknown:
        raise ValueError(
            f"unknown answer formats {sorted(unknown)}; expected a subset of {ALL_FORMATS}"
        )
    found: list[Extraction] = []
    if ANSWER_LINE in formats and (e := answer_line(text, tail_chars)) is not None:
        found.append(e)
    if BOXED in formats and (e := last_boxed(text, max_chars)) is not None:
        found.append(e)
    if GSM8K in formats and (e := gsm8k_answer(text, max_chars)) is not None:
        found.append(e)
    if not found:
        return None
    return max(found, key=lambda e: e.start)
