"""RLBatch: the generic row operations, padding sides, and the derived views."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.workers.batch import RLBatch


def make_batch(prompt_lens, resp_lens, offset=0):
    """Rows with distinct values: prompt token p of row i is 100·(i+offset) + p, etc."""
    b, tp, tr = len(prompt_lens), max(prompt_lens), max(resp_lens)
    prompt_ids = torch.zeros(b, tp, dtype=torch.long)
    prompt_mask = torch.zeros(b, tp, dtype=torch.long)
    response_ids = torch.zeros(b, tr, dtype=torch.long)
    response_mask = torch.zeros(b, tr, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        prompt_ids[i, tp - p :] = 100 * (i + offset) + torch.arange(p) + 1
        prompt_mask[i, tp - p :] = 1
        response_ids[i, :r] = 100 * (i + offset) + 50 + torch.arange(r)
        response_mask[i, :r] = 1
    rows = torch.arange(b) + offset
    return RLBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, old_logp=response_mask * -0.5, scores=rows.float(),
        uid=rows, lengths=torch.tensor(resp_lens), truncated=torch.zeros(b, dtype=torch.bool),
        prompts=[f"p{i + offset}" for i in range(b)], completions=[f"c{i + offset}" for i in range(b)],
        columns={"answer": [str(i + offset) for i in range(b)]}, meta={"n": 1},
    )


def rows_of(batch):
    """Each row's real content, padding stripped: comparable across widths."""
    out = []
    for i in range(len(batch)):
        out.append((
            batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(),
            batch.response_ids[i][batch.response_mask[i].bool()].tolist(),
            batch.old_logp[i][batch.response_mask[i].bool()].tolist(),
            float(batch.scores[i]), int(batch.uid[i]), batch.prompts[i], batch.columns["answer"][i],
        ))
    return out


def test_len_select_and_bool_mask():
    b = make_batch([2, 3, 1], [1, 4, 2])
    assert len(b) == 3
    picked = b.select([2, 0])
    assert rows_of(picked) == [rows_of(b)[2], rows_of(b)[0]]
    assert rows_of(b.select(torch.tensor([False, True, True]))) == rows_of(b)[1:]
    assert picked.meta == {"n": 1} and picked.ref_logp is None


def test_concat_pads_prompts_left_and_responses_right():
    a, b = make_batch([2], [1]), make_batch([4, 1], [3, 5], offset=1)
    c = RLBatch.concat([a, b])
    assert c.prompt_ids.shape == (3, 4) and c.response_ids.shape == (3, 5)
    assert c.prompt_mask[0].tolist() == [0, 0, 1, 1]  # padding added on the left
    assert c.response_mask[0].tolist() == [1, 0, 0, 0, 0]  # and on the right
    assert rows_of(c) == rows_of(a) + rows_of(b)


def test_concat_refuses_a_field_missing_in_some_batches():
    a, b = make_batch([1], [1]), make_batch([1], [1])
    with pytest.raises(ValueError, match="ref_logp"):
        RLBatch.concat([a.replace(ref_logp=torch.zeros(1, 1)), b])


def test_split_chunk_repeat_and_pad_to_multiple():
    b = make_batch([1, 2, 3, 1, 2], [2, 2, 1, 3, 1])
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert rows_of(RLBatch.concat(parts)) == rows_of(b)
    with pytest.raises(ValueError):
        b.chunk(2)
    assert [len(p) for p in b.select(range(4)).chunk(2)] == [2, 2]
    rep = b.select([0, 1]).repeat(3)
    assert rep.uid.tolist() == [0, 0, 0, 1, 1, 1]
    assert rep.prompts == ["p0"] * 3 + ["p1"] * 3
    padded, pad = b.pad_to_multiple(4)
    assert (len(padded), pad) == (8, 3)
    assert padded.uid.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows_of(padded.select(range(len(padded) - pad))) == rows_of(b)


def test_chunk_by_tokens_keeps_order_and_budget():
    b = make_batch([2, 2, 2, 2, 2], [1, 6, 1, 1, 9])  # costs 3, 8, 3, 3, 11
    parts = b.chunk_by_tokens(16)
    assert rows_of(RLBatch.concat(parts)) == rows_of(b)
    for p in parts:
        assert len(p) == 1 or len(p) * int(p.token_counts().max()) <= 16
    assert [len(p) for p in parts] == [2, 2, 1]  # the 11-token row goes alone


def test_by_length_sorts_rows_stably_and_cuts_padding():
    b = make_batch([2, 2, 2, 2], [5, 1, 5, 1])  # costs 7, 3, 7, 3
    s = b.by_length()
    assert s.token_counts().tolist() == [3, 3, 7, 7]
    assert rows_of(s) == [rows_of(b)[i] for i in (1, 3, 0, 2)]  # ties keep their order
    padded = [p.trimmed().input_ids.numel() for p in b.split(2)]
    assert sum(p.trimmed().input_ids.numel() for p in s.split(2)) < sum(padded)


def test_trimmed_drops_only_shared_padding_and_to_moves():
    b = make_batch([2, 3], [1, 2]).select([0])  # widths stay 3 and 2
    t = b.trimmed()
    assert t.prompt_ids.shape == (1, 2) and t.response_ids.shape == (1, 1) and t.old_logp.shape == (1, 1)
    assert rows_of(t) == rows_of(b)
    assert b.to("cpu").prompt_ids.device.type == "cpu"


def test_input_views_follow_lengths_not_the_loss_mask():
    b = make_batch([1, 2], [2, 1])
    masked = b.replace(response_mask=torch.zeros_like(b.response_mask))
    assert torch.equal(masked.attention_mask, b.attention_mask)
    assert b.input_ids.shape == (2, 4)
    assert b.num_tokens() == 1 + 2 + 2 + 1


def test_an_episode_row_attends_to_its_environment_tokens_and_counts_model_tokens():
    """Row 0: model, model, env, env, model (5 trajectory tokens, 3 model tokens)."""
    b = make_batch([1, 1], [5, 2])
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]])
    ep = b.replace(response_mask=mask, lengths=mask.sum(-1), total_lengths=torch.tensor([5, 2]))
    assert ep.generated_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert ep.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert ep.token_counts().tolist() == [6, 3] and ep.trimmed().response_ids.shape == (2, 5)
    assert b.trajectory_lengths is b.lengths and ep.trajectory_lengths is ep.total_lengths
    assert len(RLBatch.concat([ep, ep.select([1])])) == 3


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=7), st.integers(1, 4))
def test_split_then_concat_is_identity(lens, size):
    b = make_batch([p for p, _ in lens], [r for _, r in lens])
    assert rows_of(RLBatch.concat(b.split(size))) == rows_of(b)
    assert rows_of(RLBatch.concat(b.chunk_by_tokens(6))) == rows_of(b)


def test_construction_checks_every_field_has_b_rows():
    b = make_batch([2, 3, 1], [1, 4, 2])
    with pytest.raises(ValueError, match=r"RLBatch: field 'values' has 2 rows but 'prompt_ids' has 3"):
        b.replace(values=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"field 'completions' has 4 rows but 'prompt_ids' has 3"):
        b.replace(completions=["x"] * 4)
    with pytest.raises(ValueError, match=r"field 'columns.answer' has 1 rows but 'prompt_ids' has 3"):
        b.replace(columns={"answer": ["1"]})
    with pytest.raises(ValueError, match=r"field 'scores' has 5 rows but 'prompt_ids' has 3"):
        RLBatch(prompt_ids=b.prompt_ids, scores=torch.zeros(5))
    assert len(RLBatch(scores=torch.zeros(5), meta={"n": 2})) == 5  # meta has no rows


def test_require_names_the_role_and_the_missing_field():
    b = make_batch([2, 3], [1, 4])
    b.require("prompt_ids", "old_logp", role="actor.update")
    with pytest.raises(ValueError, match=r"actor.update needs RLBatch.advantages, but it is None"):
        b.require("prompt_ids", "advantages", role="actor.update")
    with pytest.raises(ValueError, match=r"critic.update needs RLBatch.returns \(with PPO\)"):
        b.require("returns", role="critic.update", why="with PPO")
    with pytest.raises(AttributeError, match="no field 'advantage'"):
        b.require("advantage", role="actor.update")
