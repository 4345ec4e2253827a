"""An exception in the user's own code (an environment, a reward function) is said in one
line: the object, the exception's class and message, and the file:line of the user's code
that raised it; the same line from the CLI, the Python API and a Ray worker (the error
pickles as itself)."""

import json
import pickle
import textwrap

import pytest

from posttrain.cli import main
from posttrain.rewards import load_object
from posttrain.user_code import UserCodeError, describe, user_code

USER_FILE = textwrap.dedent('''
    from posttrain.envs import GuessNumber

    def lookup(row):
        return row["secret"]

    class NoSecret(GuessNumber):
        def reset(self, row):
            return f"{lookup(row)}"

        columns = ()  # so the run starts on data without `secret` (GuessNumber's check)
''')
RAISING_LINE = 5  # `return row["secret"]`, under `reset`'s call


def test_the_error_names_the_object_its_class_and_the_users_line(tmp_path):
    path = tmp_path / "user_envs.py"
    path.write_text(USER_FILE)
    env = load_object(f"{path}:NoSecret")()
    with pytest.raises(UserCodeError) as caught:
        with user_code("environment 'NoSecret'"):
            env.reset({"prompt": "guess"})
    message = str(caught.value)
    assert message == f"environment 'NoSecret' raised KeyError: 'secret' at {path}:{RAISING_LINE} (in lookup)"
    assert isinstance(caught.value.__cause__, KeyError)
    assert str(pickle.loads(pickle.dumps(caught.value))) == message  # a Ray worker sends it as it is
    with pytest.raises(UserCodeError, match="^environment 'NoSecret' raised"):  # an inner one is not rewrapped
        with user_code("reward function 'outer'"):
            raise caught.value
    assert describe("x", ValueError("never raised")) == "x raised ValueError: never raised"


def test_a_file_that_fails_to_load_is_said_with_its_line(tmp_path):
    (tmp_path / "typo.py").write_text("import math\n\nvalue = math.tau()\n")
    (tmp_path / "unfinished.py").write_text("def reward(:\n")
    with pytest.raises(UserCodeError, match=rf"^the file '{tmp_path / 'typo.py'}' raised TypeError: 'float' object "
                                            rf"is not callable at {tmp_path / 'typo.py'}:3 \(in <module>\)$"):
        load_object(f"{tmp_path / 'typo.py'}:reward")
    with pytest.raises(UserCodeError, match=rf"raised SyntaxError: .* at {tmp_path / 'unfinished.py'}:1 \(in <module>\)$"):
        load_object(f"{tmp_path / 'unfinished.py'}:reward")


def test_an_environment_whose_reset_raises_is_counted_and_said_in_one_line(tmp_path, capsys, caplog):
    (tmp_path / "user_envs.py").write_text(USER_FILE)
    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"prompt": "guess"}) + "\n")  # no `secret` column
    code = main(["grpo", "model.init=tiny", f"data.train_files=[{data}]", f"rollout.env={tmp_path / 'user_envs.py'}:NoSecret",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.report_to=[]", "trainer.progress=false",
                 "trainer.max_steps=1", "data.train_batch_size=1", "rollout.n=2", "actor.micro_batch_size=2", "rollout.max_new_tokens=2",
                 "rollout.multi_turn.max_turns=1", "data.shuffle=false", "algorithm.overlong.buffer=0"])
    err = capsys.readouterr().err
    assert code == 0  # the run goes on: both episodes ended at once, counted
    assert (f"environment 'NoSecret' reset raised KeyError: 'secret' at "
            f"{tmp_path / 'user_envs.py'}:{RAISING_LINE} (in lookup)") in caplog.text
    assert "Traceback" not in err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["env/errors"] for m in metrics if "env/errors" in m] == [2.0]
