"""Environments in the episode loop: a real tool-use episode on a tiny built-in model, the
mask on the environment's answers, environment rewards, failures counted, metrics."""

import math
import time

import pytest
import torch

from posttrain.envs import EnvironmentTurns, StepResult, ToolEnvironment, calculator, play_episodes
from posttrain.rollout import MultiTurnLimits, SamplingParams, make_engine

from .conftest import DEMO, PROMPT

GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=48)
LIMITS = MultiTurnLimits(max_turns=4, max_total_tokens=160)


class Arithmetic(ToolEnvironment):
    def __init__(self, **kw):
        super().__init__(tools=[calculator], describe_tools=False, **kw)

    def score(self, answer: str) -> float:
        return float(answer.strip().endswith(str(self.row["answer"])))


@pytest.fixture(scope="module", params=["native", "hf"])
def engine(request, taught, tok, tmp_path_factory):
    if request.param == "native":
        return make_engine("native", taught, tok)
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("taught")
    taught.save_pretrained(path)
    return make_engine("hf", LlamaForCausalLM.from_pretrained(path, local_files_only=True).eval(), tok)


def test_a_tool_use_episode_runs_the_calls_and_masks_the_results(engine, tok):
    rows = [{"prompt": PROMPT, "answer": 1086}]
    out, rewards, metrics = play_episodes(engine, rows, Arithmetic, GREEDY, LIMITS)
    assert out.texts == [DEMO] * 2  # the calculator's answers are the ones the model was taught
    assert out.turn_texts[0] == [" <call>calculator(23*47)</call>", " 1081+5 <call>calculator(1081+5)</call>", " A: 1086"]
    assert out.turns.tolist() == [3, 3] and out.prompt_index.tolist() == [0, 0]
    ids = out.response_ids[0, : int(out.total_lengths[0])].tolist()
    expected = []
    for piece, from_model in [(" <call>calculator(23*47)</call>", 1), ("<result>1081</result>", 0),
                              (" 1081+5 <call>calculator(1081+5)</call>", 1), ("<result>1086</result>", 0),
                              (" A: 1086", 1)]:
        expected += [from_model] * len(tok(piece, add_special_tokens=False)["input_ids"])
    expected.append(1)  # EOS
    assert ids[-1] == tok.eos_token_id and out.response_mask[0, : len(ids)].tolist() == expected
    assert int(out.lengths[0]) == sum(expected) == len(ids) - 42  # two 21-byte results
    assert rewards.tolist() == [1.0, 1.0]
    assert metrics == {
        "turns/mean": 3.0, "turns/max": 3.0, "tool_calls/mean": 2.0, "tool/errors": 0.0,
        "tool/timeouts": 0.0, "env/errors": 0.0, "env/reward/mean": 1.0, "episode/truncated": 0.0,
    }


def test_tool_failures_are_answered_counted_and_never_crash(taught, tok):
    def broken(expression: str) -> str:
        """Fails or hangs.

        Args:
            expression: Ignored.
        """
        if "47" in expression:
            raise ArithmeticError("no")
        time.sleep(5)
        return "late"

    class Broken(ToolEnvironment):
        def __init__(self):
            super().__init__(tools=[broken], timeout_s=0.3, describe_tools=False)

    rows = [{"prompt": PROMPT}]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=48)
    out, rewards, metrics = play_episodes(make_engine("native", taught, tok), rows, Broken, params, LIMITS)
    text = out.texts[0]
    assert "<result>error: unknown tool 'calculator'; tools: broken</result>" in text
    assert metrics["tool/errors"] >= 1 and metrics["tool_calls/mean"] >= 1
    assert math.isnan(rewards[0]) and math.isnan(metrics["env/reward/mean"])


def test_an_environment_that_raises_or_hangs_ends_its_episode_only(taught, tok):
    class Flaky:
        calls = 0

        def __init__(self):
            type(self).calls += 1
            self.kind = type(self).calls % 3

        def reset(self, row):
            return None

        def step(self, action):
            if self.kind == 1:
                raise RuntimeError("env bug")
            if self.kind == 2:
                time.sleep(3)
            return StepResult("<result>ok</result>", reward=0.5, done=False)

    engine = make_engine("native", taught, tok)
    turns = EnvironmentTurns([Flaky() for _ in range(3)], tok, timeout_s=0.5)
    out = engine.generate_episodes([PROMPT] * 3, SamplingParams(n=1, temperature=0.0, max_new_tokens=48,
                                                                stop=("</call>",)), MultiTurnLimits(2, 160), turns)
    kinds = [e.kind for e in turns.envs]
    for row, kind in enumerate(kinds):
        if kind in (1, 2):
            assert out.turns[row] == 1 and "env_error" in out.infos[row][0] and out.finish_reason[row] == "stop"
        else:
            assert out.turns[row] == 2 and out.truncated[row]  # max_turns
    assert "TimeoutError" in out.infos[kinds.index(2)][0]["env_error"]


def test_observation_tokens_condition_later_model_tokens(taught, tok):
    """A calculator off by 1000: the model tokens after its answer get other log-probs (the
    model reads the observation); the turn before it is untouched."""

    def calculator_off(expression: str) -> str:
        """Off by one thousand.

        Args:
            expression: Arithmetic.
        """
        return calculator(expression + "+1000")

    def play(tool):
        env = ToolEnvironment(tools=[tool], describe_tools=False)
        env.tools = {"calculator": env.tools[tool.__name__]}  # the name the model was taught
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=48, stop=("</call>",))
        return make_engine("native", taught, tok).generate_episodes([PROMPT], params, LIMITS, EnvironmentTurns([env], tok))

    right, off = play(calculator), play(calculator_off)
    assert "<result>1081</result> 1081+5" in right.texts[0]
    assert "<result>2081</result> 1081+5" in off.texts[0]  # the same greedy tokens after it
    first_turn = len(tok(" <call>calculator(23*47)</call>", add_special_tokens=False)["input_ids"])
    assert torch.equal(right.logprobs[0, :first_turn], off.logprobs[0, :first_turn])
    second_turn = right.response_mask[0].bool() & (torch.arange(right.response_ids.shape[1]) > first_turn)
    assert torch.equal(right.response_ids[0, second_turn], off.response_ids[0, second_turn])
    assert (right.logprobs[0, second_turn] - off.logprobs[0, second_turn]).abs().max() > 1e-4


def test_episode_metrics_of_several_batches_merge_by_rows_counts_summed():
    from posttrain.envs import merge_episode_metrics

    a = {"turns/mean": 2.0, "turns/max": 3.0, "tool_calls/mean": 1.0, "tool/errors": 1.0, "tool/timeouts": 0.0,
         "env/errors": 0.0, "env/reward/mean": 0.5, "episode/truncated": 0.0}
    b = {**a, "turns/mean": 4.0, "turns/max": 4.0, "tool/errors": 2.0, "env/reward/mean": math.nan,
         "episode/truncated": 1.0}
    m = merge_episode_metrics([(1, a), (3, b)])
    assert m["turns/mean"] == (2 + 3 * 4) / 4 and m["turns/max"] == 4.0 and m["episode/truncated"] == 0.75
    assert m["tool/errors"] == 3.0 and m["env/reward/mean"] == 0.5  # the batch without rewards is left out
    assert math.isnan(merge_episode_metrics([(3, b)])["env/reward/mean"])
