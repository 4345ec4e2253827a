"""Native and hf engines: parity with transformers, logprobs vs a teacher-forced forward,
grouping, seeds, stopping, compaction. Tiny 2-layer model, fp32, CPU."""

import pytest
import torch

from posttrain.algos import token_logprobs
from posttrain.models import forward_logits
from posttrain.rollout import Completions, SamplingParams, make_engine
from posttrain.rollout.native import as_builtin

from .conftest import PROMPTS, randomized

ATOL = 1e-4
NO_STOP = dict(stop_token_ids=[])


@pytest.fixture(scope="module")
def engines(model, hf_model, tok):
    return {"native": make_engine("native", model, tok), "hf": make_engine("hf", hf_model, tok)}


def teacher_forced_logprobs(model, out: Completions, temperature: float) -> torch.Tensor:
    """(N, T_resp): each row alone (no padding) through a plain forward + algos.token_logprobs."""
    ref = torch.zeros_like(out.logprobs)
    for row, prompt in enumerate(out.prompt_ids):
        n = int(out.lengths[row])
        seq = torch.tensor(prompt + out.response_ids[row, :n].tolist())[None]
        with torch.no_grad():
            logits = forward_logits(model, seq)
        logp = token_logprobs(logits[:, :-1], seq[:, 1:], temperature)[0]
        ref[row, :n] = logp[len(prompt) - 1 :]
    return ref


def check_layout(out: Completions, params: SamplingParams, pad_id: int = 0):
    """response_mask is a prefix of ones of length `lengths`; padding is pad id / 0 logprob."""
    rows, width = out.response_ids.shape
    assert rows == len(out.prompt_ids) == len(out.texts) == len(out.finish_reason)
    assert torch.equal(out.response_mask.sum(-1), out.lengths)
    assert torch.equal(out.response_mask, (torch.arange(width) < out.lengths[:, None]).long())
    assert bool((out.response_ids[out.response_mask == 0] == pad_id).all())
    assert width == int(out.lengths.max()) and int(out.lengths.max()) <= params.max_new_tokens
    if out.logprobs is not None:
        assert out.logprobs.dtype == torch.float32
        assert bool((out.logprobs[out.response_mask == 0] == 0).all())
        assert bool((out.logprobs[out.response_mask == 1] <= 0).all())
    for reason, length in zip(out.finish_reason, out.lengths.tolist()):
        assert reason == "stop" or length == params.max_new_tokens


def test_native_greedy_matches_transformers_generate(model, hf_model, tok):
    enc = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, enc))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])
    mask = (
        torch.arange(width)[None] >= torch.tensor([width - len(e) for e in enc])[:, None]
    ).long()
    with torch.no_grad():
        ref = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=None,
            pad_token_id=0,
        )
    out = make_engine("native", model, tok).generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=24, **NO_STOP)
    )
    assert torch.equal(out.response_ids, ref[:, width:])


@pytest.mark.parametrize("kind", ["native", "hf"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_a_teacher_forced_forward(engines, model, kind, temperature):
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=16, seed=0)
    out = engines[kind].generate(PROMPTS, params)
    check_layout(out, params)
    ref = teacher_forced_logprobs(model, out, params.logprob_temperature)
    assert (out.logprobs - ref).abs().max().item() < ATOL


def test_native_samples_equal_hf_samples_for_the_same_seed(engines):
    # torch.multinomial(probs, 1) is the same exponential race on the same (N, V) Exp(1)
    # draws per step, so both engines sample the same tokens: the filters, their order
    # and the temperature agree with transformers' warpers.
    params = SamplingParams(
        n=2, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, max_new_tokens=16, seed=5, **NO_STOP
    )
    native, hf = (engines[k].generate(PROMPTS, params) for k in ("native", "hf"))
    assert torch.equal(native.response_ids, hf.response_ids)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_rows_are_grouped_by_prompt(engines, tok, kind):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=1)
    out = engines[kind].generate(PROMPTS, params)
    assert out.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert out.prompt_ids == [tok(p)["input_ids"] for p in PROMPTS for _ in range(3)]
    alone = engines[kind].generate(PROMPTS[1:2], SamplingParams(temperature=0, max_new_tokens=6))
    greedy = engines[kind].generate(PROMPTS, SamplingParams(n=3, temperature=0, max_new_tokens=6))
    assert torch.equal(greedy.response_ids[3:6], alone.response_ids.expand(3, -1))


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_same_seed_same_samples_other_seed_other_samples(engines, kind):
    params = SamplingParams(n=2, max_new_tokens=12, seed=7, **NO_STOP)
    first, again = (engines[kind].generate(PROMPTS, params) for _ in range(2))
    other = engines[kind].generate(
        PROMPTS, SamplingParams(n=2, max_new_tokens=12, seed=8, **NO_STOP)
    )
    assert torch.equal(first.response_ids, again.response_ids)
    assert not torch.equal(first.response_ids, other.response_ids)
    assert not torch.equal(first.response_ids[0], first.response_ids[1])  # the n samples differ


def test_seed_none_follows_torch_manual_seed(engines):
    params = SamplingParams(max_new_tokens=8, **NO_STOP)
    torch.manual_seed(3)
    first = engines["native"].generate(PROMPTS, params)
    torch.manual_seed(3)
    assert torch.equal(first.response_ids, engines["native"].generate(PROMPTS, params).response_ids)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_stop_token_ends_the_row_and_stays_out_of_the_text(engines, tok, kind):
    free = engines[kind].generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=20, **NO_STOP)
    )
    stop_tok = int(free.response_ids[0, 5])  # row 0 produces it at step 5 (or earlier)
    first = free.response_ids[0].tolist().index(stop_tok)
    params = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[stop_tok])
    out = engines[kind].generate(PROMPTS, params)
    check_layout(out, params)
    assert out.finish_reason[0] == "stop" and int(out.lengths[0]) == first + 1
    assert out.response_ids[0, first] == stop_tok
    assert torch.equal(out.response_ids[0, : first + 1], free.response_ids[0, : first + 1])
    assert out.texts[0] == tok.decode(
        free.response_ids[0, :first].tolist(), skip_special_tokens=True
    )


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_stop_string_ends_the_row_on_its_completing_token(engines, tok, kind):
    free = engines[kind].generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=30, **NO_STOP)
    )
    row = free.response_ids[0].tolist()
    # Byte-level ids 6+b: pick two consecutive printable ASCII bytes as a 2-char stop string.
    t = next(i for i in range(1, 30) if all(38 <= row[j] < 133 for j in (i - 1, i)))
    stop = bytes([row[t - 1] - 6, row[t] - 6]).decode()
    params = SamplingParams(temperature=0, max_new_tokens=30, stop=[stop], **NO_STOP)
    out = engines[kind].generate(PROMPTS, params)
    check_layout(out, params)
    text = tok.decode(row, skip_special_tokens=True)
    assert out.finish_reason[0] == "stop" and int(out.lengths[0]) <= t + 1
    assert out.texts[0] == text[: text.index(stop)]
    keep = engines[kind].generate(
        PROMPTS,
        SamplingParams(
            temperature=0,
            max_new_tokens=30,
            stop=[stop],
            include_stop_str_in_output=True,
            **NO_STOP,
        ),
    )
    assert keep.texts[0] == text[: text.index(stop) + 2]


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_max_new_tokens_finishes_with_length(engines, kind):
    params = SamplingParams(n=2, max_new_tokens=5, seed=0, **NO_STOP)
    out = engines[kind].generate(PROMPTS, params)
    assert out.finish_reason == ["length"] * 8 and out.lengths.tolist() == [5] * 8
    assert out.response_ids.shape == (8, 5)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_top_k_one_is_greedy(engines, kind):
    greedy = engines[kind].generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, **NO_STOP)
    )
    top1 = engines[kind].generate(
        PROMPTS, SamplingParams(temperature=0.9, top_k=1, n=1, seed=4, max_new_tokens=10, **NO_STOP)
    )
    assert torch.equal(greedy.response_ids, top1.response_ids)


def test_token_id_prompts_equal_string_prompts(engines, tok):
    params = SamplingParams(temperature=0, max_new_tokens=6)
    as_ids = engines["native"].generate([tok(p)["input_ids"] for p in PROMPTS], params)
    assert torch.equal(
        as_ids.response_ids, engines["native"].generate(PROMPTS, params).response_ids
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compaction_changes_nothing(model, tok, temperature):
    # 40 of the 262 ids stop a row: rows finish at many different steps.
    params = SamplingParams(
        n=4,
        temperature=temperature,
        max_new_tokens=40,
        seed=2,
        stop_token_ids=list(range(100, 140)),
    )
    runs = {
        frac: make_engine("native", model, tok, compact_fraction=frac).generate(PROMPTS, params)
        for frac in (None, 0.0, 0.5)
    }
    base = runs[None]
    assert 1 < len(set(base.lengths.tolist())) and "stop" in base.finish_reason
    assert base.meta["compactions"] == 0 and runs[0.0].meta["compactions"] >= 2
    assert runs[0.0].meta["decode_steps"] == base.meta["decode_steps"]
    for frac in (0.0, 0.5):
        assert torch.equal(runs[frac].response_ids, base.response_ids)
        assert torch.allclose(runs[frac].logprobs, base.logprobs, atol=1e-5)
        assert runs[frac].finish_reason == base.finish_reason


def test_max_batch_size_chunks_give_the_same_greedy_rows(model, tok):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    whole = make_engine("native", model, tok).generate(PROMPTS, params)
    chunked = make_engine("native", model, tok, max_batch_size=3).generate(PROMPTS, params)
    assert torch.equal(whole.response_ids, chunked.response_ids)


def test_native_runs_a_transformers_llama_on_shared_weights(model, hf_model, tok):
    view = as_builtin(hf_model)
    assert (
        view.model.embed_tokens.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    )
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=0)
    a = make_engine("native", hf_model, tok).generate(PROMPTS, params)
    b = make_engine("native", model, tok).generate(PROMPTS, params)
    assert torch.equal(a.response_ids, b.response_ids)


def test_native_runs_a_lora_wrapped_model_with_its_adapters(tok):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        randomized(),
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    )
    params = SamplingParams(temperature=0, max_new_tokens=8, **NO_STOP)
    with_adapters = make_engine("native", lora, tok).generate(PROMPTS, params).response_ids
    base = make_engine("native", randomized(), tok).generate(PROMPTS, params).response_ids
    merged = (
        make_engine("native", lora.merge_and_unload(), tok).generate(PROMPTS, params).response_ids
    )
    assert torch.equal(with_adapters, merged) and not torch.equal(with_adapters, base)


def test_engines_refuse_models_they_cannot_run_in_config_keys(model, tok):
    """Seen: a raw TypeError naming make_engine('hf', ...); now the keys that fix it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=262, n_embd=8, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"rollout.engine=native cannot run this GPT2LMHeadModel: "
                                         r"model_type='gpt2' .*set rollout.engine=hf"):
        make_engine("native", gpt2, tok)
    with pytest.raises(ValueError, match="Linear is not a transformers model"):
        make_engine("native", torch.nn.Linear(2, 2), tok)
    with pytest.raises(ValueError, match=r"rollout.engine=hf .*BuiltinLM .*model.impl=hf"):
        make_engine("hf", model, tok)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_sync_weights_makes_the_engine_sample_the_new_policy(tok, tmp_path, kind):
    from transformers import LlamaForCausalLM

    def load(m):
        if kind == "native":
            return m
        m.save_pretrained(tmp_path / str(id(m)))
        return LlamaForCausalLM.from_pretrained(tmp_path / str(id(m)), dtype=torch.float32).eval()

    old, new = load(randomized(seed=1)), load(randomized(seed=2))
    params = SamplingParams(temperature=0, max_new_tokens=8, **NO_STOP)
    engine = make_engine(kind, old, tok)
    before = engine.generate(PROMPTS, params).response_ids
    engine.sync_weights(new)
    synced = engine.generate(PROMPTS, params).response_ids
    assert torch.equal(synced, make_engine(kind, new, tok).generate(PROMPTS, params).response_ids)
    assert not torch.equal(before, synced)
    with torch.no_grad():  # in-place (optimizer-style) updates are seen without a sync
        for p in new.parameters():
            p.mul_(-1.0)
    assert not torch.equal(engine.generate(PROMPTS, params).response_ids, synced)


def test_generate_keeps_the_training_mode(tok):
    m = randomized().train()
    make_engine("native", m, tok).generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert m.training


def heard(engine, params, prompts=PROMPTS):
    """The output, and each row's tokens as `on_tokens` reported them, step by step."""
    rows: dict[int, list[int]] = {}
    calls = []

    def on_tokens(ids, toks):
        calls.append(ids)
        for r, t in zip(ids, toks):
            rows.setdefault(r, []).append(t)

    return engine.generate(prompts, params, on_tokens=on_tokens), rows, calls


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_on_tokens_hears_every_token_as_it_is_decoded(engines, kind):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_new_tokens=12,
                            stop_token_ids=list(range(100, 140)))
    out, rows, calls = heard(engines[kind], params)
    assert "stop" in out.finish_reason and "length" in out.finish_reason
    for r in range(len(out)):  # every row's tokens, stop token included, nothing after
        assert rows[r] == out.response_ids[r, : int(out.lengths[r])].tolist()
    assert len(calls) == int(out.lengths.max())  # one call per decode step
    assert all(ids == sorted(ids) for ids in calls)
    assert calls[0] == list(range(len(out)))


def test_on_tokens_numbers_rows_across_chunks_and_compaction(model, tok):
    params = SamplingParams(n=2, temperature=1.0, seed=2, max_new_tokens=40, stop_token_ids=list(range(100, 140)))
    engine = make_engine("native", model, tok, max_batch_size=3, compact_fraction=0.0)
    out, rows, _ = heard(engine, params)
    assert out.meta["compactions"] >= 1
    assert [rows[r] for r in range(len(out))] == [
        out.response_ids[r, : int(out.lengths[r])].tolist() for r in range(len(out))
    ]
