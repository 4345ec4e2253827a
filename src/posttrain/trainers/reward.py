"""Reward modelling: a scalar head on a decoder, trained on preference pairs (Bradley-Terry).

With r = the score at the last real token of prompt + response (`ScalarHeadModel.scores`),
each pair (y_c preferred to y_r) costs

    ℓ = −log σ(r_c − r_r − m) + c · (r_c + r_r)²

the Bradley-Terry likelihood of the preference (InstructGPT, Ouyang et al. 2022, arXiv
2203.02155, eq. 1), with the optional per-pair margin m of Llama 2 (Touvron et al. 2023,
arXiv 2307.09288, eq. 2; the data's `margin` column) and the centring term of Eisenstein
et al. 2023 (arXiv 2312.09244), weight c = `algorithm.center_rewards_coefficient`. The loss
is the mean over the pairs of the whole optimizer step (Σ over pairs ÷ pairs, accumulated
exactly across micro-batches by `training.core.train_step`).

Chosen and rejected go through one concatenated forward: the batch holds the B chosen
sequences, then the B rejected ones (`posttrain.data.preference.pair_collate`).

The backbone: `model.path` is a causal LM (LM head dropped, a fresh score head with std
1/sqrt(H+1), as TRL's example and Stiennon et al. 2020) or an existing reward model (trained
further); `model.init` builds a fresh built-in one. final/ is saved as the backbone's
`*ForSequenceClassification` checkpoint (Llama's for the built-in model, Qwen2's for a
Qwen2 base, ...) with the tokenizer, which
`posttrain.rewards.reward_model(path)` and `posttrain ppo reward.model_path=RUN_DIR/final`
load (and plain `transformers.AutoModelForSequenceClassification`).

Departures from TRL's RewardTrainer:
- Sequences are encoded as prompt + response (+ EOS) exactly as `reward_model` encodes them
  at RL time; an implicit-prompt pair is split at its shared prefix first (TRL tokenizes
  chosen and rejected whole; the two differ only at the boundary for BPE tokenizers).
- The score is read at the last position where attention_mask is 1 (TRL/HF: the last token
  that is not the pad id), so pad = EOS tokenizers are scored at the EOS.
- With LoRA the score head is trained fully (peft `modules_to_save`, as TRL sets for
  sequence classification) and saved in checkpoints with the adapter.
- `accuracy` counts a tie as wrong (r_c > r_r strictly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch

from posttrain.algos import bradley_terry_loss
from posttrain.config import ConfigError, ModelConfig
from posttrain.config.core import check
from posttrain.config.preference import RMConfig
from posttrain.data.batch import PairBatch
from posttrain.data.preference import pair_collate, prepare_pairs
from posttrain.distributed.env import is_main_process
from posttrain.logging import get_logger
from posttrain.models.builtin import BuiltinLM
from posttrain.models.factory import build_model, weights_dtype
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.loading import resolve_device
from posttrain.models.lora import apply_lora, parameter_counts
from posttrain.trainers.batches import EpochBatches
from posttrain.trainers.callbacks import Callbacks
from posttrain.trainers.loop import FitResult, fit
from posttrain.trainers.setup import prepare_run, python_inputs, set_train_length
from posttrain.training.core import LossFn, merge_metrics

log = get_logger(__name__)


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Accuracy, mean margin and reward statistics of B pairs of scores (B,) each."""
    c, r = chosen.detach().float(), rejected.detach().float()
    both = torch.cat([c, r])
    return {
        "accuracy": (c > r).float().mean(),
        "margin": (c - r).mean(),
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "reward/mean": both.mean(),
        "reward/min": both.min(),
        "reward/max": both.max(),
    }


def bt_loss(
    model: torch.nn.Module, batch: PairBatch, center_rewards_coefficient: float = 0.0
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """The `train_step` contract for the reward model: (Σ_pairs ℓ, #pairs, metrics); ℓ as in the module doc."""
    scores = model.scores(batch.input_ids, batch.attention_mask)  # (2B,)
    chosen, rejected = scores.chunk(2)
    n = chosen.shape[0]
    loss_sum = bradley_terry_loss(chosen, rejected, batch.margin) * n
    if center_rewards_coefficient:
        loss_sum = loss_sum + center_rewards_coefficient * ((chosen + rejected) ** 2).sum()
    return loss_sum, n, pairwise_metrics(chosen, rejected)


def pairwise_eval(
    model: torch.nn.Module, batches: Iterable[PairBatch], loss_fn: LossFn
) -> dict[str, float]:
    """`loss_fn` over held-out micro-batches: `eval/loss` (Σ loss ÷ Σ units) and every metric
    merged as the training step merges them, all prefixed `eval/`."""
    parts = []
    for batch in batches:
        loss_sum, n, metrics = loss_fn(model, batch)
        parts.append((int(n), {"loss": float(loss_sum) / max(int(n), 1), **metrics}))
    return {f"eval/{k}": v for k, v in merge_metrics(parts).items()}


def build_reward_model(cfg: ModelConfig, tokenizer: Any) -> torch.nn.Module:
    """A `ScalarHeadModel` as `cfg` asks: `model.path` (a causal LM gets a fresh head, a reward
    model keeps its own) or a fresh built-in `model.init`; LoRA when `model.lora.r > 0`."""
    if cfg.lora.quantize != "none":
        raise ConfigError("model.lora.quantize: quantized reward-model training is not supported; set none")
    full_finetune = cfg.lora.r == 0
    if cfg.path is not None:
        device = resolve_device(cfg.device)
        dtype = weights_dtype(cfg.dtype, device, trained=full_finetune)
        model = ScalarHeadModel.from_pretrained(cfg.path, device, dtype, cfg.impl)
    else:
        fresh = ModelConfig(init=cfg.init, device=cfg.device, dtype=cfg.dtype)
        lm = build_model(fresh, tokenizer, train=full_finetune)
        model = ScalarHeadModel(lm.model, lm.config)  # lm is dropped: its decoder needs no copy
    text_config = model.config if model.is_builtin else model.config.get_text_config()
    if text_config.pad_token_id is None:  # saved config.json needs one (see heads.save_pretrained)
        text_config.pad_token_id = tokenizer.pad_token_id
    return apply_lora(model, cfg.lora)


class RewardTrainer:
    """Reward-model training, shaped like TRL's `RewardTrainer`.

        trainer = RewardTrainer(model, args=RMConfig(...), train_dataset=pairs, eval_dataset=pairs)
        trainer.train()          # RUN_DIR/final: reward model + tokenizer

    `model` is a `ScalarHeadModel` (peft-wrapped or not), a causal LM module (given a fresh
    score head), a local model directory, or None (then `args.model` says what to build). A
    module that is not peft-wrapped gets `args.model.lora` adapters when `lora.r > 0` (or
    TRL's `peft_config`: `models.lora.apply_lora`).
    Datasets are preference rows in anything `posttrain.data.sources.load_rows` reads; when
    omitted, `args.data.train_files` / `eval_files` are read. `callbacks`: transformers
    `TrainerCallback`s (`posttrain.trainers.callbacks`).
    """

    def __init__(
        self,
        model: torch.nn.Module | str | None = None,
        args: RMConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Sequence[Any] | None = None,
    ):
        self.args = args = args if args is not None else RMConfig()
        self.callbacks = Callbacks(callbacks, args)
        train_source, eval_source, self.tokenizer = prepare_run(
            args, model, train_dataset, eval_dataset, processing_class, peft_config=peft_config, classifier=True
        )
        self.inputs = python_inputs(train_dataset, eval_dataset)  # recorded in config.yaml
        _, self.train_examples, stats = prepare_pairs(train_source, self.tokenizer, args.data)
        set_train_length(args, len(self.train_examples))
        self.data_stats = {f"data/{k}": float(v) for k, v in stats.as_dict().items()}
        self.eval_examples = prepare_pairs(eval_source, self.tokenizer, args.data)[1] if eval_source is not None else []
        self.model = self._model(model)
        self.loss_fn: LossFn = partial(bt_loss, center_rewards_coefficient=args.algorithm.center_rewards_coefficient)
        self.callbacks.init_end(self.model, self.tokenizer)

    def _model(self, model: torch.nn.Module | str | None) -> torch.nn.Module:
        """Build or adopt the reward model; a given plain model gets LoRA when `model.lora.r > 0`."""
        if model is None or isinstance(model, str):
            return build_reward_model(self.args.model, self.tokenizer)
        if not hasattr(model, "scores"):  # a ScalarHeadModel, peft-wrapped or not, has them
            if not (isinstance(model, BuiltinLM) or hasattr(model, "base_model")):
                raise TypeError(f"RewardTrainer needs a ScalarHeadModel or a causal LM, got {type(model).__name__}")
            model = ScalarHeadModel.from_causal_lm(model)
        return apply_lora(model, self.args.model.lora)

    def _collate(self, examples: list[dict]) -> PairBatch:
        device = next(self.model.parameters()).device
        return pair_collate(examples, self.tokenizer.pad_token_id).to(device)

    def _micro_batches(self, examples: list[dict]) -> Iterable[PairBatch]:
        mb = self.args.trainer.micro_batch_size
        return (self._collate(examples[i : i + mb]) for i in range(0, len(examples), mb))

    def evaluate(self, model: torch.nn.Module | None = None, step: int = 0) -> tuple[dict[str, float], list[dict]]:
        """Held-out `eval/accuracy`, `eval/loss`, `eval/margin`, `eval/rewards/*`, `eval/reward/*`."""
        model = model if model is not None else self.model
        with torch.no_grad():
            return pairwise_eval(model, self._micro_batches(self.eval_examples), self.loss_fn), []

    def train(self) -> FitResult:
        a = self.args
        batches = EpochBatches(
            self.train_examples, a.data.train_batch_size, a.trainer.micro_batch_size,
            self._collate, seed=a.trainer.seed, shuffle=a.data.shuffle,
        )
        log.info(
            "reward model: %d pairs, %d steps of %d, %s",
            len(self.train_examples), a.trainer.max_steps, a.data.train_batch_size, parameter_counts(self.model),
        )
        evaluate: Callable | None = partial(RewardTrainer.evaluate, self) if self.eval_examples else None
        return fit(
            self.model, self.tokenizer, a, batches, self.loss_fn, evaluate=evaluate,
            start_metrics=self.data_stats, desc="rm", unit="pairs", callbacks=self.callbacks, inputs=self.inputs,
        )


def run_rm(cfg: RMConfig) -> FitResult:
    """`posttrain rm`: train as configured (the loop writes config.yaml once its checks pass)."""
    check(bool(cfg.data.train_files), "data.train_files", "no training data: set data.train_files=[pairs.jsonl]")
    check(cfg.model.path is not None or cfg.model.init is not None, "model.path",
          "set model.path (a local HF model directory) or model.init (tiny|small)")
    result = RewardTrainer(args=cfg).train()
    if not is_main_process():  # rank 0 prints for all
        return result
    if summary := result.held_out(("eval/loss", "eval/accuracy", "eval/margin")):
        print(summary)
    print(f"reward model: {result.final_dir}\nmetrics: {result.run_dir / 'metrics.jsonl'}")
    return result
