"""Environments and tools from names and paths (a user environment loaded from a file), and
the guess-the-number game."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.envs import (
    GuessNumber,
    StepResult,
    calculator,
    python,
    resolve_environment,
    resolve_tools,
)


def test_a_user_environment_loads_from_a_file_path(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(textwrap.dedent('''
        from posttrain.envs import ToolEnvironment

        class Shop(ToolEnvironment):
            def price(self, item: str) -> str:
                """Price of an item.

                Args:
                    item: Its name.
                """
                return {"apple": "40"}[item]
    '''))
    factory = resolve_environment(f"{path}:Shop")
    env = factory()
    assert env is not factory() and sorted(env.tools) == ["price"]
    env.reset({"prompt": "?"})
    assert env.step("<call>price(apple)</call>").observation == "<result>40</result>"


def test_an_environment_from_a_file_pickles_by_value(tmp_path):
    """Another process (a Ray worker) cannot import the file's module by its made-up name:
    cloudpickle sends the class with its code (`rewards.registry.pickle_file_modules_by_value`)."""
    cloudpickle = pytest.importorskip("cloudpickle")
    (tmp_path / "far_envs.py").write_text(textwrap.dedent('''
        from posttrain.envs import GuessNumber

        class Far(GuessNumber):
            def reset(self, row):
                return "far" + super().reset(row)
    '''))
    blob = tmp_path / "env.pkl"
    blob.write_bytes(cloudpickle.dumps(resolve_environment(f"{tmp_path / 'far_envs.py'}:Far")))
    code = ("import pickle, sys; env = pickle.loads(open(sys.argv[1], 'rb').read())(); "
            "assert env.reset({'secret': 2}).startswith('far Guess'), env")
    src = str(Path(__file__).resolve().parents[2] / "src")
    subprocess.run([sys.executable, "-c", code, str(blob)], check=True, env={**os.environ, "PYTHONPATH": src})


def test_a_module_in_the_working_folder_loads_by_module_name_and_pickles_by_value(tmp_path, monkeypatch):
    """`rollout.env=cwd_shop:Shop` as `python -m` finds it, from the `posttrain` script too (whose
    sys.path holds its bin folder, not the working folder); sent by value, as a file's class."""
    import pickle

    cloudpickle = pytest.importorskip("cloudpickle")
    from posttrain.rewards.registry import FILE_MODULES

    (tmp_path / "cwd_shop.py").write_text(textwrap.dedent('''
        from posttrain.envs import GuessNumber

        class Shop(GuessNumber):
            def reset(self, row):
                return "shop" + super().reset(row)
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and Path(p).resolve() != tmp_path.resolve()])
    try:
        factory = resolve_environment("cwd_shop:Shop")
        assert factory().reset({"secret": 2}).startswith("shop Guess")
        assert FILE_MODULES["cwd_shop"] is sys.modules["cwd_shop"]
        blob = cloudpickle.dumps(factory)
    finally:
        module = FILE_MODULES.pop("cwd_shop", None)
        sys.modules.pop("cwd_shop", None)
        if module is not None:
            cloudpickle.unregister_pickle_by_value(module)
    sys.path.remove(os.getcwd())  # not importable now: the class must travel with its code
    assert pickle.loads(blob)().reset({"secret": 2}).startswith("shop Guess")


def test_names_callables_and_bad_specs():
    assert resolve_environment("guess_number") is GuessNumber
    assert resolve_environment(GuessNumber) is GuessNumber
    assert resolve_environment("posttrain.envs:GuessNumber") is GuessNumber
    with pytest.raises(ValueError, match="unknown environment 'nope'.*guess_number"):
        resolve_environment("nope")
    with pytest.raises(ValueError, match="environment 'no/such.py:Env'.*no such file"):
        resolve_environment("no/such.py:Env")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        resolve_environment("posttrain.envs:Nope")


def test_tools_resolve_from_names_and_paths(tmp_path):
    (tmp_path / "t.py").write_text("def shout(text: str) -> str:\n    return text.upper()\n")
    tools = resolve_tools(["calculator", "python", f"{tmp_path / 't.py'}:shout", len])
    assert tools[:2] == [calculator, python] and tools[2]("a") == "A" and tools[3] is len
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        resolve_tools(["abacus"])


def play(secret, guesses):
    env = GuessNumber()
    env.reset({"prompt": "?", "secret": secret, "low": 1, "high": 100})
    return [env.step(g) for g in guesses]


def test_the_game_says_higher_or_lower_and_fewer_turns_earn_more():
    steps = play(37, ["<call>guess(50)</call>", "<call>guess(25)</call>", "<call>guess(37)</call>"])
    assert [s.observation for s in steps[:2]] == ["<result>lower</result>", "<result>higher</result>"]
    assert steps[2] == StepResult("", 1 / 3, True, {"tool_calls": 1})
    assert play(37, ["<call>guess(37)</call>"])[0].reward == 1.0
    assert sum(s.reward for s in steps) == pytest.approx(1 / 3)


def test_the_game_answers_bad_guesses_with_errors_and_ends_without_a_guess():
    steps = play(5, ["<call>guess(x)</call>", "<call>guess(500)</call>", "<call>look(1)</call>", "<call>5</call>", "I give up"])
    assert [s.info.get("tool_errors") for s in steps] == [1, 1, 1, 1, None]
    assert "integer" in steps[0].observation and "from 1 to 100" in steps[1].observation
    assert "unknown tool 'look'" in steps[2].observation and "malformed" in steps[3].observation
    assert steps[4].done and steps[4].reward == 0.0
    with pytest.raises(ValueError, match="outside"):
        GuessNumber().reset({"secret": 0})
