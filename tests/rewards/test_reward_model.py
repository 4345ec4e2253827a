"""reward_model: a saved reward model as a TRL-signature reward function."""

import pytest
import torch

from posttrain.data.collate import tokenize_example
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM
from posttrain.models.heads import ScalarHeadModel
from posttrain.rewards.registry import resolve_reward
from posttrain.rewards.reward_model import encode_for_reward, reward_model

PROMPTS = ["2+3=", "What is 7*6? ", "hi", "Name a colour.", ""]
COMPLETIONS = ["5", "42, since 7*6 = 42.", "hello there, how are you?", "blue", "x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def saved_rm(tmp_path_factory, tokenizer):
    """A tiny reward model (built-in backbone, random weights) and its tokenizer in one folder."""
    torch.manual_seed(0)
    lm = BuiltinLM.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("rm")
    rm = ScalarHeadModel.from_causal_lm(lm, init_std=1.0).eval()  # scores spread out
    rm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, rm


def direct_scores(rm, rows):
    """Each row scored alone, unpadded: the reference."""
    with torch.no_grad():
        return [rm.scores(torch.tensor([ids])).item() for ids in rows]


def test_encoding_is_the_training_collators(tokenizer):
    ids = encode_for_reward(tokenizer, "2+3=", "5")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert ids == [bos, 6 + ord("2"), 6 + ord("+"), 6 + ord("3"), 6 + ord("="), 6 + ord("5"), eos]
    for prompt, completion in [("2+3=", "5"), (CHAT, [{"role": "assistant", "content": "5"}])]:
        row = {"prompt": prompt, "completion": completion}
        expected = tokenize_example(row, tokenizer, "prompt_completion", completion_only_loss=False)
        assert encode_for_reward(tokenizer, prompt, completion) == expected["input_ids"]


def test_batch_scores_equal_direct_scores(saved_rm, tokenizer):
    path, rm = saved_rm
    fn = reward_model(path, device="cpu", dtype="float32")
    assert fn.model is None  # nothing loads before the first call
    got = fn(PROMPTS, COMPLETIONS, completion_ids=[[0]] * 5)
    rows = [encode_for_reward(tokenizer, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert len({len(r) for r in rows}) == 5  # lengths differ: batches are padded
    assert got == pytest.approx(direct_scores(rm, rows), abs=1e-5)
    assert len(set(got)) == 5 and all(isinstance(s, float) for s in got)
    model = fn.model
    fn(PROMPTS[:1], COMPLETIONS[:1], None)
    assert fn.model is model  # loaded once


def test_batch_size_does_not_change_scores(saved_rm):
    path, _ = saved_rm
    small = reward_model(path, batch_size=2, device="cpu", dtype="float32")
    large = reward_model(path, batch_size=32, device="cpu", dtype="float32")
    assert small(PROMPTS, COMPLETIONS, None) == pytest.approx(
        large(PROMPTS, COMPLETIONS, None), abs=1e-5
    )


def test_conversational_prompt_uses_the_chat_template(saved_rm, tokenizer):
    path, rm = saved_rm
    fn = reward_model(path, device="cpu", dtype="float32")
    as_text = fn([CHAT, CHAT], ["5", "seven"], None)
    as_messages = fn([CHAT], [[{"role": "assistant", "content": "5"}]], None)
    ids = tokenizer.apply_chat_template(
        CHAT + [{"role": "assistant", "content": "5"}], tokenize=True, return_dict=True
    )["input_ids"]
    assert tokenizer.decode(ids).endswith("<|user|>2+3?<|eos|><|assistant|>5<|eos|>")
    assert as_text[0] == pytest.approx(direct_scores(rm, [ids])[0], abs=1e-5)
    assert as_messages[0] == pytest.approx(as_text[0], abs=1e-6)
    assert as_text[1] != pytest.approx(as_text[0])


def test_template_overrides_the_chat_template(saved_rm):
    path, _ = saved_rm
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fn = reward_model(path, device="cpu", dtype="float32", template=plain)
    fn.load()
    assert (
        fn.tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)
        == "ab"
    )


def test_max_length_keeps_the_first_tokens_and_counts_them(saved_rm, tokenizer):
    path, rm = saved_rm
    fn = reward_model(path, device="cpu", dtype="float32", max_length=6)
    got = fn(PROMPTS, COMPLETIONS, None)
    rows = [encode_for_reward(tokenizer, p, c)[:6] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert got == pytest.approx(direct_scores(rm, rows), abs=1e-5)
    assert fn.pop_metrics() == {"truncated": 4.0}  # all but "" + "x" (BOS, x, EOS)
    assert fn.pop_metrics() == {"truncated": 0.0}


def test_resolves_as_a_factory_through_the_registry(saved_rm):
    path, _ = saved_rm
    name, fn = resolve_reward(
        {"name": "posttrain.rewards.reward_model:reward_model", "path": str(path), "device": "cpu"}
    )
    assert name == "reward_model" and fn.__name__ == "reward_model"
    assert len(fn(["a"], ["b"], None)) == 1


def test_errors_name_the_path(tmp_path, saved_rm):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        reward_model(tmp_path / "nowhere")
    path, rm = saved_rm
    no_tokenizer = tmp_path / "weights_only"
    rm.save_pretrained(no_tokenizer)
    fn = reward_model(no_tokenizer, device="cpu")
    with pytest.raises(ValueError, match=f"cannot load a tokenizer from {no_tokenizer}"):
        fn(["a"], ["b"], None)
    with pytest.raises(TypeError, match="string prompt needs a string completion"):
        reward_model(path, device="cpu")(["a"], [[{"role": "assistant", "content": "b"}]], None)


def test_a_causal_lm_is_not_a_reward_model(tmp_path, tokenizer):
    """Seen: reward.model_path at an SFT run's final/ scored every response with a freshly
    initialised (random) head; only the warning of RM training said anything."""
    import transformers

    torch.manual_seed(0)
    BuiltinLM.from_preset("tiny", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2).save_pretrained(tmp_path / "sft")
    gpt2 = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    for name, arch in (("sft", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")):
        with pytest.raises(ValueError, match=rf"{tmp_path / name} is a causal LM \({arch}\), not a reward "
                                             r"model: .*Train one with `posttrain rm` or point reward.model_path"):
            reward_model(tmp_path / name, device="cpu")


def test_dropout_is_off_in_the_reward_model_even_in_train_mode(tmp_path, tokenizer):
    import transformers

    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                     pad_token_id=tokenizer.pad_token_id, num_labels=1, resid_pdrop=0.5,
                                     embd_pdrop=0.5)
    transformers.GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    fn = reward_model(tmp_path, device="cpu", dtype="float32").load()
    fn.model.train()
    assert fn(PROMPTS, COMPLETIONS) == fn(PROMPTS, COMPLETIONS)
