"""transformers-style callbacks (TRL's `callbacks=`) for every trainer's loop.

A callback is a `transformers.TrainerCallback`, or any object with some of its methods;
each is called as transformers calls it,

    callback.on_step_end(args, state, control, model=..., processing_class=..., optimizer=...,
                         lr_scheduler=..., **event_kwargs)

and may return the `control` (or None). Events, in the loop's order (`trainers/loop.run`):

    on_init_end (end of the trainer's __init__) → on_train_begin → for each step:
    on_step_begin → (the step) → on_step_end → on_epoch_end (a pass over the data ended
    during the step) → on_evaluate(metrics=) → on_log(logs=) → on_save → … → on_train_end

`args` is the command's config tree (`args.trainer.output_dir`, not TrainingArguments').
`state` has TrainerState's fields (global_step, epoch as a fraction of passes over the
data, max_steps, num_train_epochs, log_history, is_world_process_zero, ...); after a resume
global_step and epoch continue from the checkpoint. `control` is honoured as transformers
does: should_training_stop ends the run after the step (it still evaluates, saves a
checkpoint and writes final/), should_evaluate / should_save / should_log add an
evaluation, a checkpoint or a metrics line at this step; the three are reset at each step's
start. With data-parallel ranks every rank calls its callbacks and a flag set on any rank
acts on all of them (the ranks stay in step).

Departures from transformers: no on_substep_end, on_pre_optimizer_step, on_optimizer_step,
on_prediction_step, on_predict or on_push_begin (an RL step holds several optimizer steps
of its own; a callback that defines one of these is refused, rather than never called);
should_epoch_stop is refused the same way (a step may cross an epoch boundary). These
classes are duck-typed copies of TrainerState / TrainerControl, so that the loop does not
import transformers' trainer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.config import ConfigError

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_step_end", "on_evaluate", "on_log", "on_save")
"""The events the loop calls."""
NOT_CALLED = ("on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_prediction_step", "on_predict",
              "on_push_begin")


@dataclass
class TrainerState:
    """transformers' TrainerState, as far as the loop knows it."""

    epoch: float = 0.0
    """Passes over the training data (prompts for RL) so far, fractional."""
    global_step: int = 0
    """Steps done (during a step's reward calls, the steps before it, as in TRL)."""
    max_steps: int = 0
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int | None = None
    num_train_epochs: float = 0.0
    """trainer.num_train_epochs, or max_steps' worth of epochs when training by steps."""
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None


@dataclass
class TrainerControl:
    """transformers' TrainerControl: what a callback asks of the loop."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class Callbacks:
    """The run's callbacks, its `state` and `control`; `fire(event, **kwargs)` calls them.

    `callbacks`: instances or classes (a class is instantiated, as transformers does).
    `args`: the config tree handed to every call as `args`."""

    def __init__(self, callbacks: Sequence[Any] | None, args: Any):
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in (callbacks or [])]
        for cb in self.callbacks:
            check_callback(cb)
        self.args = args
        self.state, self.control = TrainerState(), TrainerControl()
        self.objects: dict[str, Any] = {}
        """model, processing_class, optimizer, lr_scheduler: the keyword arguments of every call."""

    def fire(self, event: str, **kwargs: Any) -> TrainerControl:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, **self.objects, **kwargs)
            if isinstance(result, TrainerControl) or _looks_like_control(result):
                self.control = result
        if self.control.should_epoch_stop:
            raise ConfigError(f"a callback set control.should_epoch_stop in {event}: posttrain's steps cross epoch "
                              "boundaries, so an epoch cannot be cut short; set should_training_stop to end the run")
        return self.control

    def init_end(self, model: Any, tokenizer: Any) -> None:
        """on_init_end, at the end of a trainer's __init__."""
        self.objects = {"model": model, "processing_class": tokenizer}
        self.fire("on_init_end")

    def begin(self, task: Any, config: Any, step: int, main: bool) -> None:
        """The state at the loop's start (a resumed run's step and epoch), then on_train_begin."""
        t, s = config.trainer, self.state
        s.global_step, s.epoch, s.max_steps = step, task.epoch, t.max_steps
        s.logging_steps, s.eval_steps, s.save_steps = t.logging_steps, t.eval_steps, t.save_steps
        s.train_batch_size = config.data.train_batch_size
        s.num_train_epochs = t.num_train_epochs or t.max_steps / task.steps_per_epoch
        s.is_world_process_zero = s.is_local_process_zero = main
        model = task.callback_model if hasattr(type(task), "callback_model") else task.model  # RL on Ray: None
        self.objects = {"model": model, "processing_class": getattr(task, "tokenizer", None),
                        "optimizer": getattr(task, "optimizer", None), "lr_scheduler": getattr(task, "scheduler", None)}
        self.control.should_training_stop = False
        self.fire("on_train_begin")
        self.fire("on_epoch_begin")

    def step_begin(self) -> None:
        c = self.control
        c.should_log = c.should_evaluate = c.should_save = False
        self.fire("on_step_begin")

    def step_end(self, step: int, epoch: float) -> None:
        """on_step_end, then on_epoch_end (and the next on_epoch_begin) when the step finished a pass."""
        finished = math.floor(epoch) > math.floor(self.state.epoch)
        self.state.global_step, self.state.epoch = step, epoch
        self.fire("on_step_end")
        if finished:
            self.fire("on_epoch_end")
            self.fire("on_epoch_begin")

    def log(self, step: int, logs: dict[str, float]) -> None:
        self.state.log_history.append({**logs, "step": step, "epoch": self.state.epoch})
        self.fire("on_log", logs=dict(logs))

    def agreed(self, flag: str, collective: Any = None) -> bool:
        """control.`flag`, true on any data-parallel rank (all ranks act on it together)."""
        value = bool(getattr(self.control, flag))
        if collective is not None:
            value = collective.all_max([float(value)])[0] > 0
        return value


def check_callback(cb: Any) -> None:
    """Refuse a callback that defines an event the loop never calls (it would be silently skipped)."""
    base = _transformers_base(cb)
    for name in NOT_CALLED:
        method = getattr(type(cb), name, None)
        if method is not None and (base is None or method is not getattr(base, name, None)):
            raise ConfigError(f"callbacks: {type(cb).__name__}.{name} would never be called: posttrain's loop calls "
                              f"{', '.join(EVENTS)} (see posttrain.trainers.callbacks)")


def _transformers_base(cb: Any) -> type | None:
    """transformers.TrainerCallback when `cb` is one (its no-op methods are not overrides)."""
    for klass in type(cb).__mro__:
        if klass.__name__ == "TrainerCallback" and klass.__module__.startswith("transformers"):
            return klass
    return None


def _looks_like_control(obj: Any) -> bool:
    """A transformers.TrainerControl returned by a callback (it has the same flags)."""
    return obj is not None and all(hasattr(obj, f.name) for f in dataclasses.fields(TrainerControl))
