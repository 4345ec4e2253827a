"""metrics.jsonl and the sinks (TensorBoard; W&B and MLflow through stand-in modules),
resume truncation, samples, console progress and the package logger."""

import io
import json
import logging
import math
import sys
import types

import numpy as np
import pytest
import torch

from posttrain.logging import MetricsLogger, Progress, get_logger, log_line
from posttrain.logging.metrics import jsonable
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


class Recorder:
    """Stands in for a tracker module, recording calls as (name, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def record(self, name, result=None):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return result

        return call

    def named(self, name):
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


def fake_wandb(recorder):
    run = types.SimpleNamespace(log=recorder.record("log"), finish=recorder.record("finish"))
    return types.SimpleNamespace(
        init=recorder.record("init", run), util=types.SimpleNamespace(generate_id=lambda: "id42")
    )


def test_wandb_offline_by_default_and_resumes_the_same_run(tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(rec))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with MetricsLogger(tmp_path / "run", ["wandb"], config={"a": {"b": 1}}) as logger:
        logger.log(3, {"loss": 0.5, "note": "skipped"})
    ((_, init),) = rec.named("init")
    assert init["mode"] == "offline" and init["id"] == "id42" and init["resume"] == "allow"
    assert init["dir"] == str(tmp_path / "run") and init["config"] == {"a": {"b": 1}}
    assert rec.named("log") == [(({"loss": 0.5},), {"step": 3})]
    assert len(rec.named("finish")) == 1

    monkeypatch.setenv("WANDB_API_KEY", "k")
    sys.modules["wandb"].util.generate_id = lambda: "another"
    MetricsLogger(tmp_path / "run", ["wandb"]).close()
    init = rec.named("init")[-1][1]
    assert init["mode"] == "online" and init["id"] == "id42"


def fake_mlflow(recorder):
    run = types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))
    names = ("set_tracking_uri", "set_experiment", "log_params", "log_metrics", "end_run")
    module = types.SimpleNamespace(**{n: recorder.record(n) for n in names})
    module.start_run = recorder.record("start_run", run)
    return module


def test_mlflow_uses_a_store_in_the_run_dir(tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(rec))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with MetricsLogger(tmp_path, ["mlflow"], config={"trainer": {"seed": 0}}) as logger:
        logger.log(1, {"kl": 0.1})
    assert rec.named("set_tracking_uri") == [(((tmp_path / "mlruns").as_uri(),), {})]
    assert rec.named("log_params") == [(({"trainer.seed": "0"},), {})]
    assert rec.named("log_metrics") == [(({"kl": 0.1},), {"step": 1})]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    MetricsLogger(tmp_path, ["mlflow"], config={"trainer": {"seed": 1}}).close()
    assert len(rec.named("set_tracking_uri")) == 1  # the user's URI is left alone
    assert rec.named("start_run")[-1] == ((), {"run_id": "r1"})  # the same run continues
    assert len(rec.named("log_params")) == 1  # MLflow refuses changed params


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


def test_progress_uses_tqdm_on_a_terminal_and_can_be_disabled():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with Progress(total=4, desc="rm", file=out) as progress:
        progress.update(2, **{"loss": 0.5, "reward/mean": 0.25})
    assert "rm" in out.getvalue() and "loss=0.5 reward/mean=0.25" in out.getvalue()
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
