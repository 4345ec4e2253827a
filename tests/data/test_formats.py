"""Format detection, row validation and implicit-prompt splitting."""

import pytest

from posttrain.data.formats import (
    FORMAT_COLUMNS,
    DataFormatError,
    detect_format,
    is_conversational,
    split_implicit_prompt,
    validate_rows,
)

USER = {"role": "user", "content": "2+2?"}
BOT = {"role": "assistant", "content": "4"}
BAD_BOT = {"role": "assistant", "content": "5"}


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        (["text"], "text"),
        (["prompt", "completion"], "prompt_completion"),
        (["messages", "id"], "messages"),
        (["prompt", "chosen", "rejected"], "preference"),
        (["chosen", "rejected", "score"], "implicit_preference"),
        (["prompt", "answer", "tests"], "prompt"),
        # chosen/rejected outrank prompt/completion; prompt/completion outranks text
        (["prompt", "completion", "chosen", "rejected"], "preference"),
        (["prompt", "completion", "text"], "prompt_completion"),
    ],
)
def test_detect_format_from_columns(columns, expected):
    assert detect_format(columns) == expected


def test_detect_format_unknown_columns_lists_expected_and_found():
    with pytest.raises(DataFormatError) as err:
        detect_format(["question", "answer"], {"question": "q", "answer": 1})
    msg = str(err.value)
    assert "prompt_completion: prompt, completion" in msg and "messages: messages" in msg
    assert "found answer, question" in msg
    assert "answer: int" in msg  # the first row's types


@pytest.mark.parametrize(
    ("fmt", "row"),
    [
        ("text", {"text": "hello"}),
        ("prompt_completion", {"prompt": "a", "completion": "b"}),
        ("prompt_completion", {"prompt": [USER], "completion": [BOT]}),
        ("messages", {"messages": [USER, BOT]}),
        ("preference", {"prompt": "q", "chosen": "a", "rejected": "b"}),
        ("preference", {"prompt": [USER], "chosen": [BOT], "rejected": [BAD_BOT]}),
        ("implicit_preference", {"chosen": [USER, BOT], "rejected": [USER, BAD_BOT]}),
        ("prompt", {"prompt": "q", "answer": 4, "tests": ["assert f() == 4"]}),
        ("prompt", {"prompt": [USER], "answer": "4"}),
    ],
)
def test_valid_rows_of_every_format(fmt, row):
    validate_rows([row, dict(row)], fmt, "d")


def test_missing_column_names_location_expected_and_found():
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}]
    with pytest.raises(DataFormatError) as err:
        validate_rows(rows, "prompt_completion", "train.parquet")
    assert str(err.value).startswith(
        "train.parquet: row 2: column 'completion' is missing; "
        "expected columns prompt, completion; found prompt, answer"
    )


def test_wrong_type_names_column_expected_and_found():
    with pytest.raises(
        DataFormatError, match=r"d: row 1: column 'completion': expected a string, found int"
    ):
        validate_rows([{"prompt": "a", "completion": 4}], "prompt_completion", "d")
    with pytest.raises(DataFormatError, match="column 'text' is null"):
        validate_rows([{"text": None}], "text", "d")


def test_mixed_standard_and_conversational_rows_are_rejected():
    rows = [{"prompt": [USER], "completion": [BOT]}, {"prompt": "2+2?", "completion": "4"}]
    with pytest.raises(DataFormatError) as err:
        validate_rows(rows, "prompt_completion", "d")
    assert (
        "d: row 2: column 'prompt': expected a list of {role, content} messages, found str"
        in str(err.value)
    )
    assert "row 1 is conversational" in str(err.value)
    with pytest.raises(DataFormatError, match="'prompt' is standard"):
        validate_rows([{"prompt": "q", "completion": [BOT]}], "prompt_completion", "d")


@pytest.mark.parametrize(
    ("messages", "found"),
    [
        ([], "an empty list"),
        ([{"content": "hi"}], "message 0 has no string 'role'"),
        ([USER, {"role": "assistant", "content": 3}], "message 1 has content of type int"),
        (["hi"], "message 0 is a str"),
        ("hi", "str (CSV cannot hold message lists"),
    ],
)
def test_bad_messages(messages, found):
    with pytest.raises(DataFormatError) as err:
        validate_rows([{"messages": messages}], "messages", "chat.json")
    assert str(err.value).startswith(
        "chat.json: row 1: column 'messages': expected a list of {role, content}"
    )
    assert found in str(err.value)


def test_tool_call_turn_without_content_is_valid():
    call = {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}
    validate_rows([{"messages": [USER, call]}], "messages", "d")


def test_explicit_format_overrides_detection_and_is_checked():
    rows = [{"prompt": "q", "completion": "a", "answer": 1}]
    validate_rows(rows, "prompt", "d")  # RL prompts: completion and answer are extra columns
    with pytest.raises(DataFormatError, match="column 'text' is missing"):
        validate_rows(rows, "text", "d")
    with pytest.raises(DataFormatError, match="unknown format 'sft'"):
        validate_rows(rows, "sft", "d")


def test_empty_dataset_is_an_error():
    with pytest.raises(DataFormatError, match="^train.jsonl: no rows$"):
        validate_rows([], "text", "train.jsonl")


def test_every_format_is_detectable_from_its_own_columns():
    for fmt, cols in FORMAT_COLUMNS.items():
        assert detect_format(cols) == fmt


def test_is_conversational():
    assert is_conversational({"messages": [USER]})
    assert is_conversational({"prompt": [USER], "completion": [BOT]})
    assert not is_conversational({"prompt": "q", "completion": "a"})
    # with a format, an unrelated extra column does not decide
    assert not is_conversational({"text": "t", "prompt": [USER]}, "text")


def test_split_implicit_prompt_strings_moves_the_space_to_the_responses():
    assert split_implicit_prompt("Q: 2+2? A: 4", "Q: 2+2? A: 5") == ("Q: 2+2? A:", " 4", " 5")
    assert split_implicit_prompt("ab", "ac") == ("a", "b", "c")
    # one side a prefix of the other: both responses stay non-empty
    assert split_implicit_prompt("abc", "abcd") == ("ab", "c", "cd")


def test_split_implicit_prompt_messages_compares_whole_messages():
    sys_msg = {"role": "system", "content": "be brief"}
    prompt, chosen, rejected = split_implicit_prompt([sys_msg, USER, BOT], [sys_msg, USER, BAD_BOT])
    assert (prompt, chosen, rejected) == ([sys_msg, USER], [BOT], [BAD_BOT])


def test_split_implicit_prompt_errors():
    with pytest.raises(DataFormatError, match="identical"):
        split_implicit_prompt("same", "same")
    with pytest.raises(DataFormatError, match="both be strings or both message lists"):
        split_implicit_prompt("a", [BOT])
