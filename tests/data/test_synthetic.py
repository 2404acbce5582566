"""The synthetic task: determinism, disjoint splits, length spread, correct clean solutions."""

from __future__ import annotations

import random
import re
import statistics

import pytest

from vapo_async.data import synthetic
from vapo_async.data.hf_dir import train_tokenizer
from vapo_async.data.synthetic import (
    DIFFICULTIES,
    VERBS,
    canonical_key,
    imperfect_solution,
    make_problems,
    prompt_text,
    single_error_solution,
    split_of,
)

LINE = re.compile(r"^\((?P<i>\d+)\) (?P<verb>[a-z]+) (?P<s>[+-])(?P<k>\d+): "
                  r"(?P<a>-?\d+) (?P<op>[+-]) (?P<b>\d+) = (?P<c>-?\d+)$")


def parse_solution(solution: str) -> tuple[int, list[dict[str, str]], int]:
    """(start, step lines as regex groups, answer) of a worked solution; asserts its layout."""
    lines = solution.split("\n")
    start = re.fullmatch(r"Start: (\d+)", lines[0])
    answer = re.fullmatch(r"Answer: (-?\d+)", lines[-1])
    assert start and answer, solution
    steps = []
    for i, line in enumerate(lines[1:-1], start=1):
        m = LINE.match(line)
        assert m and int(m.group("i")) == i, f"bad step line {line!r}"
        steps.append(m.groupdict())
    return int(start.group(1)), steps, int(answer.group(1))


def check_arithmetic(solution: str) -> tuple[int, list[dict[str, str]], int]:
    """Every step line is true arithmetic chained on the previous result; Answer = last result."""
    start, steps, answer = parse_solution(solution)
    value = start
    for s in steps:
        a, b, c = int(s["a"]), int(s["b"]), int(s["c"])
        assert a == value, f"step starts from {a}, previous result was {value}"
        assert b == int(s["k"]), "operand differs from the event's number"
        assert s["s"] == s["op"], "the sign after the verb is the sign of the line's arithmetic"
        assert c == (a + b if s["op"] == "+" else a - b), f"wrong arithmetic in {s}"
        value = c
    assert answer == value
    return start, steps, answer


def test_same_seed_same_problems_other_seed_other_problems() -> None:
    a = make_problems(40, seed=3, difficulty=2, split="train")
    b = make_problems(40, seed=3, difficulty=2, split="train")
    c = make_problems(40, seed=4, difficulty=2, split="train")
    assert a == b
    assert sum(x.question == y.question for x, y in zip(a, c, strict=True)) <= 2


def test_splits_are_disjoint_for_every_seed_and_routed_by_hash() -> None:
    train = {canonical_key(p.start, p.steps) for p in make_problems(3000, seed=0, split="train")}
    for seed in (0, 1):
        held = make_problems(400, seed=seed, split="eval")
        keys = {canonical_key(p.start, p.steps) for p in held}
        assert len(keys) == 400, "held-out problems repeat"
        assert not keys & train
        assert all(split_of(p.start, p.steps) == "eval" for p in held)
    # The route does not depend on names or items: the same events always land in the same split.
    p = make_problems(1, seed=0, split="eval")[0]
    assert split_of(p.start, p.steps) == "eval"


def test_clean_solutions_are_correct_step_by_step() -> None:
    for difficulty in DIFFICULTIES:
        for p in make_problems(300, seed=7, difficulty=difficulty, split="eval"):
            start, steps, answer = check_arithmetic(p.solution)
            assert answer == p.answer and start == p.start
            assert [s["verb"] for s in steps] == [s.verb for s in p.steps]
            # Each line's sign is the verb's meaning.
            assert all((s["op"] == "+") == (VERBS[s["verb"]][0] > 0) for s in steps)
            spec = DIFFICULTIES[difficulty]
            assert 1 <= len(steps) <= spec.max_steps
            assert all(spec.min_value <= int(s["c"]) <= spec.max_value and int(s["k"]) <= spec.max_k for s in steps)
            at = 0
            for i, s in enumerate(p.steps, start=1):  # the question states every event, in order
                at = p.question.index(f" ({i}) {s.phrase()}", at) + 1


def test_imperfect_solutions_flip_exchange_signs_and_propagate() -> None:
    problems = make_problems(400, seed=1, split="train")
    rng = random.Random(0)
    flipped = wrong = 0
    for p in problems:
        assert imperfect_solution(p, rng, 0.0) == p.solution
        text = imperfect_solution(p, rng, 1.0)
        _, steps, answer = check_arithmetic(text)  # the arithmetic stays right, only signs flip
        assert all(10 <= int(s["c"]) <= 99 for s in steps), "wrong paths keep two-digit values"
        for s, line in zip(p.steps, steps, strict=True):
            sign = 1 if line["op"] == "+" else -1
            if not s.is_exchange:
                assert sign == s.sign, "plain steps are never wrong"
            flipped += sign != s.sign
        wrong += answer != p.answer
    assert flipped > 300 and wrong > 150  # error_rate 1.0 flips (almost) every exchange step


def test_single_error_solutions_hold_at_most_one_flip_whatever_the_length() -> None:
    problems = make_problems(400, seed=1, split="train")
    rng = random.Random(0)
    wrong_by_length: dict[bool, list[bool]] = {False: [], True: []}
    for p in problems:
        assert single_error_solution(p, rng, 0.0) == p.solution
        _, steps, answer = check_arithmetic(single_error_solution(p, rng, 1.0))
        flips = [i for i, (s, line) in enumerate(zip(p.steps, steps, strict=True))
                 if (1 if line["op"] == "+" else -1) != s.sign]
        assert len(flips) <= 1 and all(p.steps[i].is_exchange for i in flips)
        # one flip of an operand k moves the answer by 2k != 0, so a flipped solution is always wrong
        assert (answer != p.answer) == (len(flips) == 1)
        if any(s.is_exchange for s in p.steps):  # then a flip that stays in range almost always exists
            wrong_by_length[len(p.steps) >= 6].append(answer != p.answer)
    assert sum(wrong_by_length[True]) / len(wrong_by_length[True]) > 0.9
    assert sum(wrong_by_length[False]) / len(wrong_by_length[False]) > 0.9
    # at error_rate 0.5 about half the solutions are wrong, short and long alike: 400 draws,
    # binomial s.d. sqrt(400 * 0.25) = 10, so 200 +- 40 is a 4-sigma band
    wrong = sum(check_arithmetic(single_error_solution(p, rng, 0.5))[2] != p.answer for p in problems)
    assert 160 <= wrong <= 240


def test_solution_lengths_spread_from_short_to_long() -> None:
    problems = make_problems(1000, seed=0, split="eval")
    tok = train_tokenizer([prompt_text(p) + p.solution for p in problems[:300]], 512, split_digits=True)
    lengths = [len(tok(p.solution)["input_ids"]) for p in problems]
    assert min(lengths) <= 30 and max(lengths) >= 180, (min(lengths), max(lengths))
    assert 40 <= statistics.mean(lengths) <= 100
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]  # digits are single tokens


def test_long_variant_draws_event_counts_log_uniformly_and_spreads_lengths_tenfold() -> None:
    """Difficulty 5 (data=synthetic_long): P(n) = ln((n+1)/n) / ln 41 for n in 1..40, so
    P(1) = ln 2 / ln 41 = 0.693 / 3.714 = 0.187, P(n >= 20) = ln(41/20) / ln 41 = 0.718 / 3.714 = 0.193,
    mean = sum n P(n) = (40 ln 41 - ln 40!) / ln 41 = (148.5 - 110.3) / 3.714 = 10.3 events."""
    problems = make_problems(4000, seed=0, difficulty=5, split="train")
    counts = [len(p.steps) for p in problems]
    assert abs(counts.count(1) / 4000 - 0.187) < 0.02  # 4000 draws: s.e. 0.006
    assert abs(sum(n >= 20 for n in counts) / 4000 - 0.193) < 0.02
    assert abs(statistics.mean(counts) - 10.3) < 0.6  # s.e. of the mean: ~0.15
    assert max(counts) == 40
    markers = synthetic.event_markers(DIFFICULTIES[5].max_steps)
    assert len(markers) == 40 and markers[:20] == synthetic.EVENT_MARKERS == synthetic.event_markers(12)
    tok = train_tokenizer([prompt_text(p) + p.solution for p in problems[:300]], 512, split_digits=True,
                          added_tokens=markers)
    lengths = [len(tok(p.solution)["input_ids"]) for p in problems]
    assert min(lengths) <= 30 and max(lengths) >= 600, (min(lengths), max(lengths))
    assert max(lengths) >= 20 * min(lengths)  # the >= 10x spread the long task is for


def test_event_tail_reweights_long_variant_event_counts_by_the_power_law() -> None:
    """``event_tail`` t draws floor(x), x ~ x^-t on [1, 41). At t = 2 the density is 41/40 x^-2, so
    P(n) = 41/40 (1/n - 1/(n+1)): P(1) = 41/40 * 1/2 = 0.5125, P(n >= 20) = 41/40 (1/20 - 1/41)
    = 1.025 * 0.02561 = 0.0263, mean = 41/40 sum_{n=1..40} 1/(n+1) = 1.025 (H_41 - 1)
    = 1.025 * 3.3007 = 3.383 events (the task's t = 1: 10.3)."""
    spec = DIFFICULTIES[5]
    rng = random.Random(7)
    draws = [synthetic._num_steps(rng, spec, event_tail=2.0) for _ in range(40_000)]
    assert abs(draws.count(1) / 40_000 - 0.5125) < 0.01  # s.e. 0.0025
    assert abs(sum(n >= 20 for n in draws) / 40_000 - 0.0263) < 0.004  # s.e. 0.0008
    assert abs(statistics.mean(draws) - 3.383) < 0.1  # s.d. ~5.6 -> s.e. 0.03
    assert 1 <= min(draws) and max(draws) == 40
    # t = 1 is the task's own distribution: the same draws as without the argument
    a, b = random.Random(3), random.Random(3)
    assert [synthetic._num_steps(a, spec) for _ in range(500)] == [
        synthetic._num_steps(b, spec, event_tail=1.0) for _ in range(500)]
    assert make_problems(50, seed=3, difficulty=5) == make_problems(50, seed=3, difficulty=5, event_tail=1.0)
    # distinct problems: fewer short ones than the draw (1-event duplicates are skipped) but far
    # fewer long ones than the task's 19%
    counts = [len(p.steps) for p in make_problems(2000, seed=0, difficulty=5, event_tail=2.0)]
    assert sum(n >= 20 for n in counts) / 2000 < 0.06 and counts.count(1) / 2000 > 0.4


def test_difficulty_knob_raises_steps_and_operands() -> None:
    easy = make_problems(500, seed=0, difficulty=1, split="train")
    hard = make_problems(500, seed=0, difficulty=4, split="train")
    assert statistics.mean(len(p.steps) for p in hard) > statistics.mean(len(p.steps) for p in easy) + 2
    assert max(s.k for p in hard for s in p.steps) > 9 >= max(s.k for p in easy for s in p.steps)


def test_prompt_text_holds_question_and_answer_instruction() -> None:
    p = make_problems(1, seed=0, split="eval")[0]
    text = prompt_text(p)
    assert text.startswith(p.question) and "Answer:" in text[len(p.question):]


def test_long_share_sets_the_share_of_long_problems() -> None:
    # difficulty 2: max 12 steps, the short range is [1, 12 * 5 // 12] = [1, 5], the long one [6, 12]
    assert all(len(p.steps) >= 6 for p in make_problems(200, seed=0, long_share=1.0))
    assert all(len(p.steps) <= 5 for p in make_problems(200, seed=0, long_share=0.0))
    half = make_problems(2000, seed=0, long_share=0.5)
    share = sum(len(p.steps) >= 6 for p in half) / len(half)
    assert 0.45 < share < 0.55, share  # binomial s.d. sqrt(0.25 / 2000) = 0.011
    # the default is the task's share (15%): the same problems with and without the argument
    assert make_problems(50, seed=3) == make_problems(50, seed=3, long_share=0.15)


@pytest.mark.parametrize(
    ("bad", "message"),
    [({"difficulty": 9}, "difficulty"), ({"split": "test"}, "split"), ({"n": -1}, "n must"),
     ({"long_share": 1.5}, "long_share"), ({"long_share": -0.1}, "long_share"),
     ({"event_tail": 2.0}, "event_tail=2.0 applies only to .*log-uniform.*not to 2"),
     ({"difficulty": 5, "event_tail": -1.0}, "event_tail must be in")],
)
def test_bad_arguments_fail_loudly(bad: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"n": 3, "seed": 0, "difficulty": 2, "split": "train", **bad}
    with pytest.raises(ValueError, match=message):
        make_problems(**args)  # type: ignore[arg-type]


def test_module_exports_problem_dataclass_fields() -> None:
    p = synthetic.make_problems(1, 0)[0]
    assert isinstance(p.question, str) and isinstance(p.answer, int) and p.solution.endswith(f"Answer: {p.answer}")
