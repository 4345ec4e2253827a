"""RewardTrainer and `posttrain rm`: the Bradley-Terry loss by hand through the trainer, learning
an easy preference, and the saved model scoring through `reward_model` (what PPO loads)."""

import copy
import json
import random

import pytest
import torch

from posttrain import RewardTrainer, RMConfig
from posttrain.cli import main
from posttrain.config import build_config
from posttrain.data.make_preferences import make_preferences
from posttrain.models import BuiltinLM
from posttrain.models.heads import ScalarHeadModel
from posttrain.rewards.reward_model import encode_for_reward, reward_model

ROWS = [
    {"prompt": "2+3=", "chosen": "5", "rejected": "6", "margin": 0.5},
    {"prompt": "10-4=", "chosen": "6", "rejected": "14", "margin": 0.0},
    {"prompt": "7*8=", "chosen": "56", "rejected": "54", "margin": 1.5},
    {"prompt": "1+1=", "chosen": "2", "rejected": "11", "margin": -1.0},
]


def tiny_rm(tok, seed=0, init_std=None):
    torch.manual_seed(seed)
    lm = BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
    )
    return ScalarHeadModel.from_causal_lm(lm, init_std=init_std)


def args(run_dir, **over):
    base = {"data.train_batch_size": 4, "trainer.micro_batch_size": 2, "trainer.max_steps": 1,
            "trainer.output_dir": str(run_dir), "trainer.report_to": [], "trainer.progress": False,
            "data.shuffle": False, "data.max_length": 64, "trainer.learning_rate": 1e-3}
    base.update(over)
    return build_config(RMConfig, None, [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()])


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("use_margin, center", [(False, 0.0), (True, 0.0), (True, 0.1)])
def test_first_step_matches_the_loss_by_hand(tmp_path, tok, use_margin, center):
    rm = tiny_rm(tok, init_std=1.0)  # spread-out scores, so a wrong formula shows
    rows = [r if use_margin else {k: v for k, v in r.items() if k != "margin"} for r in ROWS]
    # Independently: each sequence alone, unpadded, and the formula in plain torch.
    with torch.no_grad():
        score = [[rm.scores(torch.tensor([encode_for_reward(tok, r["prompt"], r[side])])).item() for r in rows]
                 for side in ("chosen", "rejected")]
    rc, rr = torch.tensor(score[0], dtype=torch.float64), torch.tensor(score[1], dtype=torch.float64)
    m = torch.tensor([r["margin"] for r in ROWS], dtype=torch.float64) if use_margin else 0.0
    expected = (-torch.log(torch.sigmoid(rc - rr - m)) + center * (rc + rr) ** 2).mean().item()

    cfg = args(tmp_path, **{"algorithm.center_rewards_coefficient": center})
    RewardTrainer(copy.deepcopy(rm), args=cfg, train_dataset=rows, processing_class=tok).train()
    first = metrics(tmp_path)[0]
    assert first["loss"] == pytest.approx(expected, abs=1e-5)
    assert first["accuracy"] == pytest.approx((rc > rr).double().mean().item())
    assert first["margin"] == pytest.approx((rc - rr).mean().item(), abs=1e-5)
    assert first["rewards/chosen"] == pytest.approx(rc.mean().item(), abs=1e-5)
    assert first["rewards/rejected"] == pytest.approx(rr.mean().item(), abs=1e-5)
    both = torch.cat([rc, rr])
    assert first["reward/min"] == pytest.approx(both.min().item(), abs=1e-5)
    assert first["reward/max"] == pytest.approx(both.max().item(), abs=1e-5)
    assert first["reward/mean"] == pytest.approx(both.mean().item(), abs=1e-5)
    assert first["data/n_rows"] == 4 and first["data/n_truncated"] == 0


def case_pairs(n, seed):
    """Easy preference: a lowercase word over the same word in capitals."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))
        rows.append({"prompt": f"say {rng.randrange(100)}:", "chosen": word, "rejected": word.upper()})
    return rows


def test_learns_an_easy_preference_and_the_saved_model_scores_it(tmp_path, tok):
    run = tmp_path / "rm"
    cfg = args(run, **{"data.train_batch_size": 16, "trainer.micro_batch_size": 16, "trainer.max_steps": 40,
                       "trainer.learning_rate": 3e-3, "data.shuffle": True})
    eval_rows = case_pairs(64, seed=1)
    trainer = RewardTrainer(tiny_rm(tok), args=cfg, train_dataset=case_pairs(320, seed=0),
                            eval_dataset=eval_rows, processing_class=tok)
    result = trainer.train()
    log = metrics(run)
    assert result.metrics["eval/accuracy"] >= 0.95
    assert log[-1]["eval/loss"] < 0.5 * log[0]["loss"]
    # final/ is what `posttrain ppo reward.model_path=...` loads, through reward_model().
    scorer = reward_model(result.final_dir, device="cpu", dtype="float32")
    prompts = [r["prompt"] for r in eval_rows]
    chosen = scorer(prompts, [r["chosen"] for r in eval_rows])
    rejected = scorer(prompts, [r["rejected"] for r in eval_rows])
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(eval_rows) >= 0.95
    with torch.no_grad():
        ids = torch.tensor([encode_for_reward(tok, prompts[0], eval_rows[0]["chosen"])])
        assert chosen[0] == pytest.approx(trainer.model.scores(ids).item(), abs=1e-5)


def test_lora_trains_the_head_and_exports_a_merged_model(tmp_path, tok):
    run = tmp_path / "lora"
    cfg = args(run, **{"model.lora.r": 4, "trainer.max_steps": 2, "trainer.learning_rate": 1e-2})
    rm = tiny_rm(tok)
    head_before = rm.score.weight.detach().clone()
    trainer = RewardTrainer(rm, args=cfg, train_dataset=ROWS, processing_class=tok)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any("score" in n for n in trainable)
    assert not any("embed_tokens" in n for n in trainable)
    result = trainer.train()
    assert (result.final_dir / "adapter" / "adapter_config.json").is_file()
    merged = ScalarHeadModel.from_pretrained(result.final_dir)
    assert not torch.equal(merged.score.weight, head_before)  # the head was trained and saved
    ids = torch.tensor([encode_for_reward(tok, "2+3=", "5")])
    with torch.no_grad():
        assert merged.scores(ids).item() == pytest.approx(trainer.model.scores(ids).item(), abs=1e-5)


def test_a_causal_lm_gets_a_fresh_head(tmp_path, tok):
    torch.manual_seed(0)
    lm = BuiltinLM.from_preset("tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    lm.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    for model in (lm, str(tmp_path / "lm")):  # a module, or a checkpoint path (model.path)
        trainer = RewardTrainer(model, args=args(tmp_path / "run"), train_dataset=ROWS)
        assert isinstance(trainer.model, ScalarHeadModel)
        torch.testing.assert_close(trainer.model.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert trainer.model.config.pad_token_id == tok.pad_token_id


def test_cli_rm_runs_and_writes_the_run_directory(tmp_path, capsys):
    data = tmp_path / "pairs"
    make_preferences("arithmetic", data, n_train=16, n_test=8, seed=0, difficulty="easy")
    run = tmp_path / "run"
    code = main(["rm", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]",
                 f"data.eval_files=[{data / 'test.jsonl'}]", "data.train_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.max_steps=2", f"trainer.output_dir={run}", "trainer.report_to=[]", "trainer.progress=false"])
    assert code == 0
    log = metrics(run)
    assert [r["step"] for r in log] == [1, 2, 2] and "eval/accuracy" in log[-1]
    assert {"loss", "accuracy", "margin", "rewards/chosen", "reward/max"} <= log[0].keys()
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert (run / "config.yaml").is_file() and "reward model:" in capsys.readouterr().out


def test_bad_config_is_named_before_loading(tmp_path):
    with pytest.raises(ValueError, match="data.format"):
        build_config(RMConfig, None, ["data.format=text"])
    with pytest.raises(ValueError, match="algorithm.center_rewards_coefficient"):
        build_config(RMConfig, None, ["algorithm.center_rewards_coefficient=-1"])
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        build_config(RMConfig, None, ["data.max_length=64", "data.max_prompt_length=64"])


def test_ppo_trains_against_the_saved_reward_model(tmp_path, tok):
    """The RM's final/ as PPO's reward (`reward.model_path`) and as its critic's start
    (`critic.model_path`, veRL's usual setup): the run scores every response with it, with no
    errors, and the policy raises the score."""
    from posttrain import PPOConfig, PPOTrainer

    torch.set_num_threads(1)
    cfg = args(tmp_path / "rm", **{"data.train_batch_size": 16, "trainer.micro_batch_size": 16,
                                   "trainer.max_steps": 40, "trainer.learning_rate": 3e-3, "data.shuffle": True})
    rm_dir = RewardTrainer(tiny_rm(tok), args=cfg, train_dataset=case_pairs(320, seed=0), processing_class=tok).train().final_dir
    torch.manual_seed(0)
    policy = BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
    )
    over = {"reward.functions": [], "reward.model_path": str(rm_dir), "critic.model_path": str(rm_dir),
            "rollout.n": 1, "rollout.max_new_tokens": 4, "data.train_batch_size": 32, "actor.micro_batch_size": 32,
            "trainer.max_steps": 20, "trainer.learning_rate": 1e-2, "trainer.lr_scheduler": "constant",
            "trainer.report_to": [], "trainer.progress": False, "trainer.output_dir": str(tmp_path / "ppo")}
    ppo_cfg = build_config(PPOConfig, None, [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in over.items()])
    prompts = [{"prompt": r["prompt"]} for r in case_pairs(64, seed=2)]
    PPOTrainer(policy, args=ppo_cfg, train_dataset=prompts, processing_class=tok).train()
    lines = [r for r in metrics(tmp_path / "ppo") if "reward/reward_model/mean" in r]
    assert len(lines) == 20
    assert all(r["reward/reward_model/errors"] == 0 for r in lines)
    scores = [r["reward/reward_model/mean"] for r in lines]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.5, scores


def test_cli_rm_prints_the_held_out_summary_and_counts_pairs(tmp_path, capsys):
    data = tmp_path / "pairs"
    make_preferences("arithmetic", data, n_train=8, n_test=4, seed=0, difficulty="easy")
    run = tmp_path / "run"
    assert main(["rm", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]",
                 f"data.eval_files=[{data / 'test.jsonl'}]", "data.train_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.max_steps=1", f"trainer.output_dir={run}", "trainer.report_to=[]",
                 "trainer.progress=false"]) == 0
    out = capsys.readouterr().out
    last = metrics(run)[-1]
    assert (f"held-out: loss={last['eval/loss']:.4g}  accuracy={last['eval/accuracy']:.4g}  margin="
            f"{last['eval/margin']:.4g}\n") in out
    first = metrics(run)[0]
    assert first["n_pairs"] == 4 and "n_tokens" not in first  # the loss's units are pairs
