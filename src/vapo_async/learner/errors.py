"""How the learner's command line reports a bad setting: ``ConfigError`` and its one-line message.

``__main__.main`` prints a ``ConfigError`` as ``vapo_async.learner: error: MESSAGE`` and exits
with code 2 (Hydra would print a traceback and exit 1).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid setting; the message names the key."""


def one_line(e: BaseException) -> str:
    """A single line naming the problem (Hydra/OmegaConf messages span several lines)."""
    parts = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        lines = [ln.strip() for ln in str(cur).splitlines() if ln.strip() and ln.strip() != "None"]
        if lines:
            parts.append(lines[0])
            parts += [ln for ln in lines[1:] if ln.startswith("full_key:")]
        cur = cur.__cause__ or cur.__context__
    text = " | ".join(list(dict.fromkeys(parts))[:3]) or type(e).__name__
    return text.replace("\n", " ")

