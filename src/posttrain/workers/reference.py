"""The reference role: the frozen model π_ref of a KL term (RL) or of the DPO loss.

Built only when something needs it (a KL term, DPO without precomputed log-probs), as TRL
(β = 0 loads none) and veRL do. Which model it is:
- with LoRA, the policy itself with its adapter disabled: no second copy of the weights;
- a given model (`DPOTrainer(ref_model=...)`), frozen;
- otherwise a frozen copy of the policy taken before training starts (and before a resume
  restores trained weights).

TR-DPO's sync (`algorithm.ref_sync_steps`, driven by `trainers/loop.py`) moves the copy
towards the policy: ref ← α·policy + (1 − α)·ref. A LoRA reference is the base model
itself, which the adapter's training never changes; syncing it would mean merging the
adapter into the base and starting a new one, so it is refused, as TRL refuses
`sync_ref_model` with PEFT.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posttrain.algos import token_logprobs
from posttrain.models.lora import is_peft
from posttrain.training.core import autocast
from posttrain.workers.batch import RLBatch
from posttrain.workers.forward import FORWARD_FIELDS, device_of, per_token_pass, response_logits


class Reference:
    """π_ref: `compute_logprobs(batch) -> (B, Tr)` for RL, `run(fn, batch)` for any other pass.

    Args:
        model: the reference module, or the peft policy itself when `disable_adapter`.
        disable_adapter: run `model` with its LoRA adapter off.
        temperature: log-probs of softmax(logits / T), as the actor's.
        micro_batch_size, max_tokens_per_micro_batch: how the RL pass is cut (as the actor's).
        precision: fp32 or bf16 autocast, as the actor's forward.
        remove_padding: packed rows for the RL pass (`model.use_remove_padding`, as the actor's).
    """

    def __init__(self, model: nn.Module, disable_adapter: bool = False, temperature: float = 1.0,
                 micro_batch_size: int = 8, max_tokens_per_micro_batch: int = 0, precision: str = "fp32",
                 remove_padding: bool = False):
        self.model, self.disable_adapter = model, disable_adapter
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_micro_batch
        self.precision = precision
        self.remove_padding = remove_padding
        self.synced = False
        self.collective: Any = None
        """Set when the model is sharded over workers (equal forward counts: `per_token_pass`)."""
        """True once `sync` moved it away from the initial policy (checkpoints then save it)."""

    @classmethod
    def for_policy(cls, policy: nn.Module, ref_model: nn.Module | None = None, **settings: Any) -> Reference:
        """`ref_model` if given; else the adapter-disabled policy (LoRA) or a frozen deep copy."""
        if ref_model is not None:
            return cls(ref_model.eval().requires_grad_(False), **settings)
        if is_peft(policy):
            return cls(policy, disable_adapter=True, **settings)
        return cls(copy.deepcopy(policy).eval().requires_grad_(False), **settings)

    @property
    def shares_policy(self) -> bool:
        return self.disable_adapter

    def _base_weights(self) -> contextlib.AbstractContextManager:
        return self.model.disable_adapter() if self.disable_adapter else contextlib.nullcontext()

    @torch.no_grad()
    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(model, *args)` with the reference's weights, without gradients."""
        with self._base_weights():
            return fn(self.model, *args)

    @torch.no_grad()
    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) log softmax(logits_ref / T)[y_t], 0 on padding (CPU). Needs the forward's
        fields (`FORWARD_FIELDS`)."""
        batch.require(*FORWARD_FIELDS, role="ref.compute_logprobs")

        def logp(mb: RLBatch) -> torch.Tensor:
            return token_logprobs(response_logits(self.model, mb, self.remove_padding), mb.response_ids,
                                  self.temperature)

        device = device_of(self.model)
        with self._base_weights(), autocast(self.precision, device):
            (out,) = per_token_pass(batch, logp, self.micro_batch_size, self.max_tokens, device,
                                    packed=self.remove_padding, collective=self.collective)
        return out

    @torch.no_grad()
    def sync(self, policy: nn.Module, alpha: float) -> None:
        """ref ← α·policy + (1 − α)·ref, parameter by parameter (TRL's `SyncRefModelCallback`)."""
        if self.disable_adapter:
            raise ValueError("algorithm.ref_sync_steps: the reference of a LoRA run is the base model with "
                             "the adapter disabled, which cannot be synced; set algorithm.ref_sync_steps=0 "
                             "or train without LoRA (model.lora.r=0)")
        ref_params = dict(self.model.named_parameters())
        for name, p in policy.named_parameters():
            ref_params[name].mul_(1.0 - alpha).add_(p.detach().to(ref_params[name].dtype), alpha=alpha)
        self.synced = True

    def saved_model(self) -> nn.Module | None:
        """The module a checkpoint must hold to restore this reference (None: rebuilt from the
        initial policy, as at the start)."""
        return self.model if self.synced else None
