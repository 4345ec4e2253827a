"""Actor and reference: first-step ratio and gradient, micro-batch invariance, padding, KL."""

import copy
import dataclasses
import functools

import pytest
import torch

from posttrain.algos import aggregate_loss, grpo_advantages, kl_penalty, token_logprobs
from posttrain.config import LoraConfig
from posttrain.config.algorithm import PolicyLossConfig
from posttrain.config.rl import GRPOConfig
from posttrain.models.lora import apply_lora
from posttrain.training.core import train_step
from posttrain.workers import Actor, Reference, forward
from posttrain.workers import actor as actor_module
from posttrain.workers.forward import response_logits

from .conftest import rollout

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
RATIO_METRICS = ["policy_loss", "clip_frac", "clip_frac/low", "clip_frac/high", "clip_frac/dual", "approx_kl",
                 "ratio/mean"]


def make_actor(model, micro=4, max_tokens=0, agg="token-mean", level="token", kl_in_loss=False, lr=1e-3, **loss):
    cfg = GRPOConfig()
    cfg.rollout.temperature, cfg.rollout.max_new_tokens = 1.0, 5
    cfg.actor.policy_loss = PolicyLossConfig(level=level, loss_agg_mode=agg, **loss)
    cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch, cfg.actor.entropy_coeff = micro, max_tokens, 0.0
    cfg.algorithm.kl.in_loss, cfg.algorithm.kl.kind = kl_in_loss, "k3"
    cfg.trainer = dataclasses.replace(cfg.trainer, learning_rate=lr, lr_scheduler="constant", max_grad_norm=0.0,
                                      precision="fp32")
    return Actor(model, cfg, total_steps=10)


def training_batch(model, tok, n=4):
    """A rollout with GRPO advantages of a made-up score and fresh old log-probs."""
    b = rollout(model, tok, n=n, max_new_tokens=5)
    scores = (b.response_ids[:, 0] % 3).float()
    adv = grpo_advantages(scores, n)[:, None] * b.response_mask
    actor = make_actor(model)
    return b.replace(advantages=adv, old_logp=actor.compute_logprobs(b), ref_logp=actor.compute_logprobs(b))


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("level,agg", [("token", a) for a in AGGS] + [("sequence", "seq-mean-token-mean")])
def test_first_step_ratio_is_one_and_gradient_is_the_policy_gradient(model, tok, level, agg):
    batch = training_batch(model, tok)
    actor = make_actor(model, agg=agg, level=level)
    mb = batch.trimmed()
    loss_sum, weight, metrics = actor.loss(model, mb, kl_coef=0.0)
    # The old log-probs were computed over the whole batch, these over a trimmed micro-batch: the
    # same values up to the last bits (kernels block by shape; AVX2 and AVX-512 differ), so 1e-6.
    assert abs(float(metrics["ratio/mean"]) - 1.0) < 1e-6 and metrics["clip_frac"] == 0.0
    assert abs(float(metrics["approx_kl"])) < 1e-6
    model.zero_grad()
    (loss_sum / weight).backward()
    ours = grads(model)
    # The plain policy gradient: −∇ agg(A · log π).
    model.zero_grad()
    logp = token_logprobs(response_logits(model, mb), mb.response_ids)
    aggregate_loss(-mb.advantages * logp, mb.response_mask, agg, 5).backward()
    for k, g in grads(model).items():
        torch.testing.assert_close(ours[k], g, atol=1e-6, rtol=1e-5)


def test_rollout_correction_weights_scale_the_policy_gradient_only(model, tok):
    # L = w · pg + β · KL: the gradient with weights w is −∇ agg(w · A · log π) + β ∇ agg(KL),
    # w = 0.5 on the first rows, 2 on the others (the KL term is not reweighted, as veRL)
    batch = training_batch(model, tok)
    w = torch.where(torch.arange(len(batch))[:, None] < 6, 0.5, 2.0) * batch.response_mask
    mb = batch.replace(rollout_is_weights=w).trimmed()
    actor = make_actor(model, agg="seq-mean-token-mean", kl_in_loss=True)
    loss_sum, weight, _ = actor.loss(model, mb, kl_coef=0.1)
    model.zero_grad()
    (loss_sum / weight).backward()
    ours = grads(model)
    model.zero_grad()
    logp = token_logprobs(response_logits(model, mb), mb.response_ids)
    pg = aggregate_loss(-mb.rollout_is_weights * mb.advantages * logp, mb.response_mask, "seq-mean-token-mean")
    kl = aggregate_loss(kl_penalty(logp, mb.ref_logp, "k3"), mb.response_mask, "seq-mean-token-mean")
    (pg + 0.1 * kl).backward()
    for k, g in grads(model).items():
        torch.testing.assert_close(ours[k], g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_size_does_not_change_the_update(model, tok, agg):
    batch = training_batch(model, tok)
    weights = []
    for micro, max_tokens in ((12, 0), (1, 0), (5, 0), (4, 18)):
        m = copy.deepcopy(model)
        actor = make_actor(m, micro=micro, max_tokens=max_tokens, agg=agg, kl_in_loss=True)
        actor.optimizer = torch.optim.SGD(m.parameters(), lr=1.0)  # the update is the gradient itself
        actor.scheduler = torch.optim.lr_scheduler.LambdaLR(actor.optimizer, lambda step: 1.0)
        actor.update(batch, mini_batch_rows=12, epochs=1, kl_coef=0.1, seed=0)
        weights.append({k: v.clone() for k, v in m.state_dict().items()})
    moved = max(float((weights[0][k] - v).abs().max()) for k, v in model.state_dict().items())
    assert moved > 1e-3
    for other in weights[1:]:
        for k in weights[0]:
            torch.testing.assert_close(other[k], weights[0][k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("agg", AGGS)
def test_length_grouped_micro_batches_do_not_change_the_update(model, tok, agg, monkeypatch):
    batch = training_batch(model, tok)
    plain = forward.micro_batches
    updates = []
    for by_length in (True, False):
        if not by_length:  # micro-batches cut in the shuffled order
            monkeypatch.setattr(actor_module, "micro_batches",
                                lambda *a, by_length: plain(*a, by_length=False))
        m = copy.deepcopy(model)
        actor = make_actor(m, micro=3, agg=agg, kl_in_loss=True)
        actor.optimizer = torch.optim.SGD(m.parameters(), lr=1.0)  # the update is the gradient itself
        actor.scheduler = torch.optim.lr_scheduler.LambdaLR(actor.optimizer, lambda step: 1.0)
        widths = [mb.input_ids.numel() for mb in actor.micro_batches(batch)]
        actor.update(batch, mini_batch_rows=12, epochs=1, kl_coef=0.1, seed=0)
        updates.append((sum(widths), {k: v.clone() for k, v in m.state_dict().items()}))
    (sorted_tokens, grouped), (plain_tokens, plain_update) = updates
    assert sorted_tokens < plain_tokens  # less padding to run
    for k in grouped:
        torch.testing.assert_close(grouped[k], plain_update[k], atol=1e-6, rtol=1e-5)


def test_padding_content_changes_nothing(model, tok):
    batch = training_batch(model, tok)
    pad = batch.response_mask == 0
    assert pad.any()
    g = torch.Generator().manual_seed(0)
    noisy = batch.replace(
        response_ids=torch.where(pad, torch.randint(0, len(tok), pad.shape, generator=g), batch.response_ids),
        old_logp=batch.old_logp.masked_fill(pad, float("nan")),
        ref_logp=batch.ref_logp.masked_fill(pad, float("nan")),
        advantages=batch.advantages.masked_fill(pad, 1e6),
    )
    results = []
    for b in (batch, noisy):
        m = copy.deepcopy(model)
        actor = make_actor(m, micro=12, kl_in_loss=True)
        loss_sum, weight, metrics = actor.loss(m, b, kl_coef=0.5)
        loss_sum.backward()
        results.append((loss_sum.detach(), {k: float(v) for k, v in metrics.items()}, grads(m)))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]
    for k, v in results[0][2].items():
        assert torch.equal(v, results[1][2][k])


def test_kl_is_zero_when_the_policy_is_the_reference(model, tok):
    batch = training_batch(model, tok)
    ref = Reference.for_policy(model, temperature=1.0, micro_batch_size=5)
    actor = make_actor(model, kl_in_loss=True)
    ref_logp = ref.compute_logprobs(batch)
    # equal up to the last bits: the reference's micro-batches have another shape than the actor's
    torch.testing.assert_close(ref_logp, actor.compute_logprobs(batch), atol=1e-6, rtol=0)
    for kind in ("k1", "k2", "k3", "abs"):
        assert float(kl_penalty(batch.old_logp, ref_logp, kind).abs().max()) < 1e-6
    _, _, metrics = actor.loss(model, batch.replace(ref_logp=ref_logp), kl_coef=1.0)
    assert abs(float(metrics["kl"])) < 1e-6


def test_lora_reference_is_the_base_model_with_adapters_off(model, tok):
    batch = training_batch(model, tok)
    base_logp = make_actor(model).compute_logprobs(batch)
    lora = apply_lora(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ref = Reference.for_policy(lora, temperature=1.0, micro_batch_size=5)
    assert ref.model is lora  # no second copy
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # as if trained
    assert not torch.allclose(make_actor(lora).compute_logprobs(batch), base_logp)
    torch.testing.assert_close(ref.compute_logprobs(batch), base_logp, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("on_policy", [True, False])
def test_rows_with_zero_advantage_skip_the_forward_but_not_the_update(model, tok, agg, on_policy, monkeypatch):
    batch = training_batch(model, tok)  # 3 prompts × 4 rows
    adv = batch.advantages.clone()
    adv[4:8] = 0.0  # one group whose rewards were all equal
    assert adv[:4].abs().sum() > 0 and adv[8:].abs().sum() > 0
    batch = batch.replace(advantages=adv, old_logp=None if on_policy else batch.old_logp)
    idle = batch.replace(advantages=torch.zeros_like(adv))  # every group equal
    forwarded = []
    counted = actor_module.response_logits
    monkeypatch.setattr(actor_module, "response_logits", lambda m, mb: forwarded.append(len(mb)) or counted(m, mb))
    results = []
    for skip in (True, False):
        m = copy.deepcopy(model)
        actor = make_actor(m, micro=5, agg=agg)
        # SGD with momentum: the update is the gradient (no Adam amplification of rounding
        # in near-zero gradients), and the idle step still moves every weight through the
        # momentum, but only if every parameter has a (zero) gradient: a None one is skipped.
        actor.optimizer = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.9)
        actor.scheduler = torch.optim.lr_scheduler.LambdaLR(actor.optimizer, lambda step: 1.0)
        losses = []
        for b, rows_run in ((batch, 8), (idle, 0 if on_policy else 12)):
            forwarded.clear()
            if skip:
                metrics = actor.update(b, mini_batch_rows=12, epochs=1, kl_coef=0.0, seed=0)
                assert sum(forwarded) == rows_run
            else:  # the reference: one step over every row
                metrics = train_step(m, actor.micro_batches(b), functools.partial(actor.loss, kl_coef=0.0),
                                     actor.optimizer, actor.scheduler, 0.0).metrics
            losses.append({k: metrics[k] for k in RATIO_METRICS if k in metrics})
        results.append(({k: v.clone() for k, v in m.state_dict().items()}, losses))
    (skipped, skipped_metrics), (full, full_metrics) = results
    assert max(float((full[k] - v).abs().max()) for k, v in model.state_dict().items()) > 1e-4
    for k in full:
        torch.testing.assert_close(skipped[k], full[k], atol=1e-6, rtol=1e-5)
    assert skipped_metrics[0]["policy_loss"] == pytest.approx(full_metrics[0]["policy_loss"], abs=1e-6)
    if on_policy:  # the ratio metrics are those of every row
        for a, b in zip(skipped_metrics, full_metrics):
            assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-6)
