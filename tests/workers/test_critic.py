"""Critic: value alignment with the states, regression, micro-batch invariance, shared backbone."""

import copy
import dataclasses

import torch

from posttrain.algos import compute_gae
from posttrain.config.rl import PPOConfig
from posttrain.models.heads import ScalarHeadModel
from posttrain.workers import Critic, head_on_policy
from posttrain.workers.forward import response_logits

from .conftest import rollout


def make_critic(model, micro=4, max_tokens=0, policy=None, lr=1e-2):
    cfg = PPOConfig()
    cfg.critic.value_clip, cfg.critic.vf_coef, cfg.critic.micro_batch_size = 0.5, 1.0, micro
    cfg.actor.policy_loss.loss_agg_mode, cfg.actor.max_tokens_per_micro_batch = "token-mean", max_tokens
    cfg.critic.learning_rate = None
    cfg.trainer = dataclasses.replace(cfg.trainer, learning_rate=lr, lr_scheduler="constant", max_grad_norm=0.0,
                                      precision="fp32")
    return Critic(model, cfg, 10, policy=policy)


def value_batch(model, tok, critic):
    b = rollout(model, tok, n=4, max_new_tokens=5)
    rewards = torch.zeros(b.response_ids.shape)
    rewards[torch.arange(len(b)), b.lengths - 1] = (b.response_ids[:, 0] % 2).float()
    values = critic.compute_values(b)
    adv, returns = compute_gae(rewards, values, b.response_mask, 1.0, 0.95)
    return b.replace(values=values, returns=returns, advantages=adv)


def test_values_are_read_at_the_state_before_each_response_token(model, tok):
    torch.manual_seed(1)
    vm = ScalarHeadModel.from_causal_lm(model)  # random head: values differ per position
    critic = make_critic(vm)
    b = rollout(model, tok)
    values = critic.compute_values(b)
    tp = b.prompt_ids.shape[1]
    with torch.no_grad():
        full = vm.values(b.input_ids, b.attention_mask)[:, tp - 1 : -1]
    mask = b.response_mask.bool()
    torch.testing.assert_close(values[mask], full[mask])
    assert float(values[~mask].abs().sum()) == 0.0


def test_update_fits_the_returns(model, tok):
    critic = make_critic(ScalarHeadModel.from_causal_lm(model, init_std=0.0))
    batch = value_batch(model, tok, critic)

    def error():
        return (critic.compute_values(batch) - batch.returns)[batch.response_mask.bool()].pow(2).mean()

    before = error()
    metrics = critic.update(batch, mini_batch_rows=6, epochs=10, seed=0)
    assert error() < 0.5 * before and metrics["value_loss"] > 0 and metrics["critic/optimizer_steps"] == 20


def test_micro_batching_does_not_change_the_critic_update(model, tok):
    critic = make_critic(ScalarHeadModel.from_causal_lm(model, init_std=0.0))
    batch = value_batch(model, tok, critic)
    states = []
    for micro, max_tokens in ((12, 0), (1, 0), (3, 20)):
        c = make_critic(copy.deepcopy(critic.model), micro=micro, max_tokens=max_tokens)
        c.optimizer = torch.optim.SGD(c.model.parameters(), lr=0.01)
        c.scheduler = torch.optim.lr_scheduler.LambdaLR(c.optimizer, lambda step: 1.0)
        c.update(batch, mini_batch_rows=12, epochs=2, seed=0)
        states.append(c.model.state_dict())
    assert float(states[0]["score.weight"].abs().max()) > 0
    for other in states[1:]:
        for k, v in states[0].items():
            torch.testing.assert_close(other[k], v, atol=1e-6, rtol=1e-5)


def test_shared_head_uses_the_policy_backbone(model, tok):
    head = head_on_policy(model)
    assert head.model is model.model and float(head.score.weight.detach().abs().sum()) == 0.0
    critic = make_critic(head, policy=model)
    assert critic.optimizer is None and critic.update(rollout(model, tok), 4, 1, 0) == {}
    batch = value_batch(model, tok, critic).trimmed()
    logits, term, metrics = critic.joint_forward(model, batch)
    torch.testing.assert_close(logits, response_logits(model, batch))
    assert term.requires_grad and "value_loss" in metrics
