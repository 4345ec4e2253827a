"""Environments that misbehave: every call (construction, reset, step) that raises, hangs or
returns a malformed value ends its episode only, counted in env/errors with its reason; the
built-in guess_number on data without its column is refused before the run."""

import json
import sys
import time

import pytest

from posttrain.cli import main
from posttrain.envs import StepResult, play_episodes
from posttrain.rollout import MultiTurnLimits, SamplingParams, make_engine

from .conftest import PROMPT

PARAMS = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
LIMITS = MultiTurnLimits(max_turns=2, max_total_tokens=64, env_timeout_s=0.5)


class Misbehaving:
    """What each call does is chosen by the row's `kind`."""

    def reset(self, row):
        self.kind = row["kind"]
        if self.kind == "reset raises":
            raise KeyError("secret")
        if self.kind == "reset returns an int":
            return 5
        if self.kind == "reset hangs":
            time.sleep(3)
        return None

    def step(self, action):
        if self.kind == "step exits":
            sys.exit(3)
        bad = {"reward is text": StepResult("", reward="high", done=True),
               "info is None": StepResult("", reward=1.0, done=True, info=None),
               "observation is an int": StepResult(42, reward=0.0, done=False)}
        return bad.get(self.kind, StepResult("", reward=1.0, done=True))


REASONS = {  # kind -> what env/errors' reason says
    "reset raises": "reset raised KeyError: 'secret' at",
    "reset returns an int": "reset returned 5 (int), not a string or None",
    "reset hangs": "reset raised TimeoutError: not finished within 0.5 s",
    "step exits": "step raised SystemExit: 3 at",
    "reward is text": "step returned reward 'high' (str), not a finite number or None",
    "info is None": "step returned info None (NoneType), not a dict",
    "observation is an int": "step returned observation 42 (int), not a string",
}


def test_every_misbehaving_call_ends_its_episode_only_with_its_reason(taught, tok):
    rows = [{"prompt": PROMPT, "kind": kind} for kind in [*REASONS, "fine"]]
    start = time.monotonic()
    out, rewards, metrics = play_episodes(make_engine("native", taught, tok), rows, Misbehaving, PARAMS, LIMITS)
    assert time.monotonic() - start < 2.5  # the hanging reset is abandoned after env_timeout_s
    for row, (kind, reason) in enumerate(REASONS.items()):
        assert out.turns[row] == 1 and reason in out.infos[row][-1]["env_error"], kind
    assert "test_misbehaving.py" in out.infos[0][-1]["env_error"]  # the user's file:line
    assert out.turns[-1] == 1 and "env_error" not in out.infos[-1][-1] and rewards[-1] == 1.0
    assert metrics["env/errors"] == len(REASONS)


def test_a_constructor_that_raises_ends_its_episodes_and_the_batch_goes_on(taught, tok, caplog):
    def broken():
        raise RuntimeError("no licence")

    out, rewards, metrics = play_episodes(make_engine("native", taught, tok), [{"prompt": PROMPT}] * 2,
                                          broken, PARAMS, LIMITS)
    assert metrics["env/errors"] == 2 and rewards.isnan().all()
    assert all("constructor raised RuntimeError: no licence at" in i[-1]["env_error"] for i in out.infos)
    assert "environment 'test_a_constructor_that_raises_ends_its_episodes_and_the_batch_goes_on.<locals>.broken'" \
        " constructor raised RuntimeError: no licence" in caplog.text


def test_env_timeout_s_is_one_setting_from_the_config():
    from posttrain.config import GRPOConfig, build_config

    cfg = build_config(GRPOConfig, overrides=["rollout.multi_turn.env_timeout_s=2.5"])
    assert MultiTurnLimits.from_config(cfg.rollout.multi_turn).env_timeout_s == 2.5


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_guess_number_without_its_column_is_refused_before_the_run(tmp_path, capsys, backend):
    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"prompt": "Guess my number."}) + "\n")
    code = main(["grpo", "model.init=tiny", f"data.train_files=[{data}]", "rollout.env=guess_number",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.report_to=[]", f"trainer.backend={backend}",
                 "data.train_batch_size=1", "rollout.n=2", "actor.micro_batch_size=2", "trainer.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "rollout.env: environment 'GuessNumber' reads the column(s) ['secret'] of each row" in err
    assert not (tmp_path / "run" / "final").exists()
