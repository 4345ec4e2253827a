"""Direct preference optimisation (DPO) and its IPO / hinge / robust variants, with optional RPO.

DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) trains the policy π_θ directly on pairs
(x, y_c ≻ y_r) against a frozen reference π_ref:

    h = [log π_θ(y_c|x) − log π_ref(y_c|x)] − [log π_θ(y_r|x) − log π_ref(y_r|x)]
    sigmoid  −(1−ε) log σ(βh) − ε log σ(−βh)         (ε = label_smoothing: cDPO)
    ipo      (h − 1/(2β))²                             (Azar et al. 2023)
    hinge    max(0, 1 − βh)                            (SLiC, Zhao et al. 2023)
    robust   (−(1−ε) log σ(βh) + ε log σ(−βh)) / (1−2ε) (rDPO, Chowdhury et al. 2024)

(`posttrain.algos.dpo_loss`). log π(y|x) is the *sum* of the response tokens' log-probs
(prompt and padding masked), as TRL; IPO uses their per-token mean, as TRL does. With
`rpo_alpha` (RPO, Pang et al. 2024, arXiv 2404.19733) the loss adds α × the token-mean NLL of
the chosen responses. The implicit rewards β(log π_θ − log π_ref) give the metrics
`rewards/chosen`, `rewards/rejected`, `rewards/accuracies` (chosen reward > rejected) and
`rewards/margins`; `logps/chosen`, `logps/rejected` are the policy's log-probs.

Chosen and rejected go through one concatenated forward (2B rows: B chosen, then B rejected).

The reference, never trained and never in the optimizer:
- default: a frozen deep copy of the policy, taken before training (and before a resume
  loads trained weights);
- LoRA: the policy itself with its adapter disabled (no second copy);
- `precompute_ref_log_probs`: reference log-probs of every train and eval pair are computed
  once, when the trainer is built, with the policy's initial weights (no copy is ever made),
  the adapter-disabled base, or a given `ref_model`, which is then released: no reference
  is held while training;
- `DPOTrainer(ref_model=...)`: any other model sharing the tokenizer.

Departures from TRL's DPOTrainer:
- The loss is the mean over the pairs of the whole optimizer step, and the RPO NLL is the
  token mean over the chosen tokens of the whole step (TRL: per micro-batch, then averaged),
  so gradient accumulation never changes the update (tests check micro-batch invariance).
- Truncation: `data.max_prompt_length` keeps a prompt's last tokens (as TRL); `data.max_length`
  cuts each response at the end (`truncate`) or drops the pair (`drop`); both counted in the
  `data/*` metrics. TRL's `max_completion_length` and `truncation_mode` are not offered.
- Dropout is off in the policy and the reference (TRL's `disable_dropout`, on by default
  there): with it, log π_θ and log π_ref of the same pair differ by noise at step 1, where
  h must be 0 (`models.loading.disable_dropout`; the built-in model has none).
- `eval.task` adds greedy task accuracy on held-out prompts (`eval/accuracy`), as `posttrain sft`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from posttrain.algos import dpo_loss, token_logprobs
from posttrain.config.core import check
from posttrain.config.preference import DPOAlgorithmConfig, DPOConfig
from posttrain.data.batch import IGNORE_INDEX, PairBatch
from posttrain.data.preference import pair_collate, prepare_pairs
from posttrain.distributed import Collective
from posttrain.distributed.env import is_main_process
from posttrain.evaluation import task_eval
from posttrain.logging import get_logger
from posttrain.models.factory import build_model
from posttrain.models.loading import device_of, disable_dropout, forward_logits
from posttrain.models.lora import apply_lora, is_peft
from posttrain.trainers.batches import EpochBatches
from posttrain.trainers.callbacks import Callbacks
from posttrain.trainers.loop import FitResult, RefSync, fit
from posttrain.trainers.reward import pairwise_eval
from posttrain.trainers.setup import prepare_run, python_inputs, set_train_length
from posttrain.training.core import autocast
from posttrain.workers.reference import Reference

log = get_logger(__name__)


def sequence_logps(model: torch.nn.Module, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ of response-token log-probs and the number of response tokens of each row, (2B,) each
    (the B chosen rows, then the B rejected).

    The logits at t score the label at t + 1; labels are -100 on the prompt and padding.
    """
    logits = forward_logits(model, batch.input_ids, batch.attention_mask)  # (2B, T, V)
    labels = batch.labels[:, 1:]
    logp = token_logprobs(logits[:, :-1], labels)  # (2B, T-1), 0 where labels are -100
    return logp.sum(-1), (labels != IGNORE_INDEX).sum(-1)


def _summed(logps: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    return logps


def _token_mean(logps: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    return logps / n_tokens.clamp_min(1)


LOGP_REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sigmoid": _summed,
    "hinge": _summed,
    "robust": _summed,
    "ipo": _token_mean,
}
"""How each loss type reads a sequence's log-prob from its token sum (TRL: IPO averages)."""


def dpo_step_loss(
    model: torch.nn.Module,
    batch: PairBatch,
    reference: Reference | None,
    algo: DPOAlgorithmConfig,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """The `train_step` contract for DPO: (Σ_pairs loss [+ RPO term], #pairs, metrics).

    The reference log-probs come from `batch.ref_logps` when precomputed, else `reference`.
    The RPO term of a micro-batch is α · (P / N) · Σ chosen-token NLL, with P pairs and N
    chosen tokens in the whole step (`batch.step_pairs`, `batch.step_chosen_tokens`), so
    that after train_step's division by P it is α · (the step's token-mean NLL).
    """
    logps, n_tokens = sequence_logps(model, batch)  # (2B,) each
    ref = batch.ref_logps if batch.ref_logps is not None else reference.run(sequence_logps, batch)[0]
    reduce = LOGP_REDUCTIONS[algo.loss_type]
    chosen, rejected = reduce(logps, n_tokens).chunk(2)
    ref_chosen, ref_rejected = reduce(ref.to(logps.device), n_tokens).chunk(2)
    losses, rewards_c, rewards_r = dpo_loss(
        chosen, rejected, ref_chosen, ref_rejected, algo.beta, algo.loss_type, algo.label_smoothing
    )
    n = chosen.shape[0]
    loss_sum = losses.sum()
    metrics = {
        "rewards/chosen": rewards_c.mean(),
        "rewards/rejected": rewards_r.mean(),
        "rewards/accuracies": (rewards_c > rewards_r).float().mean(),
        "rewards/margins": (rewards_c - rewards_r).mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
    }
    if algo.rpo_alpha is not None:
        batch.require("step_pairs", "step_chosen_tokens", role="dpo_step_loss", why="with algorithm.rpo_alpha")
        scale = batch.step_pairs / batch.step_chosen_tokens
        nll_sum = -logps[:n].sum()
        loss_sum = loss_sum + algo.rpo_alpha * scale * nll_sum
        metrics["nll_loss"] = scale * nll_sum.detach() / n
    return loss_sum, n, metrics


def with_step_totals(micro_batches: list[PairBatch], collective: Collective | None = None) -> list[PairBatch]:
    """The micro-batches with their step's pair and chosen-token counts (for the RPO token mean),
    summed over the data-parallel ranks when `collective` is given."""
    pairs = sum(len(mb) for mb in micro_batches)
    tokens = sum(int((mb.chosen_labels[:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
    if collective is not None:
        pairs, tokens = (int(v) for v in collective.all_sum([pairs, tokens]))
    return [mb.replace(step_pairs=float(pairs), step_chosen_tokens=float(max(tokens, 1))) for mb in micro_batches]


class StepTotalBatches(EpochBatches):
    """`EpochBatches` whose micro-batches also carry their step's totals (`with_step_totals`)."""

    def next_step(self) -> list[Any]:
        return with_step_totals(super().next_step(), self.collective)


class DPOTrainer:
    """DPO, shaped like TRL's `DPOTrainer`.

        trainer = DPOTrainer(model, args=DPOConfig(...), train_dataset=pairs, eval_dataset=pairs)
        trainer.train()

    `model` is a loaded causal LM (given `args.model.lora` adapters when `lora.r > 0`, or
    TRL's `peft_config`), a local model directory, or None (then `args.model` says what
    to build). `ref_model` is an optional separate reference (default: see the module
    doc). Datasets are preference rows in anything `posttrain.data.sources.load_rows` reads;
    when omitted, `args.data.train_files` / `eval_files` are read. `callbacks`: transformers
    `TrainerCallback`s (`posttrain.trainers.callbacks`).
    """

    def __init__(
        self,
        model: torch.nn.Module | str | None = None,
        ref_model: torch.nn.Module | None = None,
        args: DPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Sequence[Any] | None = None,
    ):
        self.args = args = args if args is not None else DPOConfig()
        self.callbacks = Callbacks(callbacks, args)
        train_source, eval_source, self.tokenizer = prepare_run(
            args, model, train_dataset, eval_dataset, processing_class, peft_config=peft_config
        )
        self.inputs = python_inputs(train_dataset, eval_dataset)  # recorded in config.yaml
        _, self.train_examples, stats = prepare_pairs(train_source, self.tokenizer, args.data)
        set_train_length(args, len(self.train_examples))
        self.data_stats = {f"data/{k}": float(v) for k, v in stats.as_dict().items()}
        self.eval_examples, self.eval_rows = [], None
        if eval_source is not None:
            self.eval_rows, self.eval_examples, _ = prepare_pairs(eval_source, self.tokenizer, args.data)
        if args.eval.task is not None:
            self._check_task_rows()
        if isinstance(model, torch.nn.Module):
            self.model = apply_lora(model, args.model.lora)
        else:
            self.model = build_model(args.model, self.tokenizer, train=True)
        disable_dropout(self.model, "policy")  # before the reference is copied from it
        if ref_model is not None:
            disable_dropout(ref_model, "reference")
        self.reference: Reference | None = None
        if args.algorithm.precompute_ref_log_probs:
            self._precompute(
                Reference.for_policy(self.model, ref_model) if ref_model is not None else self._initial_policy_reference()
            )
        else:
            self.reference = Reference.for_policy(self.model, ref_model)
        self.loss_fn = partial(dpo_step_loss, reference=self.reference, algo=args.algorithm)
        self.callbacks.init_end(self.model, self.tokenizer)

    def _initial_policy_reference(self) -> Reference:
        """The policy as it is now (its initial weights), adapter off with LoRA: no copy."""
        return Reference(self.model, disable_adapter=is_peft(self.model))

    def _check_task_rows(self) -> None:
        check(self.eval_rows is not None, "eval.task", "needs held-out data: set data.eval_files")
        missing = next((i for i, r in enumerate(self.eval_rows) if "prompt" not in r or "answer" not in r), None)
        check(missing is None, "eval.task",
              f"{self.eval_rows.locate(missing) if missing is not None else ''}: task accuracy needs "
              "`prompt` and `answer` columns in data.eval_files")

    def _precompute(self, reference: Reference) -> None:
        """Store [chosen, rejected] reference log-probs on every train and eval example."""
        was_training = self.model.training
        self.model.eval()
        mb = self.args.trainer.micro_batch_size
        for examples in (self.train_examples, self.eval_examples):
            for i in range(0, len(examples), mb):
                chunk = examples[i : i + mb]
                with autocast(self.args.trainer.precision, device_of(self.model)):
                    ref = reference.run(sequence_logps, self._collate(chunk))[0].float().cpu()
                for j, ex in enumerate(chunk):
                    ex["ref_logps"] = [ref[j].item(), ref[j + len(chunk)].item()]
        self.model.train(was_training)
        log.info("precomputed reference log-probs of %d train and %d eval pairs",
                 len(self.train_examples), len(self.eval_examples))

    def _collate(self, examples: list[dict]) -> PairBatch:
        return pair_collate(examples, self.tokenizer.pad_token_id).to(device_of(self.model))

    def evaluate(self, model: torch.nn.Module | None = None, step: int = 0) -> tuple[dict[str, float], list[dict]]:
        """Held-out `eval/loss`, `eval/rewards/*`, `eval/logps/*`; `eval/accuracy` (and samples)
        from greedy completions when `eval.task` is set."""
        model = model if model is not None else self.model
        out: dict[str, float] = {}
        samples: list[dict] = []
        if self.eval_examples:
            mb = self.args.trainer.micro_batch_size
            batches = with_step_totals(
                [self._collate(self.eval_examples[i : i + mb]) for i in range(0, len(self.eval_examples), mb)]
            )
            with torch.no_grad():
                out.update(pairwise_eval(model, batches, self.loss_fn))
        if self.args.eval.task is not None:
            metrics, samples = task_eval(model, self.tokenizer, self.eval_rows, self.args.eval)
            out.update(metrics)
        return out, samples

    def train(self) -> FitResult:
        a = self.args
        batches = StepTotalBatches(
            self.train_examples, a.data.train_batch_size, a.trainer.micro_batch_size,
            self._collate, seed=a.trainer.seed, shuffle=a.data.shuffle,
        )
        has_eval = bool(self.eval_examples) or a.eval.task is not None
        log.info(
            "DPO (%s, beta %g): %d pairs, %d steps of %d; reference: %s",
            a.algorithm.loss_type, a.algorithm.beta, len(self.train_examples), a.trainer.max_steps,
            a.data.train_batch_size, self._reference_kind(),
        )
        return fit(
            self.model, self.tokenizer, a, batches, self.loss_fn,
            evaluate=partial(DPOTrainer.evaluate, self) if has_eval else None,
            start_metrics=self.data_stats, desc="dpo", reference=self.reference,
            ref_sync=RefSync(a.algorithm.ref_sync_steps, a.algorithm.ref_sync_alpha), unit="pairs", inputs=self.inputs,
            callbacks=self.callbacks,
        )

    def _reference_kind(self) -> str:
        if self.reference is None:
            return "precomputed log-probs"
        return "the policy with its adapter disabled" if self.reference.disable_adapter else "a frozen model"


def run_dpo(cfg: DPOConfig) -> FitResult:
    """`posttrain dpo`: train as configured (the loop writes config.yaml once its checks pass)."""
    check(bool(cfg.data.train_files), "data.train_files", "no training data: set data.train_files=[pairs.jsonl]")
    check(cfg.model.path is not None or cfg.model.init is not None, "model.path",
          "set model.path (a local HF model directory, e.g. an SFT run's final/) or model.init (tiny|small)")
    result = DPOTrainer(args=cfg).train()
    if not is_main_process():  # rank 0 prints for all
        return result
    if summary := result.held_out(("eval/loss", "eval/rewards/accuracies", "eval/rewards/margins", "eval/accuracy")):
        print(summary)
    print(f"model: {result.final_dir}\nmetrics: {result.run_dir / 'metrics.jsonl'}")
    return result
