"""Preference pairs: tokenisation, truncation, the concatenated collator, errors, synthetic pairs."""

import json
import random

import pytest

from posttrain.cli import main
from posttrain.data.collate import IGNORE_INDEX, tokenize_example
from posttrain.data.formats import DataFormatError
from posttrain.data.make_preferences import ERRORS, _Sampler, make_preferences, solve_with_mistake
from posttrain.data.preference import encode_pair, load_pairs, pair_collate, tokenize_pairs
from posttrain.data.sources import load_rows
from posttrain.data.tasks import get_task, make_task
from posttrain.data.tasks.arithmetic import solve
from posttrain.data.tokenizer import build_tokenizer
from posttrain.rewards.reward_model import encode_for_reward


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def b(text):
    """Ids of the built-in byte tokenizer: byte + 6."""
    return [6 + c for c in text.encode()]


def test_explicit_pair_tokens_by_hand(tok):
    ex, outcome, cut = encode_pair({"prompt": "2+3=", "chosen": "5", "rejected": "6"}, tok, "preference", 64)
    assert (outcome, cut) == ("kept", False)
    assert ex == {"prompt_ids": [tok.bos_token_id, *b("2+3=")], "chosen_ids": [*b("5"), tok.eos_token_id],
                  "rejected_ids": [*b("6"), tok.eos_token_id]}
    # What the reward model is trained on is what `reward_model` scores at RL time.
    assert ex["prompt_ids"] + ex["chosen_ids"] == encode_for_reward(tok, "2+3=", "5")


def test_implicit_prompt_is_the_shared_prefix(tok):
    explicit, _, _ = encode_pair({"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"}, tok, "preference", 64)
    implicit, _, _ = encode_pair({"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}, tok, "implicit_preference", 64)
    assert implicit == explicit


def test_conversational_pair_uses_the_chat_template(tok):
    prompt = [{"role": "user", "content": "2+3?"}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "5"}],
           "rejected": [{"role": "assistant", "content": "6"}]}
    ex, _, _ = encode_pair(row, tok, "preference", 64)
    full = tokenize_example({"prompt": prompt, "completion": row["chosen"]}, tok, "prompt_completion")
    assert ex["prompt_ids"] + ex["chosen_ids"] == full["input_ids"]
    assert ex["prompt_ids"] == tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ex["prompt_ids"] + ex["chosen_ids"] == encode_for_reward(tok, prompt, row["chosen"])


def test_truncation_is_counted(tok):
    rows = [
        {"prompt": "abcdefgh", "chosen": "x", "rejected": "y"},  # prompt 9 tokens → last 4
        {"prompt": "ab", "chosen": "long answer", "rejected": "z"},  # 3 + 12 > 8 → cut
        {"prompt": "ab", "chosen": "ok", "rejected": "no"},
    ]
    examples, stats = tokenize_pairs(rows, tok, "preference", max_length=8, max_prompt_length=4)
    assert stats.as_dict() == {"n_rows": 3, "n_kept": 3, "n_truncated": 1, "n_dropped": 0, "n_dropped_too_long": 0,
                               "n_dropped_no_loss": 0, "n_prompt_truncated": 1}
    assert examples[0]["prompt_ids"] == b("efgh")  # TRL keeps the end of a long prompt
    assert examples[1]["chosen_ids"] == b("long ")  # 8 − 3 prompt tokens
    assert examples[1]["rejected_ids"] == [*b("z"), tok.eos_token_id]
    examples, stats = tokenize_pairs(rows, tok, "preference", max_length=8, max_prompt_length=4, truncation="drop")
    assert (len(examples), stats.n_dropped_too_long) == (2, 1)
    # A prompt that fills max_length leaves no response token: that pair is dropped.
    examples, stats = tokenize_pairs(rows, tok, "preference", max_length=9)
    assert stats.n_dropped_no_loss == 1 and len(examples) == 2


def test_pair_collate_puts_chosen_then_rejected(tok):
    examples = [
        {"prompt_ids": [1, 10], "chosen_ids": [11, 2], "rejected_ids": [12, 13, 2], "margin": 0.5, "ref_logps": [-1.0, -2.0]},
        {"prompt_ids": [1], "chosen_ids": [14, 2], "rejected_ids": [15, 2], "margin": 1.0, "ref_logps": [-3.0, -4.0]},
    ]
    batch = pair_collate(examples, pad_token_id=0)
    P = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[1, 10, 11, 2, 0], [1, 14, 2, 0, 0], [1, 10, 12, 13, 2], [1, 15, 2, 0, 0]]
    assert batch.labels.tolist() == [[P, P, 11, 2, P], [P, 14, 2, P, P], [P, P, 12, 13, 2], [P, 15, 2, P, P]]
    assert batch.attention_mask.sum(-1).tolist() == [4, 3, 5, 3]
    assert batch.margin.tolist() == [0.5, 1.0]
    assert batch.ref_logps.tolist() == [-1.0, -3.0, -2.0, -4.0]


def test_bad_rows_name_the_row(tmp_path, tok):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    with pytest.raises(DataFormatError, match=r"pairs\.jsonl:2: column 'rejected' is missing"):
        load_pairs(path)
    path.write_text('{"chosen": "same", "rejected": "x"}\n{"chosen": "same", "rejected": "same"}\n')
    rows, fmt = load_pairs(path)
    with pytest.raises(DataFormatError, match=r"pairs\.jsonl:2: .*identical"):
        tokenize_pairs(rows, tok, fmt, 64)
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "margin": 1}\n'
                    '{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}\n')
    rows, fmt = load_pairs(path)
    with pytest.raises(DataFormatError, match=r"pairs\.jsonl:2: column 'margin'"):
        tokenize_pairs(rows, tok, fmt, 64)
    path.write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(DataFormatError, match="prompt/chosen/rejected"):
        load_pairs(path)


# --- synthetic pairs ------------------------------------------------------------------


def test_solve_with_mistake_carries_the_error():
    nums, ops = [37, 85, 2, 4], ["+", "*", "-"]
    assert solve_with_mistake(nums, ops) == solve(nums, ops)
    # Step 0 is 85*2 (products first); off by +1 there flows into both sums.
    value, steps = solve_with_mistake(nums, ops, 0, lambda a, op, c, v: v + 1)
    assert steps == ["85*2=171", "37+171=208", "208-4=204"] and value == 204
    rng = random.Random(0)
    assert ERRORS["operator"](7, "*", 3, 21, rng) in (10, 4)
    assert ERRORS["digit"](7, "+", 5, 12, rng) != 12


def test_constructed_pairs_are_right_and_wrong_and_deterministic(tmp_path):
    info = make_preferences("arithmetic", tmp_path / "a", n_train=300, n_test=50, seed=3)
    make_preferences("arithmetic", tmp_path / "b", n_train=300, n_test=50, seed=3)
    make_preferences("arithmetic", tmp_path / "c", n_train=10, n_test=50, seed=3)
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
    assert (tmp_path / "a" / "test.jsonl").read_bytes() == (tmp_path / "c" / "test.jsonl").read_bytes()
    make_preferences("arithmetic", tmp_path / "d", n_train=300, n_test=50, seed=4)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "d" / "train.jsonl").read_bytes()
    task = get_task("arithmetic")
    train, test = load_rows(info["train"]), load_rows(info["test"])
    assert (len(train), len(test)) == (300, 50)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for row in [*train, *test]:
        assert task.score(row["chosen"], row["answer"]) == 1.0
        assert task.score(row["rejected"], row["answer"]) == 0.0
        assert row["task"] == "arithmetic" and row["source"] == "constructed"
    assert {r["error"] for r in train} == {*ERRORS, "answer_typo"}
    # Held out together with make_task's test split (same seed and n_test).
    make_task("arithmetic", tmp_path / "sft", n_train=100, n_test=50, seed=3)
    assert [r["prompt"] for r in load_rows(tmp_path / "sft" / "test.jsonl")] == [r["prompt"] for r in test]
    assert load_pairs(info["train"])[1] == "preference"


def test_pairs_per_prompt_gives_different_mistakes_and_keeps_the_test_split(tmp_path):
    one = make_preferences("arithmetic", tmp_path / "one", n_train=300, n_test=50, seed=3)
    four = make_preferences("arithmetic", tmp_path / "four", n_train=300, n_test=50, seed=3, pairs_per_prompt=4)
    assert (tmp_path / "one" / "test.jsonl").read_bytes() == (tmp_path / "four" / "test.jsonl").read_bytes()
    train = load_rows(four["train"])
    assert four["n_train"] == len(train) == 300
    by_prompt: dict[str, list[dict]] = {}
    for row in train:
        by_prompt.setdefault(row["prompt"], []).append(row)
    assert len(by_prompt) == 75  # 300 pairs / 4 per prompt
    for rows in by_prompt.values():
        assert len({r["rejected"] for r in rows}) == len(rows) == 4
        assert len({r["chosen"] for r in rows}) == 1
    assert not set(by_prompt) & {r["prompt"] for r in load_rows(one["test"])}
    with pytest.raises(ValueError, match="pairs_per_prompt"):
        make_preferences("arithmetic", tmp_path / "x", n_train=4, n_test=0, pairs_per_prompt=0)


def test_constructed_pairs_show_steps_on_both_sides_whatever_worked_is(tmp_path):
    # `medium` shows the steps in half of its demonstrations (worked=0.5) and worked=0.0 in none:
    # a pair whose chosen skipped them would differ from its rejected in form, not only in the
    # arithmetic, and a reward model could rank by length alone.
    for worked in (0.0, 0.5):
        info = make_preferences("arithmetic", tmp_path / str(worked), n_train=200, n_test=0, seed=0, worked=worked)
        for row in load_rows(info["train"]):
            chosen, rejected = row["chosen"].splitlines(), row["rejected"].splitlines()
            assert len(chosen) == len(rejected) == 4, row  # three steps and the answer line (4 operands)
            if row["error"] == "answer_typo":
                assert chosen[:3] == rejected[:3]


def test_bare_fraction_mixes_forms_evenly_and_keeps_every_pair_right_and_wrong(tmp_path):
    info = make_preferences("arithmetic", tmp_path / "bare", n_train=2000, n_test=50, seed=0, bare_fraction=0.5)
    task = get_task("arithmetic")
    train = load_rows(info["train"])
    forms: dict[str, int] = {}
    for row in train:
        assert task.score(row["chosen"], row["answer"]) == 1.0
        assert task.score(row["rejected"], row["answer"]) == 0.0
        chosen_form, rejected_form = row["form"].split("/")
        for side, form in (("chosen", chosen_form), ("rejected", rejected_form)):
            assert (len(row[side].splitlines()) == 1) == (form == "bare"), row  # 3 operands: steps unless bare
        forms[row["form"]] = forms.get(row["form"], 0) + 1
    # Each of the four combinations near a quarter: the form says nothing about which side is right.
    assert set(forms) == {"worked/worked", "worked/bare", "bare/worked", "bare/bare"}
    assert all(400 <= n <= 600 for n in forms.values()), forms
    guesses = [r for r in train if r["error"] == "guess"]
    assert guesses and {r["rejected"].splitlines()[-1] for r in guesses} & {"Answer: 0", "Answer: 1"}
    assert "form" in load_rows(info["test"])[0]
    assert json.loads(info["meta"].read_text())["bare_fraction"] == 0.5
    # The default writes no form column and the same pairs as before the option existed.
    plain = load_rows(make_preferences("arithmetic", tmp_path / "plain", n_train=50, n_test=0, seed=0)["train"])
    assert all("form" not in r for r in plain) and {r["error"] for r in plain} <= {*ERRORS, "answer_typo"}
    with pytest.raises(ValueError, match="bare_fraction"):
        make_preferences("arithmetic", tmp_path / "x", n_train=4, n_test=0, bare_fraction=1.5)


def _fake_sample(prompts):
    """`2+3=` right on odd samples, wrong on even ones (the first cut at the token limit); `9-9=` always wrong."""
    return [[("Answer: 5" if p == "2+3=" and i % 2 == 1 else "Answer: 7", "stop" if i else "length")
             for i in range(4)] for p in prompts]


def test_sampled_pairs_need_a_right_and_a_wrong_sample():
    sampler = _Sampler(_fake_sample, batch_size=8)
    rows = [{"prompt": "2+3=", "answer": "5", "completion": "Answer: 5"}, {"prompt": "9-9=", "answer": "0", "completion": "Answer: 0"}]
    pairs = sampler.pairs(get_task("arithmetic"), rows)
    assert len(pairs) == 1 and sampler.counts == {"prompts": 2, "all_right": 0, "all_wrong": 1}
    # The wrong sample that stopped on its own (sample 2) is preferred to the cut one (sample 0): same text here.
    assert pairs[0]["chosen"] == "Answer: 5" and pairs[0]["rejected"] == "Answer: 7" and pairs[0]["source"] == "sampled"


def test_sampled_pairs_come_from_any_sample_callable(tmp_path):
    """No model: `sample` is a plain function; prompts reach it `batch_size` at a time."""
    calls = []

    def sample(prompts):  # right on even samples: every prompt gives a pair
        calls.append(len(prompts))
        return [[(f"Answer: {eval(p.rstrip('='))}", "stop"), ("Answer: -99999", "stop")] for p in prompts]

    info = make_preferences("arithmetic", tmp_path / "s", n_train=10, n_test=3, seed=0, sample=sample, batch_size=4,
                            sample_meta={"model": "fake", "samples": 2})
    assert (info["n_train"], info["n_test"]) == (10, 3) and max(calls) <= 4
    assert info["counts"] == {"prompts": sum(calls), "all_right": 0, "all_wrong": 0}
    assert {r["rejected"] for r in load_rows(info["train"])} == {"Answer: -99999"}
    meta = json.loads(info["meta"].read_text())
    assert (meta["source"], meta["model"], meta["samples"]) == ("sampled", "fake", 2)
    with pytest.raises(ValueError, match="pairs_per_prompt > 1 is for constructed"):
        make_preferences("arithmetic", tmp_path / "x", n_train=4, n_test=0, sample=sample, pairs_per_prompt=2)


# sha256 prefixes of train.jsonl, test.jsonl and preferences.json as `posttrain data make-preferences` wrote
# them before the sampling moved out of data/ (commit 015f5f7): the same arguments give the same bytes.
PINNED = {
    "easy": ("8680620a863cff8b", "4d6ecf2373f2e662", "f244e235d6679a52"),
    "bare": ("3b1700abd87e1e12", "6e0486cbf8804890", "32845b865b20fb7e"),
}


def sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_constructed_pairs_keep_their_bytes(tmp_path):
    easy = make_preferences("arithmetic", tmp_path / "easy", n_train=50, n_test=10, seed=0, difficulty="easy")
    bare = make_preferences("arithmetic", tmp_path / "bare", n_train=50, n_test=10, seed=2, pairs_per_prompt=3,
                            bare_fraction=0.5, num_operands=3)  # `medium` had 3 operands then
    for name, info in (("easy", easy), ("bare", bare)):
        assert tuple(sha(info[k]) for k in ("train", "test", "meta")) == PINNED[name], name


def test_cli_make_preferences(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["data", "make-preferences", "--task", "arithmetic", "--out", str(out), "--n-train", "20",
                 "--n-test", "5", "difficulty=easy"]) == 0
    assert "wrote 20 train and 5 test pairs" in capsys.readouterr().out
    rows = load_rows(out / "train.jsonl")
    assert {"prompt", "chosen", "rejected", "answer", "task"} <= rows[0].keys()
    assert main(["data", "make-preferences", "--task", "arithmetic", "--out", str(tmp_path / "k"), "--n-train", "20",
                 "--n-test", "5", "--pairs-per-prompt", "2"]) == 0
    assert len({r["prompt"] for r in load_rows(tmp_path / "k" / "train.jsonl")}) == 10
    assert main(["data", "make-preferences", "--task", "arithmetic", "--out", str(tmp_path / "b"), "--n-train", "40",
                 "--n-test", "5", "--bare-fraction", "0.5"]) == 0
    assert {r["form"].split("/")[0] for r in load_rows(tmp_path / "b" / "train.jsonl")} == {"bare", "worked"}
    assert main(["data", "make-preferences", "--task", "countdown", "--out", str(out)]) == 1
    assert "pass a model" in capsys.readouterr().err


def test_a_huge_response_is_cut_before_tokenising_with_the_same_pair(tok):
    import time

    rows = [{"prompt": "2+2=", "chosen": "4 " * 3_000_000, "rejected": "5"},  # a 6 MB response
            {"prompt": "1+1=", "chosen": "2" * 300, "rejected": "3 " * 100}]
    start = time.perf_counter()
    examples, stats = tokenize_pairs(rows, tok, "preference", max_length=64)
    assert time.perf_counter() - start < 1.0  # before: ≈9 s, the whole response tokenised
    assert stats.n_truncated == 2
    # The same as the whole of each side tokenised, then cut to max_length.
    for row, example in zip(rows, examples):
        full, _, _ = encode_pair({**row, "chosen": row["chosen"][:2000]}, tok, "preference", max_length=64)
        assert example == full and len(example["prompt_ids"]) + len(example["chosen_ids"]) == 64
