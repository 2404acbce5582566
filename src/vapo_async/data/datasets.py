"""Prompt datasets: jsonl / parquet readers, field mapping, templating -> ``PromptRecord`` lists.

    load_prompts(DataConfig(name="gsm8k"), split="eval")      # ../shared/data/gsm8k/test.jsonl
    load_prompts(DataConfig(name="/data/dapo.parquet"), "train")

Row formats (``DataConfig.format``; ``auto`` decides from the first row of a file):
- ``gsm8k``: ``question`` + ``answer`` whose final answer follows ``####``;
- ``aime``: ``problem`` + ``answer`` (string or integer);
- ``dapo_math``: ``prompt`` (a string or a list of chat messages; the last user turn is used, and
  DAPO's template already in it is stripped so it is not applied twice) +
  ``reward_model.ground_truth``.
``question_key`` / ``answer_key`` (dotted paths) override the fields for other files. Any bad row
raises ``DatasetError`` naming the file, the line (jsonl) or row (parquet) and the field.

Departures: none (this is plumbing, not an algorithm).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .templates import apply_chat_template, apply_template, resolve_template, strip_dapo_template

SPLITS = ("train", "eval")
FORMATS = ("auto", "gsm8k", "aime", "dapo_math")


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or has a bad row (message: file, line, field)."""


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One prompt as the controller leases it."""

    prompt: str
    """Final text given to the engine (template and, if enabled, chat template applied)."""
    answer: str
    """Ground-truth final answer, compared by ``vapo_async.rewards``."""
    uid: str
    """Stable id ``<source>:<line or row number>``, e.g. ``gsm8k/test:17``, ``synthetic/eval:3``."""


@dataclass
class DataConfig:
    """Which prompts to train and evaluate on (``data.*`` in the Hydra config)."""

    name: str = "synthetic"
    """``synthetic``, ``gsm8k``, ``aime``, ``dapo_math``, ``path`` (see ``path``) or a file/dir."""
    path: str | None = None
    """File or directory for ``name=path``, or replacing a built-in dataset's location."""
    train_file: str | None = None
    """Train-split file (absolute, or relative to the dataset directory)."""
    eval_file: str | None = None
    """Eval-split file (absolute, or relative to the dataset directory)."""
    format: str = "auto"
    """Row format: ``auto``, ``gsm8k``, ``aime``, ``dapo_math``."""
    question_key: str | None = None
    """Dotted field holding the problem, overriding the format's."""
    answer_key: str | None = None
    """Dotted field holding the ground truth, overriding the format's."""
    template: str = "auto"
    """``auto`` (synthetic: answer_line, else dapo), ``dapo``, ``answer_line``, ``none``, or text
    containing ``{problem}``."""
    chat_template: bool = False
    """Wrap the templated prompt with the tokenizer's chat template (one user turn)."""
    limit: int | None = None
    """Keep at most this many prompts (after shuffling)."""
    shuffle_seed: int | None = None
    """Shuffle with this seed; None keeps file order."""
    data_root: str | None = None
    """Folder of built-in datasets; default $VAPO_DATA_ROOT, else ../shared/data beside the repo."""
    n_train: int = 4096
    """Synthetic: number of training problems."""
    n_eval: int = 256
    """Synthetic: number of held-out problems."""
    difficulty: int = 2
    """Synthetic: difficulty level (see ``vapo_async.data.synthetic.DIFFICULTIES``)."""
    seed: int = 0
    """Synthetic: generator seed (train and eval sets are disjoint for every seed)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format must be one of {FORMATS}, got {self.format!r}")
        if self.template != "auto":
            resolve_template(self.template)
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"data.limit must be >= 1 or None, got {self.limit}")
        if self.n_train < 0 or self.n_eval < 0:
            raise ValueError(f"data.n_train/n_eval must be >= 0, got {self.n_train}/{self.n_eval}")


@dataclass(frozen=True)
class _Builtin:
    subdir: str
    files: dict[str, tuple[str, ...]]
    format: str


BUILTINS: dict[str, _Builtin] = {
    "gsm8k": _Builtin(
        "gsm8k",
        {"train": ("train.jsonl", "train.parquet"), "eval": ("test.jsonl", "test.parquet")},
        "gsm8k",
    ),
    "aime": _Builtin("aime24", {"eval": ("test.jsonl", "test.parquet")}, "aime"),
    "dapo_math": _Builtin(
        "dapo_math",
        {"train": ("train.parquet", "dapo-math-17k.parquet", "train.jsonl")},
        "dapo_math",
    ),
}
_GENERIC_FILES = {
    "train": ("train.jsonl", "train.parquet"),
    "eval": ("test.jsonl", "test.parquet", "eval.jsonl", "eval.parquet"),
}
# format -> (question field, answer field)
_FIELDS = {
    "custom": ("", ""),  # question_key and answer_key both given
    "gsm8k": ("question", "answer"),
    "aime": ("problem", "answer"),
    "dapo_math": ("prompt", "reward_model.ground_truth"),
}


def default_data_root() -> Path | None:
    """$VAPO_DATA_ROOT, else ``../shared/data`` beside the repository when it exists."""
    if env := os.environ.get("VAPO_DATA_ROOT"):
        return Path(env)
    beside_repo = Path(__file__).resolve().parents[3].parent / "shared" / "data"
    return beside_repo if beside_repo.is_dir() else None


def _base_location(cfg: DataConfig) -> tuple[Path, str, str]:
    """(file or directory, row format, built-in name or "") of a non-synthetic ``cfg``."""
    builtin = BUILTINS.get(cfg.name)
    if builtin is None:
        if cfg.name == "path":
            if not cfg.path:
                raise DatasetError("data.name=path needs data.path")
            base = Path(cfg.path)
        elif cfg.path:
            raise DatasetError(
                f"data.name={cfg.name!r} is a path; do not also set data.path={cfg.path!r}"
            )
        else:
            base = Path(cfg.name)
        return base, cfg.format, ""
    fmt = builtin.format if cfg.format == "auto" else cfg.format
    if cfg.path:
        return Path(cfg.path), fmt, cfg.name
    root = Path(cfg.data_root) if cfg.data_root else default_data_root()
    if root is None:
        raise DatasetError(
            f"dataset {cfg.name!r}: no data root; set data.data_root, $VAPO_DATA_ROOT or data.path "
            "(../shared/data beside the repository does not exist)"
        )
    return root / builtin.subdir, fmt, cfg.name


def resolve_file(cfg: DataConfig, split: str) -> tuple[Path, str, str]:
    """(file, row format, uid prefix) of ``split`` of a non-synthetic dataset; raises if missing."""
    base, fmt, label = _base_location(cfg)
    explicit = cfg.train_file if split == "train" else cfg.eval_file
    if explicit:
        file = Path(explicit)
        if not file.is_absolute() and base.is_dir():
            file = base / file
    elif base.is_file():
        file = base
    elif base.is_dir():
        builtin = BUILTINS.get(cfg.name)
        names = builtin.files.get(split, ()) if builtin else _GENERIC_FILES[split]
        if not names:
            raise DatasetError(f"dataset {cfg.name!r} has no {split} split; set data.{split}_file")
        found = [base / n for n in names if (base / n).is_file()]
        if not found:
            raise DatasetError(f"dataset {cfg.name!r}: none of {list(names)} found in {base}")
        file = found[0]
    else:
        raise DatasetError(f"dataset {cfg.name!r}: {base} does not exist")
    if not file.is_file():
        raise DatasetError(f"dataset {cfg.name!r}: {split} file {file} does not exist")
    return file, fmt, f"{label}/{file.stem}" if label in BUILTINS else file.stem


def _read_jsonl(path: Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    try:
        f = path.open("rb")  # bytes, decoded per line, so a bad byte is reported on its own line
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"{path}:{n}: not valid UTF-8 ({e.reason} at column {e.start + 1})"
                ) from None
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            yield n, f"{path}:{n}", row


def _read_parquet(path: Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: not a readable parquet file: {e}") from None
    for n, row in enumerate(rows, start=1):
        yield n, f"{path}:row {n}", row


def read_rows(path: Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line/row number, location ``file:N`` / ``file:row N``, row) per row of .jsonl / .parquet."""
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise DatasetError(
        f"{path}: unsupported file type {path.suffix!r} (expected .jsonl or .parquet)"
    )


def _field(row: dict[str, Any], dotted: str, loc: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DatasetError(f"{loc}: missing field '{dotted}'")
        value = value[part]
    if value is None:
        raise DatasetError(f"{loc}: field '{dotted}' is null")
    return value


def _detect_format(row: dict[str, Any], loc: str) -> str:
    if "reward_model" in row or isinstance(row.get("prompt"), list):
        return "dapo_math"
    if "problem" in row:
        return "aime"
    if "question" in row:
        return "gsm8k"
    raise DatasetError(
        f"{loc}: cannot tell the row format from fields {sorted(row)}; "
        "set data.format or data.question_key/answer_key"
    )


def _problem_text(value: Any, key: str, loc: str) -> str:
    if isinstance(value, list):  # chat messages: the last user turn
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise DatasetError(f"{loc}: field '{key}' is a message list without a user turn")
        value = users[-1]
    if not isinstance(value, str):
        raise DatasetError(f"{loc}: field '{key}' must be text, got {type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{loc}: field '{key}' is empty")
    return strip_dapo_template(value)


def _answer_text(value: Any, key: str, loc: str, gsm8k: bool, strict: bool) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DatasetError(
            f"{loc}: field '{key}' must be a string or number, got {type(value).__name__}"
        )
    text = str(value)
    if gsm8k and "####" in text:
        text = text.rsplit("####", 1)[1]
    elif gsm8k and strict:
        raise DatasetError(f"{loc}: field '{key}' has no '#### N' final answer (GSM8K format)")
    text = text.strip()
    if not text:
        raise DatasetError(f"{loc}: field '{key}' is empty")
    return text


def _file_records(cfg: DataConfig, split: str) -> list[tuple[str, str, str]]:
    """(problem, answer, uid) for every row of the split's file."""
    path, fmt, label = resolve_file(cfg, split)
    out = []
    row_fmt = None if fmt == "auto" else fmt
    for n, loc, row in read_rows(path):
        if row_fmt is None:
            custom_keys = cfg.question_key is not None and cfg.answer_key is not None
            row_fmt = "custom" if custom_keys else _detect_format(row, loc)
        q_key = cfg.question_key or _FIELDS[row_fmt][0]
        a_key = cfg.answer_key or _FIELDS[row_fmt][1]
        problem = _problem_text(_field(row, q_key, loc), q_key, loc)
        gsm8k = row_fmt == "gsm8k" and cfg.answer_key is None
        answer = _answer_text(_field(row, a_key, loc), a_key, loc, gsm8k, strict=fmt == "gsm8k")
        out.append((problem, answer, f"{label}:{n}"))
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out


def _synthetic_records(cfg: DataConfig, split: str) -> list[tuple[str, str, str]]:
    from . import synthetic  # lazy: only the default task needs it

    n = cfg.n_train if split == "train" else cfg.n_eval
    problems = synthetic.make_problems(n, seed=cfg.seed, difficulty=cfg.difficulty, split=split)
    return [(p.question, str(p.answer), f"synthetic/{split}:{i}") for i, p in enumerate(problems)]


def load_prompts(
    cfg: DataConfig, split: str = "train", tokenizer: Any = None
) -> list[PromptRecord]:
    """The templated prompts of ``split`` (``train`` or ``eval``) described by ``cfg``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if cfg.name == "synthetic":
        rows = _synthetic_records(cfg, split)
    else:
        rows = _file_records(cfg, split)
    if cfg.shuffle_seed is not None:
        random.Random(cfg.shuffle_seed).shuffle(rows)
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    template = cfg.template
    if template == "auto":
        template = "answer_line" if cfg.name == "synthetic" else "dapo"
    records = []
    for problem, answer, uid in rows:
        prompt = apply_template(problem, template)
        if cfg.chat_template:
            prompt = apply_chat_template(prompt, tokenizer)
        records.append(PromptRecord(prompt=prompt, answer=answer, uid=uid))
    return records
