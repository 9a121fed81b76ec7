"""forge/safe_json.py: JSON that Forge did not write is refused before json.loads recurses or reads gigabytes, and a
value of another type than the reader expects is refused with the file named."""

import json

import pytest

from forge.safe_json import JSONFileError, nesting_depth, parse_json, read_json


@pytest.mark.parametrize("text, depth", [
    ("{}", 1), ('{"a": [1, {"b": []}]}', 4), ("[" * 7 + "]" * 7, 7),
    ('{"a": "[[[[[[", "b": "\\"[[[["}', 1),  # brackets inside strings, escaped quotes included, do not count
    ("1", 0),
])
def test_nesting_depth_counts_brackets_outside_strings(text, depth):
    assert nesting_depth(text) == depth


def test_json_nested_past_the_recursion_limit_is_refused_before_parsing(tmp_path):
    file = tmp_path / "config.json"
    file.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(JSONFileError, match=r"config\.json is JSON nested 200,000 levels deep, more than the 100"):
        read_json(file, list)
    assert parse_json('{"a": ' * 100 + "1" + "}" * 100, "f") is not None  # 100 levels: read


@pytest.mark.parametrize("text, expect, problem", [
    ("[1, 2, 3]", dict, "is not a JSON object (it holds an array)"),
    ('"ok"', dict, "is not a JSON object (it holds a string)"),
    ("{}", list, "is not a JSON array (it holds an object)"),
    ('{"a": ', dict, "is not valid JSON (Expecting value"),
    (b"\xff\xfe{}", dict, "is not valid JSON (not UTF-8 text)"),
])
def test_a_value_of_another_type_or_no_json_names_the_file(text, expect, problem):
    with pytest.raises(JSONFileError) as caught:
        parse_json(text, "out/checkpoint-3/trainer_state.json", expect)
    assert str(caught.value).startswith(f"out/checkpoint-3/trainer_state.json {problem}")
    assert caught.value.problem.startswith(problem)


def test_a_file_over_the_size_limit_is_not_read(tmp_path):
    file = tmp_path / "COMPLETE"
    file.write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(JSONFileError, match=r"COMPLETE is 2,011 bytes, more than the 1,000 Forge reads as JSON"):
        read_json(file, max_bytes=1000)
    assert read_json(file)["pad"] == "x" * 2000
