"""The tool task's environment replays its own SFT demonstrations: the model turns of a
demonstration, stepped through `ArithmeticTools`, get back exactly the results it shows,
and the final answer is rewarded."""

import random

from posttrain.data.tasks import ArithmeticToolsTask
from posttrain.envs import ArithmeticTools, resolve_environment
from posttrain.envs.text_protocol import CALL_END, RESULT_END


def model_turns(completion):
    """The demonstration's model turns: each ends on a call, the results cut out."""
    turns, rest = [], completion
    while CALL_END in rest:
        turn, rest = rest.split(CALL_END, 1)
        turns.append(turn + CALL_END)
        rest = rest.split(RESULT_END, 1)[1]
    return turns + [rest]


def test_a_demonstration_is_an_episode_of_the_environment():
    for row in ArithmeticToolsTask(difficulty="hard").generate(20, random.Random(1)):
        env = resolve_environment("arithmetic_tools")()
        assert env.reset(row) is None  # the prompt is the task's, as in the SFT data
        replay = ""
        turns = model_turns(row["completion"])
        for turn in turns[:-1]:
            result = env.step(turn)
            assert not result.done and result.info["tool_calls"] == 1 and result.info["tool_errors"] == 0
            replay += turn + result.observation
        final = env.step(turns[-1])
        assert final.done and final.reward == 1.0 and replay + turns[-1] == row["completion"]


def test_a_wrong_final_answer_earns_zero():
    env = ArithmeticTools()
    env.reset({"prompt": "2*3+4*5=", "answer": "26"})
    assert env.step("\nAnswer: 25").reward == 0.0
