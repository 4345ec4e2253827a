"""Every advantage estimator and policy loss on an episode batch, against numbers worked out by
hand: the trajectory is one response whose environment (observation) tokens sit at
response_mask = 0 in the middle, so they must get no advantage, no loss and no gradient, count in
no token total (DAPO's token-mean, Dr.GRPO's L, GSPO's sequence ratio, DAPO's overlong length),
and must not cut the return of the model turns before them (REINFORCE++, GAE).

The batch (4 rows of one prompt, G = 4, width T = 6; m model token, e environment token, . pad):

    row 0   m m e e m m     4 model tokens, 2 turns, score 1
    row 1   m e m . . .     2 model tokens, 2 turns, score 0
    row 2   m m m m . .     4 model tokens, 1 turn,  score 0
    row 3   m e e m m .     3 model tokens, 2 turns, score 0

13 model tokens in all. The score sits on the trajectory's last token (a model token).
logp − old_logp on the model tokens is DELTAS (each ratio e^δ is in (0.8, 1.2): no clip binds);
the environment and padding positions hold garbage that must not matter.
"""

import math

import pytest
import torch

from posttrain.algos import compute_gae, policy_loss, value_loss
from posttrain.config.algorithm import AlgorithmConfig
from posttrain.config.rollout import MultiTurnConfig, RolloutConfig
from posttrain.rewards import RewardRunner
from posttrain.trainers.rl_steps import compute_advantages
from posttrain.workers import Reward, RLBatch

MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0]])
LENGTHS = [4, 2, 4, 3]  # model tokens
TOTAL = [6, 3, 4, 5]  # trajectory tokens, the environment's included
SCORES = [1.0, 0.0, 0.0, 0.0]
DELTAS = [[0.1, 0.0, 0.15, 0.15], [-0.1, -0.1], [0.0, 0.0, 0.0, 0.0], [0.05, 0.05, -0.1]]  # per model token
S3 = math.sqrt(3.0)


def model_positions(row):
    return [t for t in range(MASK.shape[1]) if MASK[row, t]]


def token_tensor(per_row, fill):
    """(4, 6) with per_row's values on the model tokens and `fill` elsewhere."""
    out = torch.full(MASK.shape, fill, dtype=torch.float64)
    for i, values in enumerate(per_row):
        out[i, model_positions(i)] = torch.tensor(values, dtype=torch.float64)
    return out


def episode_batch(values=None):
    """The batch above as the reward role leaves it: the score on the last trajectory token."""
    token_rewards = torch.zeros(MASK.shape, dtype=torch.float64)
    for i, (k, s) in enumerate(zip(TOTAL, SCORES)):
        token_rewards[i, k - 1] = s
    return RLBatch(response_ids=torch.ones(MASK.shape, dtype=torch.long), response_mask=MASK,
                   lengths=torch.tensor(LENGTHS), total_lengths=torch.tensor(TOTAL), token_rewards=token_rewards,
                   uid=torch.zeros(4, dtype=torch.long), values=values)


def log_probs(garbage):
    """(old_logp, logp leaf): old −1 and logp = old + δ on model tokens, `garbage` elsewhere."""
    old = torch.where(MASK.bool(), -1.0, garbage).double()
    logp = (old + token_tensor(DELTAS, 0.0)).where(MASK.bool(), -garbage).requires_grad_(True)
    return old, logp


# ------------------------------------------------------------------ advantages, by hand

# GRPO: mean 1/4, population std sqrt(3/16) = √3/4 → (1 − 1/4)/(√3/4) = √3, (−1/4)/(√3/4) = −1/√3.
GRPO_ADV = [S3, -1 / S3, -1 / S3, -1 / S3]
DR_GRPO_ADV = [0.75, -0.25, -0.25, -0.25]  # s − mean, no division
RLOO_ADV = [1.0, -1 / 3, -1 / 3, -1 / 3]  # s_i − mean of the other three
# REINFORCE++, γ = 1: every model token of row 0 (both turns) has return 1, the other 9 have 0;
# mean 4/13, unbiased var (4 (9/13)² + 9 (4/13)²) / 12 = 3/13.
_SD = math.sqrt(3 / 13 + 1e-8)
RPP_ADV = [9 / 13 / _SD, -4 / 13 / _SD, -4 / 13 / _SD, -4 / 13 / _SD]


@pytest.mark.parametrize("estimator,row_adv", [("grpo", GRPO_ADV), ("dr_grpo", DR_GRPO_ADV), ("rloo", RLOO_ADV),
                                                ("reinforce_pp", RPP_ADV)])
def test_outcome_estimators_give_every_model_token_its_rows_advantage_and_observations_none(estimator, row_adv):
    batch, _ = compute_advantages(episode_batch(), AlgorithmConfig(adv_estimator=estimator), n=4)
    expected = token_tensor([[a] * n for a, n in zip(row_adv, LENGTHS)], 0.0)
    torch.testing.assert_close(batch.advantages.double(), expected, atol=1e-5, rtol=0)  # GRPO's eps 1e-6


def test_reinforce_pp_return_flows_through_an_observation_span():
    """One row m m e e m m, score 1 on the last token, a reward of 7 on an observation token
    (ignored), γ = 0.5: the observation tokens are skipped, not time steps, so the returns of
    the model tokens are 1, 0.5 | 0.25, 0.125 (veRL's reset would give the first turn 0, 0)."""
    from posttrain.algos import reinforce_pp_advantages

    rewards = torch.tensor([[0.0, 0.0, 7.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    returns = [0.125, 0.25, 0.5, 1.0]
    mean = sum(returns) / 4  # 0.46875
    sd = math.sqrt(sum((g - mean) ** 2 for g in returns) / 3 + 1e-8)  # unbiased: 0.44921875 / 3
    expected = [(returns[0] - mean) / sd, (returns[1] - mean) / sd, 0.0, 0.0,
                (returns[2] - mean) / sd, (returns[3] - mean) / sd]
    torch.testing.assert_close(reinforce_pp_advantages(rewards, mask, gamma=0.5),
                               torch.tensor([expected], dtype=torch.float64))
    assert expected[0] < expected[1] < expected[4] < expected[5]  # the first turn is credited, discounted


def test_gae_bridges_an_observation_span_with_the_next_model_tokens_value():
    """GAE over model tokens only: the last model token before an observation bootstraps from
    the value of the first model token after it (discounted once: observation tokens are not
    time steps); the values and rewards at observation positions never enter. Row m m e e m m,
    V = .1 .2 [9 9] .4 .5, score 1 on the last token, a reward of 3 on an observation token,
    γ = 0.9, λ = 0.5:
        t=5: δ = 1 − .5 = .5                          A = .5
        t=4: δ = .9·.5 − .4 = .05                     A = .05 + .45·.5 = .275
        t=1: δ = .9·.4 − .2 = .16   (V_4, not V_2)    A = .16 + .45·.275 = .28375
        t=0: δ = .9·.2 − .1 = .08                     A = .08 + .45·.28375 = .2076875
    """
    rewards = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.2076875, 0.28375, 0, 0, 0.275, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.3076875, 0.48375, 0, 0, 0.675, 1.0]], dtype=torch.float64))
    other = values.clone()
    other[0, 2:4] = -5.0
    torch.testing.assert_close(compute_gae(rewards, other, mask, gamma=0.9, lam=0.5)[0], adv)


def test_ppo_on_the_episode_batch_whitens_over_model_tokens_and_ignores_observation_values():
    """The driver's gae path (whitened over the 13 model tokens): the same whatever the critic
    says at observation positions; and the value loss does not see them either."""
    values = token_tensor([[0.1 * (i + 1)] * n for i, n in enumerate(LENGTHS)], 0.0)
    algo = AlgorithmConfig(adv_estimator="gae", lam=1.0)
    a = compute_advantages(episode_batch(values.where(MASK.bool(), 9.0)), algo, n=1)[0]
    b = compute_advantages(episode_batch(values.where(MASK.bool(), -4.0)), algo, n=1)[0]
    torch.testing.assert_close(a.advantages, b.advantages)
    torch.testing.assert_close(a.returns, b.returns)
    # γ = λ = 1: A_t = score − V_t on every model token (the values telescope across the span).
    raw = token_tensor([[s - 0.1 * (i + 1)] * n for i, (s, n) in enumerate(zip(SCORES, LENGTHS))], 0.0)
    flat = [raw[i, t].item() for i in range(4) for t in model_positions(i)]
    mean = sum(flat) / 13
    sd = math.sqrt(sum((x - mean) ** 2 for x in flat) / 12 + 1e-8)
    torch.testing.assert_close(a.advantages, ((raw - mean) / sd).where(MASK.bool(), 0.0))
    torch.testing.assert_close(a.returns, (raw + values).where(MASK.bool(), 0.0))
    v1 = values.where(MASK.bool(), 9.0).requires_grad_(True)
    v2 = values.where(MASK.bool(), -4.0).requires_grad_(True)
    l1, _ = value_loss(v1, v1.detach(), a.returns, MASK, clip=0.2)
    l2, _ = value_loss(v2, v2.detach(), a.returns, MASK, clip=0.2)
    l1.backward()
    l2.backward()
    assert l1.item() == l2.item() and torch.equal(v1.grad, v2.grad) and not v1.grad[~MASK.bool()].any()


# ------------------------------------------------------------------ losses, by hand

L_EPISODE = RolloutConfig(max_new_tokens=2, env="arithmetic_tools",
                          multi_turn=MultiTurnConfig(max_turns=2, max_total_tokens=6)).max_response_tokens()

# name: (row advantages, ratio level, aggregation, clip_low, clip_high, max_len)
LOSSES = {
    "grpo": (GRPO_ADV, "token", "seq-mean-token-mean", 0.2, 0.2, None),
    "dapo": (GRPO_ADV, "token", "token-mean", 0.2, 0.28, None),
    "gspo": (GRPO_ADV, "sequence", "seq-mean-token-mean", 0.2, 0.2, None),
    "dr_grpo": (DR_GRPO_ADV, "token", "seq-mean-token-sum-norm", 0.2, 0.2, L_EPISODE),
    "rloo": (RLOO_ADV, "token", "token-mean", 0.2, 0.2, None),
    "reinforce_pp": (RPP_ADV, "token", "token-mean", 0.2, 0.2, None),
}


def hand_loss_and_grad(name):
    """ℓ_{i,t} = −A_i r_{i,t} (no clip binds), r = e^δ per token, or for GSPO the sequence
    ratio s_i = exp(mean of row i's δ over its model tokens) with ∂ℓ/∂logp_{i,t} = −A_i s_i.
    Aggregations over model tokens: token-mean ÷ 13; seq-mean-token-mean ÷ (4 |y_i|) per row;
    Dr.GRPO Σ ÷ (B · L) with L = 4 model tokens (min(2 turns · 2, 6)), not the width 6."""
    row_adv, level, agg, *_ = LOSSES[name]
    loss, grads = 0.0, []
    for a, deltas in zip(row_adv, DELTAS):
        seq = math.exp(sum(deltas) / len(deltas))
        ratios = [seq if level == "sequence" else math.exp(d) for d in deltas]
        weight = {"token-mean": 1 / 13, "seq-mean-token-mean": 1 / (4 * len(deltas)),
                  "seq-mean-token-sum-norm": 1 / (4 * 4)}[agg]
        loss += sum(-a * r * weight for r in ratios)
        grads.append([-a * r * weight for r in ratios])
    return loss, token_tensor(grads, 0.0)


def run_loss(name, garbage):
    row_adv, level, agg, clip_low, clip_high, max_len = LOSSES[name]
    adv = token_tensor([[a] * n for a, n in zip(row_adv, LENGTHS)], garbage)
    old, logp = log_probs(garbage)
    loss, metrics = policy_loss(logp, old, adv, MASK, clip_low, clip_high, level=level, agg=agg, max_len=max_len)
    loss.backward()
    return loss, logp.grad, metrics


def test_the_episode_model_token_limit_is_drgrpos_constant():
    assert L_EPISODE == 4  # min(max_turns 2 · max_new_tokens 2, max_total_tokens 6), not the width T = 6


@pytest.mark.parametrize("name", list(LOSSES))
def test_policy_losses_on_an_episode_batch_by_hand(name):
    assert all(0.8 < math.exp(d) < 1.2 for row in DELTAS for d in row)
    loss, grad, metrics = run_loss(name, garbage=0.0)
    expected_loss, expected_grad = hand_loss_and_grad(name)
    assert loss.item() == pytest.approx(expected_loss, abs=2e-6)
    torch.testing.assert_close(grad, expected_grad, atol=2e-6, rtol=0)
    assert metrics["clip_frac"].item() == 0.0
    # approx_kl averages old − new over the 13 model tokens only
    assert metrics["approx_kl"].item() == pytest.approx(-sum(map(sum, DELTAS)) / 13)


@pytest.mark.parametrize("name", list(LOSSES))
def test_log_probs_and_advantages_at_observation_positions_change_neither_loss_nor_gradient(name):
    loss_a, grad_a, metrics_a = run_loss(name, garbage=0.0)
    loss_b, grad_b, metrics_b = run_loss(name, garbage=30.0)
    assert loss_a.item() == loss_b.item() and torch.equal(grad_a, grad_b)
    assert not grad_b[~MASK.bool()].any()
    assert all(metrics_a[k].item() == metrics_b[k].item() for k in metrics_a)


def test_gspos_sequence_ratio_is_over_model_tokens_only():
    """Row 0's mean δ over its 4 model tokens is 0.1, so every token's ratio is e^0.1 (1.10517),
    including the token whose own δ is 0; counting the 2 observation tokens (δ 30) would not."""
    _, grad, metrics = run_loss("gspo", garbage=30.0)
    assert grad[0, 1].item() == pytest.approx(-S3 * math.exp(0.1) / 16, abs=1e-7)
    seq = [math.exp(sum(d) / len(d)) for d in DELTAS]
    assert metrics["ratio/mean"].item() == pytest.approx(sum(s * n for s, n in zip(seq, LENGTHS)) / 13)


# ------------------------------------------------------------------ DAPO's overlong shaping


def test_dapos_overlong_penalty_counts_model_tokens_only():
    """L_max = 4 (the episode's model-token limit), L_cache = 2, α = 1: the penalty ramps over
    model lengths 3..4: lengths 4, 2, 4, 3 → −1, 0, −1, −0.5 (the trajectory lengths 6, 3, 4, 5
    would give −1, −0.5, −1, −1); the score lands on the trajectory's last token."""
    batch = episode_batch().replace(token_rewards=None, prompts=["p"] * 4, completions=["c"] * 4)
    runner = RewardRunner([("one", lambda prompts, completions, completion_ids, **kw: [1.0] * len(prompts))])
    scored, _ = Reward(runner, max_new_tokens=L_EPISODE, overlong_buffer=2, overlong_penalty=1.0).score(batch)
    assert scored.scores.tolist() == [0.0, 1.0, 0.0, 0.5]
    last = [int(scored.token_rewards[i].nonzero().max()) if scored.scores[i] else None for i in range(4)]
    assert last == [None, 2, None, 4]  # rows 1 and 3: columns TOTAL − 1
