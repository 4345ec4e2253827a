"""benchmarks/async_sim.py: the simulated schedules against hand-computed ones, the core sharing,
and the fit of the stage times (the measurement itself is benchmarks/async_rl.py's)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "async_sim.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("async_sim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_equal_generation_and_update_give_2x_for_k1_and_1x_for_k0(sim):
    st = sim.Stages(gen=1.0, update=1.0, sync=0.0)
    # K=0: gen, update in turn: 2 s a step. K=1: gen(s+1) runs during update(s): 1 s a step.
    assert sim.step_time(st, 0) == pytest.approx(2.0)
    assert sim.step_time(st, 1) == pytest.approx(1.0)
    assert sim.speedup(st, 1) == pytest.approx(2.0)
    assert sim.speedup(st, 0) == pytest.approx(1.0)


@pytest.mark.parametrize("gen,update", [(3.0, 1.0), (1.0, 3.0)])
def test_k1_with_one_stage_three_times_the_other_gives_four_thirds(sim, gen, update):
    # sync: 3 + 1 = 4 s a step; K=1: the longer stage alone sets the pace, 3 s: (3 + 1) / 3.
    assert sim.speedup(sim.Stages(gen, update, 0.0), 1) == pytest.approx(4 / 3)


def test_the_synchronous_loop_runs_gen_update_sync_in_turn(sim):
    # gen1 [0,1], update1 [1,3] → step 1 ends at 3; sync1 [3,3.5], gen2 [3.5,4.5], update2 [4.5,6.5];
    # sync2 [6.5,7], gen3 [7,8], update3 [8,10].
    assert sim.simulate(sim.Stages(gen=1.0, update=2.0, sync=0.5), 3, k=0) == pytest.approx([3.0, 6.5, 10.0])


def test_k2_keeps_two_batches_ahead_and_queues_each_sync_behind_them(sim):
    # gen=2, update=1, sync=0.5, K=2. The lane: gen1 [0,2], gen2 [2,4], gen3 [4,6] (submitted at
    # step 1), sync1 [6,6.5] (queued at 3), gen4 [6.5,8.5] (submitted at step 2's start, 3),
    # sync2 [8.5,9], gen5 [9,11]. The driver: update1 [2,3], update2 [4,5], update3 [6,7],
    # update4 [8.5,9.5], update5 [11,12].
    ends = sim.simulate(sim.Stages(gen=2.0, update=1.0, sync=0.5), 5, k=2)
    assert ends == pytest.approx([3.0, 5.0, 7.0, 9.5, 12.0])


def test_the_sync_on_the_rollout_lane_lengthens_the_async_step(sim):
    # K=1, gen = update = 1, sync 0.5: the lane runs gen + sync = 1.5 s a step, the actor 1 s;
    # synchronous 2.5 s: 2.5 / 1.5.
    st = sim.Stages(gen=1.0, update=1.0, sync=0.5)
    assert sim.step_time(st, 1) == pytest.approx(1.5)
    assert sim.speedup(st, 1) == pytest.approx(2.5 / 1.5)


@pytest.mark.parametrize("workers,cores", [(1, 1), (2, 2)])
def test_overlapped_stages_sharing_too_few_cores_gain_nothing(sim, workers, cores):
    # W + W busy workers on W cores: each runs at half speed while both are busy: gen(s+1) and
    # update(s) both take 2 s, so K=1 takes 2 s a step, as the synchronous loop (1 + 1, each alone).
    st = sim.Stages(1.0, 1.0, 0.0, rollout_workers=workers, actor_workers=workers)
    assert sim.step_time(st, 0, cores) == pytest.approx(2.0)
    assert sim.step_time(st, 1, cores) == pytest.approx(2.0)
    assert sim.step_time(st, 1, 2 * cores) == pytest.approx(1.0)
    assert sim.step_time(st, 1, math.inf) == pytest.approx(1.0)


def test_the_fit_recovers_the_stage_models_from_synchronous_runs(sim):
    # gen = 0.1 + 0.02·R/W, update = 0.3 + 0.05·R/W, sync = 0.01 + 1e-9·W·B (B = 1e7 bytes),
    # at W ∈ {1, 2} and R ∈ {8, 16, 32}; the async runs are not fitted.
    runs = [{"mode": "sync", "workers": w, "rows": r, "gen_s": 0.1 + 0.02 * r / w, "update_s": 0.3 + 0.05 * r / w,
             "sync_s": 0.01 + 1e-9 * w * 1e7, "weight_bytes": 1e7} for w in (1, 2) for r in (8, 16, 32)]
    runs.append({"mode": "async_k1", "workers": 1, "rows": 8, "gen_s": 9.0, "update_s": 9.0, "sync_s": 9.0,
                 "weight_bytes": 1e7})
    m = sim.fit(runs)
    assert (m.a, m.b, m.c, m.d, m.e, m.f) == pytest.approx((0.1, 0.02, 0.3, 0.05, 0.01, 1e-9))
    st = m.stages(rows=64, rollout_workers=4, actor_workers=2)
    assert (st.gen, st.update, st.sync) == pytest.approx((0.1 + 0.02 * 16, 0.3 + 0.05 * 32, 0.01 + 0.04))
    assert m.stages(rows=64, rollout_workers=4, actor_workers=2, serial_sync=False).sync == pytest.approx(0.01 + 0.01)
