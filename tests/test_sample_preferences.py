"""Preference pairs sampled from a model: the engine sampler, its seeds, and the bytes it writes."""

import hashlib
import json
import random
from types import SimpleNamespace

import pytest
import torch

import posttrain.sample_preferences as sp
from posttrain.cli import main
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM


class SeededEngine:
    """Right or wrong by a coin seeded with the call's seed and the prompt, so the pairs depend on every seed."""

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, params):
        self.seeds.append(params.seed)
        texts, reasons = [], []
        for p in prompts:
            rng = random.Random(f"{params.seed}|{p}")
            right = eval(p.rstrip("="))
            for _ in range(params.n):
                texts.append(f"Answer: {right if rng.random() < 0.5 else right + rng.choice((-1, 1))}")
                reasons.append(rng.choice(("stop", "length")))
        return SimpleNamespace(texts=texts, finish_reason=reasons)


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_engine_sampler_groups_by_prompt_loads_once_and_seeds_each_call():
    engine, loads = SeededEngine(), []
    sample = sp.engine_sampler(lambda: loads.append(1) or engine, samples=3, max_new_tokens=8, seed=2)
    first, second = sample(["1+2=", "3*4="]), sample(["5-1="])
    assert [len(s) for s in first] == [3, 3] and len(second) == 1
    assert all(reason in ("stop", "length") for s in first for _, reason in s)
    assert loads == [1] and engine.seeds == [2 * 1_000_003, 2 * 1_000_003 + 1]


def test_sampled_pairs_keep_their_bytes(tmp_path, monkeypatch):
    # sha256 prefixes of the same run (a SeededEngine in place of the model) before the sampling
    # moved out of data/make_preferences.py (commit 015f5f7).
    monkeypatch.setattr(sp, "load_engine", lambda path: SeededEngine())
    info = sp.sample_preferences("arithmetic", tmp_path / "s", "tiny-model", n_train=40, n_test=10, seed=5, samples=4,
                                 num_operands=3)  # `medium` had 3 operands then
    assert (info["n_train"], info["n_test"]) == (40, 8)  # two held-out prompts were all right or all wrong
    assert [sha(info[k]) for k in ("train", "test", "meta")] == ["c87b85d9c46a1b0a", "e1bdc29bb5ef33af",
                                                                "b6f524ab88dce504"]


def test_sampling_from_a_saved_model_is_deterministic_and_the_cli_writes_the_same(tmp_path):
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = BuiltinLM.from_preset("tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    infos = [sp.sample_preferences("arithmetic", tmp_path / o, str(tmp_path / "m"), n_train=2, n_test=2, seed=0,
                                   samples=2, max_new_tokens=4, max_prompts_factor=2) for o in ("a", "b")]
    # A random model is never right: every prompt tried (2 test, 2 · 2 train) is all wrong, none kept.
    assert infos[0]["counts"] == infos[1]["counts"] == {"prompts": 6, "all_right": 0, "all_wrong": 6}
    assert infos[0]["n_train"] == 0
    meta = json.loads((tmp_path / "a" / "preferences.json").read_text())
    assert meta["source"] == "sampled" and meta["sampling"]["all_wrong"] == 6 and meta["samples"] == 2
    assert main(["data", "make-preferences", "--task", "arithmetic", "--out", str(tmp_path / "cli"), "--model",
                 str(tmp_path / "m"), "--n-train", "3", "--n-test", "3", "--samples", "3", "--max-new-tokens", "6"]) == 0
    api = sp.sample_preferences("arithmetic", tmp_path / "api", str(tmp_path / "m"), n_train=3, n_test=3, samples=3,
                                max_new_tokens=6)
    for name in ("train.jsonl", "test.jsonl", "preferences.json"):
        assert (tmp_path / "cli" / name).read_bytes() == api["meta"].with_name(name).read_bytes(), name


def test_bad_arguments_fail_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(sp, "load_engine", lambda path: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="samples >= 2"):
        sp.sample_preferences("arithmetic", tmp_path / "x", "m", samples=1)
    with pytest.raises(ValueError, match="bare_fraction is for constructed"):
        sp.sample_preferences("arithmetic", tmp_path / "x", "m", bare_fraction=0.5)
    with pytest.raises(ValueError, match="n_train, n_test >= 0"):
        sp.sample_preferences("arithmetic", tmp_path / "x", "m", n_train=-1)
