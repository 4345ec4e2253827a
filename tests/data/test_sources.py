"""Loading rows from every kind of source, and the errors that name file and line."""

import csv
import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.data.formats import DataFormatError
from posttrain.data.sources import Rows, describe_source, load_and_validate, load_rows, rows_sha256

# Awkward on purpose: a numeric-looking completion, a comma, a quote, newlines, non-ASCII
# (U+2028 is a line break to str.splitlines, not to JSON Lines).
ROWS = [
    {"prompt": "2+2=", "completion": "4", "answer": 4},
    {"prompt": 'say "hi",\nthen stop', "completion": "héllo ✓\u2028\r", "answer": 7},
]
CHAT = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
]


def _write(path, rows, kind):
    if kind == "jsonl":
        path.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
    elif kind == "json":
        path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "datasets":
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "datasets"])
def test_every_file_kind_loads_the_same_rows(tmp_path, kind):
    path = _write(tmp_path / (f"train.{kind}" if kind != "datasets" else "saved"), ROWS, kind)
    rows = load_rows(path)
    assert rows == ROWS
    assert isinstance(rows[0]["completion"], str) and isinstance(rows[0]["answer"], int)


def test_describe_source_names_files_or_the_type_and_fingerprints_the_rows(tmp_path):
    """What config.yaml records of a dataset passed from Python: the same rows give the same
    sha256 from a list, a datasets.Dataset or a file; files are listed by absolute path."""
    path = _write(tmp_path / "train.jsonl", ROWS, "jsonl")
    digest = rows_sha256(ROWS)
    assert describe_source(ROWS) == {"type": "list", "rows": len(ROWS), "sha256": digest}
    hf = describe_source(datasets.Dataset.from_list(ROWS))
    assert hf["type"] == "datasets.Dataset" and hf["sha256"] == digest and hf["hf_fingerprint"]
    assert describe_source(str(tmp_path / "*.jsonl")) == {"files": [str(path.resolve())], "rows": len(ROWS),
                                                          "sha256": digest}
    assert rows_sha256(ROWS[::-1]) != digest and rows_sha256([dict(reversed(ROWS[0].items()))]) == rows_sha256(ROWS[:1])


def test_in_memory_sources_load_the_same_rows():
    assert load_rows(ROWS) == ROWS
    assert load_rows(datasets.Dataset.from_list(ROWS)) == ROWS
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    assert load_rows(dd) == ROWS


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "datasets"])
def test_message_lists_survive_every_kind_that_can_hold_them(tmp_path, kind):
    path = _write(tmp_path / (f"chat.{kind}" if kind != "datasets" else "saved"), CHAT, kind)
    assert load_rows(path) == CHAT


def test_csv_types(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_text("prompt,completion,answer,score,flag\n42,007,12,0.5,true\nq,,x,,false\n")
    rows = load_rows(path)
    # format columns stay text ("007" is not 7, an empty cell is ""); others are inferred
    assert rows[0] == {
        "prompt": "42",
        "completion": "007",
        "answer": "12",
        "score": 0.5,
        "flag": True,
    }
    assert rows[1] == {"prompt": "q", "completion": "", "answer": "x", "score": None, "flag": False}
    chat = tmp_path / "chat.csv"
    chat.write_text('messages\n"[{""role"": ""user""}]"\n')
    with pytest.raises(DataFormatError, match="CSV cannot hold message lists"):
        load_and_validate(chat)


def test_dataset_dict_folder_takes_train_or_the_named_split(tmp_path, caplog):
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    with caplog.at_level(logging.INFO, logger="posttrain.data.sources"):
        assert load_rows(tmp_path / "dd") == ROWS
    assert "using 'train'" in caplog.text
    assert load_rows(tmp_path / "dd", split_name="test") == ROWS[:1]
    with pytest.raises(DataFormatError, match="no split 'dev'; splits are train, test"):
        load_rows(tmp_path / "dd", split_name="dev")
    datasets.DatasetDict({"a": dd["train"], "b": dd["test"]}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataFormatError, match="splits a, b and no 'train'; pass split_name"):
        load_rows(tmp_path / "ab")


def test_several_files_concatenate_and_keep_their_line_numbers(tmp_path):
    a = _write(tmp_path / "a.jsonl", ROWS, "jsonl")
    b = tmp_path / "b.jsonl"
    b.write_text('{"prompt": "p", "completion": "c"}\n\n{"prompt": "p", "answer": "c"}\n')
    rows = load_rows([a, b])
    assert len(rows) == 4 and rows[:2] == ROWS
    assert rows.locate(1) == f"{a}:2" and rows.locate(3) == f"{b}:3"  # line 2 of b is blank
    with pytest.raises(DataFormatError) as err:
        load_and_validate([a, b])
    assert str(err.value).startswith(
        f"{b}:3: column 'completion' is missing; expected columns prompt, completion; found prompt, answer"
    )
    assert load_rows(str(tmp_path / "*.jsonl")) == rows


def test_load_and_validate_detects_or_takes_the_format(tmp_path):
    path = _write(tmp_path / "t.jsonl", ROWS, "jsonl")
    rows, fmt = load_and_validate(path)
    assert fmt == "prompt_completion" and rows == ROWS
    assert load_and_validate(path, format="prompt")[1] == "prompt"
    with pytest.raises(DataFormatError, match=r"t.jsonl:1: column 'text' is missing"):
        load_and_validate(path, format="text")


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b",}\n')
    with pytest.raises(DataFormatError) as err:
        load_rows(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert "one JSON object per line" in str(err.value)


def test_non_object_line(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "a"}\n["text", "b"]\n')
    with pytest.raises(DataFormatError, match=r"list.jsonl:2: expected a JSON object, got list$"):
        load_rows(path)


def test_json_file_variants(tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "a"}\n{"text": "b"}\n')  # JSON Lines saved as .json
    assert load_rows(lines) == [{"text": "a"}, {"text": "b"}]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [{"text": "a"}]}, indent=1))
    with pytest.raises(DataFormatError, match="found one object with keys data"):
        load_rows(wrapped)
    items = tmp_path / "items.json"
    items.write_text('[{"text": "a"}, 3]')
    with pytest.raises(
        DataFormatError, match="items.json: row 2: expected a JSON object, got number"
    ):
        load_rows(items)


@pytest.mark.parametrize(
    ("name", "content"), [("e.jsonl", ""), ("e.json", "[]"), ("e.csv", "text\n")]
)
def test_empty_sources_are_errors(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataFormatError, match=f"^{path}: no rows$"):
        load_rows(path)


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="the pattern matches no file"):
        load_rows(str(tmp_path / "*.parquet"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(
        DataFormatError,
        match=r"unsupported file type '.txt'; supported: .jsonl, .json, .parquet, .csv",
    ):
        load_rows(tmp_path / "d.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataFormatError, match="not one written by datasets' save_to_disk"):
        load_rows(tmp_path / "folder")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataFormatError, match="not UTF-8"):
        load_rows(tmp_path / "bin.jsonl")
    with pytest.raises(DataFormatError, match="^list: no rows$"):
        load_rows([])
    with pytest.raises(TypeError, match="only row dicts or only file paths"):
        load_rows([{"text": "a"}, "b.jsonl"])
    with pytest.raises(TypeError, match="cannot load rows from a dict"):
        load_rows({"text": ["a"]})


def test_rows_locate_falls_back_to_row_numbers():
    rows = Rows([{"text": "a"}], "mem")
    assert rows.locate(0) == "mem: row 1"


# ShareGPT: {"conversations": [{"from", "value"}]} reads as messages, from files and datasets alike
SHAREGPT = {"conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
    {"from": "gpt", "value": "4"}, {"from": "tool", "value": "ok"}], "id": 7}
CHATML = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"}, {"role": "tool", "content": "ok"}], "id": 7}


def test_sharegpt_conversations_read_as_messages_from_a_file_and_a_dataset(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n")
    for source in (path, datasets.Dataset.from_list([SHAREGPT]), [SHAREGPT]):
        rows, fmt = load_and_validate(source)
        assert fmt == "messages" and list(rows) == [CHATML]
    assert "conversations" in SHAREGPT  # the caller's rows are not changed


def test_an_unknown_sharegpt_role_names_the_row(tmp_path):
    path = tmp_path / "chat.jsonl"
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]}
    path.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataFormatError, match=r"chat.jsonl:2: column 'messages': message 1 is from 'bot'.*human"):
        load_rows(path)


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_a_file_with_the_wrong_columns_is_named(tmp_path, kind):
    from posttrain.data.collate import tokenize_dataset
    from posttrain.data.tokenizer import build_tokenizer

    good = _write(tmp_path / "good.jsonl", ROWS, "jsonl")
    path = _write(tmp_path / f"wrong.{kind}", [{"question": "2+2=", "reply": "4"}], kind)
    with pytest.raises(DataFormatError, match=f"^{path}: cannot tell the dataset format from its columns;.*"
                       "found question, reply"):
        load_and_validate(path)
    with pytest.raises(DataFormatError, match=f"^{path}: cannot tell"):  # the SFT path, the first of two files
        tokenize_dataset(load_rows([str(path), str(good)]), build_tokenizer(), max_length=32)
