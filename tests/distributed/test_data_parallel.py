"""Data-parallel SFT, RM and DPO (`trainer.strategy=ddp|fsdp2`) under torchrun, 2 gloo ranks on
127.0.0.1, against one process on the same global batch (`cases.py` builds both).

One torchrun launch runs every 2-rank job (about 20 s on 2 cores); the module fixture runs
the one-process references beside it. The launch is its own session, killed with its whole
process group whatever happens, so no rank outlives a test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config import ConfigError
from posttrain.distributed import init_from_env, rank_slice

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
_spec = importlib.util.spec_from_file_location("dp_cases", HERE / "cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

EXACT = [(c, s) for c in ("sft", "rm", "dpo") for s in ("ddp", "fsdp2")]
LAUNCH_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(spec: dict | list[str], workdir: Path) -> None:
    """Run cases.py's jobs (`spec`), or `-m posttrain ARGV` (a list), on 2 ranks; fail with
    the log's tail; leave no process behind."""
    if isinstance(spec, dict):
        (workdir / "spec.json").write_text(json.dumps(spec))
        target = [str(HERE / "cases.py"), str(workdir / "spec.json")]
    else:
        target = ["-m", "posttrain", *spec]
    log = workdir / "torchrun.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), *target]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the agent and both ranks, if anything is left
            except ProcessLookupError:
                pass
            proc.wait()
    assert rc == 0, f"torchrun {'timed out' if rc is None else f'exited {rc}'}:\n{log.read_text()[-4000:]}"


def cut_at_step_2(run_dir: Path, into: Path) -> Path:
    """A copy of a finished run as if it had stopped after its step-2 checkpoint."""
    shutil.copytree(run_dir, into)
    shutil.rmtree(into / "checkpoints" / "step-3")
    shutil.rmtree(into / "final")
    return into


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    saved = {"trainer.save_steps": 2}
    cases.train("sft", root / "one-fsdp2", "fsdp2", **saved)  # one process writing sharded checkpoints
    resume_1to2 = cut_at_step_2(root / "one-fsdp2", root / "resume-1to2")
    jobs = [{"kind": "train", "command": c, "run_dir": str(root / f"{c}-{s}"), "strategy": s, "over": saved}
            for c, s in EXACT]
    jobs.append({"kind": "train", "command": "sft", "run_dir": str(resume_1to2), "strategy": "fsdp2", "over": saved})
    jobs += [{"kind": "grads", "strategy": s, "out": str(root / f"grads-{s}.pt")} for s in ("ddp", "fsdp2")]
    torchrun({"jobs": jobs}, root)
    for command in ("sft", "rm", "dpo"):
        cases.train(command, root / f"{command}-none", "none")
    torch.save(cases.float32_grads("none", None), root / "grads-none.pt")
    resume_2to1 = cut_at_step_2(root / "sft-fsdp2", root / "resume-2to1")
    cases.train("sft", resume_2to1, "fsdp2", **saved)  # one process resumes 2 ranks' shards
    return root


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def assert_same_weights(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"max |Δθ| {worst:.3g} > {atol}"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("command, strategy", EXACT)
def test_two_ranks_give_the_one_process_update(runs, command, strategy):
    """float64, 3 AdamW steps with warmup, cosine decay and clipping: θ within 1e-10."""
    one, two = runs / f"{command}-none", runs / f"{command}-{strategy}"
    assert_same_weights(final_weights(two), final_weights(one), atol=1e-10)
    # rank 0's metrics are the global batch's: the loss over all units, the units, the
    # loss_fn's means (weighted by units; RM's are float32) and maxima (reward/max)
    unit = f"n_{cases.UNITS[command]}"
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert a[unit] == b[unit]
        for key in a:
            if not key.startswith(("timing/", "throughput/", "data/")):
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_give_the_one_process_gradients_in_float32(runs, strategy):
    want, got = torch.load(runs / "grads-none.pt"), torch.load(runs / f"grads-{strategy}.pt")
    assert_same_weights(got, want, atol=1e-6)
    assert max(g.abs().max().item() for g in want.values()) > 1e-3  # a real gradient


def test_checkpoints_are_sharded_sealed_and_keep_a_plain_hf_folder(runs):
    from transformers import AutoModelForCausalLM

    ckpt = runs / "sft-fsdp2" / "checkpoints" / "step-2"
    sealed = json.loads((ckpt / "COMPLETE").read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "model.safetensors"} <= sealed.keys()
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"] is None  # it is in dcp/
    hf = AutoModelForCausalLM.from_pretrained(runs / "sft-fsdp2" / "final", torch_dtype=torch.float64)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    assert_same_weights({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"},
                        final_weights(runs / "sft-none"), atol=1e-10)


@pytest.mark.parametrize("direction", ["2to1", "1to2"])
def test_resume_at_another_number_of_ranks_gives_the_exact_next_step(runs, direction):
    resumed = runs / f"resume-{direction}"
    assert [m["step"] for m in metrics(resumed)] == [1, 2, 3]  # the resumed step 3 replaced nothing
    assert_same_weights(final_weights(resumed), final_weights(runs / "sft-none"), atol=1e-10)


def test_one_process_never_joins_a_group(runs, monkeypatch):
    assert not torch.distributed.is_initialized()  # the fixture's one-process runs, ddp/fsdp2 included
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_from_env("fsdp2") is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="trainer.strategy"):
        init_from_env("none")


@pytest.mark.parametrize("n, world, want", [(10, 4, [3, 3, 2, 2]), (3, 2, [2, 1]), (4, 2, [2, 2])])
def test_rank_slices_cover_the_batch_in_order(n, world, want):
    slices = [range(n)[rank_slice(n, r, world)] for r in range(world)]
    assert [len(s) for s in slices] == want
    assert [i for s in slices for i in s] == list(range(n))


def test_torchrun_of_the_cli_trains_evaluates_and_only_rank_0_writes(tmp_path):
    """`torchrun --nproc_per_node 2 -m posttrain sft ... trainer.strategy=fsdp2` with held-out
    loss and greedy task accuracy (the native engine reaches past `forward`)."""
    from posttrain.cli import main

    assert main(["data", "make", "arithmetic", "--out", str(tmp_path / "d"), "--n-train", "16", "--n-test", "4"]) == 0
    run = tmp_path / "run"
    cli = ["sft", "model.init=tiny", f"data.train_files=[{tmp_path / 'd' / 'train.jsonl'}]",
           f"data.eval_files=[{tmp_path / 'd' / 'test.jsonl'}]", "eval.task=arithmetic", "eval.max_new_tokens=4",
           f"trainer.output_dir={run}", "trainer.max_steps=2", "trainer.eval_steps=1", "trainer.strategy=fsdp2",
           "data.train_batch_size=4", "trainer.micro_batch_size=2", "trainer.report_to=[]", "model.device=cpu"]
    torchrun(cli, tmp_path)
    logged = metrics(run)
    assert [m["step"] for m in logged] == [1, 2]  # once per step: rank 1 wrote nothing
    assert all("eval/loss" in m and "eval/accuracy" in m for m in logged)
    assert (run / "final" / "model.safetensors").is_file() and (run / "config.yaml").is_file()
    log = (tmp_path / "torchrun.log").read_text()  # both ranks' stdout and stderr
    assert log.count("finished at step 2") == 1 and log.count("\nmodel: ") == 1, log[-3000:]  # rank 0 alone


def test_what_cannot_run_data_parallel_is_refused_before_training():
    from posttrain.trainers.batches import EpochBatches
    from posttrain.trainers.loop import RefSync

    with pytest.raises(ConfigError, match="data.train_batch_size=1 is smaller than the 2 ranks"):
        EpochBatches([{}] * 4, 1, 1, list).shard(0, 2)
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp2"):
        RefSync(steps=2).check(reference=object(), sharded=True)
