"""Dataset loaders on the shared GSM8K / AIME files, parquet round trips, and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vapo_async.data import DataConfig, DatasetError, PromptRecord, load_prompts
from vapo_async.data.templates import apply_template


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- the shared copies of GSM8K and AIME 2024 ----------------------------------------------------


def test_gsm8k_train_and_test(shared_data: Path) -> None:
    cfg = DataConfig(name="gsm8k", data_root=str(shared_data))
    train, test = load_prompts(cfg, "train"), load_prompts(cfg, "eval")
    assert (len(train), len(test)) == (7473, 1319)
    # Line 1 of test.jsonl: Janet's ducks, "... #### 18"
    assert test[0].answer == "18" and test[0].uid == "gsm8k/test:1"
    assert test[0].prompt == apply_template(
        json.loads((shared_data / "gsm8k/test.jsonl").read_text().splitlines()[0])["question"],
        "dapo",
    )
    assert train[0].answer == "72" and train[0].uid == "gsm8k/train:1"
    assert all(r.answer and "####" not in r.answer for r in train + test)
    assert "2,125" in {r.answer for r in test}  # thousands separators kept; the reward reads them


def test_aime_eval_only(shared_data: Path) -> None:
    cfg = DataConfig(name="aime", data_root=str(shared_data))
    records = load_prompts(cfg, "eval")
    assert len(records) == 30 and records[0].answer == "204" and records[0].uid == "aime/test:1"
    assert "Every morning Aya goes for a $9$-kilometer-long walk" in records[0].prompt
    with pytest.raises(
        DatasetError, match="dataset 'aime' has no train split; set data.train_file"
    ):
        load_prompts(cfg, "train")


def test_shuffle_and_limit(shared_data: Path) -> None:
    base = dict(name="gsm8k", data_root=str(shared_data))
    full = load_prompts(DataConfig(**base), "eval")
    a = load_prompts(DataConfig(**base, shuffle_seed=3), "eval")
    b = load_prompts(DataConfig(**base, shuffle_seed=3, limit=10), "eval")
    assert a != full and sorted(a, key=lambda r: r.uid) == sorted(full, key=lambda r: r.uid)
    assert b == a[:10]
    assert load_prompts(DataConfig(**base, limit=5), "eval") == full[:5]


def test_missing_data_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"dataset 'gsm8k': .*gsm8k does not exist"):
        load_prompts(DataConfig(name="gsm8k", data_root=str(tmp_path)), "train")


def test_env_data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gsm8k").mkdir()
    _write_jsonl(
        tmp_path / "gsm8k/test.jsonl", [json.dumps({"question": "1+1?", "answer": "2\n#### 2"})]
    )
    monkeypatch.setenv("VAPO_DATA_ROOT", str(tmp_path))
    assert load_prompts(DataConfig(name="gsm8k", template="none"), "eval") == [
        PromptRecord(prompt="1+1?", answer="2", uid="gsm8k/test:1")
    ]


# --- error messages: file, line, field ----------------------------------------------------


def test_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "qa.jsonl",
        [
            json.dumps({"problem": "a", "answer": "1"}),
            "",  # blank lines are skipped but still counted
            json.dumps({"problem": "b"}),
        ],
    )
    with pytest.raises(DatasetError) as e:
        load_prompts(DataConfig(name=str(path)), "train")
    assert str(e.value) == f"{path}:3: missing field 'answer'"


def test_missing_nested_field(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "dapo.jsonl",
        [
            json.dumps({"prompt": "p", "reward_model": {"ground_truth": "3"}}),
            json.dumps({"prompt": "q", "reward_model": {"style": "rule"}}),
        ],
    )
    with pytest.raises(DatasetError) as e:
        load_prompts(DataConfig(name=str(path)), "train")
    assert str(e.value) == f"{path}:2: missing field 'reward_model.ground_truth'"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            ['{"question": "a", "answer": "#### 1"}', '{"question": "b", "answer": '],
            ":2: invalid JSON: Expecting value (column 28)",
        ),
        (["[1, 2]"], ":1: expected a JSON object, got list"),
        (['{"question": "a", "answer": null}'], ":1: field 'answer' is null"),
        (
            ['{"question": "a", "answer": true}'],
            ":1: field 'answer' must be a string or number, got bool",
        ),
        (['{"question": "  ", "answer": "1"}'], ":1: field 'question' is empty"),
        (
            ['{"text": "a", "label": "1"}'],
            ":1: cannot tell the row format from fields ['label', 'text']",
        ),
    ],
)
def test_bad_rows(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError) as e:
        load_prompts(DataConfig(name=str(path)), "eval")
    assert str(e.value).startswith(f"{path}{message}")


def test_unreadable_files(tmp_path: Path) -> None:
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(
        b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n'
    )
    with pytest.raises(
        DatasetError,
        match=f"^{bad_utf8}:2: not valid UTF-8 \\(invalid continuation byte at column 18\\)",
    ):
        load_prompts(DataConfig(name=str(bad_utf8)), "train")
    as_dir = tmp_path / "dir.jsonl"
    as_dir.mkdir()
    (as_dir / "x").touch()
    with pytest.raises(DatasetError, match="none of \\['train.jsonl', 'train.parquet'\\] found"):
        load_prompts(DataConfig(name=str(as_dir)), "train")
    not_parquet = tmp_path / "junk.parquet"
    not_parquet.write_text("not parquet")
    with pytest.raises(DatasetError, match=f"^{not_parquet}: not a readable parquet file"):
        load_prompts(DataConfig(name=str(not_parquet)), "train")
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        load_prompts(DataConfig(name=str(csv)), "train")


def test_gsm8k_format_requires_final_answer_marker(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "g.jsonl", [json.dumps({"question": "a", "answer": "it is 4"})])
    # auto: a question/answer file without "####" keeps the whole answer
    assert load_prompts(DataConfig(name=str(path)), "train")[0].answer == "it is 4"
    with pytest.raises(
        DatasetError, match=f"^{path}:1: field 'answer' has no '#### N' final answer"
    ):
        load_prompts(DataConfig(name=str(path), format="gsm8k"), "train")


# --- parquet and the DAPO-Math-17k row format --------------------------------------------


def test_parquet_round_trip_dapo_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = ["What is $2^{10}$?", "Sum of 1..10?"]
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [
                {"role": "user", "content": apply_template(p, "dapo")}
            ],  # DAPO rows carry the template
            "reward_model": {"ground_truth": gt, "style": "rule-lighteval/MATH_v2"},
        }
        for p, gt in zip(problems, ["1024", "55"], strict=True)
    ]
    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records = load_prompts(DataConfig(name="dapo_math", path=str(path)), "train")
    assert records == [
        PromptRecord(apply_template(problems[0], "dapo"), "1024", "dapo_math/dapo-math-17k:1"),
        PromptRecord(apply_template(problems[1], "dapo"), "55", "dapo_math/dapo-math-17k:2"),
    ]  # the template is applied once, not twice
    # a plain-string prompt column and the answer-line template
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "1+2?", "reward_model": {"ground_truth": "3"}}]), path
    )
    assert load_prompts(DataConfig(name=str(path), template="answer_line"), "eval")[
        0
    ] == PromptRecord(apply_template("1+2?", "answer_line"), "3", "dapo-math-17k:1")


def test_parquet_aime_rows_with_integer_answers_and_missing_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "aime25.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"problem": "p1", "answer": 70}, {"problem": "p2", "answer": 588}]),
        path,
    )
    assert [r.answer for r in load_prompts(DataConfig(name=str(path)), "eval")] == ["70", "588"]
    pq.write_table(pa.Table.from_pylist([{"problem": "p1", "solution": "s"}]), path)
    with pytest.raises(DatasetError) as e:
        load_prompts(DataConfig(name=str(path), format="aime"), "eval")
    assert str(e.value) == f"{path}:row 1: missing field 'answer'"


def test_custom_keys_and_directory_layout(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    d.mkdir()
    _write_jsonl(d / "train.jsonl", [json.dumps({"input": {"text": "q1"}, "target": 5})])
    _write_jsonl(d / "test.jsonl", [json.dumps({"input": {"text": "q2"}, "target": 6})])
    cfg = DataConfig(
        name="path", path=str(d), question_key="input.text", answer_key="target", template="none"
    )
    assert load_prompts(cfg, "train") == [PromptRecord("q1", "5", "train:1")]
    assert load_prompts(cfg, "eval") == [PromptRecord("q2", "6", "test:1")]
    cfg = DataConfig(
        name=str(d), eval_file="train.jsonl", question_key="input.text", answer_key="target"
    )
    assert load_prompts(cfg, "eval")[0].answer == "5"


# --- config ------------------------------------------------------------------------------


def test_config_validation_and_structured_config() -> None:
    with pytest.raises(ValueError, match="data.format must be one of"):
        DataConfig(format="csv")
    with pytest.raises(ValueError, match="unknown prompt template 'x'"):
        DataConfig(template="x")
    with pytest.raises(ValueError, match="data.limit must be >= 1"):
        DataConfig(limit=0)
    with pytest.raises(ValueError, match="split must be one of"):
        load_prompts(DataConfig(), "test")
    node = OmegaConf.structured(DataConfig)
    node.merge_with(OmegaConf.from_dotlist(["name=gsm8k", "limit=8", "chat_template=true"]))
    cfg = OmegaConf.to_object(node)
    assert isinstance(cfg, DataConfig) and (cfg.name, cfg.limit, cfg.chat_template) == (
        "gsm8k",
        8,
        True,
    )


def test_chat_template_needs_a_tokenizer(shared_data: Path) -> None:
    cfg = DataConfig(name="aime", data_root=str(shared_data), chat_template=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_prompts(cfg, "eval")


def test_synthetic_split_sizes_template_and_disjointness() -> None:
    synthetic = pytest.importorskip("vapo_async.data.synthetic")
    cfg = DataConfig(name="synthetic", n_train=300, n_eval=50, difficulty=2, seed=7)
    train, held_out = load_prompts(cfg, "train"), load_prompts(cfg, "eval")
    assert (len(train), len(held_out)) == (300, 50)
    problems = synthetic.make_problems(50, seed=7, difficulty=2, split="eval")
    assert held_out[3] == PromptRecord(
        apply_template(problems[3].question, "answer_line"),
        str(problems[3].answer),
        "synthetic/eval:3",
    )
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    assert load_prompts(cfg, "eval") == held_out  # reproducible from the seed
