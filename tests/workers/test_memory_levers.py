"""The RL memory levers: model.use_remove_padding (packed rows) and model.gradient_checkpointing
give the log-probs, values, losses, gradients and updates of the plain padded run (float64,
1e-10), for GRPO's actor and reference and PPO's critic, with row and token micro-batches."""

import copy
import dataclasses

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

from posttrain.algos import compute_gae, grpo_advantages
from posttrain.config import ConfigError
from posttrain.config.rl import GRPOConfig, PolicyLossConfig, PPOConfig
from posttrain.models.heads import ScalarHeadModel
from posttrain.workers import Actor, Critic, Reference, head_on_policy
from posttrain.workers.forward import micro_batches, pack_responses, response_logits

from .conftest import rollout

TOL = 1e-10
# (remove padding, gradient checkpointing, micro_batch_size, max_tokens_per_micro_batch)
CASES = [(True, False, 4, 0), (False, True, 12, 0), (True, True, 12, 30)]


def levers(cfg, remove_padding, checkpointing, micro, max_tokens, agg="token-mean"):
    cfg.model.use_remove_padding, cfg.model.gradient_checkpointing = remove_padding, checkpointing
    cfg.rollout.temperature, cfg.rollout.max_new_tokens = 1.0, 5
    cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch = micro, max_tokens
    cfg.actor.policy_loss = PolicyLossConfig(loss_agg_mode=agg)
    cfg.trainer = dataclasses.replace(cfg.trainer, lr_scheduler="constant", max_grad_norm=0.0, precision="fp32")
    return cfg


def sgd(role, params):
    """The update is the gradient itself (AdamW's first step would hide its size)."""
    role.optimizer = torch.optim.SGD(params, lr=1.0)
    role.scheduler = torch.optim.lr_scheduler.LambdaLR(role.optimizer, lambda step: 1.0)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture
def model64(model):
    return model.double()


@pytest.fixture
def batch(model64, tok):
    """A GRPO batch with prompts of 2-5 tokens and responses of 1-5: packing has room."""
    b = rollout(model64, tok, n=4, max_new_tokens=5, prompts=("a b", "c", "d e f g", "h"))
    adv = grpo_advantages((b.response_ids[:, 0] % 3).double(), 4)[:, None] * b.response_mask
    logp = Actor(model64, levers(GRPOConfig(), False, False, 16, 0), 10).compute_logprobs(b)
    return b.replace(advantages=adv, old_logp=logp, ref_logp=logp - 0.1 * adv)


def test_packed_rows_hold_only_real_tokens(batch):
    layout = pack_responses(batch)
    real = int((batch.prompt_mask.sum(1) + batch.lengths - 1).sum())
    assert int(layout.rows.fill.sum()) == real and len(layout.source) == int(batch.lengths.sum())
    assert layout.rows.input_ids.numel() < batch.input_ids[:, :-1].numel()  # padding gone
    one_row = pack_responses(batch, one_row=True).rows
    assert one_row.input_ids.shape == (1, real) and int(one_row.fill.sum()) == real  # no tail at all


def test_the_builtin_projections_and_mlp_see_only_the_real_tokens(model64, batch):
    """The built-in model takes the packed tokens as one row; only its attention regroups
    them into rows (with tails), so the MLP computes exactly the real tokens, not the
    rows-as-wide-as-the-longest layout's tails."""
    seen = []
    hook = model64.model.layers[0].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1]))
    try:
        response_logits(model64, batch, remove_padding=True)
    finally:
        hook.remove()
    real = int((batch.prompt_mask.sum(1) + batch.lengths - 1).sum())
    assert seen == [(1, real)]
    assert pack_responses(batch).rows.real_fraction < 0.95  # the rows layout would compute a tail


@pytest.mark.parametrize("micro,max_tokens", [(4, 0), (12, 30)])
def test_packed_log_probs_and_values_equal_the_padded_ones(model64, batch, micro, max_tokens):
    outs = []
    for remove_padding in (False, True):
        cfg = levers(PPOConfig(), remove_padding, False, micro, max_tokens)
        torch.manual_seed(0)
        critic = Critic(ScalarHeadModel.from_causal_lm(model64), cfg, 10)  # a random head: values differ
        ref = Reference(model64, micro_batch_size=micro, max_tokens_per_micro_batch=max_tokens,
                        remove_padding=remove_padding)
        outs.append([Actor(model64, cfg, 10).compute_logprobs(batch), ref.compute_logprobs(batch),
                     critic.compute_values(batch)])
    for padded, packed in zip(*outs):
        assert padded.dtype == torch.float64 and float(padded.abs().max()) > 0.1
        assert float((padded - packed).abs().max()) < TOL


@pytest.mark.parametrize("remove_padding,checkpointing,micro,max_tokens", CASES)
def test_grpo_update_equals_the_plain_one(model64, batch, remove_padding, checkpointing, micro, max_tokens):
    runs = []
    for on in ((False, False), (remove_padding, checkpointing)):
        m = copy.deepcopy(model64)
        actor = Actor(m, levers(GRPOConfig(), *on, micro, max_tokens, agg="seq-mean-token-mean"), 10)
        sgd(actor, m.parameters())
        metrics = actor.update(batch, mini_batch_rows=8, epochs=1, kl_coef=0.0, seed=0)
        runs.append(({k: v.clone() for k, v in m.state_dict().items()}, metrics))
    (plain, plain_metrics), (levered, levered_metrics) = runs
    assert max_diff(plain, model64.state_dict()) > 1e-3  # the update moved the weights
    assert max_diff(plain, levered) < TOL
    # Packed token budgets cut other micro-batches, whose per-micro-batch metrics (entropy) then
    # average differently; the loss is exact either way.
    same_parts = not (remove_padding and max_tokens)
    for key in ("policy_loss", "entropy", "clip_frac", "approx_kl") if same_parts else ("policy_loss",):
        assert abs(plain_metrics[key] - levered_metrics[key]) < TOL, key


def ppo_batch(model64, batch):
    critic = Critic(ScalarHeadModel.from_causal_lm(model64), levers(PPOConfig(), False, False, 16, 0), 10)
    rewards = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    rewards[torch.arange(len(batch)), batch.lengths - 1] = (batch.response_ids[:, 0] % 2).double()
    values = critic.compute_values(batch) + 0.3 * batch.response_mask  # V_old off the current values
    adv, returns = compute_gae(rewards, values, batch.response_mask, 1.0, 0.95)
    return batch.replace(values=values, returns=returns, advantages=adv)


@pytest.mark.parametrize("remove_padding,checkpointing,micro,max_tokens", CASES)
def test_ppo_critic_update_equals_the_plain_one(model64, batch, remove_padding, checkpointing, micro, max_tokens):
    torch.manual_seed(0)
    start = ScalarHeadModel.from_causal_lm(model64)
    batch = ppo_batch(model64, batch)
    runs = []
    for on in ((False, False), (remove_padding, checkpointing)):
        vm = copy.deepcopy(start)
        critic = Critic(vm, levers(PPOConfig(), *on, micro, max_tokens), 10)
        sgd(critic, vm.parameters())
        metrics = critic.update(batch, mini_batch_rows=8, epochs=1, seed=0)
        runs.append(({k: v.clone() for k, v in vm.state_dict().items()}, metrics))
    (plain, plain_metrics), (levered, levered_metrics) = runs
    assert max_diff(plain, start.state_dict()) > 1e-3
    assert max_diff(plain, levered) < TOL
    assert abs(plain_metrics["value_loss"] - levered_metrics["value_loss"]) < TOL


def test_shared_critic_joint_loss_and_gradients_equal_the_padded_ones(model64, batch):
    batch = ppo_batch(model64, batch)
    results = []
    for remove_padding in (False, True):
        m = copy.deepcopy(model64)
        cfg = levers(PPOConfig(), remove_padding, True, 12, 0)
        critic = Critic(head_on_policy(m), cfg, 10, policy=m)
        with torch.no_grad():
            critic.model.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        actor = Actor(m, cfg, 10, extra_params=critic.model.score)
        actor.joint = critic.joint_forward
        m.train()
        loss, weight, metrics = actor.loss(m, batch.trimmed(), kl_coef=0.0)
        (loss / weight).backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        grads["score"] = critic.model.score.weight.grad.clone()
        results.append((float(loss.detach()), float(metrics["value_loss"]), grads))
    (loss, value_loss, grads), (loss_p, value_loss_p, grads_p) = results
    assert abs(loss - loss_p) < TOL and abs(value_loss - value_loss_p) < TOL and value_loss > 0
    assert max_diff(grads, grads_p) < TOL


def test_dynamic_batching_counts_real_tokens_when_packed(batch):
    budget = 30
    parts = micro_batches(batch, 12, budget, by_length=True, packed=True)
    padded = micro_batches(batch, 12, budget, by_length=True)
    assert all(int(p.token_counts().sum()) <= budget for p in parts)
    assert any(p.input_ids.numel() > budget for p in parts)  # the padded width would not fit
    assert max(map(len, parts)) > max(map(len, padded))  # fuller micro-batches
    assert sorted(int(u) for p in parts for u in p.uid) == sorted(batch.uid.tolist())


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=11, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).double()


def test_hf_llama_packed_logits_and_gradients_equal_the_padded_ones(batch):
    hf = tiny_llama()
    mb = batch.trimmed()
    mask = mb.response_mask.bool()
    out = []
    for remove_padding in (False, True):
        hf.zero_grad()
        logits = response_logits(hf, mb, remove_padding)
        (logits.log_softmax(-1)[..., 3] * mask).sum().backward()
        out.append((logits[mask].detach(), {k: p.grad.clone() for k, p in hf.named_parameters()}))
    (padded, grads), (packed, grads_p) = out
    assert float((padded - packed).abs().max()) < TOL and max_diff(grads, grads_p) < TOL


def test_hf_critic_packed_values_equal_the_padded_ones(batch):
    torch.manual_seed(0)
    vm = ScalarHeadModel.from_causal_lm(tiny_llama())
    values = [Critic(vm, levers(PPOConfig(), rp, False, 6, 0), 10).compute_values(batch) for rp in (False, True)]
    assert float(values[0].abs().max()) > 0.01 and float((values[0] - values[1]).abs().max()) < TOL


def test_a_model_that_cannot_pack_is_refused_naming_the_key():
    bloom = BloomForCausalLM(BloomConfig(vocab_size=11, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="model.use_remove_padding: BloomForCausalLM cannot run packed"):
        Actor(bloom, levers(GRPOConfig(), True, False, 4, 0), 10)
