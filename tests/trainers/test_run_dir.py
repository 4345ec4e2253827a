"""A run directory belongs to one run (issue #15, part 1).

A checkpoint records the command and the fingerprint of the settings that wrote it; a resume
continues only a run of the same command and settings, checked before any weights load, and
a new run never shares its folder with an old one unless told to replace it. The first tests
replay what the issue saw on the command line, with the built-in tiny model.
"""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from posttrain import SFTConfig, SFTTrainer
from posttrain.checkpoint import BUILT_MODEL, COMPLETE, STATE_JSON
from posttrain.checkpoint import lock as run_lock
from posttrain.cli import _train_commands, main
from posttrain.config import ConfigError, build_config
from posttrain.data.tasks import make_task
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM

QUIET = ["trainer.report_to=[]", "trainer.progress=false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    make_task("arithmetic", out, n_train=16, n_test=4, seed=0, difficulty="easy")
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"] + "1"} for r in rows]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return out


def sft(data, run, *extra):
    return ["sft", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]", "data.train_batch_size=4",
            "trainer.micro_batch_size=4", "trainer.max_steps=2", f"trainer.output_dir={run}", *QUIET, *extra]


def after_sft(command, data, run, model):
    """The issue's second command: `command` on the SFT run's model, in the same folder."""
    if command in ("rm", "dpo"):
        return [command, f"model.path={model}", f"data.train_files=[{data / 'pairs.jsonl'}]",
                "data.train_batch_size=4", "trainer.micro_batch_size=4", "trainer.max_steps=2",
                f"trainer.output_dir={run}", *QUIET]
    return [command, "--config", command, f"model.path={model}", f"data.train_files=[{data / 'train.jsonl'}]",
            "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4",
            f"data.eval_files=[{data / 'test.jsonl'}]", "eval.num_examples=2", "actor.micro_batch_size=4", "trainer.max_steps=2", "critic.warmup_steps=0", "algorithm.overlong.buffer=0",
            f"trainer.output_dir={run}", *QUIET]


def files(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sft_run(data, tmp_path_factory):
    """A finished 2-step `posttrain sft model.init=tiny` run (copied by each test that changes it)."""
    run = tmp_path_factory.mktemp("sft") / "run"
    assert main(sft(data, run)) == 0
    return run


@pytest.fixture
def used_run(sft_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    return run


@pytest.mark.parametrize("command", ["dpo", "rm", "grpo", "ppo"])
def test_another_command_in_an_sft_run_dir_stops_before_loading(command, data, used_run, capsys):
    # Seen: DPO "resumed" the SFT checkpoint and wrote it as final/ with exit 0; GRPO failed
    # with KeyError 'prompts'; RM with size mismatches after overwriting config.yaml.
    before = files(used_run)
    assert main(after_sft(command, data, used_run, model=used_run / "final")) == 2
    err = capsys.readouterr().err
    assert "checkpoints/step-2 belongs to a `posttrain sft` run" in err
    assert f"this is `posttrain {command}`" in err
    assert "new trainer.output_dir" in err and "trainer.resume=never trainer.overwrite=true" in err
    assert files(used_run) == before  # nothing written, config.yaml included


def test_sft_small_over_a_tiny_run_names_the_setting_and_writes_nothing(data, used_run, capsys):
    before = files(used_run)
    assert main(sft(data, used_run, "model.init=small")) == 2
    err = capsys.readouterr().err
    assert 'model.init: "tiny" → "small"' in err and BUILT_MODEL in err
    assert "new trainer.output_dir" in err
    assert files(used_run) == before


def test_a_checkpoint_records_its_command_and_fingerprint_readably(sft_run):
    state = json.loads((sft_run / "checkpoints" / "step-2" / STATE_JSON).read_text())
    run = state["run"]
    assert run["command"] == "sft"
    assert run["fingerprint"]["model.init"] == "tiny"
    assert run["fingerprint"]["data.train_files"][0].endswith("train.jsonl")
    assert run["fingerprint"][BUILT_MODEL].startswith("BuiltinLM, 1,8")
    assert run["settings"]["trainer.max_steps"] == 2 and "trainer.max_steps" not in run["fingerprint"]


def test_a_setting_that_may_change_resumes_with_a_log_line(data, used_run, caplog):
    with caplog.at_level(logging.INFO, logger="posttrain"):
        assert main(sft(data, used_run, "trainer.max_steps=3", "trainer.logging_steps=2")) == 0
    assert "resuming with changed settings: trainer.max_steps: 2 → 3; trainer.logging_steps: 1 → 2" in caplog.text
    assert "resumed from" in caplog.text and "finished at step 3" in caplog.text
    assert [json.loads(line)["step"] for line in (used_run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_setting_that_must_match_is_refused(data, used_run, capsys):
    assert main(sft(data, used_run, "trainer.learning_rate=0.5")) == 2
    assert "trainer.learning_rate: 0.0001 → 0.5" in capsys.readouterr().err


def test_a_checkpoint_past_max_steps_is_an_error_not_finished(data, used_run, capsys):
    before = files(used_run)
    assert main(sft(data, used_run, "trainer.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert "trainer.max_steps=1:" in err and "already at step 2" in err and "trainer.max_steps >= 2" in err
    assert files(used_run) == before


def test_resume_never_refuses_a_used_run_dir_and_overwrite_replaces_it(data, tmp_path, capsys):
    # Seen: a 4-step run, then a resume=never 3-step run, then the 3-step command with
    # resume=auto printed "finished at step 4" and final/ was the old step-4 model.
    run = tmp_path / "run"
    steps = ["trainer.save_steps=1", "trainer.save_total_limit=0"]
    assert main(sft(data, run, "trainer.max_steps=4", *steps)) == 0
    before, old = files(run), load_file(run / "final" / "model.safetensors")
    assert main(sft(data, run, "trainer.max_steps=3", "trainer.resume=never", *steps)) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir={run} already holds a run (checkpoints/, final/, metrics.jsonl)" in err
    assert "trainer.overwrite=true" in err and "trainer.resume=auto" in err
    assert files(run) == before

    assert main(sft(data, run, "trainer.max_steps=3", "trainer.resume=never", "trainer.overwrite=true", *steps)) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2", "step-3"]
    fresh = load_file(run / "final" / "model.safetensors")
    assert not all(torch.equal(fresh[k], old[k]) for k in fresh)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    assert main(sft(data, run, "trainer.max_steps=3", *steps)) == 0  # resume=auto: already finished
    again = load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(fresh[k], again[k]) for k in fresh)  # the new run's model, not the old step-4 one


def test_auto_with_no_checkpoint_keeps_a_finished_model(data, used_run, capsys):
    shutil.rmtree(used_run / "checkpoints")
    before = files(used_run)
    assert main(sft(data, used_run)) == 2
    assert "already holds a run (final/, metrics.jsonl) and there is no checkpoint in it to continue" in (
        capsys.readouterr().err)
    assert files(used_run) == before


def test_auto_starts_over_a_run_that_stopped_before_its_first_checkpoint(data, used_run):
    shutil.rmtree(used_run / "checkpoints")
    shutil.rmtree(used_run / "final")
    assert main(sft(data, used_run)) == 0
    assert [json.loads(line)["step"] for line in (used_run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def _strip_run_record(checkpoint):
    """Make `checkpoint` look saved by a posttrain that did not record its run."""
    state = json.loads((checkpoint / STATE_JSON).read_text())
    del state["run"]
    (checkpoint / STATE_JSON).write_text(json.dumps(state, indent=2) + "\n")
    manifest = json.loads((checkpoint / COMPLETE).read_text())
    manifest["files"][STATE_JSON] = (checkpoint / STATE_JSON).stat().st_size
    del manifest["crc32"]  # nor checksums
    (checkpoint / COMPLETE).write_text(json.dumps(manifest))


def test_a_checkpoint_of_an_older_posttrain_is_resumed_only_when_named(data, used_run, capsys, caplog):
    _strip_run_record(used_run / "checkpoints" / "step-2")
    assert main(sft(data, used_run, "trainer.max_steps=3")) == 2
    err = capsys.readouterr().err
    assert "older posttrain" in err and f"trainer.resume={used_run / 'checkpoints' / 'step-2'}" in err

    named = used_run / "checkpoints" / "step-2"
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert main(sft(data, used_run, "trainer.max_steps=3", f"trainer.resume={named}")) == 0
    assert "resuming it unchecked" in caplog.text
    assert [json.loads(line)["step"] for line in (used_run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_model_of_another_shape_passed_to_the_api_is_refused_before_loading(tmp_path):
    tok = build_tokenizer()
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)]

    def trainer(hidden):
        torch.manual_seed(0)
        model = BuiltinLM.from_preset("tiny", vocab_size=len(tok), hidden_size=hidden, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        cfg = build_config(SFTConfig, None, [f"trainer.output_dir={tmp_path}", "trainer.max_steps=1",
                                             "data.train_batch_size=4", "trainer.micro_batch_size=4", *QUIET])
        return SFTTrainer(model, args=cfg, train_dataset=rows, processing_class=tok)

    trainer(32).train()
    with pytest.raises(ConfigError, match=r"\(built model\): \"BuiltinLM, .* → \"BuiltinLM, "):
        trainer(64).train()


def test_each_command_defaults_to_its_own_run_dir():
    dirs = {cmd.name: build_config(cmd.config_cls).trainer.output_dir for cmd in _train_commands()}
    assert dirs == {name: f"runs/{name}" for name in ("sft", "rm", "dpo", "grpo", "ppo")}
    assert all(cmd.config_cls.command == cmd.name for cmd in _train_commands())


# --- two runs in one folder (issue #31, item 1) ------------------------------------------

HOLD = """import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
lock.acquire(sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder():
    """Start a process that holds a run directory's lock with `checkpoint.lock.acquire` (a bare
    Python: no torch to import, so it holds it within ~0.1 s); killed with SIGKILL at the end."""
    procs = []

    def start(run_dir):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, run_lock.__file__, str(run_dir)],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_run_in_a_folder_in_use_is_refused_naming_the_pid_and_a_killed_holder_frees_it(
        data, used_run, holder, capsys):
    first = holder(used_run)
    before = files(used_run)
    for how in ([], ["trainer.resume=never", "trainer.overwrite=true"], ["trainer.max_steps=3"]):
        assert main(sft(data, used_run, *how)) == 1
        err = capsys.readouterr().err
        assert f"trainer.output_dir={used_run} is in use by another run (pid {first.pid}, still running)" in err
        assert len(err.strip().splitlines()) == 1
    assert files(used_run) == before  # the first run's checkpoints, metrics and model are intact
    first.kill()  # SIGKILL: no chance to clean up, and the kernel drops its lock
    first.wait()
    with run_lock.hold(used_run):
        assert (used_run / run_lock.LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_the_loop_holds_the_lock_for_the_whole_run(tmp_path, holder):
    """The refusal before loading is a courtesy; the lock the run holds is the loop's own: a
    holder that appears after the trainer was built still stops it before anything is written."""
    tok = build_tokenizer()
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)]
    cfg = build_config(SFTConfig, None, [f"trainer.output_dir={tmp_path}", "trainer.max_steps=1",
                                         "data.train_batch_size=4", "trainer.micro_batch_size=4", *QUIET])
    torch.manual_seed(0)
    model = BuiltinLM.from_preset("tiny", vocab_size=len(tok), num_hidden_layers=1)
    trainer = SFTTrainer(model, args=cfg, train_dataset=rows, processing_class=tok)
    other = holder(tmp_path)
    with pytest.raises(run_lock.RunDirBusy, match=f"pid {other.pid}"):
        trainer.train()
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_lock.LOCK_FILE]
    other.kill()
    other.wait()
    assert trainer.train().step == 1
    with run_lock.hold(tmp_path):  # released when the run ended
        pass


# --- a damaged checkpoint (issue #31, item 4) --------------------------------------------


def test_auto_falls_back_past_a_damaged_checkpoint_and_a_named_one_is_a_one_line_error(data, used_run, capsys, caplog):
    ckpts = used_run / "checkpoints"
    damaged = ckpts / "step-3"  # a newer checkpoint (a copy of step-2) whose weights got a flipped byte
    shutil.copytree(ckpts / "step-2", damaged)
    weights = bytearray((damaged / "model.safetensors").read_bytes())
    weights[len(weights) * 2 // 3] ^= 0xFF
    (damaged / "model.safetensors").write_bytes(bytes(weights))

    assert main(sft(data, used_run, f"trainer.resume={damaged}", "trainer.max_steps=4")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"posttrain sft: error: trainer.resume={damaged}: {damaged} is not a complete checkpoint "
                          "(model.safetensors is damaged (CRC32 ") and len(err.splitlines()) == 1
    with caplog.at_level(logging.INFO):
        assert main(sft(data, used_run, "trainer.max_steps=4")) == 0
    assert f"skipping checkpoint {damaged}: model.safetensors is damaged" in caplog.text
    assert f"resumed from {ckpts / 'step-2'} at step 2" in caplog.text and "finished at step 4" in caplog.text
