"""Prompt templates: DAPO's for real models, a short answer-line template for the synthetic task.

Both ask for a final line ``Answer: ...``, so one reward path (``rewards.extract``) serves both.
``apply_template(problem)`` with the default template is also what the tiny-base builder
pre-trains on, so the base model has seen exactly the prompts it is later trained and evaluated on.

Departures: none; the DAPO text is quoted from PAPER.md ("DAPO-Math-17k format").
"""

from __future__ import annotations

from typing import Any

PROBLEM = "{problem}"

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""DAPO-Math-17k's prompt (PAPER.md)."""

ANSWER_LINE_TEMPLATE = '{problem}\nSolve it step by step and end with a line "Answer: N".\n'
"""The synthetic task's prompt: the same family as DAPO's, short enough for a tiny model."""

TEMPLATES: dict[str, str] = {
    "dapo": DAPO_TEMPLATE,
    "answer_line": ANSWER_LINE_TEMPLATE,
    "none": PROBLEM,
}


def resolve_template(template: str) -> str:
    """A template name (``dapo``, ``answer_line``, ``none``) or a text containing ``{problem}``."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if PROBLEM in template:
        return template
    raise ValueError(
        f"unknown prompt template {template!r}: use one of {sorted(TEMPLATES)} "
        "or a text containing '{problem}'"
    )


def apply_template(problem: str, template: str = "answer_line") -> str:
    """``problem`` inside ``template`` (plain substitution: braces in the problem are kept)."""
    return resolve_template(template).replace(PROBLEM, problem)


def strip_dapo_template(text: str) -> str:
    """The bare problem of a DAPO-Math-17k prompt (its rows already carry DAPO's template)."""
    head, tail = DAPO_TEMPLATE.split(PROBLEM)
    if text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail):
        return text[len(head) : len(text) - len(tail)]
    return text


def apply_chat_template(text: str, tokenizer: Any) -> str:
    """``text`` as one user turn rendered by the tokenizer's chat template, ready for generation."""
    if tokenizer is None:
        raise ValueError(
            "data.chat_template=True needs a tokenizer (load_prompts(..., tokenizer=tok))"
        )
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"data.chat_template=True but tokenizer {name!r} has no chat template")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str):
        raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, expected str")
    return rendered
