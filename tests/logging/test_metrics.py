"""metrics.jsonl and the sinks (TensorBoard; W&B offline and MLflow's file store when
installed), resume truncation, samples, console progress and the package logger."""

import io
import json
import logging
import math
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from posttrain.logging import MetricsLogger, Progress, default_level, get_logger, log_line
from posttrain.logging.metrics import jsonable, wandb_mode
from posttrain.logging.progress import format_value


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_is_json_safe(tmp_path):
    with MetricsLogger(tmp_path, report_to=[]) as logger:
        logger.log(1, {"loss": torch.tensor(1.5), "n": 3, "acc": np.float32(0.5), "kl": math.nan})
        logger.log(2, {"loss": 1.25, "grad_norm": math.inf})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 1.5, "n": 3, "acc": 0.5, "kl": None},
        {"step": 2, "loss": 1.25, "grad_norm": None},
    ]
    with pytest.raises(ValueError, match="reserved"):
        MetricsLogger(tmp_path).log(3, {"step": 3})


def test_jsonable_nested_values():
    other = object()
    value = {"t": torch.tensor([1.0, math.nan]), "o": other, 1: (np.int64(2), -math.inf)}
    assert jsonable(value) == {"t": [1.0, None], "o": str(other), "1": [2, None]}


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_scalars_read_back(tmp_path):
    with MetricsLogger(tmp_path, ["tensorboard"], config={"trainer": {"seed": 0}}) as logger:
        logger.log(1, {"reward/mean": 0.25, "note": "text is jsonl-only"})
        logger.log(2, {"reward/mean": torch.tensor(0.75)})
    assert scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.75)]
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["note"] == "text is jsonl-only"


def test_truncate_after_keeps_each_step_once(tmp_path):
    logger = MetricsLogger(tmp_path, ["tensorboard"])
    for step in range(1, 6):
        logger.log(step, {"loss": float(step)})
    logger.log_samples(2, [{"prompt": "a", "reward": 1.0}, {"prompt": "b", "reward": math.nan}])
    logger.log_samples(4, [{"prompt": "c"}])
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash

    resumed = MetricsLogger(tmp_path, ["tensorboard"])
    resumed.truncate_after(3)  # resuming from checkpoint step-3
    resumed.log(4, {"loss": 40.0})
    resumed.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["loss"] == 40.0
    assert read_jsonl(tmp_path / "samples.jsonl") == [
        {"step": 2, "prompt": "a", "reward": 1.0},
        {"step": 2, "prompt": "b", "reward": None},
    ]
    assert scalars(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_tracker_is_a_clear_error_before_anything_starts(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    expected = (
        f"trainer.report_to includes '{name}' but {name} is not installed: "
        "pip install 'posttrain[tracking]' or remove it"
    )
    with pytest.raises(ImportError) as err:
        MetricsLogger(tmp_path, ["tensorboard", name])
    assert str(err.value) == expected
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ValueError, match="comet"):
        MetricsLogger(tmp_path, ["comet"])


# --- W&B and MLflow, the real packages in their offline modes ---------------------------


@pytest.fixture
def offline(monkeypatch):
    """No tracker key, mode or URI set, and the W&B server pointed at a closed local port."""
    names = ["WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_DIR"]
    names += ["MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"]
    for name in names:
        monkeypatch.setenv(name, "")  # so that the value before (or its absence) is restored
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing reaches wandb.ai
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch, offline):
    """wandb with its own dirs and no output; its service process is shut down after."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    for var in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{var}_DIR", str(tmp_path / "wandb-home" / var.lower()))
    yield wandb
    wandb.teardown()  # ends wandb-core: no process is left behind


def wandb_records(path):
    """The protobuf records of an offline `.wandb` file (a LevelDB-style log after a header)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7 or data[pos : pos + 7] == bytes(7):  # block padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])  # after a CRC
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(Record.FromString(chunk))
            chunk = b""
    return records


def wandb_offline_run(run_dir):
    """(run record, [(step, {key: value})]) of each offline run folder, oldest first."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        records = wandb_records(log)
        (run,) = [r.run for r in records if r.HasField("run")]
        history = [
            (
                r.history.step.num,
                {i.nested_key[0]: json.loads(i.value_json) for i in r.history.item},
            )
            for r in records
            if r.HasField("history")
        ]
        runs.append((run, history))
    return runs


def test_wandb_runs_offline_in_the_run_dir_and_resumes_the_same_run(tmp_path, offline_wandb):
    run_dir = tmp_path / "sft-run"
    with MetricsLogger(run_dir, ["wandb"], config={"a": {"b": 1}}) as logger:
        logger.log(3, {"loss": 0.5, "note": "skipped"})
        logger.log(4, {"loss": torch.tensor(0.25)})
    offline_wandb.teardown()  # wandb-core writes the file's end after finish() returns
    run_id = json.loads((run_dir / "tracking.json").read_text())["wandb_run_id"]
    ((run, history),) = wandb_offline_run(run_dir)
    assert (run.run_id, run.project, run.display_name) == (run_id, "posttrain", "sft-run")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["a"] == {"b": 1}
    assert [(step, row["loss"]) for step, row in history] == [(3, 0.5), (4, 0.25)]
    assert "note" not in history[0][1]

    with MetricsLogger(run_dir, ["wandb"]) as logger:  # resumed
        logger.log(5, {"loss": 0.125})
    offline_wandb.teardown()
    assert json.loads((run_dir / "tracking.json").read_text())["wandb_run_id"] == run_id
    first, (run, history) = wandb_offline_run(run_dir)
    assert run.run_id == run_id and first[0].run_id == run_id
    assert [(step, row["loss"]) for step, row in history] == [(5, 0.125)]


def test_wandb_mode_is_offline_unless_a_key_or_a_mode_is_set(tmp_path, offline_wandb, monkeypatch):
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's mode is used
    with MetricsLogger(tmp_path, ["wandb"]) as logger:
        logger.log(1, {"loss": 1.0})
    assert not list((tmp_path / "wandb").glob("*run-*"))


OFFLINE_TRAINING = """
import atexit, json, sys
connects = []
sys.addaudithook(
    lambda event, args: event == "socket.connect"
    and isinstance(args[1], tuple)
    and connects.append(args[1][:2])
)
atexit.register(lambda: print(json.dumps(connects)))  # runs last, after the trackers' hooks
from posttrain.logging import MetricsLogger
with MetricsLogger(sys.argv[1], ["wandb", "mlflow"], config={"a": 1}) as logger:
    logger.log(1, {"loss": 1.0})
"""


def test_offline_trackers_contact_no_server_even_at_exit(tmp_path, offline_wandb):
    """wandb.init(mode="offline") alone still sends wandb's analytics at exit: not here."""
    pytest.importorskip("mlflow")
    script = [sys.executable, "-c", OFFLINE_TRAINING, str(tmp_path / "run")]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []  # not even to the fake server
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert (tmp_path / "run" / "mlruns").is_dir()


@pytest.fixture
def local_mlflow(offline):
    return pytest.importorskip("mlflow")


def test_mlflow_writes_a_run_in_the_run_dir_and_resumes_it(tmp_path, local_mlflow):
    run_dir = tmp_path / "dpo-run"
    config = {"trainer": {"seed": 0, "lr": 1e-5}, "model": "tiny"}
    with MetricsLogger(run_dir, ["mlflow"], config=config) as logger:
        logger.log(1, {"kl": 0.1, "note": "skipped"})
        logger.log(2, {"kl": np.float32(0.5)})
    client = local_mlflow.MlflowClient((run_dir / "mlruns").as_uri())
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == "dpo-run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "posttrain"
    assert run.data.params == {"trainer.seed": "0", "trainer.lr": "1e-05", "model": "tiny"}
    assert set(run.data.metrics) == {"kl"}

    def history():
        return [(m.step, m.value) for m in client.get_metric_history(run_id, "kl")]

    assert history() == [(1, 0.1), (2, 0.5)]

    with MetricsLogger(run_dir, ["mlflow"], config={"trainer": {"seed": 1}}) as logger:
        assert client.get_run(run_id).info.status == "RUNNING"
        logger.log(3, {"kl": 0.25})
    assert history() == [(1, 0.1), (2, 0.5), (3, 0.25)]
    assert client.get_run(run_id).data.params["trainer.seed"] == "0"  # not logged again
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_mlflow_uses_the_users_tracking_uri(tmp_path, local_mlflow, monkeypatch):
    store = (tmp_path / "team-store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sweep")
    for name in ("a", "b"):
        with MetricsLogger(tmp_path / name, ["mlflow"]) as logger:
            logger.log(1, {"loss": 2.0})
    assert not (tmp_path / "a" / "mlruns").exists()
    client = local_mlflow.MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b"]
    assert all(r.data.metrics == {"loss": 2.0} for r in runs)


def test_runs_in_one_process_each_keep_their_own_mlflow_store(tmp_path, local_mlflow):
    for name in ("sft", "dpo"):
        with MetricsLogger(tmp_path / name, ["mlflow"]) as logger:
            logger.log(1, {"loss": 1.0})
    for name in ("sft", "dpo"):
        client = local_mlflow.MlflowClient((tmp_path / name / "mlruns").as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
        assert run.info.run_name == name


# --- console ----------------------------------------------------------------------------


def test_format_and_log_line():
    assert [format_value(v) for v in (1.23456, 1e-4, 12345.0, 0.0, math.nan, 7, "x")] == [
        "1.235", "1.00e-04", "1.23e+04", "0", "nan", "7", "x",
    ]  # fmt: skip
    metrics = {"loss": torch.tensor(1.23456), "lr": 1e-4, "grad_norm": 0.5}
    assert log_line(12, metrics, keys=["loss", "lr", "absent"]) == "step 12 loss=1.235 lr=1.00e-04"
    assert log_line(3, {}) == "step 3"


def test_progress_writes_plain_lines_with_eta_when_not_a_tty():
    out = io.StringIO()
    progress = Progress(total=10, desc="sft", initial=2, file=out, interval=3600)
    progress.update(1, loss=1.5)  # the first update is shown at once
    progress.update(3, loss=1.25)  # within the interval: not shown
    progress.close()  # the last state is shown at the end
    first, last = out.getvalue().splitlines()
    assert "sft 3/10 (30%) loss=1.5 |" in first and "ETA" in first
    assert "sft 6/10 (60%) loss=1.25 |" in last


def test_progress_eta_ends_at_the_time_budget_when_it_comes_first():
    out = io.StringIO()
    progress = Progress(total=100000, desc="rl", file=out, interval=0, max_seconds=300)
    start = progress._start
    assert progress.line(start).endswith("0s elapsed")
    progress.n = 10  # 10 steps in 60 s: the steps would take ~166 hours, the budget ends in 4 minutes
    assert progress.line(start + 60).endswith("1m00s elapsed, ETA 4m00s (time budget)")
    short = Progress(total=20, desc="rl", file=out, max_seconds=300)
    short.n = 10  # the steps end first (in 60 s): their ETA
    assert short.line(short._start + 60).endswith("ETA 1m00s")
    unbounded = Progress(total=20, desc="rl", file=out)
    unbounded.n = 10
    assert unbounded.line(unbounded._start + 600).endswith("ETA 10m00s")


def test_progress_uses_tqdm_on_a_terminal_and_can_be_disabled():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with Progress(total=4, desc="rm", file=out) as progress:
        progress.update(2, **{"loss": 0.5, "reward/mean": 0.25})
    assert "rm" in out.getvalue() and "loss=0.5 reward/mean=0.25" in out.getvalue()
    budgeted = Terminal()
    with Progress(total=4, desc="rl", file=budgeted, max_seconds=600) as progress:
        progress.update(1, loss=0.5)
    assert re.search(r"loss=0.5 time budget left (10m00s|9m5\ds)", budgeted.getvalue())
    quiet = Terminal()
    with Progress(total=4, desc="rm", enabled=False, file=quiet) as progress:
        progress.update(4)
    assert quiet.getvalue() == ""


def test_get_logger_is_under_posttrain_and_propagates(caplog):
    log = get_logger("trainers.sft")
    assert log.name == "posttrain.trainers.sft"
    assert get_logger("posttrain.rl") is logging.getLogger("posttrain.rl")
    with caplog.at_level(logging.INFO):
        log.info("hello %d", 1)
    assert "hello 1" in caplog.text


def test_only_rank_0_logs_below_error():
    """torchrun's RANK: every rank but 0 logs errors only (rank 0 speaks for all)."""
    assert default_level({}) == default_level({"RANK": "0"}) == logging.INFO
    assert default_level({"RANK": "1"}) == default_level({"RANK": "7"}) == logging.ERROR
