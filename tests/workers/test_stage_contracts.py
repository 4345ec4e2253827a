"""Each role checks the fields it reads at its entry: a missing one is a ValueError naming the
role, the method and the field, raised before any forward pass or optimizer step."""

import pytest
import torch

from posttrain.models.heads import ScalarHeadModel
from posttrain.rewards import RewardRunner
from posttrain.workers import Reference, Reward, head_on_policy

from .conftest import prompt_batch, rollout
from .test_actor import make_actor, training_batch
from .test_critic import make_critic, value_batch


def half(prompts, completions, completion_ids, **kw):
    return [0.5] * len(completions)


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_actor_update_needs_advantages(model, tok):
    batch = training_batch(model, tok).replace(advantages=None)
    actor, before = make_actor(model), snapshot(model)
    with pytest.raises(ValueError, match=r"actor.update needs RLBatch.advantages"):
        actor.update(batch, mini_batch_rows=len(batch), epochs=1, kl_coef=0.0, seed=0)
    assert unchanged(model, before) and actor.steps == 0


@pytest.mark.parametrize("rows,epochs", [(6, 1), (12, 2)])
def test_an_off_policy_actor_update_needs_old_logp(model, tok, rows, epochs):
    batch = training_batch(model, tok).replace(old_logp=None)  # 12 rows
    actor, before = make_actor(model), snapshot(model)
    with pytest.raises(ValueError, match=r"actor.update needs RLBatch.old_logp \(off-policy"):
        actor.update(batch, mini_batch_rows=rows, epochs=epochs, kl_coef=0.0, seed=0)
    assert unchanged(model, before) and actor.steps == 0


def test_a_single_step_actor_update_uses_its_own_logp(model, tok):
    batch = training_batch(model, tok).replace(old_logp=None)
    actor = make_actor(model)
    metrics = actor.update(batch, mini_batch_rows=len(batch), epochs=1, kl_coef=0.0, seed=0)
    assert metrics["ratio/mean"] == 1.0 and actor.steps == 1


def test_actor_update_with_kl_in_the_loss_needs_ref_logp(model, tok):
    batch = training_batch(model, tok).replace(ref_logp=None)
    actor = make_actor(model, kl_in_loss=True)
    with pytest.raises(ValueError, match=r"actor.update needs RLBatch.ref_logp \(the KL term is in the loss\)"):
        actor.update(batch, mini_batch_rows=len(batch), epochs=1, kl_coef=0.1, seed=0)


def test_log_prob_passes_need_responses(model, tok):
    prompts = prompt_batch(tok, ["a b", "c"])
    with pytest.raises(ValueError, match=r"actor.compute_logprobs needs RLBatch.response_ids"):
        make_actor(model).compute_logprobs(prompts)
    with pytest.raises(ValueError, match=r"ref.compute_logprobs needs RLBatch.response_ids"):
        Reference(model, temperature=1.0, micro_batch_size=4).compute_logprobs(prompts)
    with pytest.raises(ValueError, match=r"critic.compute_values needs RLBatch.response_ids"):
        make_critic(ScalarHeadModel.from_causal_lm(model, init_std=0.0)).compute_values(prompts)


@pytest.mark.parametrize("field", ["values", "returns"])
def test_critic_update_needs_values_and_returns(model, tok, field):
    vm = ScalarHeadModel.from_causal_lm(model, init_std=0.0)
    critic = make_critic(vm)
    batch = value_batch(model, tok, critic).replace(**{field: None})
    before = snapshot(vm)
    with pytest.raises(ValueError, match=rf"critic.update needs RLBatch.{field}"):
        critic.update(batch, mini_batch_rows=6, epochs=1, seed=0)
    assert unchanged(vm, before) and critic.steps == 0


def test_an_actor_with_a_shared_value_head_needs_returns(model, tok):
    critic = make_critic(head_on_policy(model), policy=model)
    batch = value_batch(model, tok, critic).replace(returns=None)
    actor = make_actor(model)
    actor.joint = critic.joint_forward
    assert critic.update(batch, 6, 1, 0) == {}  # a shared critic reads nothing: the actor trains it
    with pytest.raises(ValueError, match=r"actor.update needs RLBatch.returns \(a shared value head"):
        actor.update(batch, mini_batch_rows=len(batch), epochs=1, kl_coef=0.0, seed=0)


def test_reward_score_and_apply_kl_state_their_fields(model, tok):
    b = rollout(model, tok, n=2, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"reward.score needs RLBatch.completions"):
        Reward(RewardRunner([("half", half)])).score(b.replace(completions=None))
    eos = Reward(RewardRunner([("half", half)]), missing_eos_penalty=1.0)
    with pytest.raises(ValueError, match=r"reward.score needs RLBatch.truncated \(reward.missing_eos_penalty"):
        eos.score(b.replace(truncated=None))
    scored, _ = Reward(RewardRunner([("half", half)])).score(b)
    with pytest.raises(ValueError, match=r"reward.apply_kl needs RLBatch.ref_logp"):
        Reward.apply_kl(scored.replace(old_logp=torch.zeros(b.response_ids.shape)), 0.1, "k1")


def test_rollout_needs_prompts(model, tok):
    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.workers import Rollout

    worker = Rollout(make_engine("native", model, tok), SamplingParams(n=2, max_new_tokens=2))
    with pytest.raises(ValueError, match=r"rollout.generate needs RLBatch.prompt_mask"):
        worker.generate(prompt_batch(tok, ["a b"]).replace(prompt_mask=None), seed=0)
