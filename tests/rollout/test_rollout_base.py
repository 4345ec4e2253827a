"""Shared pieces: SamplingParams checks, filters and sampling by hand, stop strings, assembly."""

import dataclasses
import math

import pytest
import torch

from posttrain.rollout import (
    SamplingParams,
    engine_kind_for,
    filter_logits,
    make_engine,
    sample_next,
)
from posttrain.rollout.base import StopStrings, TextStream, build_completions, replay_tokens

NEG = float("-inf")


class PieceTokenizer:
    """Token i decodes to PIECES[i]: multi-character tokens for the stop-string rules."""

    PIECES = [
        "<eos>",
        "st",
        "op",
        "opera",
        "sto",
        "pper",
        "las",
        "topper",
        "s",
        "to",
        "pped",
        "at",
        "stop",
    ]
    eos_token_id, pad_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


def ids(*pieces):
    return [PieceTokenizer.PIECES.index(p) for p in pieces]


def first_stop(tokens, stops):
    """Index of the token that completes a stop string, fed one token at a time, or None."""
    return next((t for t in range(len(tokens)) if stops.completes(tokens[: t + 1])), None)


@pytest.mark.parametrize(
    "bad",
    [
        dict(n=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=2),
        dict(max_new_tokens=0),
        dict(stop=[""]),
    ],
)
def test_sampling_params_reject_out_of_range(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_params_store_tuples_and_resolve_eos(tok):
    p = SamplingParams(stop=["\n"], stop_token_ids=[5, 6])
    assert p.stop == ("\n",) and p.stop_token_ids == (5, 6)
    assert SamplingParams().resolved_stop_token_ids(tok) == (2,)  # the tokenizer's eos
    assert SamplingParams(stop_token_ids=[]).resolved_stop_token_ids(tok) == ()
    assert SamplingParams(temperature=0).logprob_temperature == 1.0


def test_top_k_keeps_the_k_largest_and_ties():
    z = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    out = filter_logits(z, top_k=2)
    assert torch.equal(out[0], torch.tensor([NEG, 3.0, 2.0, NEG]))
    assert torch.equal(out[1], torch.tensor([NEG, 2.0, 2.0, NEG]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.2. top_p 0.6: the mass of {0.2} = 0.2 <= 0.4 -> dropped;
    # of {0.2, 0.3} = 0.5 > 0.4 -> 0.3 kept. top_p 0.5: 0.5 <= 0.5 -> 0.3 dropped too.
    z = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isinf(filter_logits(z, top_p=0.6)).tolist() == [[False, False, True]]
    assert torch.isinf(filter_logits(z, top_p=0.5)).tolist() == [[False, True, True]]
    assert torch.isinf(filter_logits(z, top_p=1e-6)).tolist() == [
        [False, True, True]
    ]  # top token stays


def test_min_p_is_relative_to_the_top_probability():
    z = torch.tensor([[0.5, 0.3, 0.2]]).log()  # threshold 0.5 * 0.5 = 0.25 drops 0.2
    assert torch.isinf(filter_logits(z, min_p=0.5)).tolist() == [[False, False, True]]


def test_exponential_race_samples_the_softmax():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(40_000, 4)
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(40_000, 4).exponential_(generator=gen)
    tokens, logp = sample_next(logits, SamplingParams(), noise)
    freq = torch.bincount(tokens, minlength=4) / 40_000
    assert torch.allclose(freq, probs, atol=0.01)  # 4 sigma is about 0.01
    assert torch.allclose(logp, probs.log()[tokens], atol=1e-6)


def test_logprobs_are_temperature_scaled_and_unfiltered():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    noise = torch.ones(1, 4)
    tok, logp = sample_next(logits, SamplingParams(temperature=0.5, top_k=1), noise)
    assert tok.item() == 0
    z = logits[0] / 0.5  # log softmax over all four tokens, though top-k kept one
    assert logp.item() == pytest.approx((z[0] - torch.logsumexp(z, 0)).item(), abs=1e-6)
    tok, logp = sample_next(logits, SamplingParams(temperature=0))
    assert tok.item() == 0
    by_hand = 2.0 - math.log(sum(math.exp(v) for v in (2, 1, 0, -1)))
    assert logp.item() == pytest.approx(by_hand, abs=1e-6)


@pytest.mark.parametrize(
    "pieces, fires_at",
    [
        (["st", "op"], 1),
        (["stop"], 0),
        (["st", "opera"], 1),
        (["sto", "pper"], 1),
        (["las", "topper"], 1),
        (["s", "to", "pped"], 2),
        (["at", "st", "at"], None),
    ],
)
def test_stop_string_fires_on_the_token_that_completes_it(pieces, fires_at):
    stops = StopStrings(PieceTokenizer(), ["stop"])
    assert first_stop(ids(*pieces), stops) == fires_at
    # Later tokens never fire again for an occurrence already completed.
    if fires_at is not None:
        assert not stops.completes(ids(*pieces) + ids("at"))


def test_cut_drops_or_keeps_the_first_stop_string():
    stops = StopStrings(PieceTokenizer(), ["stop", "at"])
    assert stops.cut("xxstopyyat", keep=False) == "xx"
    assert stops.cut("xatstop", keep=True) == "xat"
    stops = StopStrings(PieceTokenizer(), ["stop"])
    assert stops.cut("xxstopyy", keep=False) == "xx"
    assert stops.cut("xxstopyy", keep=True) == "xxstop"
    assert stops.cut("none", keep=False) == "none"


def test_build_completions_pads_masks_and_cuts_texts():
    tok = PieceTokenizer()
    params = SamplingParams(n=2, stop=["stop"])
    out = build_completions(
        prompt_ids=[[1], [1], [2], [2]],
        response_ids=torch.tensor(
            [
                ids("at", "<eos>", "at"),
                ids("las", "topper", "at"),
                ids("at", "at", "at"),
                ids("st", "at", "at"),
            ]
        ),
        lengths=torch.tensor([2, 2, 3, 1]),
        stopped=torch.tensor([True, True, False, False]),
        logprobs=torch.full((4, 3), -1.0),
        params=params,
        tokenizer=tok,
        pad_id=0,
    )
    assert out.response_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert out.response_ids[0, 2] == 0 and out.logprobs[3].tolist() == [-1.0, 0.0, 0.0]
    assert out.finish_reason == ["stop", "stop", "length", "length"]
    assert out.texts == ["at", "la", "atatat", "st"]  # eos and stop string left out of the text
    assert out.prompt_index.tolist() == [0, 0, 1, 1] and out.num_tokens == 8


def test_make_engine_names_the_choices(model, tok):
    with pytest.raises(ValueError, match="native"):
        make_engine("sglang", model, tok)


def test_every_sampling_field_of_the_rollout_config_reaches_sampling_params():
    from posttrain.config.rl import PPORolloutConfig
    from posttrain.config.rollout import ROLLOUT_ENGINE_OPTIONS, RolloutConfig

    # One value per sampling field, none of them a default of either class: a field added to
    # RolloutConfig fails here (and in from_config until SamplingParams has it too).
    values = {"n": 3, "max_new_tokens": 17, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
              "stop": ["\n\n", "Q:"], "seed_mode": "row"}
    sampling = {f.name for f in dataclasses.fields(RolloutConfig)} - set(ROLLOUT_ENGINE_OPTIONS)
    assert sampling == set(values)
    defaults = SamplingParams()
    for cls in (RolloutConfig, PPORolloutConfig):
        params = SamplingParams.from_config(cls(**values, engine="hf", max_batch_size=4))
        for name, value in values.items():
            assert getattr(params, name) == (tuple(value) if name == "stop" else value) != getattr(defaults, name)
            assert value != getattr(cls(), name)
        assert params.seed is None and params.stop_token_ids is None and params.logprobs  # not in the config


def test_engine_kind_for_lives_beside_make_engine(model, hf_model):
    from posttrain.models.lora import LoraConfig, apply_lora

    from .conftest import randomized

    assert engine_kind_for.__module__ == "posttrain.rollout"
    assert engine_kind_for(model) == "native" and engine_kind_for(hf_model) == "hf"
    assert engine_kind_for(apply_lora(randomized(), LoraConfig(r=2))) == "native"  # peft: its base decides


class CleanupTokenizer:
    """Byte tokens (id = byte) decoded like a tokenizer with clean-up: " ." becomes "."."""

    eos_token_id, pad_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=True):
        text = bytes(i for i in ids if i).decode("utf-8", errors="replace")
        return text.replace(" .", ".")


def streamed(stream, tokens):
    """The pieces `TextStream.push` returns, fed one token at a time."""
    return [stream.push(t) for t in tokens]


def test_text_stream_waits_for_whole_utf8_characters():
    stream = TextStream(CleanupTokenizer(), SamplingParams())
    tokens = list("é€a".encode())  # 2 + 3 + 1 bytes
    assert streamed(stream, tokens) == ["", "é", "", "", "€", "a"]
    assert stream.finish("é€a") == ""


def test_text_stream_holds_back_what_decoding_may_still_change():
    stream = TextStream(CleanupTokenizer(), SamplingParams())
    # The space waits: the next token's clean-up removes it.
    assert streamed(stream, list(b"ab .c")) == ["a", "b", "", ".", "c"]
    assert stream.finish("ab.c ") == " "


def test_text_stream_stops_at_stop_strings_and_stop_tokens():
    stream = TextStream(CleanupTokenizer(), SamplingParams(stop=["xyz"]))
    # "xy" could begin the stop string: it is held back; then the text ends before "xyz".
    assert streamed(stream, list(b"axyb xyz!")) == ["a", "", "", "xyb", "", "", "", " ", ""]
    assert stream.finish("axyb ") == ""
    eos = TextStream(CleanupTokenizer(), SamplingParams(stop_token_ids=[ord("!")]))
    assert streamed(eos, list(b"a!b")) == ["a", "", ""]
    assert eos.finish("a") == ""


def test_replay_tokens_walks_the_responses_step_by_step():
    seen = []
    replay_tokens(lambda rows, toks: seen.append((rows, toks)), torch.tensor([[5, 6, 7], [8, 0, 0]]),
                  torch.tensor([3, 1]))
    assert seen == [([0, 1], [5, 8]), ([0], [6]), ([0], [7])]
