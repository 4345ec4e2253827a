"""DAPO's reward shaping and dynamic-sampling filter (Yu et al. 2025, arXiv 2503.14476).

Notation: B batch (responses), G group size (responses per prompt, G
consecutive rows per group), B / G groups.
"""

import torch

from .advantages import _groups


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment, added to the task reward (DAPO eq. 13).

    Shapes: lengths (B,) response lengths in tokens → (B,) float, ≤ 0.
    Formula, with L_max = max_len, L_cache = buffer_len, α = penalty:
        0                                  if L ≤ L_max − L_cache
        α ((L_max − L_cache) − L) / L_cache if L_max − L_cache < L ≤ L_max
        −α                                 if L > L_max
    computed as α · clamp(((L_max − L_cache) − L) / L_cache, −1, 0).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got {buffer_len}, {max_len}")
    lengths = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    return penalty * (((max_len - buffer_len) - lengths) / buffer_len).clamp(-1.0, 0.0)


def filter_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling: which groups carry a learning signal (DAPO §3.2).

    Shapes: scores (B,) → keep (B / G,) bool, one entry per group (prompt).
    Formula: keep_g = not all scores of group g are equal (max_g > min_g), so
    0 < #correct < G for 0/1 rewards. A group with equal scores has all-zero
    group-relative advantages and no gradient. Per-response mask:
    `keep.repeat_interleave(group_size)` (B,).
    """
    groups = _groups(scores, group_size)
    return groups.amax(dim=-1) > groups.amin(dim=-1)
