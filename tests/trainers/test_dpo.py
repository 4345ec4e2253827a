"""DPOTrainer and `posttrain dpo`: every loss type by hand through the trainer, a learning signal,
precomputed vs live reference, the LoRA reference, micro-batch invariance, the CLI."""

import copy
import json
import random

import pytest
import torch

from posttrain import DPOConfig, DPOTrainer
from posttrain.cli import main
from posttrain.config import build_config
from posttrain.data.make_preferences import make_preferences
from posttrain.models import BuiltinLM
from posttrain.trainers.dpo import sequence_logps

ROWS = [
    {"prompt": "2+3=", "chosen": "5", "rejected": "6"},
    {"prompt": "10-4=", "chosen": "6", "rejected": "14"},
    {"prompt": "7*8=", "chosen": "56", "rejected": "54 or so"},
    {"prompt": "1+1=", "chosen": "2", "rejected": "11"},
]


def tiny_lm(tok, seed=0, scale=0.3):
    """A 2-layer model with O(1) logits, so a wrong formula cannot hide below 1e-5."""
    torch.manual_seed(seed)
    lm = BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, scale)
    return lm


def args(run_dir, **over):
    base = {"data.train_batch_size": 4, "trainer.micro_batch_size": 2, "trainer.max_steps": 1,
            "trainer.output_dir": str(run_dir), "trainer.report_to": [], "trainer.progress": False,
            "data.shuffle": False, "data.max_length": 64, "trainer.learning_rate": 1e-3}
    base.update(over)
    return build_config(DPOConfig, None, [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()])


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def response_logps(model, tok, prompt, response):
    """Σ log p(response tokens + EOS | prompt) of one unpadded sequence, and its token count."""
    prompt_ids = tok(prompt)["input_ids"]
    ids = prompt_ids + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].double()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return logp[len(prompt_ids) - 1 :].sum().item(), len(ids) - len(prompt_ids)


@pytest.mark.parametrize(
    "loss_type, smoothing, rpo_alpha",
    [("sigmoid", 0.0, None), ("sigmoid", 0.1, None), ("ipo", 0.0, None), ("hinge", 0.0, None),
     ("robust", 0.1, None), ("sigmoid", 0.0, 0.5)],
)
def test_first_step_matches_the_loss_by_hand(tmp_path, tok, loss_type, smoothing, rpo_alpha):
    policy, ref, beta = tiny_lm(tok, 0), tiny_lm(tok, 1), 0.5
    # Independently of the trainer: each sequence alone, log-softmax in float64, formulas by hand.
    lp = {(m, s): [response_logps(model, tok, r["prompt"], r[s]) for r in ROWS]
          for m, model in (("pol", policy), ("ref", ref)) for s in ("chosen", "rejected")}

    def seq(m, s):  # IPO reads per-token means (as TRL), the others sums
        return torch.tensor([v / n if loss_type == "ipo" else v for v, n in lp[m, s]], dtype=torch.float64)

    pc, pr, rc, rr = seq("pol", "chosen"), seq("pol", "rejected"), seq("ref", "chosen"), seq("ref", "rejected")
    h, eps = (pc - rc) - (pr - rr), smoothing
    nls = lambda x: -torch.log(torch.sigmoid(x))  # noqa: E731
    losses = {
        "sigmoid": (1 - eps) * nls(beta * h) + eps * nls(-beta * h),
        "robust": ((1 - eps) * nls(beta * h) - eps * nls(-beta * h)) / (1 - 2 * eps),
        "hinge": torch.clamp(1 - beta * h, min=0),
        "ipo": (h - 1 / (2 * beta)) ** 2,
    }[loss_type]
    expected = losses.mean().item()
    if rpo_alpha:
        expected += rpo_alpha * -sum(v for v, _ in lp["pol", "chosen"]) / sum(n for _, n in lp["pol", "chosen"])

    cfg = args(tmp_path, **{"algorithm.loss_type": loss_type, "algorithm.beta": beta,
                            "algorithm.label_smoothing": smoothing, "algorithm.rpo_alpha": rpo_alpha or "null"})
    DPOTrainer(policy, ref_model=ref, args=cfg, train_dataset=ROWS, processing_class=tok).train()
    first = metrics(tmp_path)[0]
    assert first["loss"] == pytest.approx(expected, abs=1e-5)
    assert first["rewards/chosen"] == pytest.approx((beta * (pc - rc)).mean().item(), abs=1e-5)
    assert first["rewards/rejected"] == pytest.approx((beta * (pr - rr)).mean().item(), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx((beta * h).mean().item(), abs=1e-5)
    assert first["rewards/accuracies"] == pytest.approx((h > 0).double().mean().item())
    assert first["logps/chosen"] == pytest.approx(pc.mean().item(), abs=1e-5)
    assert first["logps/rejected"] == pytest.approx(pr.mean().item(), abs=1e-5)


def case_pairs(n, seed):
    """Easy preference: a lowercase word over the same word in capitals."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghij") for _ in range(3))
        rows.append({"prompt": f"say {rng.randrange(10)}:", "chosen": word, "rejected": word.upper()})
    return rows


def test_rewards_accuracies_rise(tmp_path, tok):
    cfg = args(tmp_path, **{"data.train_batch_size": 16, "trainer.micro_batch_size": 16, "trainer.max_steps": 25,
                            "trainer.learning_rate": 3e-3, "data.shuffle": True, "trainer.eval_steps": 25})
    trainer = DPOTrainer(tiny_lm(tok, scale=0.1), args=cfg, train_dataset=case_pairs(200, 0),
                         eval_dataset=case_pairs(64, 1), processing_class=tok)
    result = trainer.train()
    log = [r for r in metrics(tmp_path) if "rewards/accuracies" in r]
    assert log[0]["rewards/accuracies"] == 0.0  # policy = reference: every implicit reward is 0
    assert sum(r["rewards/accuracies"] for r in log[-5:]) / 5 >= 0.9
    assert result.metrics["eval/rewards/accuracies"] >= 0.9
    assert result.metrics["eval/loss"] < 0.5 * log[0]["loss"]  # log 2 at the start


def run_steps(tmp_path, tok, name, model, steps=3, **over):
    cfg = args(tmp_path / name, **{"trainer.max_steps": steps, "data.train_batch_size": 4, **over})
    trainer = DPOTrainer(model, args=cfg, train_dataset=ROWS * 2, eval_dataset=ROWS, processing_class=tok)
    result = trainer.train()
    return trainer, result, metrics(tmp_path / name)


def test_precomputed_reference_matches_the_live_one_and_is_not_kept(tmp_path, tok):
    policy = tiny_lm(tok)
    live, live_result, live_log = run_steps(tmp_path, tok, "live", copy.deepcopy(policy))
    pre, pre_result, pre_log = run_steps(tmp_path, tok, "pre", copy.deepcopy(policy),
                                         **{"algorithm.precompute_ref_log_probs": True})
    assert live.reference is not None and pre.reference is None
    assert pre.loss_fn.keywords["reference"] is None
    assert all("ref_logps" in ex for ex in pre.train_examples + pre.eval_examples)
    for a, b in zip(live_log, pre_log):
        for key in ("loss", "rewards/margins", "eval/loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-6), key
    for p, q in zip(live.model.parameters(), pre.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_lora_reference_is_the_policy_with_its_adapter_off(tmp_path, tok):
    base = tiny_lm(tok)
    before = copy.deepcopy(base)
    trainer, _, log = run_steps(tmp_path, tok, "lora", base, steps=3,
                                **{"model.lora.r": 4, "trainer.learning_rate": 5e-2})
    ref = trainer.reference
    assert ref.disable_adapter and ref.model is trainer.model  # no second copy
    assert {id(p) for p in ref.model.parameters()} == {id(p) for p in trainer.model.parameters()}
    n_base = sum(p.numel() for p in before.parameters())
    n_lora = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert sum(p.numel() for p in trainer.model.parameters()) == n_base + n_lora
    batch = trainer._collate(trainer.train_examples)
    with torch.no_grad():
        expected = sequence_logps(before, batch)[0]
        policy = sequence_logps(trainer.model, batch)[0]
    torch.testing.assert_close(ref.run(sequence_logps, batch)[0], expected, atol=1e-5, rtol=0)
    assert (policy - expected).abs().max() > 1e-3  # the adapter did learn something
    assert [r for r in log if "rewards/margins" in r][-1]["rewards/margins"] > 0


def test_micro_batch_size_does_not_change_the_update(tmp_path, tok):
    policy, weights = tiny_lm(tok), []
    for micro in (4, 1):
        trainer, _, _ = run_steps(tmp_path, tok, f"mb{micro}", copy.deepcopy(policy),
                                  **{"trainer.micro_batch_size": micro, "algorithm.rpo_alpha": 0.5,
                                     "trainer.learning_rate": 1e-4})
        weights.append(trainer.model.state_dict())
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], atol=1e-5, rtol=1e-5)


def test_cli_dpo_runs_and_writes_the_run_directory(tmp_path, capsys):
    data = tmp_path / "pairs"
    make_preferences("arithmetic", data, n_train=16, n_test=4, seed=0, difficulty="easy")
    run = tmp_path / "run"
    code = main(["dpo", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]",
                 f"data.eval_files=[{data / 'test.jsonl'}]", "data.train_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.max_steps=2", f"trainer.output_dir={run}", "trainer.report_to=[]", "trainer.progress=false",
                 "trainer.learning_rate=1e-4", "eval.task=arithmetic", "eval.max_new_tokens=4"])
    assert code == 0, capsys.readouterr().err
    log = metrics(run)
    assert [r["step"] for r in log] == [1, 2, 2]
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "data/n_rows"} <= log[0].keys()
    assert {"eval/loss", "eval/rewards/accuracies", "eval/accuracy"} <= log[-1].keys()
    assert (run / "config.yaml").is_file() and (run / "samples.jsonl").is_file()
    BuiltinLM.from_pretrained(run / "final")


def test_bad_config_is_named_before_loading():
    with pytest.raises(ValueError, match="algorithm.label_smoothing"):
        build_config(DPOConfig, None, ["algorithm.loss_type=hinge", "algorithm.label_smoothing=0.1"])
    with pytest.raises(ValueError, match="algorithm.beta"):
        build_config(DPOConfig, None, ["algorithm.beta=0"])
    with pytest.raises(ValueError, match="algorithm.loss_type.*'ipo'"):
        build_config(DPOConfig, None, ["algorithm.loss_type=ipp"])
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        build_config(DPOConfig, None, ["data.train_batch_size=6", "trainer.micro_batch_size=4"])


def test_eval_task_needs_prompt_and_answer(tmp_path, tok):
    cfg = args(tmp_path, **{"eval.task": "arithmetic"})
    with pytest.raises(ValueError, match="eval.task.*answer"):
        DPOTrainer(tiny_lm(tok), args=cfg, train_dataset=ROWS, eval_dataset=ROWS, processing_class=tok)


def test_logps_ignore_padding(tok):
    """A pair scored alone or padded next to longer ones gets the same log-probs."""
    from posttrain.data.preference import pair_collate, tokenize_pairs

    model = tiny_lm(tok)
    examples, _ = tokenize_pairs(ROWS, tok, "preference", 64)
    together = sequence_logps(model, pair_collate(examples, tok.pad_token_id))[0]
    alone = torch.cat([sequence_logps(model, pair_collate([ex], tok.pad_token_id))[0][None] for ex in examples])
    torch.testing.assert_close(together.view(2, -1), alone.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("precompute", ["false", "true"])
def test_dropout_is_off_so_the_first_step_starts_at_log_2(tmp_path, tok, precompute):
    """The policy is the reference at step 1: h = 0 exactly, so every implicit reward is 0 and
    the loss is log 2. GPT-2's default dropout (0.1) made them noise."""
    import math

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    cfg = args(tmp_path, **{"algorithm.precompute_ref_log_probs": precompute})
    DPOTrainer(policy, args=cfg, train_dataset=ROWS, processing_class=tok).train()
    (first,) = metrics(tmp_path)
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_cli_dpo_prints_the_held_out_summary_and_counts_pairs(tmp_path, capsys):
    data = tmp_path / "pairs"
    make_preferences("arithmetic", data, n_train=8, n_test=4, seed=0, difficulty="easy")
    run = tmp_path / "run"
    assert main(["dpo", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]",
                 f"data.eval_files=[{data / 'test.jsonl'}]", "data.train_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.max_steps=1", f"trainer.output_dir={run}", "trainer.report_to=[]",
                 "trainer.progress=false"]) == 0
    out = capsys.readouterr().out
    last = metrics(run)[-1]
    assert f"held-out: loss={last['eval/loss']:.4g}  rewards/accuracies=" in out and "rewards/margins=" in out
    first = metrics(run)[0]
    assert first["n_pairs"] == 4 and "n_tokens" not in first  # the loss's units are pairs
