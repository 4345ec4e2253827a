"""Tools: schemas from type hints and docstrings, argument binding, concurrent calls that
never crash (raising, sleeping, malformed), the built-in calculator and python tools."""

import time

import pytest

from posttrain.envs import ToolCall, as_tool, calculator, python, run_calls
from posttrain.envs.builtin_tools import python_tool
from posttrain.envs.tools import MAX_RESULT_CHARS, bind_arguments, tools_by_name


def lookup(word: str, limit: int = 3, exact: bool = False) -> str:
    """Look a word up in the dictionary.

    Args:
        word: The word to look up.
        limit: Most senses to return.
        exact: Match the whole word only.
    """
    return f"{word}:{limit}:{exact}"


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("kaput")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def test_schema_comes_from_type_hints_and_docstring():
    schema = as_tool(lookup).schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look a word up in the dictionary."
    assert fn["parameters"]["properties"] == {
        "word": {"type": "string", "description": "The word to look up."},
        "limit": {"type": "integer", "description": "Most senses to return."},
        "exact": {"type": "boolean", "description": "Match the whole word only."},
    }
    assert fn["parameters"]["required"] == ["word"]


def test_a_method_is_a_tool_without_self():
    class Box:
        def open(self, key: str) -> str:
            """Open the box.

            Args:
                key: The key.
            """
            return "open" if key == "k" else "locked"

    tool = as_tool(Box().open)
    assert list(tool.schema["function"]["parameters"]["properties"]) == ["key"]
    assert run_calls([ToolCall("open", "k")], {"open": tool}, 1.0)[0].text == "open"


def test_an_undocumented_argument_is_an_error():
    def bad(x: int) -> int:
        """No Args block."""
        return x

    with pytest.raises(Exception, match="x"):
        as_tool(bad)


def test_arguments_bind_raw_text_literals_and_dicts():
    tool = as_tool(lookup)
    assert bind_arguments(tool, '"cat", limit=2') == {"word": "cat", "limit": 2}
    assert bind_arguments(tool, "'cat', 5, True") == {"word": "cat", "limit": 5, "exact": True}
    assert bind_arguments(tool, {"word": "cat", "limit": "4", "exact": "false"}) == {
        "word": "cat", "limit": 4, "exact": False,
    }
    assert bind_arguments(as_tool(calculator), "2*(3+4)") == {"expression": "2*(3+4)"}
    for bad in ("cat", "'cat', nope=1", "limit=2", "'a', 'b'", {"word": "a", "limit": True}):
        with pytest.raises((TypeError, ValueError, SyntaxError)):
            bind_arguments(tool, bad)


def test_calls_run_concurrently_each_under_the_timeout_and_never_raise():
    tools = tools_by_name([lookup, boom, sleepy, calculator])
    calls = [
        ToolCall("sleepy", "0.3"),
        ToolCall("sleepy", "0.3"),
        ToolCall("boom", "x"),
        ToolCall("sleepy", "30"),
        ToolCall("nope", "1"),
        ToolCall("lookup", "cat, 1"),  # cat is not a literal
        ToolCall("calculator", "23*47"),
    ]
    start = time.monotonic()
    out = run_calls(calls, tools, timeout_s=1.0)
    assert time.monotonic() - start < 2.0  # the two 0.3 s sleeps overlap; the 30 s one is abandoned
    assert [o.text for o in out[:2]] == ["woke", "woke"] and not out[0].error
    assert out[2].error and out[2].text == "error: RuntimeError: kaput"
    assert out[3].error and out[3].timed_out and "timed out" in out[3].text
    assert out[4].error and "unknown tool 'nope'" in out[4].text
    assert out[5].error and out[5].text.startswith("error: bad arguments for lookup")
    assert out[6].text == "1081" and not out[6].error
    assert sum(o.timed_out for o in out) == 1


def test_long_results_are_clipped():
    def shout(n: int) -> str:
        """Many a's.

        Args:
            n: How many.
        """
        return "a" * n

    out = run_calls([ToolCall("shout", "10000")], tools_by_name([shout]), 1.0)[0].text
    assert len(out) == MAX_RESULT_CHARS and out.endswith("...")


@pytest.mark.parametrize(
    "expression, value",
    [("23*47", "1081"), ("23*47 + 5", "1086"), ("7/2", "3.5"), ("8/4", "2"), ("2**10", "1024"),
     ("-(3 - 10) % 4", "3"), ("17 // 5", "3"), ("0.1+0.2", "0.3"), ("123456789*987654321", "121932631112635269")],
)
def test_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "x + 1", "9**9**9", "10**99 * 10**5", "1/0", "'a'*3", "(1", "[1, 2]", "2**0.5j"],
)
def test_calculator_refuses_what_is_not_safe_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError, ZeroDivisionError)):
        calculator(expression)


def test_python_runs_in_the_sandbox():
    assert python("print(sum(range(10)))") == "45"
    with pytest.raises(RuntimeError, match="ValueError: no"):
        python("raise ValueError('no')")
    with pytest.raises(RuntimeError, match="timeout"):
        python_tool(timeout_s=0.5)("while True: pass")
    out = run_calls([ToolCall("python", "import socket; socket.create_connection(('1.1.1.1', 80), 1)")],
                    tools_by_name([python]), 10.0)[0]
    assert out.error


def test_model_text_that_is_not_python_leaves_no_syntax_warning_in_the_log():
    """`3if` in a calculator call or a tool call's arguments is an error result, and Python's
    tokenizer no longer prints `<unknown>:1: SyntaxWarning: invalid decimal literal` to stderr
    (the default warning filters, as a user's run has them)."""
    import subprocess
    import sys

    code = ("from posttrain.envs import calculator, run_calls, ToolCall\n"
            "from posttrain.envs.tools import tools_by_name\n"
            "try:\n    calculator('3if 2')\nexcept SyntaxError as e:\n    print('error:', e.msg)\n"
            "print(run_calls([ToolCall('calculator', '3if 2')], tools_by_name([calculator]), 5.0)[0].text)\n")
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("error: ")
    assert "SyntaxError" in out.stdout.splitlines()[1]
    assert "SyntaxWarning" not in out.stderr, out.stderr
