"""Prompt templates and chat templates (with a real tokenizer from the tiny model directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vapo_async.data.templates import (
    ANSWER_LINE_TEMPLATE,
    DAPO_TEMPLATE,
    apply_chat_template,
    apply_template,
    resolve_template,
    strip_dapo_template,
)
from vapo_async.rewards import RewardConfig, build_reward_fn


def test_dapo_template_is_papers_text() -> None:
    # PAPER.md, "DAPO-Math-17k format", with {problem} = "What is 1+1?"
    expected = (
        "Solve the following math problem step by step. The last line of your response "
        "should be of the form Answer: $Answer (without quotes) where $Answer is the answer to "
        "the problem.\n\n"
        'What is 1+1?\n\nRemember to put your answer on its own line after "Answer:".'
    )
    assert apply_template("What is 1+1?", "dapo") == expected


def test_answer_line_template_is_the_default_and_keeps_braces() -> None:
    problem = "Let f(x) = {x}. What is f(2)?"  # str.format would choke on the braces
    prompt = apply_template(problem)
    assert prompt == ANSWER_LINE_TEMPLATE.replace("{problem}", problem)
    assert prompt.startswith(problem) and '"Answer: N"' in prompt


def test_custom_and_unknown_templates() -> None:
    assert apply_template("2+2", "Q: {problem}\nA:") == "Q: 2+2\nA:"
    assert apply_template("2+2", "none") == "2+2"
    with pytest.raises(ValueError, match="unknown prompt template 'dapo2'"):
        resolve_template("dapo2")


def test_strip_dapo_template_round_trip() -> None:
    problem = "Find x if 2x = 6."
    assert strip_dapo_template(apply_template(problem, "dapo")) == problem
    assert strip_dapo_template(problem) == problem
    assert (
        strip_dapo_template(DAPO_TEMPLATE.split("{problem}")[0])
        == DAPO_TEMPLATE.split("{problem}")[0]
    )


def test_chat_template_with_a_real_tokenizer(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template("hi", tok)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert apply_chat_template("What is 2+3?", tok) == "<|user|>What is 2+3?\n<|assistant|>"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        apply_chat_template("hi", None)


def test_synthetic_solutions_score_correct_through_the_shared_reward_path() -> None:
    """The synthetic task's worked solutions end in the same `Answer:` line the reward reads."""
    synthetic = pytest.importorskip("vapo_async.data.synthetic")
    problems = synthetic.make_problems(200, seed=1, difficulty=2, split="eval")
    with build_reward_fn(RewardConfig()) as fn:
        scores = [fn(p.solution, str(p.answer), 50) for p in problems]
        wrong = [
            fn(p.solution + "\nAnswer: " + str(p.answer + 1), str(p.answer), 50) for p in problems
        ]
    assert all(s.correct and s.formatted for s in scores)
    assert not any(s.correct for s in wrong) and all(s.formatted for s in wrong)
