"""ToolEnvironment: steps, final answers, failures counted, methods as tools."""

import time

from posttrain.envs import Environment, StepResult, ToolEnvironment, calculator


class Dictionary(ToolEnvironment):
    """An environment whose public methods are its tools (TRL's environment_factory)."""

    def define(self, word: str) -> str:
        """Define a word.

        Args:
            word: The word.
        """
        return {"cat": "a small feline"}[word]

    def nap(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "rested"

    def score(self, answer: str) -> float:
        return float(self.row["answer"] in answer)


def test_a_tool_call_is_answered_and_the_final_answer_ends_the_episode():
    env = ToolEnvironment(tools=[calculator])
    assert isinstance(env, Environment)
    assert env.reset({"prompt": "23*47=?"}).startswith(" Tools: calculator(expression)")
    step = env.step("I will compute <call>calculator(23*47)</call>")
    calls = [{"name": "calculator", "arguments": "23*47", "result": "1081", "error": False}]
    assert step == StepResult("<result>1081</result>", None, False,
                              {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "calls": calls})
    final = env.step("The answer is 1081.")
    assert final.done and final.reward is None and final.info == {"tool_calls": 0}


def test_failures_become_error_results_and_are_counted():
    env = Dictionary(tools=[calculator], timeout_s=0.5, max_calls_per_turn=5)
    env.reset({"prompt": "?", "answer": "feline"})
    step = env.step(
        "<call>define(cat)</call><call>define(dog)</call><call>nap(5)</call>"
        "<call>calculator(1/0)</call><call>oops</call><call>define(cat)</call>"
    )
    results = step.observation.split("</result>")[:-1]
    assert results[0] == "<result>a small feline"
    assert results[1] == "<result>error: KeyError: 'dog'"
    assert "timed out" in results[2]
    assert results[3] == "<result>error: ZeroDivisionError: division by zero"
    assert results[4].startswith("<result>error: malformed call 'oops'")
    assert results[5] == "<result>error: more than 5 calls in one turn"
    calls = step.info.pop("calls")
    assert step.info == {"tool_calls": 6, "tool_errors": 5, "tool_timeouts": 1} and not step.done
    assert [(c["name"], c["arguments"], c["error"]) for c in calls] == [
        ("define", "cat", False), ("define", "dog", True), ("nap", "5", True), ("calculator", "1/0", True),
        (None, "oops", True), ("define", "cat", True)]
    assert [c["result"] for c in calls] == [r.removeprefix("<result>") for r in results]
    assert env.step("It is a feline.").reward == 1.0


def test_public_methods_are_tools_and_the_base_methods_are_not():
    env = Dictionary()
    assert sorted(env.tools) == ["define", "nap"]
    assert [s["function"]["name"] for s in env.schemas] == ["define", "nap"]
