"""Incremental decoding with KVCache gives the logits of a full forward."""

import pytest
import torch

ATOL = 1e-5


def test_incremental_decoding_matches_full_forward(tiny_lm):
    ids = torch.randint(0, 61, (2, 9))
    full = tiny_lm(ids)
    cache = tiny_lm.new_cache(batch_size=2, max_len=12)
    assert cache.keys.shape == (2, 2, 2, 12, 8)  # (L, B, nkv, T_max, D)
    steps = [tiny_lm(ids[:, :4], cache=cache)]  # prefill 4, then one token at a time
    for t in range(4, 9):
        steps.append(tiny_lm(ids[:, t : t + 1], cache=cache))
    assert cache.length == 9
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=ATOL)


def test_chunked_prefill_without_mask(tiny_lm):
    ids = torch.randint(0, 61, (1, 8))
    cache = tiny_lm.new_cache(1, 8)
    chunks = [tiny_lm(ids[:, a:b], cache=cache) for a, b in ((0, 3), (3, 7), (7, 8))]
    assert torch.allclose(torch.cat(chunks, dim=1), tiny_lm(ids), atol=ATOL)


def left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths -> ids (B, T) left-padded with 0 and mask (B, T)."""
    width = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - s.numel() :], mask[row, width - s.numel() :] = s, 1
    return ids, mask


def decode(model, cache, mask, next_ids):
    """Feed next_ids (B, n) one column at a time; return logits (B, n, V) and the grown mask."""
    outs = []
    for t in range(next_ids.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        outs.append(model(next_ids[:, t : t + 1], attention_mask=mask, cache=cache))
    return torch.cat(outs, dim=1), mask


def test_left_padded_batch_decoding_matches_each_row_alone(tiny_lm):
    prompts = [torch.randint(1, 61, (n,)) for n in (5, 2, 3)]
    continuation = torch.randint(1, 61, (3, 4))
    ids, mask = left_padded(prompts)
    cache = tiny_lm.new_cache(3, ids.shape[1] + 4)
    prefill = tiny_lm(ids, attention_mask=mask, cache=cache)
    steps, _ = decode(tiny_lm, cache, mask, continuation)
    for row, prompt in enumerate(prompts):
        alone = tiny_lm(torch.cat([prompt, continuation[row]])[None])[0]
        real_prefill = prefill[row][mask[row].bool()]
        assert torch.allclose(real_prefill, alone[: prompt.numel()], atol=ATOL)
        assert torch.allclose(steps[row], alone[prompt.numel() :], atol=ATOL)


def test_select_compaction_keeps_rows_decoding_correctly(tiny_lm):
    prompts = [torch.randint(1, 61, (n,)) for n in (3, 5, 4)]
    continuation = torch.randint(1, 61, (3, 5))
    ids, mask = left_padded(prompts)
    cache = tiny_lm.new_cache(3, ids.shape[1] + 5)
    tiny_lm(ids, attention_mask=mask, cache=cache)
    _, mask = decode(tiny_lm, cache, mask, continuation[:, :2])
    rows = torch.tensor([2, 0])  # row 1 finished; keep the others, reordered
    cache.select(rows)
    mask = mask[rows]
    assert cache.batch_size == 2 and cache.length == ids.shape[1] + 2
    steps, _ = decode(tiny_lm, cache, mask, continuation[rows, 2:])
    for i, row in enumerate(rows.tolist()):
        alone = tiny_lm(torch.cat([prompts[row], continuation[row]])[None])[0]
        assert torch.allclose(steps[i], alone[-3:], atol=ATOL)


def test_select_with_positions_keeps_only_those_and_decodes_the_same(tiny_lm):
    prompts = [torch.randint(1, 61, (n,)) for n in (2, 5, 3)]
    continuation = torch.randint(1, 61, (3, 4))
    ids, mask = left_padded(prompts)
    cache = tiny_lm.new_cache(3, ids.shape[1] + 4)
    tiny_lm(ids, attention_mask=mask, cache=cache)
    _, mask = decode(tiny_lm, cache, mask, continuation[:, :1])  # 6 filled, pads: row 0 [0, 3), row 2 [0, 2)
    rows = torch.tensor([2, 0])
    positions = torch.tensor([[1, 2, 3, 4, 5], [0, 1, 3, 4, 5]])  # rows 2, 0 keep 1, 2 pad columns
    kept_keys = cache.keys[:, 0, :, [0, 1, 3, 4, 5]]
    cache.select(rows, positions)
    assert cache.batch_size == 2 and cache.length == 5 and cache.max_len == ids.shape[1] + 4
    assert torch.equal(cache.keys[:, 1, :, :5], kept_keys)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # what each kept column holds
    steps, _ = decode(tiny_lm, cache, mask, continuation[rows, 1:])
    for i, row in enumerate(rows.tolist()):
        alone = tiny_lm(torch.cat([prompts[row], continuation[row]])[None])[0]
        assert torch.allclose(steps[i], alone[-3:], atol=ATOL)


def test_explicit_position_ids_with_cache(tiny_lm):
    ids = torch.randint(0, 61, (1, 6))
    cache = tiny_lm.new_cache(1, 6)
    first = tiny_lm(ids[:, :4], position_ids=torch.arange(4)[None], cache=cache)
    rest = tiny_lm(ids[:, 4:], position_ids=torch.tensor([[4, 5]]), cache=cache)
    assert torch.allclose(torch.cat([first, rest], 1), tiny_lm(ids), atol=ATOL)


def test_cache_overflow_and_wrong_shapes_are_errors(tiny_lm):
    cache = tiny_lm.new_cache(1, 4)
    tiny_lm(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        tiny_lm(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache holds 1 rows"):
        tiny_lm(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, cached \+ new\)"):
        tiny_lm(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), cache=cache)


def test_reserve_grows_the_cache_and_keeps_what_it_holds(tiny_lm):
    ids = torch.randint(0, 61, (2, 9))
    cache = tiny_lm.new_cache(2, 4)
    first = tiny_lm(ids[:, :4], cache=cache)
    cache.reserve(2)  # already large enough: nothing happens
    assert cache.max_len == 4
    cache.reserve(9)
    assert cache.max_len == 9 and cache.length == 4
    rest = tiny_lm(ids[:, 4:], cache=cache)
    assert torch.allclose(torch.cat([first, rest], dim=1), tiny_lm(ids), atol=ATOL)
