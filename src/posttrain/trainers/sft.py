"""Supervised fine-tuning, and pretraining the built-in model from scratch.

Loss: the token-mean next-token NLL over trained tokens,
    L = Σ_{b,t} m_{b,t+1} · −log p_θ(x_{b,t+1} | x_{b,≤t}) / Σ m,
where m masks prompts (`completion_only_loss`, TRL's default for prompt/completion data),
non-assistant turns (`assistant_only_loss`) and padding. The mean is over every token of
the optimizer step, across micro-batches (see `training.core.train_step`), so gradient
accumulation does not change the update.

Departures from TRL's SFTTrainer:
- The config is a tree (`model`, `data`, `trainer`, `eval`), not one flat class; the
  Python API takes the same tree so a YAML recipe and a script are interchangeable.
- Packing keeps documents whole (best-fit decreasing) and blocks attention across them
  with position ids, as TRL's `bfd` does; the first token of each packed document is
  not predicted from the previous document.
- `eval.task` adds exact-match accuracy of greedy completions on a bundled task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from posttrain.config import ConfigError, SFTConfig
from posttrain.config.core import check
from posttrain.data.batch import LMBatch
from posttrain.data.collate import causal_lm_loss_sum, pad_collate, tokenize_dataset
from posttrain.data.formats import DataFormatError
from posttrain.data.packing import pack_collate, pack_examples, packing_efficiency
from posttrain.data.sources import load_rows, map_rows, validate_loaded
from posttrain.distributed.env import is_main_process
from posttrain.evaluation import task_eval
from posttrain.logging import get_logger
from posttrain.models.factory import build_model
from posttrain.models.loading import device_of, forward_logits
from posttrain.models.lora import apply_lora, parameter_counts
from posttrain.trainers.batches import EpochBatches
from posttrain.trainers.callbacks import Callbacks
from posttrain.trainers.loop import FitResult, fit
from posttrain.trainers.setup import prepare_run, python_inputs, set_train_length

log = get_logger(__name__)

_FORMATS = {"auto": None, "text": "text", "prompt_completion": "prompt_completion", "messages": "messages"}


def lm_loss(model: torch.nn.Module, batch: LMBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The `train_step` loss contract for next-token prediction: (Σ NLL, #trained tokens, {})."""
    logits = forward_logits(model, batch.input_ids, batch.attention_mask, batch.position_ids)
    loss_sum, n_tokens = causal_lm_loss_sum(logits, batch.labels)
    return loss_sum, n_tokens, {}


class SFTTrainer:
    """Supervised fine-tuning, shaped like TRL's `SFTTrainer`.

        trainer = SFTTrainer(model, args=SFTConfig(...), train_dataset=rows, eval_dataset=rows)
        trainer.train()

    `model` is a loaded module, a local model directory, or None (then `args.model` says
    what to build: `model.init=tiny` pretrains the built-in model from scratch). LoRA
    (`model.lora.r > 0`, or TRL's `peft_config=peft.LoraConfig(...)`) wraps any of them.
    `processing_class` is the tokenizer; by default that of the folder a module was loaded
    from, or of `model.path` (see `models.factory.load_tokenizer`).
    Datasets are anything `posttrain.data.sources.load_rows` reads (ShareGPT `conversations`
    included); when omitted, `args.data.train_files` / `eval_files` are read.
    `formatting_func(example) -> str` (TRL's) turns each row into the text trained on, as
    `text` data; `data.dataset_text_field` names the text column otherwise. `callbacks`:
    transformers `TrainerCallback`s (`posttrain.trainers.callbacks`).
    """

    def __init__(
        self,
        model: torch.nn.Module | str | None = None,
        args: SFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Sequence[Any] | None = None,
        formatting_func: Callable[[dict], str] | None = None,
    ):
        self.args = args = args if args is not None else SFTConfig()
        self.callbacks = Callbacks(callbacks, args)
        self.formatting_func = formatting_func
        check(formatting_func is None or args.data.format in ("auto", "text"), "data.format",
              f"formatting_func makes text data, and data.format={args.data.format}; set data.format=auto")
        train_source, eval_source, self.tokenizer = prepare_run(
            args, model, train_dataset, eval_dataset, processing_class, peft_config=peft_config
        )
        self.inputs = python_inputs(train_dataset, eval_dataset)  # recorded in config.yaml
        self.train_examples, self.data_stats = self._prepare(*self._load(train_source))
        set_train_length(args, len(self.train_examples))
        self.eval_examples, self.eval_rows = None, None
        if eval_source is not None:
            self.eval_rows, eval_fmt = self._load(eval_source)
            self.eval_examples, _ = self._prepare(self.eval_rows, eval_fmt)
        if args.eval.task is not None:
            check(self.eval_rows is not None, "eval.task", "needs held-out data: set data.eval_files")
        if isinstance(model, torch.nn.Module):
            self.model = apply_lora(model, args.model.lora)
        else:
            self.model = build_model(args.model, self.tokenizer, train=True)
        self.callbacks.init_end(self.model, self.tokenizer)

    def _load(self, source: Any) -> tuple[Any, str]:
        """Read and validate rows; the format is `data.format` or detected, `text` for rows made
        by formatting_func or read from data.dataset_text_field."""
        fmt = _FORMATS.get(self.args.data.format, "unsupported")
        if fmt == "unsupported":
            raise ConfigError(
                f"data.format: SFT trains on text, prompt_completion or messages data, not {self.args.data.format}"
            )
        rows, field = load_rows(source), self.args.data.dataset_text_field
        if self.formatting_func is not None:
            rows, fmt = map_rows(rows, partial(formatted_text, fn=self.formatting_func)), "text"
        elif field != "text":
            rows, fmt = map_rows(rows, partial(text_from_field, field=field)), "text"
        return validate_loaded(rows, fmt)

    def _prepare(self, rows: Any, fmt: str) -> tuple[list[dict], dict[str, float]]:
        """Tokenize (with loss masks) and optionally pack; returns examples and counts."""
        d = self.args.data
        examples, stats = tokenize_dataset(
            rows, self.tokenizer, fmt, d.max_length, d.completion_only_loss, d.assistant_only_loss, d.truncation,
            environment_markers=d.environment_markers,
        )
        counts = {f"data/{k}": float(v) for k, v in stats.as_dict().items()}
        if d.packing:
            examples = pack_examples(examples, d.max_length)
            counts["data/packing_efficiency"] = packing_efficiency(examples, d.max_length)
        return examples, counts

    def _collate(self, examples: list[dict]) -> LMBatch:
        pad = self.tokenizer.pad_token_id
        batch = pack_collate(examples, pad) if self.args.data.packing else pad_collate(examples, pad)
        return batch.to(device_of(self.model))

    def evaluate(
        self, model: torch.nn.Module | None = None, step: int = 0
    ) -> tuple[dict[str, float], list[dict]]:
        """Held-out loss and perplexity; exact-match accuracy (and samples) when `eval.task` is set."""
        model = model if model is not None else self.model
        out: dict[str, float] = {}
        samples: list[dict] = []
        if self.eval_examples:
            total, count = 0.0, 0
            mb = self.args.trainer.micro_batch_size
            for i in range(0, len(self.eval_examples), mb):
                loss_sum, n, _ = lm_loss(model, self._collate(self.eval_examples[i : i + mb]))
                total, count = total + float(loss_sum), count + int(n)
            out["eval/loss"] = total / max(count, 1)
            out["eval/perplexity"] = math.exp(min(out["eval/loss"], 50.0))
        if self.args.eval.task is not None:
            metrics, samples = task_eval(model, self.tokenizer, self.eval_rows, self.args.eval)
            out.update(metrics)
        return out, samples

    def train(self) -> FitResult:
        a = self.args
        batches = EpochBatches(
            self.train_examples, a.data.train_batch_size, a.trainer.micro_batch_size,
            self._collate, seed=a.trainer.seed, shuffle=a.data.shuffle,
        )
        has_eval = bool(self.eval_examples) or a.eval.task is not None
        rows = int(self.data_stats["data/n_kept"])
        packed = f" packed into {len(self.train_examples)} rows of {a.data.max_length} tokens" if a.data.packing else ""
        log.info(
            "SFT: %d examples%s, %d steps of %d, %s",
            rows, packed, a.trainer.max_steps, a.data.train_batch_size, parameter_counts(self.model),
        )
        return fit(
            self.model, self.tokenizer, a, batches, lm_loss,
            evaluate=partial(SFTTrainer.evaluate, self) if has_eval else None,
            start_metrics=self.data_stats, desc="sft", callbacks=self.callbacks, inputs=self.inputs,
        )


def formatted_text(row: Mapping[str, Any], fn: Callable[[dict], str]) -> dict[str, str]:
    """{"text": fn(row)}: TRL's per-example formatting_func; an error names the function."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        text = fn(dict(row))
    except Exception as e:  # noqa: BLE001 - the user's function: say which row and function failed
        raise DataFormatError(f"formatting_func {name} raised {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise DataFormatError(f"formatting_func {name} returned {type(text).__name__}, not a str: it takes one "
                              "example (a dict) and returns its text, as TRL's does")
    return {"text": text}


def text_from_field(row: Mapping[str, Any], field: str) -> dict[str, Any]:
    """{"text": row[field]}: the text column that data.dataset_text_field names."""
    if field not in row:
        raise DataFormatError(f"data.dataset_text_field={field}: the row has no column {field!r} "
                              f"(its columns: {', '.join(map(str, row))})")
    return {"text": row[field]}


def run_sft(cfg: SFTConfig) -> FitResult:
    """`posttrain sft`: train as configured (the loop writes config.yaml once its checks pass)."""
    check(bool(cfg.data.train_files), "data.train_files", "no training data: set data.train_files=[path.jsonl]")
    check(cfg.model.path is not None or cfg.model.init is not None, "model.path",
          "set model.path (a local HF model directory) or model.init (tiny|small)")
    result = SFTTrainer(args=cfg).train()
    if not is_main_process():  # rank 0 prints for all
        return result
    if summary := result.held_out(("eval/loss", "eval/accuracy")):
        print(summary)
    print(f"model: {result.final_dir}\nmetrics: {result.run_dir / 'metrics.jsonl'}")
    return result
