"""DDP and FSDP2 wrapping of a model a loss function runs.

`loss_fn(model, batch)` calls whatever the model offers (`forward`, a reward model's `scores`,
a peft model with its adapter off): a wrapper must see every such call, which a
DistributedDataParallel module only does through its own `forward`. So:
- ddp: `DDP(_LossCall(model))`, whose forward is `loss_fn(model, batch)`: the loss runs
  inside DDP's forward, and the gradients are all-reduced (averaged) in the backward.
- fsdp2: `torch.distributed.fsdp.fully_shard` on each decoder layer, then on the model
  (the root: embeddings, final norm, head; a tied head stays tied, one parameter in the root
  group). The root's other entry points (`scores`) are registered as forward methods. The
  model itself runs the loss; its parameters become DTensor shards, and gradients are
  reduce-scattered (averaged).
`Wrapped.module` is the model whose parameters the optimizer updates and whose state a
checkpoint holds (the inner model, never the DDP wrapper, so its names do not depend on the
strategy or the world size).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from posttrain.distributed.env import DistContext

LossFn = Callable[[nn.Module, Any], Any]


class _LossCall(nn.Module):
    """forward(loss_fn, batch) = loss_fn(model, batch): the loss inside DDP's forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, loss_fn: LossFn, batch: Any) -> Any:
        return loss_fn(self.model, batch)


class Wrapped:
    """A model prepared for `strategy` on this rank (see the module doc)."""

    def __init__(self, model: nn.Module, strategy: str, ctx: DistContext | None):
        self.module, self.strategy, self.ctx = model, strategy, ctx
        self._ddp: nn.Module | None = None
        self._export_copy: nn.Module | None = None
        if ctx is None or strategy == "none":
            return
        if strategy == "ddp":
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self._ddp = nn.parallel.DistributedDataParallel(_LossCall(model), device_ids=ids)
        elif strategy == "fsdp2":
            if ctx.is_main:  # the plain copy final/ and each checkpoint's HF folder are written from
                self._export_copy = copy.deepcopy(model).cpu()
            shard_fsdp2(model)
        else:
            raise ValueError(f"unknown strategy {strategy!r}")

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp2" and self.ctx is not None

    def loss(self, loss_fn: LossFn, batch: Any) -> Any:
        """`loss_fn(model, batch)`, through DDP's forward under ddp."""
        if self._ddp is not None:
            return self._ddp(loss_fn, batch)
        return loss_fn(self.module, batch)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Under fsdp2, every parameter gathered (and kept so through each forward) for the
        duration, so code that reads weights past `forward` runs (the native engine's fused
        decode reads each layer's projections): held-out evaluation holds the full model on
        every rank. Collective: every rank enters it. A no-op otherwise."""
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_reshard_after_forward(False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(True)

    def full_model(self) -> nn.Module | None:
        """A plain module with the full weights on rank 0 (None on the others). Under fsdp2
        every rank must call it: the shards are gathered (`get_model_state_dict`, full and
        offloaded to the CPU) into a CPU copy kept on rank 0."""
        if not self.sharded:
            return self.module if self.ctx is None or self.ctx.is_main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self._export_copy is None:
            return None
        self._export_copy.load_state_dict(full)
        return self._export_copy


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's block list: the first `ModuleList` named `layers` (built-in `model.layers`,
    HF Llama `model.model.layers`, under peft `base_model.model.model.layers`)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            return module
    raise ValueError(f"{type(model).__name__} has no decoder `layers` list to shard")


def shard_fsdp2(model: nn.Module) -> nn.Module:
    """`fully_shard` per decoder layer, then the root; extra entry points registered."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    for method in ("scores", "values"):
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    return model


def wrap(model: nn.Module, strategy: str, ctx: DistContext | None) -> Wrapped:
    """`Wrapped(model, strategy, ctx)`; with no group (ctx None) the model is left as it is."""
    return Wrapped(model, strategy, ctx)
