"""evaluate(), pass@k and the SFT-facing evaluate_task, on a tiny built-in model (CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.data.tokenizer import build_tokenizer
from posttrain.evaluation import (
    EvalReport,
    evaluate,
    evaluate_task,
    pass_at_k,
    pass_at_k_values,
    summarize,
)
from posttrain.models import BuiltinLM
from posttrain.rewards import RewardRunner
from posttrain.rollout import SamplingParams, make_engine

PROMPTS = ["12+3=", "hello", "7*8=", "a"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ).eval()


def equals_expected(completions, expected, **kwargs):
    """1.0 when the completion is exactly the row's `expected` text."""
    return [float(c == e) for c, e in zip(completions, expected)]


def always(value):
    def reward(completions, **kwargs):
        return [value] * len(completions)

    return reward


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c = 3 < k: every 4-subset holds a correct sample
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomials_and_stays_stable_for_large_n():
    for n, c, k in [(10, 3, 4), (20, 7, 5), (16, 1, 16)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    # C(2000, 1000) overflows a float; the product form does not.
    assert 0 < pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize(("n", "ks"), [(1, [1]), (4, [1, 2, 4]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8])])
def test_pass_at_k_values_are_powers_of_two_and_n(n, ks):
    assert pass_at_k_values(n) == ks


def test_summarize_averages_pass_at_k_over_prompts():
    # Two prompts, n = 4: one right once, one right every time.
    correct = [True, False, False, False, True, True, True, True]
    samples = [
        {"correct": c, "reward": float(c), "rewards": {"r": float(c)}, "length": 3 + i, "finish_reason": "stop"}
        for i, c in enumerate(correct)
    ]
    samples[-1]["finish_reason"] = "length"
    m = summarize(samples, 4, ["r"])
    assert m["accuracy"] == 5 / 8
    assert m["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["pass@2"] == pytest.approx((0.5 + 1.0) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert m["pass@4"] == 1.0
    assert m["response_length/mean"] == 6.5 and m["response_length/max"] == 10
    assert m["truncation_rate"] == 1 / 8
    assert m["reward/mean"] == m["reward/r/mean"] == 5 / 8
    assert m["reward/min"] == 0.0 and m["reward/max"] == 1.0
    assert m["reward/std"] == pytest.approx(math.sqrt((5 * 0.375**2 + 3 * 0.625**2) / 7))
    assert m["num_prompts"] == 2 and m["num_samples"] == 8


# ---------------------------------------------------------------- evaluate


def test_greedy_completions_scored_against_themselves(model, tok):
    """The greedy text is deterministic: rows expecting it are right, rows expecting
    something else are wrong, so accuracy and every pass@k are exactly 1/2."""
    greedy = make_engine("native", model, tok).generate(
        PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    ).texts[::2]
    rows = [
        {"prompt": p, "expected": g if i % 2 == 0 else g + "never"}
        for i, (p, g) in enumerate(zip(PROMPTS, greedy))
    ]
    runner = RewardRunner([("equals_expected", equals_expected)])
    report = evaluate(model, tok, rows, runner, n=2, temperature=0.0, max_new_tokens=8, batch_size=len(rows))
    assert [s["correct"] for s in report.samples] == [True, True, False, False] * 2
    assert report.metrics["accuracy"] == 0.5
    assert report.metrics["pass@1"] == report.metrics["pass@2"] == 0.5
    assert report.metrics["reward/equals_expected/mean"] == 0.5


def test_sampled_eval_metrics_agree_with_the_samples(model, tok):
    rows = [{"prompt": p, "answer": "x"} for p in PROMPTS[:3]]
    runner = RewardRunner([("half", always(0.5)), ("one", always(1.0))], weights=[1.0, 0.5])
    report = evaluate(model, tok, rows, runner, n=3, temperature=1.0, max_new_tokens=6, batch_size=2, seed=3)
    s, m = report.samples, report.metrics
    assert len(s) == 9
    assert [x["prompt_index"] for x in s] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [x["sample_index"] for x in s] == [0, 1, 2] * 3
    assert all(x["prompt"] == rows[x["prompt_index"]]["prompt"] and x["answer"] == "x" for x in s)
    assert m["response_length/mean"] == pytest.approx(sum(x["length"] for x in s) / 9)
    assert m["response_length/max"] == max(x["length"] for x in s) <= 6
    assert m["truncation_rate"] == pytest.approx(sum(x["finish_reason"] == "length" for x in s) / 9)
    assert all(x["finish_reason"] == "stop" or x["length"] == 6 for x in s)
    # total = 1.0 * 0.5 + 0.5 * 1.0 = 1.0 >= the default threshold: every sample is correct.
    assert all(x["reward"] == 1.0 and x["rewards"] == {"half": 0.5, "one": 1.0} for x in s)
    assert m["accuracy"] == m["pass@1"] == m["pass@3"] == 1.0
    assert m["reward/half/mean"] == 0.5 and m["reward/one/mean"] == 1.0 and m["reward/std"] == 0.0
    assert m["reward/half/errors"] == 0.0
    assert report.settings["n"] == 3 and report.settings["engine"] == "native"
    again = evaluate(model, tok, rows, runner, n=3, temperature=1.0, max_new_tokens=6, batch_size=2, seed=3)
    assert [x["completion"] for x in again.samples] == [x["completion"] for x in s]


def test_threshold_decides_correctness(model, tok):
    rows = [{"prompt": p} for p in PROMPTS[:2]]
    runner = RewardRunner([("partial", always(0.5))])
    strict = evaluate(model, tok, rows, runner, max_new_tokens=2)
    lenient = evaluate(model, tok, rows, runner, max_new_tokens=2, correct_threshold=0.5)
    assert strict.metrics["accuracy"] == 0.0 and lenient.metrics["accuracy"] == 1.0
    assert strict.metrics["reward/mean"] == lenient.metrics["reward/mean"] == 0.5


def test_conversational_prompts_get_the_chat_template_and_message_completions(model, tok):
    seen = []

    def record(prompts, completions, **kwargs):
        seen.extend(completions)
        return [1.0] * len(completions)

    messages = [{"role": "user", "content": "hi"}]
    report = evaluate(model, tok, [{"prompt": messages}], RewardRunner([("record", record)]), max_new_tokens=4)
    text = report.samples[0]["completion"]
    assert seen == [[{"role": "assistant", "content": text}]]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    direct = make_engine("native", model, tok).generate([ids], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert direct.texts[0] == text


def test_report_writes_eval_json_and_samples(model, tok, tmp_path):
    report = evaluate(model, tok, [{"prompt": "1+1="}], RewardRunner([("one", always(1.0))]), n=2,
                      temperature=1.0, max_new_tokens=3)
    assert isinstance(report, EvalReport)
    paths = report.write(tmp_path / "out")
    summary = json.loads(paths["eval"].read_text())
    assert summary["metrics"]["accuracy"] == 1.0 and summary["settings"]["n"] == 2
    lines = paths["samples"].read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["correct"] is True
    assert report.table().splitlines()[0].split() == ["accuracy", "1"]


def test_evaluate_task_keeps_the_sft_contract(model, tok):
    rows = [{"prompt": "1+2=", "answer": "3", "completion": "Answer: 3"}, {"prompt": "2+2=", "answer": "4"}]
    metrics, samples = evaluate_task(model, tok, rows, "arithmetic", max_new_tokens=4, batch_size=1)
    assert set(metrics) == {"accuracy", "response_length/mean", "truncation_rate"}
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert [set(s) for s in samples] == [{"prompt", "completion", "answer", "score"}] * 2
    assert [s["answer"] for s in samples] == ["3", "4"]
    assert metrics["accuracy"] == sum(s["score"] for s in samples) / 2
