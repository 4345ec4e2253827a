"""Reward functions for online RL: built-ins, a registry, a robust runner, an LLM judge.

    from posttrain.rewards import RewardRunner, resolve_reward

    runner = RewardRunner.from_specs(
        ["math_accuracy", {"name": "format_reward"}, "my_rewards.py:brevity"],
        weights=[1.0, 0.2, 0.1], timeout_s=10.0,
    )
    result = runner.score(prompts, completions, completion_ids, {"answer": answers})

Every reward function has TRL's signature, `fn(prompts, completions, completion_ids,
**columns) -> list[float | None]`. How None, NaN, errors and timeouts are handled is written
once, in `posttrain.rewards.runner`. Generated code only ever runs in
`posttrain.rewards.sandbox`.
"""

from posttrain.rewards.builtin import (
    BUILTIN_REWARDS,
    REWARD_FACTORIES,
    code_tests,
    completion_text,
    env_reward,
    exact_match,
    extract_code,
    extract_final_answer,
    format_reward,
    math_accuracy,
    normalize_answer,
    overlong_penalty,
    task_reward,
)
from posttrain.rewards.judge import JudgeError, LLMJudge, llm_judge
from posttrain.rewards.registry import load_object, resolve_reward
from posttrain.rewards.runner import RewardResult, RewardRunner

__all__ = [
    "BUILTIN_REWARDS",
    "REWARD_FACTORIES",
    "JudgeError",
    "LLMJudge",
    "RewardResult",
    "RewardRunner",
    "code_tests",
    "completion_text",
    "env_reward",
    "exact_match",
    "extract_code",
    "extract_final_answer",
    "format_reward",
    "llm_judge",
    "load_object",
    "math_accuracy",
    "normalize_answer",
    "overlong_penalty",
    "resolve_reward",
    "task_reward",
]
