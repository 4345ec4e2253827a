"""Environments of the bundled tool-use tasks (`posttrain.data.tasks`).

    env = ArithmeticTools()                      # rollout.env=arithmetic_tools
    env.reset({"prompt": "23*47+58*91=", "answer": "6359"})
    env.step("<call>calculator(23*47)</call>")   # StepResult("<result>1081</result>", ...)
    env.step("\\nAnswer: 6359")                  # done, reward 1.0

The prompt is the task's prompt as it is (no tool description is appended), so an SFT
demonstration (`posttrain data make arithmetic_tools`) and an RL episode see the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from posttrain.data.tasks import ArithmeticToolsTask
from posttrain.envs.builtin_tools import calculator
from posttrain.envs.tool_env import ToolEnvironment


class ArithmeticTools(ToolEnvironment):
    """The calculator, and the `arithmetic_tools` scorer on the final answer (reward 1 right,
    0 wrong); `row["answer"]` is the expected value.

    Args:
        tools: the tools (default: the calculator).
        timeout_s: wall-clock limit of each call.
    """

    columns = ("answer",)
    """The data columns the episode reads (`registry.check_environment_columns`)."""

    def __init__(self, tools: Sequence[Callable[..., Any]] = (calculator,), timeout_s: float = 5.0):
        super().__init__(tools=tools, timeout_s=timeout_s, describe_tools=False)
        self.task = ArithmeticToolsTask()

    def score(self, answer: str) -> float:
        return self.task.score(answer, str(self.row["answer"]))
