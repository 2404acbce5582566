"""Synthetic multi-step arithmetic word problems with worked solutions (the embedded default task).

A problem follows one person's count of some item through a sequence of events ("finds 5",
"gives 7 to Ben", ...); each event adds or subtracts a number. The question numbers the events
``(1) ..., (2) ...``; the worked solution has one line per event,
``(<i>) <verb> <op><k>: <before> <op> <k> = <after>``, e.g. ``(2) gives -7: 84 - 7 = 77``, and ends
with ``Answer: N``. The partner of an exchange is left out (it does not change the count, and
copying names cost the tiny base most of its errors). The sign is written right after the verb
that decides it, so a model can learn verb -> sign as a one-token step; with the sign seven tokens
later (``gives 7: 84 - 7``, the first layout) the tiny base never learnt it and guessed the sign
from the running count (``benchmarks/base_errors.py``). The running count keeps
its digit count (10-99 up to difficulty 3), so every line has the same layout. Solution length
grows with the number of events, from about 20 to about 200 tokens with the tiny tokenizer (mean
~80 at difficulty 2), so that length-dependent parts of the algorithm (length-adaptive GAE,
token-level loss) have work to do. Difficulty 5 is the long-reasoning variant (``data=synthetic_long``):
1 to 40 events drawn log-uniformly (most problems short, a long tail), so solutions spread from
about 25 to about 650 tokens, far past the ~20-token horizon of GAE with lambda 0.95.

Events come in two kinds: *plain* events whose verb names the direction outright ("buys", "loses"),
and *exchange* events between two people ("gives 7 to Ben", "gets 7 from Ben", "lends", "borrows").
Half of all events are exchanges. The tiny base model is pre-trained on imperfect solutions that
flip the sign of exchange steps with some probability (:func:`imperfect_solution`), so its errors
sit at few, identifiable decision tokens that reinforcement learning can sharpen.

Train and held-out problems are disjoint for every seed: each problem's canonical form (start value,
verbs, operands; not the names or items) is hashed with a fixed salt, and the hash decides its
split. Sets are reproducible from ``(seed, difficulty, split)``.

Departures: none (this task is ours, not a paper's).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Literal

from .templates import apply_template

Split = Literal["train", "eval"]



def event_markers(max_steps: int = 20) -> tuple[str, ...]:
    """``(1)``..``(n)`` with n = max(20, ``max_steps``): the event numbers a tokenizer should keep
    whole for problems of up to ``max_steps`` events (20 for difficulties 1-4, so their bases'
    tokenizers are unchanged)."""
    return tuple(f"({i})" for i in range(1, max(20, max_steps) + 1))


EVENT_MARKERS = event_markers()
"""Event numbers as they appear in questions and solutions; the tiny base's tokenizer makes each
one a single token, so finding event i in the question is one-token induction (a 1,500-step trial,
teacher-forced: verb copied with p 0.93 and operand 0.997, against 0.51 / 0.11 with ``(``, digit,
``)``; the default base samples the right verb in 99% of lines but the right operand in only 68%,
failing mostly on late events of long questions)."""
EVAL_FRACTION_PERCENT = 10
"""Share of the canonical problem space routed to the held-out split (percent)."""
_SPLIT_SALT = "vapo_async.synthetic.v1"

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon", "Kim", "Leo")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "cards", "shells", "pencils")

# verb -> (sign, needs a partner, preposition); exchange verbs are the error-prone ones.
VERBS: dict[str, tuple[int, bool, str]] = {
    "buys": (+1, False, ""),
    "finds": (+1, False, ""),
    "wins": (+1, False, ""),
    "picks": (+1, False, ""),
    "loses": (-1, False, ""),
    "sells": (-1, False, ""),
    "drops": (-1, False, ""),
    "uses": (-1, False, ""),
    "gets": (+1, True, "from"),
    "borrows": (+1, True, "from"),
    "gives": (-1, True, "to"),
    "lends": (-1, True, "to"),
}
EXCHANGE_VERBS = tuple(v for v, (_, partner, _) in VERBS.items() if partner)
LONG_SHARE = 0.15
"""Share of problems drawn from the long range (difficulty 2: 6-12 events) in the task's sets."""
EXCHANGE_SHARE = 0.5
"""Probability that an event is an exchange (the kind imperfect solutions get wrong)."""


@dataclass(frozen=True)
class Step:
    """One event: ``verb`` ``k`` (to/from ``partner``) changes the running count by ``sign * k``."""

    verb: str
    k: int
    partner: str = ""

    @property
    def sign(self) -> int:
        """+1 for gains, -1 for losses."""
        return VERBS[self.verb][0]

    @property
    def is_exchange(self) -> bool:
        """Exchange steps (with a partner) are the ones imperfect solutions get wrong."""
        return VERBS[self.verb][1]

    def phrase(self) -> str:
        """The event as written in the solution line, e.g. ``gives 7 to Ben``."""
        if self.is_exchange:
            return f"{self.verb} {self.k} {VERBS[self.verb][2]} {self.partner}"
        return f"{self.verb} {self.k}"


@dataclass(frozen=True)
class SyntheticProblem:
    """A word problem, its integer answer and its clean worked solution."""

    question: str
    """Problem text (no instruction; the prompt template adds that)."""
    answer: int
    """Correct final count."""
    solution: str
    """Clean worked solution, one line per step, last line ``Answer: N``."""
    start: int = 0
    """Count before the first event."""
    steps: tuple[Step, ...] = ()
    """The events in order."""
    difficulty: int = 1
    """Difficulty the problem was drawn at."""


@dataclass(frozen=True)
class DifficultySpec:
    """What a difficulty level means: number of events and operand/value ranges."""

    max_steps: int
    """Most events in one problem (at least 1); short problems are more frequent than long."""
    max_k: int
    """Largest operand of one event."""
    min_value: int
    """Running count stays in [min_value, max_value] (same digit count: fixed layout per line)."""
    max_value: int
    """Upper end of the running count."""
    log_uniform_steps: bool = False
    """Draw the number of events log-uniformly from [1, max_steps] (P(n) ~ 1/n: a long tail)
    instead of the short/long split of ``LONG_SHARE`` (which then does not apply)."""


DIFFICULTIES: dict[int, DifficultySpec] = {
    1: DifficultySpec(max_steps=6, max_k=9, min_value=10, max_value=99),
    2: DifficultySpec(max_steps=12, max_k=9, min_value=10, max_value=99),
    3: DifficultySpec(max_steps=14, max_k=19, min_value=10, max_value=99),
    4: DifficultySpec(max_steps=16, max_k=49, min_value=100, max_value=999),
    # the long-reasoning variant: mean ~10 events (~180 solution tokens), median ~5, up to 40 (~650)
    5: DifficultySpec(max_steps=40, max_k=9, min_value=10, max_value=99, log_uniform_steps=True),
}


def difficulty_spec(difficulty: int) -> DifficultySpec:
    """The spec of ``difficulty``; raises on an unknown level."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty}")
    return DIFFICULTIES[difficulty]


def canonical_key(start: int, steps: tuple[Step, ...]) -> str:
    """Surface-free identity of a problem (names and items excluded) used for split routing."""
    return f"{start}|" + ";".join(f"{s.verb}{s.k}" for s in steps)


def split_of(start: int, steps: tuple[Step, ...]) -> Split:
    """Route a problem to ``train`` or ``eval`` by a salted hash of its canonical form."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}|{canonical_key(start, steps)}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 100 < EVAL_FRACTION_PERCENT else "train"


def _num_steps(
    rng: random.Random, spec: DifficultySpec, long_share: float = LONG_SHARE, event_tail: float = 1.0
) -> int:
    """Skewed towards short problems: ``1 - long_share`` from [1, 5/12 max], the rest from above
    that up to max (difficulty 2 at the default 0.15: 1-5 or 6-12 steps, mean ~3.9, i.e. ~80
    solution tokens). With ``spec.log_uniform_steps``: floor(x) for x drawn from the power law
    x^-event_tail on [1, max + 1). At ``event_tail`` 1 (the task's) that is floor(exp(u)) for u
    uniform in [0, ln(max + 1)), so P(n) = ln((n + 1) / n) / ln(max + 1) (max 40: P(1) = 0.19,
    P(>= 20) = 0.19); at 2, P(n) = (1/n - 1/(n + 1)) / (1 - 1/(max + 1)) (P(1) = 0.51,
    P(>= 20) = 0.026)."""
    max_steps = spec.max_steps
    if spec.log_uniform_steps:
        if event_tail == 1.0:
            return min(max_steps, int(math.exp(rng.uniform(0.0, math.log(max_steps + 1)))))
        # inverse CDF of x^-t on [1, M + 1): F(x) = (1 - x^(1-t)) / (1 - (M + 1)^(1-t))
        a = 1.0 - event_tail
        x = (1.0 - rng.random() * (1.0 - (max_steps + 1) ** a)) ** (1.0 / a)
        return min(max_steps, int(x))
    short = max(1, max_steps * 5 // 12)
    if short == max_steps or rng.random() < 1.0 - long_share:
        return rng.randint(1, short)
    return rng.randint(short + 1, max_steps)


def _draw_steps(
    rng: random.Random, start: int, n: int, spec: DifficultySpec, names: list[str]
) -> tuple[Step, ...]:
    """Draw ``n`` events whose correct running count stays within [min_value, max_value]."""
    steps: list[Step] = []
    value = start
    plain = [v for v in VERBS if v not in EXCHANGE_VERBS]
    while len(steps) < n:
        verb = rng.choice(EXCHANGE_VERBS if rng.random() < EXCHANGE_SHARE else plain)
        k = rng.randint(1, spec.max_k)
        new = value + VERBS[verb][0] * k
        if not spec.min_value <= new <= spec.max_value:
            continue
        partner = rng.choice(names) if VERBS[verb][1] else ""
        steps.append(Step(verb, k, partner))
        value = new
    return tuple(steps)


def _question(name: str, item: str, start: int, steps: tuple[Step, ...]) -> str:
    events = ", ".join(f"({i}) {s.phrase()}" for i, s in enumerate(steps, start=1))
    return f"{name} has {start} {item}. Then {name} {events}. How many {item} does {name} have now?"


def render_solution(start: int, steps: tuple[Step, ...], flips: frozenset[int] = frozenset()) -> str:
    """Worked solution; steps whose index is in ``flips`` use the wrong sign (error propagates)."""
    lines = [f"Start: {start}"]
    value = start
    for i, s in enumerate(steps):
        sign = -s.sign if i in flips else s.sign
        new = value + sign * s.k
        op = "+" if sign > 0 else "-"
        lines.append(f"({i + 1}) {s.verb} {op}{s.k}: {value} {op} {s.k} = {new}")
        value = new
    lines.append(f"Answer: {value}")
    return "\n".join(lines)


def solution_answer(start: int, steps: tuple[Step, ...], flips: frozenset[int] = frozenset()) -> int:
    """Final count of :func:`render_solution` with the same ``flips``."""
    value = start
    for i, s in enumerate(steps):
        value += (-s.sign if i in flips else s.sign) * s.k
    return value


def _draw_problem(
    rng: random.Random, spec: DifficultySpec, difficulty: int, long_share: float = LONG_SHARE,
    event_tail: float = 1.0,
) -> SyntheticProblem:
    name, *others = rng.sample(NAMES, 4)
    item = rng.choice(ITEMS)
    start = rng.randint(spec.min_value, spec.max_value)
    steps = _draw_steps(rng, start, _num_steps(rng, spec, long_share, event_tail), spec, others)
    return SyntheticProblem(
        question=_question(name, item, start, steps),
        answer=solution_answer(start, steps),
        solution=render_solution(start, steps),
        start=start,
        steps=steps,
        difficulty=difficulty,
    )


def make_problems(
    n: int, seed: int, difficulty: int = 2, split: Split = "train", long_share: float = LONG_SHARE,
    event_tail: float = 1.0,
) -> list[SyntheticProblem]:
    """``n`` distinct problems of ``split`` (disjoint from the other split), reproducible from
    ``seed``; ``long_share`` of them from the long range of event counts, or, at difficulties with
    log-uniform event counts, event counts from the power law of exponent ``event_tail`` (the
    task's sets use the defaults; the tiny base's pre-training may weight them otherwise)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    spec = difficulty_spec(difficulty)
    if not 0.0 <= event_tail <= 8.0:
        raise ValueError(f"event_tail must be in [0, 8], got {event_tail}")
    if event_tail != 1.0 and not spec.log_uniform_steps:
        raise ValueError(
            f"event_tail={event_tail} applies only to difficulties with log-uniform event counts "
            f"({sorted(d for d, s in DIFFICULTIES.items() if s.log_uniform_steps)}), not to {difficulty}"
        )
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{seed}|{difficulty}|{split}")
    seen: set[str] = set()
    out: list[SyntheticProblem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise RuntimeError(f"could not draw {n} distinct {split} problems at difficulty {difficulty}")
        p = _draw_problem(rng, spec, difficulty, long_share, event_tail)
        key = canonical_key(p.start, p.steps)
        if key in seen or split_of(p.start, p.steps) != split:
            continue
        seen.add(key)
        out.append(p)
    return out


def _flip_stays_in_range(problem: SyntheticProblem, i: int, value: int, sign: int) -> bool:
    """Whether writing step ``i`` with ``-sign`` from the running count ``value`` keeps the path it
    starts (later steps with their own signs) inside [min_value, max_value]."""
    spec = difficulty_spec(problem.difficulty)
    rest = value - sign * problem.steps[i].k
    if not spec.min_value <= rest <= spec.max_value:
        return False
    for later in problem.steps[i + 1 :]:
        rest += later.sign * later.k
        if not spec.min_value <= rest <= spec.max_value:
            return False
    return True


def imperfect_solution(problem: SyntheticProblem, rng: random.Random, error_rate: float) -> str:
    """A worked solution that flips the sign of each exchange step with probability ``error_rate``.

    A flip is skipped when the path it starts (later steps with their own signs) would leave
    [min_value, max_value], so wrong paths keep the layout of right ones.
    """
    flips: set[int] = set()
    value = problem.start
    for i, s in enumerate(problem.steps):
        sign = s.sign
        if s.is_exchange and rng.random() < error_rate and _flip_stays_in_range(problem, i, value, sign):
            sign = -sign
            flips.add(i)
        value += sign * s.k
    return render_solution(problem.start, problem.steps, frozenset(flips))


def single_error_solution(problem: SyntheticProblem, rng: random.Random, error_rate: float) -> str:
    """A worked solution that, with probability ``error_rate``, flips the sign of one exchange step
    drawn uniformly from those whose flip keeps the path in range (else it is right).

    Unlike :func:`imperfect_solution`, the chance that a solution is wrong does not grow with the
    number of events: a base trained on it is about as often right on long problems as on short ones.
    """
    if rng.random() >= error_rate:
        return problem.solution
    candidates, value = [], problem.start
    for i, s in enumerate(problem.steps):
        if s.is_exchange and _flip_stays_in_range(problem, i, value, s.sign):
            candidates.append(i)
        value += s.sign * s.k
    flips = frozenset([rng.choice(candidates)]) if candidates else frozenset()
    return render_solution(problem.start, problem.steps, flips)


def prompt_text(problem: SyntheticProblem, template: str = "answer_line") -> str:
    """The prompt the engine sees for ``problem``: ``template`` (see ``data.templates``) around it."""
    return apply_template(problem.question, template)
