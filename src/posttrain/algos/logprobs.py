"""Per-token log-probabilities and entropies from logits, in bounded memory.

Notation: B batch, T tokens, V vocab. The inputs are aligned: `logits[..., t, :]`
scores `labels[..., t]` (the caller shifts a causal LM's outputs by one).

The naive `log_softmax(logits.float()).gather(...)` materialises two (B, T, V)
float32 tensors (the upcast and the log-softmax) and keeps one alive for the
backward pass. Here the vocabulary reductions run over row chunks of at most
`_CHUNK_ELEMENTS` values, each upcast to float32 on its own; the backward pass
recomputes the softmax chunk by chunk from the saved logits and the per-row
log-normaliser, so nothing of size B·T·V beyond the logits' own gradient is ever
allocated. `benchmarks/logprob_memory.py` measures it.

The autograd functions are differentiable once (no double backward).
"""

from collections.abc import Iterator

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

# float32 elements per chunk (16 MiB); a module constant so tests can shrink it.
_CHUNK_ELEMENTS = 1 << 22


def _row_chunks(logits: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first_row, rows) over `logits` seen as (N, V) in row-major order.

    Every `rows` is a view, never a copy, also when `logits` is a slice such as
    `logits[:, :-1]` that cannot be flattened to (N, V) as a view.
    """
    vocab = logits.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // vocab)
    try:
        blocks = [logits.view(-1, vocab)]
    except RuntimeError:
        blocks = list(logits.reshape(-1, *logits.shape[-2:]).unbind(0))
    first = 0
    for block in blocks:
        for start in range(0, block.shape[0], step):
            yield first + start, block[start : start + step]
        first += block.shape[0]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, logits: torch.Tensor, labels: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        ignored = labels < 0
        index = labels.clamp_min(0).unsqueeze(-1)
        logp = logits.new_empty(labels.shape, dtype=_compute_dtype(logits))
        lse = torch.empty_like(logp)
        for first, rows in _row_chunks(logits):
            rng = slice(first, first + rows.shape[0])
            z = rows.to(logp.dtype) / temperature
            lse[rng] = torch.logsumexp(z, dim=-1)
            logp[rng] = z.gather(-1, index[rng]).squeeze(-1) - lse[rng]
        ctx.save_for_backward(logits, index, ignored, lse)
        ctx.temperature = temperature
        return logp.masked_fill_(ignored, 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logp: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, index, ignored, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logp = grad_logp.masked_fill(ignored, 0.0)
        grad = logits.new_empty(logits.shape)
        grad_rows = grad.view(-1, logits.shape[-1])
        for first, rows in _row_chunks(logits):
            rng = slice(first, first + rows.shape[0])
            g = grad_logp[rng].unsqueeze(-1)
            # d logp / d z = onehot(label) − softmax(z), and z = logits / temperature.
            d = (rows.to(lse.dtype) / temperature).sub_(lse[rng].unsqueeze(-1)).exp_().mul_(-g)
            d.scatter_add_(-1, index[rng], g)
            grad_rows[rng] = d.div_(temperature)
        return grad, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        entropy = logits.new_empty(logits.shape[:-1], dtype=_compute_dtype(logits)).view(-1)
        lse = torch.empty_like(entropy)
        mean_z = torch.empty_like(entropy)
        for first, rows in _row_chunks(logits):
            rng = slice(first, first + rows.shape[0])
            z = rows.to(entropy.dtype) / temperature
            lse[rng] = torch.logsumexp(z, dim=-1)
            mean_z[rng] = (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.temperature = temperature
        return entropy.copy_(lse - mean_z).view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        grad_entropy = grad_entropy.reshape(-1)
        grad = logits.new_empty(logits.shape)
        grad_rows = grad.view(-1, logits.shape[-1])
        for first, rows in _row_chunks(logits):
            rng = slice(first, first + rows.shape[0])
            z = rows.to(lse.dtype) / temperature
            # dH/dz_j = −p_j (z_j − Σ_k p_k z_k), and z = logits / temperature.
            p = (z - lse[rng].unsqueeze(-1)).exp_()
            d = z.sub_(mean_z[rng].unsqueeze(-1)).mul_(p).mul_(-grad_entropy[rng].unsqueeze(-1))
            grad_rows[rng] = d.div_(temperature)
        return grad, None


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each label under the temperature-scaled softmax.

    Shapes: logits (B, T, V) (any leading dims, slices welcome), labels (B, T)
    integer → logp (B, T), float32 (float64 for float64 logits).
    Formula: z = logits / temperature;
    logp_t = z_{t, y_t} − logsumexp_v z_{t, v} = log softmax(z_t)[y_t].
    Labels below 0 (the -100 ignore index of Hugging Face labels) give
    logp = 0 and no gradient.
    Memory: row chunks of at most `_CHUNK_ELEMENTS` float32 values; the
    backward recomputes the softmax per chunk (module docstring).
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be logits {tuple(logits.shape)}[:-1]")
    logp = _TokenLogprobs.apply(logits, labels.reshape(-1), float(temperature))
    return logp.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled softmax at every position.

    Shapes: logits (B, T, V) (any leading dims) → entropy (B, T), float32
    (float64 for float64 logits).
    Formula: z = logits / temperature, p = softmax(z);
    H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v.
    Memory: as `token_logprobs`.
    """
    return _Entropy.apply(logits, float(temperature))
