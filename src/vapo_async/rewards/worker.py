"""math-verify worker process: JSON lines on stdin/stdout, killed by its parent on timeout.

Started by ``verify.VerifyPool`` as
``python -m vapo_async.rewards.worker --memory-mb N --cpu-s-per-request S``.
Protocol (one JSON object per line, UTF-8):
- worker -> parent, once after start-up: ``{"ready": true}``
- parent -> worker: ``{"id": int, "gold": str, "pred": str}``
- worker -> parent: ``{"id": int, "equal": bool}`` or ``{"id": int, "error": str}``

math-verify's own timeouts are disabled (they use SIGALRM, which only works in a main thread and
cannot interrupt C code); the parent enforces the time limit by killing this process. An address
space limit (``RLIMIT_AS``) turns memory bombs such as ``10^{10^{10}}`` into a fast MemoryError.
The worker ignores SIGINT (Ctrl-C reaches the parent, which closes it) and exits when its stdin
closes or its parent disappears. A parent killed while a check is stuck (e.g. in a C-level bignum
loop that holds the GIL, so the orphan watchdog thread cannot run) is covered by ``RLIMIT_CPU``:
before each check the soft CPU limit is set ``cpu_s_per_request`` seconds past the CPU used so far,
and the kernel ends the process with SIGXCPU when it is exceeded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, TextIO

GOLD_CACHE_SIZE = 1024


def _exit_when_orphaned(parent_pid: int) -> None:
    """Leave when the parent dies (stdin EOF is not seen while stuck inside sympy)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _limit_cpu(cpu_s: int) -> None:
    """Allow this check ``cpu_s`` more CPU seconds (SIGXCPU ends the process after that)."""
    if cpu_s > 0:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime) + 1 + cpu_s
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


class _Checker:
    """Parses both sides with math-verify (gold parses cached) and compares them."""

    def __init__(self) -> None:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        self._parse = parse
        self._verify = verify
        self._config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        self._gold: OrderedDict[str, Any] = OrderedDict()

    def parse(self, answer: str) -> Any:
        # "$...$" anchors the LaTeX extractor, so "\\frac12" or "(1,2)" parse as a whole.
        return self._parse(
            f"${answer}$",
            extraction_config=self._config,
            parsing_timeout=None,
            raise_on_error=False,
        )

    def gold(self, answer: str) -> Any:
        if answer in self._gold:
            self._gold.move_to_end(answer)
            return self._gold[answer]
        parsed = self.parse(answer)
        self._gold[answer] = parsed
        if len(self._gold) > GOLD_CACHE_SIZE:
            self._gold.popitem(last=False)
        return parsed

    def equal(self, gold: str, pred: str) -> bool:
        return bool(
            self._verify(
                self.gold(gold), self.parse(pred), timeout_seconds=None, raise_on_error=False
            )
        )


def _protocol_stream() -> TextIO:
    """The original stdout for replies; fd 1 then points at stderr, so a library that prints
    (from Python or C) cannot corrupt the protocol."""
    stream = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(2, 1)
    return stream


def _reply(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def serve(memory_mb: int, cpu_s_per_request: int) -> None:
    """Answer requests from stdin until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notices
    out = _protocol_stream()
    checker = _Checker()
    checker.equal("1", "1")  # import sympy and the LaTeX grammar before reporting ready
    _limit_memory(memory_mb)
    _reply(out, {"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rid = request["id"]
        _limit_cpu(cpu_s_per_request)
        try:
            _reply(out, {"id": rid, "equal": checker.equal(request["gold"], request["pred"])})
        except Exception as e:  # reported to the parent and counted there
            # Only the type: str() of a sympy error can itself hang (math-verify's warning).
            _reply(out, {"id": rid, "error": type(e).__name__})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-mb", type=int, default=2048, help="address-space limit, 0 = none")
    parser.add_argument(
        "--cpu-s-per-request", type=int, default=30, help="CPU seconds one check may use, 0 = none"
    )
    args = parser.parse_args()
    serve(args.memory_mb, args.cpu_s_per_request)


if __name__ == "__main__":
    main()
