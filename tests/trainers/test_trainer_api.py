"""The TRL-shaped trainer API every command shares: trainer.num_train_epochs (the step count,
the epoch in metrics, resume), transformers callbacks (events, state, control), TRL's reward
arguments (trainer_state, log_metric), and SFT's formatting_func, dataset_text_field and
ShareGPT rows.

Each command runs on the tiny built-in model of `test_loop` (16 rows, 4 per step: one epoch
is 4 steps)."""

import shutil

import pytest
import torch
from transformers import TrainerCallback

from posttrain import GRPOConfig, SFTConfig, SFTTrainer
from posttrain.config import ConfigError, build_config

from .test_loop import COMMANDS, metric_lines, overrides, tiny_lm, weights

BY_EPOCHS = {"trainer.max_steps": "null"}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_num_train_epochs_sets_the_step_count(tok, tmp_path, command):
    # 16 rows at 4 per step: 0.75 epochs = ceil(0.75 · 16 / 4) = 3 steps, each a quarter epoch
    trainer = COMMANDS[command](tok, tmp_path, **BY_EPOCHS, **{"trainer.num_train_epochs": 0.75})
    assert trainer.args.trainer.max_steps == 3  # set before training: the progress bar's total
    result = trainer.train()
    lines = [m for m in metric_lines(tmp_path) if "epoch" in m]
    assert result.step == 3 and [m["step"] for m in lines] == [1, 2, 3]
    assert [m["epoch"] for m in lines] == [0.25, 0.5, 0.75]


def test_max_steps_wins_over_num_train_epochs_and_the_default_is_100_steps(tok, tmp_path):
    both = COMMANDS["sft"](tok, tmp_path / "a", **{"trainer.max_steps": 2, "trainer.num_train_epochs": 3})
    assert both.args.trainer.max_steps == 2  # as transformers' max_steps > 0
    neither = COMMANDS["sft"](tok, tmp_path / "b", **BY_EPOCHS)
    assert neither.args.trainer.max_steps == 100


def test_an_override_of_num_train_epochs_clears_a_recipes_max_steps(tmp_path):
    cfg = build_config(GRPOConfig, "grpo", ["trainer.num_train_epochs=2"])
    assert cfg.trainer.max_steps is None and cfg.trainer.num_train_epochs == 2
    with pytest.raises(ConfigError, match="trainer.num_train_epochs: must be > 0"):
        build_config(GRPOConfig, "grpo", ["trainer.num_train_epochs=0"])
    for theirs in ("num_train_epochs=2", "trainer.total_epochs=2"):  # TRL's and veRL's names
        with pytest.raises(ConfigError, match=r"Did you mean trainer\.num_train_epochs=2\?"):
            build_config(GRPOConfig, "grpo", [theirs])
    with pytest.raises(ConfigError, match=r"Did you mean data\.dataset_text_field=body\?"):
        build_config(SFTConfig, None, ["dataset_text_field=body"])


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_a_run_by_epochs_resumes_exactly(tok, tmp_path, command):
    opts = {**BY_EPOCHS, "trainer.num_train_epochs": 1, "trainer.save_steps": 2}
    full = COMMANDS[command](tok, tmp_path / "full", **opts)
    full.train()
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step-4")
    shutil.rmtree(cut / "final")
    resumed = COMMANDS[command](tok, cut, **opts)
    resumed.train()
    a, b = weights(full.model), weights(resumed.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)
    assert [(m["step"], m["epoch"]) for m in metric_lines(cut) if "epoch" in m] == [
        (1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]


class Recorder(TrainerCallback):
    """A real transformers callback: records each event with the state it saw; stops at step 2."""

    def __init__(self):
        self.calls = []

    def _record(self, event, state, **kwargs):
        self.calls.append((event, state.global_step, round(state.epoch, 4)))

    def on_train_begin(self, args, state, control, **kwargs):
        self.max_steps, self.model = state.max_steps, kwargs["model"]
        self._record("train_begin", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._record("step_end", state)
        if state.global_step == 2:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._record("log", state)
        self.last_logs = logs

    def on_save(self, args, state, control, **kwargs):
        self._record("save", state)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._record("epoch_end", state)

    def on_train_end(self, args, state, control, **kwargs):
        self._record("train_end", state)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_transformers_callback_sees_the_events_and_stops_the_run(tok, tmp_path, command):
    cb = Recorder()
    trainer = COMMANDS[command](tok, tmp_path, callbacks=[cb], **{"trainer.max_steps": 10})
    result = trainer.train()
    assert cb.calls == [("train_begin", 0, 0.0), ("step_end", 1, 0.25), ("log", 1, 0.25), ("step_end", 2, 0.5),
                        ("log", 2, 0.5), ("save", 2, 0.5), ("train_end", 2, 0.5)]
    assert cb.max_steps == 10 and cb.model is trainer.model
    assert result.step == 2 and (tmp_path / "checkpoints" / "step-2").is_dir() and (tmp_path / "final").is_dir()
    assert cb.last_logs["epoch"] == 0.5 and ("loss" in cb.last_logs or "reward/mean" in cb.last_logs)


def test_callback_control_asks_for_a_checkpoint_and_epoch_end_fires(tok, tmp_path):
    class SaveAtOne(Recorder):
        def on_step_end(self, args, state, control, **kwargs):
            self._record("step_end", state)
            control.should_save = state.global_step == 1

    cb = SaveAtOne()
    COMMANDS["sft"](tok, tmp_path, callbacks=[cb], **{"trainer.max_steps": 5}).train()
    assert ("save", 1, 0.25) in cb.calls and ("epoch_end", 4, 1.0) in cb.calls
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1", "step-5"]


def test_a_callback_event_the_loop_never_calls_is_refused(tok, tmp_path):
    class OnOptimizerStep(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            pass

    with pytest.raises(ConfigError, match="OnOptimizerStep.on_optimizer_step would never be called"):
        COMMANDS["sft"](tok, tmp_path, callbacks=[OnOptimizerStep])


def test_a_reward_function_reads_the_trainer_state_and_logs_its_own_metric(tok, tmp_path):
    seen = []

    def shaped(completions, trainer_state, log_metric, **kwargs):  # TRL's reward arguments
        seen.append((trainer_state.global_step, trainer_state.epoch, trainer_state.max_steps))
        for i in range(len(completions)):
            log_metric("parity", i % 2)
        return [float(i % 2) for i in range(len(completions))]

    COMMANDS["grpo"](tok, tmp_path, reward=shaped, **{"trainer.max_steps": 3}).train()
    assert seen == [(0, 0.0, 3), (1, 0.25, 3), (2, 0.5, 3)]  # as TRL: the steps done before this one
    lines = [m for m in metric_lines(tmp_path) if "epoch" in m]
    assert [m["reward/shaped/parity"] for m in lines] == [0.5, 0.5, 0.5]  # the mean of 16 logged 0/1s


# ---------------------------------------------------------------------------- SFT data, TRL's ways

QA = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(4) for b in range(4)]


def sft_examples(tok, tmp_path, rows, **kwargs):
    over = kwargs.pop("over", {})
    cfg = build_config(SFTConfig, None, overrides(tmp_path, **{"trainer.micro_batch_size": 2, **over}))
    trainer = SFTTrainer(tiny_lm(tok), args=cfg, train_dataset=rows, processing_class=tok, **kwargs)
    return [ex["input_ids"] for ex in trainer.train_examples]


def test_formatting_func_and_dataset_text_field_give_the_text_rows(tok, tmp_path):
    texts = sft_examples(tok, tmp_path / "t", [{"text": r["q"] + r["a"]} for r in QA])
    assert sft_examples(tok, tmp_path / "f", QA, formatting_func=lambda ex: ex["q"] + ex["a"]) == texts
    body = [{"body": r["q"] + r["a"], "id": i} for i, r in enumerate(QA)]
    assert sft_examples(tok, tmp_path / "d", body, over={"data.dataset_text_field": "body"}) == texts


def test_formatting_func_and_dataset_text_field_errors_name_the_row(tok, tmp_path):
    with pytest.raises(ValueError, match=r"list: row 1: formatting_func .*returned list, not a str"):
        sft_examples(tok, tmp_path / "f", QA, formatting_func=lambda ex: [ex["q"]])
    with pytest.raises(ValueError, match=r"list: row 1: data.dataset_text_field=body: the row has no column 'body'"):
        sft_examples(tok, tmp_path / "d", QA, over={"data.dataset_text_field": "body"})


def test_sharegpt_rows_train_as_their_messages(tok, tmp_path):
    roles = {"human": "user", "gpt": "assistant"}
    share = [{"conversations": [{"from": "human", "value": r["q"]}, {"from": "gpt", "value": r["a"]}]} for r in QA]
    chat = [{"messages": [{"role": roles[m["from"]], "content": m["value"]} for m in s["conversations"]]}
            for s in share]
    assert sft_examples(tok, tmp_path / "s", share) == sft_examples(tok, tmp_path / "m", chat)
