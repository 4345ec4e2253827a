"""Tokenisation with loss masks (token level), the padding collator and the summed LM loss."""

import functools
import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from posttrain.data.collate import (
    IGNORE_INDEX,
    TokenizeStats,
    causal_lm_loss_sum,
    pad_collate,
    tokenize_dataset,
    tokenize_example,
)
from posttrain.data.formats import DataFormatError
from posttrain.data.sources import load_rows
from posttrain.data.tokenizer import CHAT_TEMPLATE, build_tokenizer

BOS, EOS, USER, ASSISTANT = 1, 2, 4, 5  # ids of the built-in tokenizer's special tokens


def b(text: str) -> list[int]:
    """Ids of `text` in the built-in byte-level tokenizer (byte v is id 6 + v)."""
    return [6 + v for v in text.encode()]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def trained(ex):
    return [t for t in ex["labels"] if t != IGNORE_INDEX]


def test_text_trains_every_token_and_appends_eos(tok):
    ex = tokenize_example({"text": "hello"}, tok, "text")
    assert ex["input_ids"] == [BOS, *b("hello"), EOS]
    assert ex["labels"] == ex["input_ids"]
    assert tokenize_example({"text": "hello"}, tok, "text", add_eos=False)["input_ids"] == [
        BOS,
        *b("hello"),
    ]


def test_text_collated_trains_all_but_padding(tok):
    examples, _ = tokenize_dataset([{"text": "hi"}, {"text": "a longer text"}], tok)
    batch = pad_collate(examples, tok.pad_token_id, pad_to_multiple_of=8)
    assert batch.input_ids.shape == (2, 16)
    real = batch.attention_mask.bool()
    assert torch.equal(batch.labels[real], batch.input_ids[real])
    assert (batch.labels[~real] == IGNORE_INDEX).all()
    assert (batch.input_ids[~real] == tok.pad_token_id).all()
    assert batch.attention_mask.sum(1).tolist() == [4, 15]


def test_completion_only_loss_masks_exactly_the_prompt(tok):
    ex = tokenize_example({"prompt": "2+2=", "completion": "4 ok"}, tok, "prompt_completion")
    assert ex["input_ids"] == [BOS, *b("2+2="), *b("4 ok"), EOS]
    assert ex["labels"] == [IGNORE_INDEX] * 5 + b("4 ok") + [EOS]
    assert tok.decode(trained(ex)) == "4 ok" + tok.eos_token
    full = tokenize_example(
        {"prompt": "2+2=", "completion": "4"}, tok, "prompt_completion", completion_only_loss=False
    )
    assert full["labels"] == full["input_ids"]


def test_prompt_and_completion_are_tokenized_apart_not_as_one_string():
    # A BPE with the merge a+b and no BOS: "xa" + "b" re-tokenized as "xab" would give
    # [x, ab] and lose the boundary; tokenized apart it is [x, a] + [b] + [eos].
    core = Tokenizer(
        models.BPE(
            vocab={"a": 0, "b": 1, "x": 2, "ab": 3, "<eos>": 4, "<pad>": 5}, merges=[("a", "b")]
        )
    )
    bpe = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    assert bpe("xab")["input_ids"] == [2, 3]
    ex = tokenize_example({"prompt": "xa", "completion": "b"}, bpe, "prompt_completion")
    assert ex == {"input_ids": [2, 0, 1, 4], "labels": [IGNORE_INDEX, IGNORE_INDEX, 1, 4]}


def test_conversational_prompt_completion_trains_the_completion_turn(tok):
    row = {
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": [{"role": "assistant", "content": "yo"}],
    }
    ex = tokenize_example(row, tok, "prompt_completion")
    assert ex["input_ids"] == [BOS, USER, *b("hi"), EOS, ASSISTANT, *b("yo"), EOS]
    assert tok.decode(trained(ex)) == "yo" + tok.eos_token
    both = tokenize_example(row, tok, "prompt_completion", assistant_only_loss=True)
    assert both == ex


def test_assistant_only_loss_keeps_exactly_assistant_content_and_eos(tok):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ab"},
    ]
    ex = tokenize_example({"messages": msgs}, tok, "messages", assistant_only_loss=True)
    SYSTEM = 3
    # <bos> <system>S<eos> <user>hi<eos> <assistant>yo<eos> <user>q<eos> <assistant>ab<eos>
    ids = [BOS, SYSTEM, *b("S"), EOS, USER, *b("hi"), EOS, ASSISTANT, *b("yo"), EOS]
    ids += [USER, *b("q"), EOS, ASSISTANT, *b("ab"), EOS]
    assert ex["input_ids"] == ids
    kept = [i for i, label in enumerate(ex["labels"]) if label != IGNORE_INDEX]
    assert kept == [9, 10, 11, 16, 17, 18]
    assert tok.decode(trained(ex)) == "yo<|eos|>ab<|eos|>"
    everything = tokenize_example({"messages": msgs}, tok, "messages")
    assert everything["labels"] == ids


def test_assistant_only_loss_needs_generation_marks(tok):
    plain = build_tokenizer()
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(ValueError) as err:
        tokenize_example(row, plain, "messages", assistant_only_loss=True)
    assert str(err.value) == (
        "the chat template has no {% generation %} marks; assistant_only_loss needs them "
        "— use a template that has them or set assistant_only_loss=false"
    )


@pytest.mark.parametrize(
    ("row", "fmt", "kwargs", "match"),
    [
        (
            {"text": "t"},
            "text",
            {"assistant_only_loss": True},
            "assistant_only_loss needs conversational data",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}]},
            "messages",
            {"completion_only_loss": True},
            "use assistant_only_loss",
        ),
        (
            {"prompt": "q", "chosen": "a", "rejected": "b"},
            "preference",
            {},
            "SFT tokenisation takes formats",
        ),
        ({"text": "t"}, "text", {"truncation": "left"}, "truncation must be one of truncate, drop"),
    ],
)
def test_bad_options_are_explained(tok, row, fmt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tokenize_example(row, tok, fmt, **kwargs)


def test_conversational_needs_a_prefix_stable_template(tok):
    odd = build_tokenizer()
    odd.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}!{% endif %}"
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "completion": [{"role": "assistant", "content": "a"}],
    }
    with pytest.raises(DataFormatError, match="prompt/completion boundary is unknown"):
        tokenize_example(row, odd, "prompt_completion")


def test_truncation_and_drop_are_counted_and_logged(tok, caplog):
    rows = [
        {"prompt": "p", "completion": "short"},  # 1 + 1 + 5 + 1 = 8 tokens
        {"prompt": "p", "completion": "a longer one"},  # 15 tokens: too long
        {"prompt": "a prompt that fills max_length", "completion": "c"},  # nothing trainable left
    ]
    with caplog.at_level(logging.WARNING, logger="posttrain.data.collate"):
        kept, stats = tokenize_dataset(rows, tok, max_length=10)
    assert [len(ex["input_ids"]) for ex in kept] == [8, 10]
    assert kept[1]["labels"][-1] != EOS  # cut, not re-terminated
    counts = (stats.n_rows, stats.n_truncated, stats.n_dropped_too_long, stats.n_dropped_no_loss)
    assert counts == (3, 1, 0, 1)
    assert stats.dropped_at == ["dataset: row 3"]
    assert "1 dropped with no trained token left (first: dataset: row 3)" in caplog.text

    kept, stats = tokenize_dataset(rows, tok, max_length=10, truncation="drop")
    assert len(kept) == 1
    assert stats.as_dict() == {
        "n_rows": 3,
        "n_kept": 1,
        "n_truncated": 0,
        "n_dropped": 2,
        "n_dropped_too_long": 2,
        "n_dropped_no_loss": 0,
    }


def test_single_example_drop_is_counted_or_logged(tok, caplog):
    stats = TokenizeStats()
    row = {"prompt": "long prompt", "completion": "c"}
    assert tokenize_example(row, tok, "prompt_completion", max_length=4, stats=stats) is None
    assert stats.n_dropped_no_loss == 1
    with caplog.at_level(logging.WARNING, logger="posttrain.data.collate"):
        assert tokenize_example(row, tok, "prompt_completion", max_length=4) is None
    assert "dropped an SFT example (no loss" in caplog.text


def test_dataset_without_any_kept_row_is_an_error(tok):
    with pytest.raises(DataFormatError, match="every one of 1 rows was dropped"):
        tokenize_dataset([{"text": "abcdef"}], tok, max_length=3, truncation="drop")


def test_encoding_error_names_the_row(tok, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "q"}]}\n'
        '{"messages": [{"role": "tool", "content": "q"}]}\n'
    )
    with pytest.raises(
        DataFormatError, match=r"chat.jsonl:2: cannot tokenize: .*unknown chat role tool"
    ):
        tokenize_dataset(load_rows(path), tok)


def test_pad_collate_layout_and_errors():
    batch = pad_collate(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [9]}], pad_token_id=0
    )
    assert batch.input_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.labels.tolist() == [[-100, 6, 7], [9, -100, -100]]
    with pytest.raises(ValueError, match="set tokenizer.pad_token"):
        pad_collate([{"input_ids": [1]}], pad_token_id=None)


def test_causal_lm_loss_sum_by_hand():
    # Uniform logits over V=4: every target costs log 4. labels[:, 0] is never a target.
    logits = torch.zeros(1, 4, 4)
    labels = torch.tensor([[3, -100, 1, 2]])
    sum_nll, n = causal_lm_loss_sum(logits, labels)
    assert n.item() == 2 and sum_nll.item() == pytest.approx(2 * math.log(4))
    # One confident logit: target 1 at t=2 predicted from t=1 with logit 10 on it:
    # nll = -log(e^10 / (e^10 + 3)) = log(1 + 3 e^-10).
    logits[0, 1, 1] = 10.0
    sum_nll, _ = causal_lm_loss_sum(logits, labels)
    assert sum_nll.item() == pytest.approx(math.log(1 + 3 * math.exp(-10)) + math.log(4), rel=1e-6)


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from posttrain.models import BuiltinLM

    torch.manual_seed(0)
    small = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
    )
    return BuiltinLM.from_preset("tiny", vocab_size=64, **small).eval()


_example = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 63), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
    )
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(examples=st.lists(_example, min_size=1, max_size=4), multiple=st.sampled_from([None, 8, 16]))
def test_padding_never_changes_the_loss_sum(examples, multiple):
    model = _tiny_model()
    exs = [
        {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, keep)]}
        for ids, keep in examples
    ]
    with torch.no_grad():
        alone = [
            causal_lm_loss_sum(model(torch.tensor([e["input_ids"]])), torch.tensor([e["labels"]]))
            for e in exs
        ]
        batch = pad_collate(exs, pad_token_id=0, pad_to_multiple_of=multiple)
        padded_sum, padded_n = causal_lm_loss_sum(
            model(batch.input_ids, attention_mask=batch.attention_mask), batch.labels
        )
    assert padded_n.item() == sum(n.item() for _, n in alone)
    assert padded_sum.item() == pytest.approx(sum(s.item() for s, _ in alone), abs=1e-4)


def _small_bpe() -> PreTrainedTokenizerFast:
    """A BPE with multi-character merges (up to whole words), trained here in milliseconds."""
    from tokenizers import pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["the cat sat on the mat, 12+34=46 and thethethe"] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")


@pytest.mark.parametrize("which, fmt", [("builtin", "text"), ("builtin", "prompt_completion"), ("builtin", "messages"),
                                        ("bpe", "text"), ("bpe", "prompt_completion")])  # the BPE has no chat template
def test_a_long_row_is_cut_before_tokenising_with_the_same_tokens(tok, which, fmt):
    tokenizer = tok if which == "builtin" else _small_bpe()
    words = "the cat sat on the mat, 12+34=46 and thethethe " * 3000  # 141,000 characters

    def row(text):
        if fmt == "text":
            return {"text": text}
        if fmt == "prompt_completion":
            return {"prompt": "say: ", "completion": text}
        return {"messages": [{"role": "user", "content": "say"}, {"role": "assistant", "content": text}]}

    for text, max_length in [("the cat", 64), (words, 64), (words, 500), ("thethethe" * 20000, 100)]:
        got = tokenize_example(row(text), tokenizer, fmt, max_length=max_length)
        # The reference: the whole row tokenised, then its first max_length tokens.
        stats = TokenizeStats()
        full = tokenize_example(row(text), tokenizer, fmt, max_length=None, stats=stats)
        assert got == {k: v[:max_length] for k, v in full.items()}
        assert len(got["input_ids"]) == min(max_length, len(full["input_ids"]))


def test_a_30_mb_row_costs_milliseconds_not_minutes(tok):
    import time

    huge = {"prompt": "say: ", "completion": "12+34=46 " * 3_500_000}  # 31.5 MB on one line
    start = time.perf_counter()
    examples, stats = tokenize_dataset([huge, {"prompt": "1+1=", "completion": "2"}], tok, max_length=128)
    # Before: the whole row was tokenised, then cut (≈47 s and GBs of ids with this tokenizer).
    assert time.perf_counter() - start < 1.0
    assert [len(e["input_ids"]) for e in examples] == [128, 7] and stats.n_truncated == 1
    assert examples[0]["input_ids"] == ([BOS, *b("say: ")] + b("12+34=46 ") * 14)[:128]
