"""The reference role: log-probs of the frozen initial policy π_ref, for the KL term.

Built only when a KL term is on (`algorithm.kl.in_reward` or `in_loss`), as TRL (β = 0
loads none) and veRL do. With LoRA the reference is the policy itself with its adapters
disabled, so there is no second copy of the weights; otherwise it is a frozen copy of
the policy taken before training starts (and before a resume restores trained weights).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from posttrain.algos import token_logprobs
from posttrain.models.lora import is_peft
from posttrain.trainers.core import autocast
from posttrain.workers.batch import RLBatch
from posttrain.workers.forward import FORWARD_FIELDS, device_of, per_token_pass, response_logits


class Reference:
    """π_ref: `compute_logprobs(batch) -> (B, Tr)`.

    Args:
        policy: the actor's model at its initial weights.
        temperature: the sampling temperature (log-probs of softmax(logits / T), as the actor's).
        micro_batch_size, max_tokens_per_micro_batch: how the pass is cut (as the actor's).
        precision: fp32 or bf16 autocast, as the actor's forward.
    """

    def __init__(self, policy: nn.Module, temperature: float, micro_batch_size: int,
                 max_tokens_per_micro_batch: int = 0, precision: str = "fp32"):
        self.shares_policy = is_peft(policy)
        if self.shares_policy:
            self.model = policy
        else:
            self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_micro_batch
        self.precision = precision

    def _base_weights(self) -> contextlib.AbstractContextManager:
        return self.model.disable_adapter() if self.shares_policy else contextlib.nullcontext()

    @torch.no_grad()
    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) log softmax(logits_ref / T)[y_t], 0 on padding (CPU). Needs the forward's
        fields (`FORWARD_FIELDS`)."""
        batch.require(*FORWARD_FIELDS, role="ref.compute_logprobs")

        def logp(mb: RLBatch) -> torch.Tensor:
            return token_logprobs(response_logits(self.model, mb), mb.response_ids, self.temperature)

        device = device_of(self.model)
        with self._base_weights(), autocast(self.precision, device):
            (out,) = per_token_pass(batch, logp, self.micro_batch_size, self.max_tokens, device)
        return out
