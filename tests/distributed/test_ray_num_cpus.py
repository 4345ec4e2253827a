"""ray.num_cpus on a real local Ray (veRL's ray_init.num_cpus): the Ray a run starts declares
that many CPUs, more than the machine has, and a run that fails leaves no Ray behind."""

import json
import os
import re
import time
from pathlib import Path

import pytest

from posttrain.cli import main


def live_raylets(marker: str, program: str = "raylet") -> set[int]:
    """Pids of `program` processes (raylet; "": any) whose command line holds `marker`."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and program in cmd and marker in cmd:
            found.add(int(proc.name))
    return found


@pytest.mark.slow  # a Ray start: 5-30 s on 2 cores
def test_a_run_starts_ray_with_ray_num_cpus_and_shuts_it_down_when_placement_fails(tmp_path, capsys):
    """More CPUs than the cores reach the Ray the run starts (its placement error reads them
    back); one CPU more per worker than declared cannot be placed, and the failed run stops its
    Ray: no raylet of this process, no session folder, no watchdog left."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    cpus = (os.cpu_count() or 1) + 1
    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    code = main(["grpo", "model.init=tiny", f"data.train_files=[{data}]", "reward.functions=[math_accuracy]",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.report_to=[]", "trainer.progress=false",
                 "data.train_batch_size=1", "rollout.n=2", "actor.micro_batch_size=2", "trainer.backend=ray",
                 f"ray.num_cpus={cpus}", f"placement.cpus_per_worker={cpus + 1}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(re.escape(f"placement.cpus_per_worker={cpus + 1} × trainer.n_workers_per_node=1 × trainer.nnodes=1 = "
                               f"{cpus + 1} CPUs, but the Ray cluster at ") + r"\S+:\d+" +
                     re.escape(f" has {cpus} CPUs on 1 node(s)"), err), err  # the address of the Ray it started
    assert "ray.num_cpus=N" in err  # the advice names it
    assert not ray.is_initialized()
    deadline = time.time() + 15  # the raylet exits within seconds of ray.shutdown()
    while live_raylets(f"/tmp/ptray-{os.getpid()}-") and time.time() < deadline:
        time.sleep(0.2)
    assert not live_raylets(f"/tmp/ptray-{os.getpid()}-"), "the failed run left its raylet"
    assert not list(Path("/tmp").glob(f"ptray-{os.getpid()}-*")), "the failed run left its session folder"
    assert not live_raylets(f"/tmp/ptray-{os.getpid()}-", program=""), "the failed run left its watchdog"
