"""Partial rollouts (trainer.async_training.partial_rollout, `trainers.rl_partial`): a weight sync
reaches a generation in flight at a segment boundary; each token keeps the log-prob and the
version of the weights that sampled it; the bound and the staleness metrics count a sample's
oldest token; a segmented generation without a weight change is the unsegmented one.

float64 models, rollout.seed_mode=row. The engines return log-probs as float32, so a recorded
log-prob equals a float64 teacher-forced one to float32 rounding (2e-6 at these magnitudes).
"""

import dataclasses
import threading
from functools import partial

import pytest
import torch

import posttrain.trainers.rl as rl_module
from posttrain.algos.logprobs import token_logprobs
from posttrain.config import ConfigError
from posttrain.distributed.groups import LocalWorkerGroup
from posttrain.rollout import SamplingParams
from posttrain.rollout.sampling import stream_seed
from posttrain.trainers.rl_async import stale_groups, staleness_metrics
from posttrain.trainers.rl_build import check_reward_source
from posttrain.workers.forward import response_logits

from .test_rl import metric_lines, starts_with_a, tiny_model, trainer_for
from .test_rl_async import max_diff, prompt_log, run, small

PARTIAL = {"trainer.async_training.max_staleness": 1, "trainer.async_training.partial_rollout": "true",
           "trainer.async_training.partial_rollout_tokens": 2, "rollout.max_new_tokens": 6}
FLOAT32_LOGP = 2e-6


class Versions:
    """A callback keeping the weights of every version (after each step) and each step's batch."""

    def __init__(self):
        self.trainer, self.weights, self.batches = None, {}, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.weights[state.global_step] = {k: v.clone() for k, v in self.trainer.model.state_dict().items()}
        self.batches[state.global_step] = self.trainer.last_batch


def partial_run(run_dir, **over):
    versions = Versions()
    trainer = trainer_for(small(run_dir, **{**PARTIAL, **over}), model=tiny_model().double(), callbacks=[versions])
    versions.trainer = trainer
    versions.weights[0] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    return trainer, versions


def teacher_forced(weights, batch, temperature=1.0):
    """(B, Tr) float64 log-probs of the batch's responses under `weights`."""
    model = tiny_model().double()
    model.load_state_dict(weights)
    with torch.no_grad():
        return token_logprobs(response_logits(model.eval(), batch), batch.response_ids, temperature)


def check_each_token_s_version(versions, batch):
    """Every generated token's recorded log-prob is the teacher-forced one under the weights of
    its own version (and not under the other versions of the batch). Returns the versions seen."""
    seen = sorted(set(batch.versions[batch.generated_mask.bool()].tolist()))
    for v in seen:
        at = batch.generated_mask.bool() & (batch.versions == v)
        diff = (teacher_forced(versions.weights[v], batch) - batch.rollout_logp.double()).abs()
        assert float(diff[at].max()) < FLOAT32_LOGP, (v, float(diff[at].max()))
        for other in seen:
            if other != v:  # the test tells the versions apart
                assert float((teacher_forced(versions.weights[other], batch)
                              - batch.rollout_logp.double()).abs()[at].max()) > 1e-4
    return seen


def test_a_sync_reaches_the_generation_in_flight_and_each_token_keeps_its_version_s_logprob(tmp_path):
    """In turn, K = 1, segments of 2 of 6 tokens: step s+1's batch starts (tokens 0-1) with the
    weights of version s-1 before step s's update, and the sync after it reaches the generation:
    tokens 2-5 are version s's. Each token's behaviour log-prob is its own version's."""
    trainer, versions = partial_run(tmp_path)
    for step in (2, 3):
        batch = versions.batches[step]
        gen = batch.generated_mask.bool()
        assert batch.lengths.max() > 2  # rows went on after the first segment
        assert (batch.versions[:, :2][gen[:, :2]] == step - 2).all()
        assert (batch.versions[:, 2:][gen[:, 2:]] == step - 1).all()
        assert check_each_token_s_version(versions, batch) == [step - 2, step - 1]
        two = gen[:, 2:].any(-1)  # samples holding tokens of both versions
        assert int(two.sum()) >= len(batch) // 2
    assert versions.batches[1].versions.unique().tolist() == [0]
    # the bound and the metrics count a sample's oldest token: each trained token is 1 update stale
    lines = metric_lines(tmp_path)
    assert [m["async/staleness/mean"] for m in lines] == [0.0, 1.0, 1.0]
    assert [m["async/staleness/max"] for m in lines] == [0.0, 1.0, 1.0]
    assert [r["version"] for r in prompt_log(tmp_path)] == [[0] * 4, [0] * 4, [1] * 4]


def test_staleness_and_the_bound_count_a_sample_s_oldest_token():
    """Row 0 holds tokens of versions 1 and 3 (a sync reached it mid-generation): at version 3 it
    is 2 updates stale in every token, over K = 1; row 1 (version 3 only) is not."""
    versions = torch.tensor([[1, 3, 3], [3, 3, 3]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    m = staleness_metrics(versions, mask, version=3)
    assert m == {"async/staleness/mean": pytest.approx(2 * 3 / 5), "async/staleness/max": 2.0}
    assert stale_groups(versions, mask, version=3, k=1, n=1).tolist() == [True, False]


def test_a_segmented_generation_without_a_weight_change_is_the_unsegmented_one(tmp_path):
    """seed_mode=row: segments of 2 tokens sample the tokens of one 6-token call (rows continue
    their own draws at their own positions, finished rows drop out), with the same log-probs."""
    trainer = trainer_for(small(tmp_path, **PARTIAL), model=tiny_model().double())
    segments = trainer.pipeline.partial
    prompts = trainer.prompts_of([0, 1, 2, 3]).replace(uid=torch.arange(4))
    whole = trainer.roles.rollout.generate(prompts, segments.seed_of(1))
    part = segments.start(prompts, 1, version=0)
    resumed = 0
    while not part.finished:
        part = segments.resume(part, version=0)
        resumed += 1
    out = segments.complete(part)
    assert resumed == 2 and bool((whole.lengths < 6).any()) and bool((whole.lengths > 2).any())
    assert torch.equal(out.response_ids, whole.response_ids)
    assert torch.equal(out.lengths, whole.lengths) and torch.equal(out.truncated, whole.truncated)
    assert torch.equal(out.response_mask, whole.response_mask)
    assert out.completions == whole.completions
    assert torch.allclose(out.rollout_logp, whole.rollout_logp, atol=FLOAT32_LOGP, rtol=0)
    assert out.versions.unique().tolist() == [0]


def test_batch_mode_segments_are_samples_of_the_policy(tmp_path):
    """seed_mode=batch: each segment draws from a stream of its own (not the unsegmented call's
    tokens), and each token's recorded log-prob is the policy's."""
    trainer = trainer_for(small(tmp_path, **PARTIAL, **{"rollout.seed_mode": "batch"}), model=tiny_model().double())
    segments = trainer.pipeline.partial
    part = segments.start(trainer.prompts_of([0, 1, 2, 3]).replace(uid=torch.arange(4)), 1, version=0)
    while not part.finished:
        part = segments.resume(part, version=0)
    out = segments.complete(part)
    assert int(out.lengths.max()) > 2
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    diff = (teacher_forced(weights, out) - out.rollout_logp.double()).abs()
    assert float(diff[out.generated_mask.bool()].max()) < FLOAT32_LOGP


def test_drop_counts_the_oldest_token_of_a_partial_sample_and_refills_with_current_weights(tmp_path):
    """A batch started at version 0 and finished at version 2 is 2 updates old at its oldest token:
    over K = 1, every group is dropped; the fresh ones are generated after the syncs, all version 2."""
    trainer = trainer_for(small(tmp_path, **PARTIAL, **{"trainer.async_training.stale_policy": "drop"}),
                          model=tiny_model().double())
    pipe = trainer.pipeline
    pipe.fill(1)  # steps 1 and 2: their first segments, version 0
    pipe.updated()
    pipe.updated()  # two syncs (of unchanged weights): the engine holds version 2
    batch = pipe.take(1)  # its other segments now, version 2
    gen = batch.generated_mask.bool()
    assert batch.versions[gen].unique().tolist() == [0, 2]
    drawn = set(batch.prompt_index.tolist()) | set(pipe.jobs[0].prompts.prompt_index.tolist())
    batch, dropped = pipe.enforce_bound(batch, 1)
    assert dropped == 4 and len(batch) == 16 and not set(batch.prompt_index.tolist()) & drawn  # 4 fresh prompts
    assert batch.versions[batch.generated_mask.bool()].unique().tolist() == [2]
    assert bool(((batch.lengths == 6) | ~batch.truncated).all())  # finished rows only


def test_row_mode_draws_follow_a_resumed_call_s_rows_and_positions():
    params = SamplingParams(seed_mode="row", first_row=1, row_index=(3, 5, 8), first_position=4)
    assert params.draw_rows(torch.tensor([0, 1])).tolist() == [5, 8]
    with pytest.raises(ValueError, match="row_index"):
        SamplingParams(row_index=(0,))
    # batch mode: the first segment's stream is the unsegmented call's, each later one its own
    assert stream_seed(5, 0) == 5 and len({stream_seed(5, g) for g in (0, 2, 4, 6)}) == 4


def test_a_run_on_a_pool_of_its_own_records_each_token_s_version(tmp_path, monkeypatch):
    """The rollout's thread runs every segment of a batch, applying the newest sync waiting before
    each: where it lands depends on timing, but every token's log-prob is its recorded version's,
    and no token is older than the batch's submission."""
    monkeypatch.setattr(rl_module, "build_roles", partial(rl_module.build_roles, make_group=LocalWorkerGroup))
    trainer, versions = partial_run(tmp_path, **{"trainer.backend": "ray", "placement.rollout.enable_resource_pool": "true"})
    assert trainer.pipeline.lane.pool is not None
    for step in (1, 2, 3):
        batch = versions.batches[step]
        seen = check_each_token_s_version(versions, batch)
        assert max(step - 2, 0) <= seen[0] and seen[-1] <= step - 1
        # a row's versions never go down along its tokens
        gen = batch.generated_mask.bool()
        v = torch.where(gen, batch.versions, torch.full_like(batch.versions, 10**6))
        assert bool((v[:, 1:] >= v[:, :-1]).all())


def test_one_segment_is_the_pipeline_without_partial_rollouts(tmp_path):
    """partial_rollout_tokens >= rollout.max_new_tokens: one segment per batch, generated when it
    is submitted, as without partial rollouts: the same weights and metrics."""
    two_steps = {**PARTIAL, "trainer.max_steps": 2}
    plain = run(small(tmp_path / "plain", **{**two_steps, "trainer.async_training.partial_rollout": "false"}))
    one = run(small(tmp_path / "one", **{**two_steps, "trainer.async_training.partial_rollout_tokens": 6}))
    assert max_diff(plain.model, one.model) == 0.0
    for a, b in zip(metric_lines(tmp_path / "plain"), metric_lines(tmp_path / "one"), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("timing/", "throughput/", "perf/")) and not k.endswith("time_s")} == \
               {k: v for k, v in b.items() if not k.startswith(("timing/", "throughput/", "perf/")) and not k.endswith("time_s")}


def test_on_a_pool_of_its_own_an_update_during_a_segment_reaches_the_next_one(tmp_path, monkeypatch):
    """Deterministic: the rollout's thread is held after step 1's first segment while the driver
    changes the actor's weights and calls `updated`; the sync goes ahead of the remaining
    segments of that batch and of the whole batch queued behind it."""
    monkeypatch.setattr(rl_module, "build_roles", partial(rl_module.build_roles, make_group=LocalWorkerGroup))
    trainer = trainer_for(small(tmp_path, **PARTIAL, **{"trainer.backend": "ray",
                                                        "placement.rollout.enable_resource_pool": "true"}),
                          model=tiny_model().double())
    pipe, real = trainer.pipeline, trainer.pipeline.partial.generate
    first_done, updated = threading.Event(), threading.Event()

    def held_after_the_first_segment(prompts, seed, params):
        out = real(prompts, seed, params)
        if not first_done.is_set():
            first_done.set()
            assert updated.wait(60)
        return out

    pipe.partial.generate = held_after_the_first_segment
    versions = Versions()
    versions.weights[0] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    pipe.fill(1)  # steps 1 and 2 on the rollout's thread
    assert first_done.wait(60)
    with torch.no_grad():  # an update of the actor's weights (the rollout's copy is untouched)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    versions.weights[1] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    pipe.updated()
    updated.set()
    one, two = pipe.take(1), pipe.take(2)
    gen = one.generated_mask.bool()
    assert (one.versions[:, :2][gen[:, :2]] == 0).all() and (one.versions[:, 2:][gen[:, 2:]] == 1).all()
    assert check_each_token_s_version(versions, one) == [0, 1]
    assert check_each_token_s_version(versions, two) == [1]
    pipe.lane.close()


def test_partial_rollout_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="trainer.async_training.partial_rollout.*max_staleness >= 1"):
        small(tmp_path, **{**PARTIAL, "trainer.async_training.max_staleness": 0})
    with pytest.raises(ConfigError, match="trainer.async_training.partial_rollout_tokens: must be >= 1, got 0"):
        small(tmp_path, **{**PARTIAL, "trainer.async_training.partial_rollout_tokens": 0})
    with pytest.raises(ConfigError, match="rollout.engine.*rollout.engine=native or hf"):
        small(tmp_path, **{**PARTIAL, "rollout.engine": "vllm"})
    with pytest.raises(ConfigError, match="rollout.stop.*rollout.stop_token_ids"):
        trainer_for(small(tmp_path, **{**PARTIAL, "rollout.stop": ["."]}))
    # multi-turn episodes keep each turn's tokens on the worker between segments: stop strings work,
    # whether the episodes come from the config or from the Python API's environment_factory / tools
    stop = small(tmp_path, **{**PARTIAL, "rollout.stop": ["."]})
    check_reward_source(stop, [starts_with_a], episodes=True)
    episodes = small(tmp_path, **{**PARTIAL, "rollout.env": "guess_number", "rollout.stop": ["."]})
    check_reward_source(episodes, None)
    with pytest.raises(ConfigError, match="veRL's async_training.partial_rollout is trainer.async_training.partial_rollout"):
        small(tmp_path, **{"async_training.partial_rollout": "true"})


def test_the_vllm_engines_refuse_a_resumed_generation():
    from posttrain.rollout.vllm_rows import check_sampling

    with pytest.raises(ValueError, match="cannot resume a generation"):
        check_sampling(dataclasses.replace(SamplingParams(seed_mode="row"), first_position=2))

