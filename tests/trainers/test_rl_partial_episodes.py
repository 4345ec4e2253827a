"""Partial rollouts of multi-turn episodes (`trainers.rl_partial.PartialEpisodes`): the episodes
and their environments stay on the rollout workers between segments, a weight sync lands between
two segments (mid-turn or between turns), and each model token keeps the log-prob and version of
the weights that sampled it.

The policy is conftest's `guesser` (float64, taught to play GuessNumber over 1..3): its first
turn ` <call>guess(N)</call>` is 22 tokens, so segments of 22 tokens end at the turn boundary.
"""

import copy
from functools import partial

import pytest
import torch

import posttrain.trainers.rl as rl_module
from posttrain import GRPOTrainer
from posttrain.algos.logprobs import token_logprobs
from posttrain.distributed.groups import LocalWorkerGroup
from posttrain.distributed.register import role_view
from posttrain.trainers.rl_build import episode_source
from posttrain.trainers.rl_partial import PartialEpisodes
from posttrain.trainers.rl_worker import RLWorker
from posttrain.workers import RLBatch
from posttrain.workers.forward import response_logits

from .conftest import GUESS_ROWS
from .test_rl import metric_lines
from .test_rl_async import assert_each_prompt_once_per_epoch, crashed_and_resumed, prompt_log
from .test_rl_partial import FLOAT32_LOGP, Versions
from .test_rl_ray import episode_config

TURN = 22
PARTIAL = {"trainer.async_training.max_staleness": 1, "trainer.async_training.partial_rollout": "true",
           "trainer.async_training.partial_rollout_tokens": TURN, "rollout.seed_mode": "row",
           "rollout.calculate_log_probs": "true"}


def model_columns(batch: RLBatch, row: int) -> list[list[int]]:
    """Per model turn of `row`, its model tokens' columns (`episodes` bounds)."""
    return [list(range(t["bounds"][0], t["bounds"][1])) for t in batch.episodes[row]["turns"]]


def teacher_forced(model, weights, batch):
    """(B, Tr) float64 log-probs of every response token under `weights` (environment tokens as
    context)."""
    model = copy.deepcopy(model)
    model.load_state_dict(weights)
    with torch.no_grad():
        return token_logprobs(response_logits(model.eval(), batch), batch.response_ids, 1.0)


def check_versions(model, versions, batch):
    """Each model token's recorded log-prob is its own version's teacher-forced one (and not the
    other versions'). Returns the versions seen."""
    cols = torch.zeros_like(batch.response_ids, dtype=torch.bool)
    for row in range(len(batch)):
        for turn in model_columns(batch, row):
            cols[row, turn] = True
    seen = sorted(set(batch.versions[cols].tolist()))
    forced = {v: teacher_forced(model, versions.weights[v], batch) for v in seen}
    for v in seen:
        at = cols & (batch.versions == v)
        assert float((forced[v] - batch.rollout_logp.double()).abs()[at].max()) < FLOAT32_LOGP, v
        for other in seen:
            if other != v:
                assert float((forced[other] - batch.rollout_logp.double()).abs()[at].max()) > 1e-4
    return seen


def partial_episode_run(model, tok, run_dir, **over):
    versions = Versions()
    cfg = episode_config(run_dir, "guess_number", **{**PARTIAL, "trainer.max_steps": 3, **over})
    trainer = GRPOTrainer(copy.deepcopy(model), args=cfg, train_dataset=GUESS_ROWS * 2, processing_class=tok,
                          callbacks=[versions])
    versions.trainer = trainer
    versions.weights[0] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    return trainer, versions


def test_a_sync_lands_between_the_turns_of_an_episode_and_each_token_keeps_its_version(guesser, tmp_path):
    """In turn, K = 1, segments of 22 tokens: step s+1's episodes play their first turn with the
    weights before step s's update, the environment answers, and the sync after the update reaches
    them there: their next turns are version s's. Each model token's behaviour log-prob is its
    own version's; the bound and the metrics count an episode's oldest token."""
    model, tok = guesser
    trainer, versions = partial_episode_run(model, tok, tmp_path)
    between = 0
    for step in (2, 3):
        batch = versions.batches[step]
        assert check_versions(model, versions, batch) == [step - 2, step - 1]
        for row in range(len(batch)):
            turns = [batch.versions[row, cols].unique().tolist() for cols in model_columns(batch, row)]
            if len(turns) >= 2 and turns[0] == [step - 2] and all(t == [step - 1] for t in turns[1:]):
                between += 1  # its first turn the old weights', the others the new ones'
    assert between >= 4
    assert versions.batches[1].versions.unique().tolist() == [0]
    lines = metric_lines(tmp_path)
    assert [m["async/staleness/max"] for m in lines] == [0.0, 1.0, 1.0]
    assert max(m["turns/max"] for m in lines) >= 2
    assert max(abs(m["rollout_corr/rollout_is_mean"] - 1) for m in lines[1:]) > 1e-4  # decoupled PPO's weight
    assert [r["version"] for r in prompt_log(tmp_path)] == [[0] * 2, [0] * 2, [1] * 2]


def test_on_a_pool_of_its_own_episodes_in_parts_record_each_token_s_version(guesser, tmp_path, monkeypatch):
    """The rollout's thread plays every segment of a batch, applying the newest sync before each:
    where it lands depends on timing, but each model token's log-prob is its recorded version's,
    never older than the batch's submission, and a row's versions never go down."""
    monkeypatch.setattr(rl_module, "build_roles", partial(rl_module.build_roles, make_group=LocalWorkerGroup))
    model, tok = guesser
    trainer, versions = partial_episode_run(model, tok, tmp_path, **{
        "trainer.backend": "ray", "placement.rollout.enable_resource_pool": "true"})
    assert trainer.pipeline.lane.pool is not None
    for step in (1, 2, 3):
        batch = versions.batches[step]
        seen = check_versions(model, versions, batch)
        assert max(step - 2, 0) <= seen[0] and seen[-1] <= step - 1
        for row in range(len(batch)):
            v = batch.versions[row, [c for cols in model_columns(batch, row) for c in cols]]
            assert bool((v[1:] >= v[:-1]).all())


def test_episodes_in_parts_split_over_two_rollout_workers_are_one_worker_s(guesser, tmp_path, in_process_group):
    """rollout.dispatch=split: each worker keeps its slice's episodes and environments between
    segments; the joined batch is one worker's segmented batch and the unsegmented one (row
    draws). A finished batch is dropped from the workers at the next call; a batch they do not
    hold is refused, naming it."""
    model, tok = guesser
    cfg = episode_config(tmp_path, "guess_number", **{**PARTIAL, "trainer.backend": "ray",
                                                      "trainer.n_workers_per_node": 2})
    env = episode_source(cfg)
    two = in_process_group(RLWorker, 2, cfg, tok, copy.deepcopy(model), None, env)
    one = LocalWorkerGroup(RLWorker, cfg, tok, copy.deepcopy(model), None, env)
    prompts = RLBatch.from_prompts([{"ids": tok(r["prompt"])["input_ids"], "prompt": r["prompt"],
                                     "columns": {"secret": r["secret"], "low": 1, "high": 3}} for r in GUESS_ROWS],
                                   0).replace(uid=torch.arange(4))
    out = {}
    for name, group in (("two", two), ("one", one)):
        view = role_view(group, RLWorker, "rollout", {"split": True})
        parts = PartialEpisodes(view.play_in_parts, TURN, lambda step: 7)
        part, calls = parts.start(prompts, 1, version=0), 1
        while not part.finished:
            part, calls = parts.resume(part, version=0), calls + 1
        out[name] = parts.complete(part)
        assert calls >= 2
    whole = role_view(one, RLWorker, "rollout").generate(prompts, 7)
    for batch in (out["two"], whole):
        assert torch.equal(batch.response_ids, out["one"].response_ids) and batch.completions == out["one"].completions
        assert batch.episodes == out["one"].episodes and torch.equal(batch.uid, out["one"].uid)
        torch.testing.assert_close(batch.rollout_logp, out["one"].rollout_logp, atol=FLOAT32_LOGP, rtol=0)
    assert max(len(e["turns"]) for e in whole.episodes) >= 2
    assert all(len(w.rollout.in_parts) == 1 for w in two.workers)  # the finished batch, until the next call
    view = role_view(two, RLWorker, "rollout", {"split": True})
    view.play_in_parts(prompts, 7, 5, True, TURN, 0, [5])
    assert all(list(w.rollout.in_parts) == [5] for w in two.workers)
    with pytest.raises(RuntimeError, match="the episodes of batch 9 are not held by this worker"):
        view.play_in_parts(prompts, 7, 9, False, TURN, 0, [5, 9])


@pytest.mark.slow
def test_episodes_in_parts_on_a_ray_rollout_pool_of_two_workers(ray_session, guesser, tmp_path):
    """Real Ray workers: a rollout pool of its own, its 2 workers each keeping its slice's
    episodes and environments between segments while the actor pool trains; every model token's
    log-prob is its recorded version's."""
    model, tok = guesser
    trainer, versions = partial_episode_run(model, tok, tmp_path, **{
        "trainer.backend": "ray", "placement.rollout.enable_resource_pool": "true",
        "placement.rollout.n_workers_per_node": 2, "rollout.dispatch": "split"})
    assert trainer.pipeline.lane.pool is not None and trainer.roles.rollout.group.world_size == 2
    for step in (1, 2, 3):
        seen = check_versions(model, versions, versions.batches[step])
        assert max(step - 2, 0) <= seen[0] and seen[-1] <= step - 1
    assert max(m["turns/max"] for m in metric_lines(tmp_path)) >= 2


def test_a_crashed_run_with_episodes_in_parts_trains_every_prompt_once_per_epoch(guesser, tmp_path):
    """8 prompts, 2 per step, 8 steps, checkpoints every 2: crashes at steps 3 and 6, each resumed
    (trainer.resume=auto). The episodes in flight at a checkpoint (their first segment played)
    are regenerated from their prompts: every prompt is trained on exactly once per epoch."""
    model, tok = guesser
    rows = [{**r, "prompt": f"{r['prompt']} {i}"} for i, r in enumerate(GUESS_ROWS * 2)]
    over = {**PARTIAL, "trainer.max_steps": 8, "trainer.save_steps": 2, "trainer.resume": "auto"}
    crashed_and_resumed(lambda callbacks: GRPOTrainer(
        copy.deepcopy(model), args=episode_config(tmp_path, "guess_number", **over), train_dataset=rows,
        processing_class=tok, callbacks=callbacks))
    assert_each_prompt_once_per_epoch(tmp_path, prompts=8, steps_per_epoch=4, epochs=2)
