"""Packed documents attend in BFD-regrouped rows (`models.document_rows`): the layout by
hand, split/merge, and the built-in model's packed forward and gradients in float64."""

import torch

from posttrain.models import BuiltinConfig, BuiltinLM
from posttrain.models.document_rows import document_rows

from .conftest import TINY, randomize_


def test_document_rows_by_hand():
    # Two input rows of 5: documents d0 = 3 tokens @0, d1 = 2 @3, d2 = 4 @5, d3 = 1 @9
    # (flat indices). Width = the longest (4). BFD, longest first: d2 -> row0 (full);
    # d0 -> row1 (1 free); d1 does not fit there -> row2 (2 free); d3 -> row1 (full).
    # Slots: d2 at 0..3, d0 at 4..6, d3 at 7, d1 at 8..9; row2's tail is 10, 11.
    rows = document_rows(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]))
    assert (rows.rows, rows.width) == (3, 4)
    assert rows.index.tolist() == [4, 5, 6, 8, 9, 0, 1, 2, 3, 7]
    t, f = True, False
    causal = [[t, f, f, f], [t, t, f, f], [t, t, t, f], [t, t, t, t]]
    assert rows.mask.shape == (3, 1, 4, 4)
    assert rows.mask[0, 0].tolist() == causal  # d2 alone
    assert rows.mask[1, 0].tolist() == [[t, f, f, f], [t, t, f, f], [t, t, t, f], [f, f, f, t]]  # d0 | d3
    # d1 | its tail, a pseudo-document that sees only itself (no query without a key: no NaN).
    assert rows.mask[2, 0].tolist() == [[t, f, f, f], [t, t, f, f], [f, f, t, f], [f, f, t, t]]


def test_split_and_merge_are_inverse_with_zero_tails():
    rows = document_rows(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]))
    x = torch.arange(2 * 3 * 5 * 2, dtype=torch.float64).view(2, 3, 5, 2) + 1  # (B, n, T, D), no zero
    split = rows.split(x)  # (R, n, W, D)
    assert split.shape == (3, 3, 4, 2)
    assert torch.equal(split[1, :, 3], x[1, :, 4])  # d3 (token 9 = row 1, column 4) sits at slot 7
    assert not split[2, :, 2:].any()  # the tail holds zeros
    assert torch.equal(rows.merge(split, 2, 5), x)


def test_packed_forward_and_gradients_equal_each_document_alone():
    torch.manual_seed(0)
    model = randomize_(BuiltinLM(BuiltinConfig(**TINY))).double()  # GQA: nh 4, nkv 2
    lengths = (3, 4, 1, 2, 5, 1)  # input row 0: 3 + 4 + 1; row 1: 2 + 5 + 1
    docs = [torch.randint(0, 61, (n,)) for n in lengths]
    ids = torch.cat(docs).view(2, 8)
    positions = torch.cat([torch.arange(n) for n in lengths]).view(2, 8)
    packed = model(ids, position_ids=positions).flatten(0, 1)
    alone = torch.cat([model(d[None])[0] for d in docs])
    assert float((packed - alone).detach().abs().max()) < 1e-12
    (g_packed,) = torch.autograd.grad(packed.square().sum(), model.model.layers[0].self_attn.q_proj.weight)
    (g_alone,) = torch.autograd.grad(alone.square().sum(), model.model.layers[0].self_attn.q_proj.weight)
    assert float(g_alone.abs().max()) > 1.0 and float((g_packed - g_alone).abs().max()) < 1e-9
