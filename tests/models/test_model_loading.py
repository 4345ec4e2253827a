"""load_causal_lm chooses built-in or transformers; forward_logits treats both alike."""

import pytest
import torch

from posttrain.models import (
    BuiltinConfig,
    BuiltinLM,
    forward_logits,
    load_causal_lm,
    resolve_device,
    resolve_dtype,
)

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[4, 8, 15, 16, 23, 42], [0, 0, 7, 1, 9, 3]])
MASK = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_kwargs, randomize):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_kwargs))
    randomize(model).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(vocab_size=61, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_device_of_is_where_the_parameters_are():
    from posttrain.models.loading import device_of
    from posttrain.workers import forward

    assert device_of(torch.nn.Linear(2, 2)) == torch.device("cpu")
    if torch.cuda.is_available():
        assert device_of(torch.nn.Linear(2, 2).cuda()).type == "cuda"
    assert forward.device_of is device_of  # the roles' import: one function, not a copy


def test_resolve_device_and_dtype():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cpu", trained=True) == torch.float32
    assert resolve_dtype("bfloat16", "cpu", trained=True) == torch.bfloat16  # explicit wins
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


def test_auto_picks_builtin_for_llama_and_matches_hf(llama_dir):
    builtin = load_causal_lm(llama_dir, device="cpu", dtype="float32")
    hf = load_causal_lm(llama_dir, impl="hf", device="cpu", dtype="float32")
    assert isinstance(builtin, BuiltinLM) and isinstance(hf, transformers.LlamaForCausalLM)
    with torch.no_grad():
        a, b = forward_logits(builtin, IDS, MASK), forward_logits(hf, IDS, MASK)
    assert a.shape == b.shape == (2, 6, 61)
    real = MASK.bool()
    assert (a[real] - b[real]).abs().max() <= 1e-4


def test_dtype_is_applied(llama_dir):
    assert load_causal_lm(llama_dir, impl="builtin", dtype="bfloat16").dtype == torch.bfloat16
    assert load_causal_lm(llama_dir, impl="hf", dtype="bfloat16").dtype == torch.bfloat16


def test_auto_picks_hf_for_other_architectures(gpt2_dir):
    model = load_causal_lm(gpt2_dir, device="cpu")
    assert isinstance(model, transformers.GPT2LMHeadModel)
    with torch.no_grad():
        assert forward_logits(model, IDS, MASK).shape == (2, 6, 61)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        load_causal_lm(gpt2_dir, impl="builtin")


def test_forward_logits_on_a_peft_wrapped_builtin(tiny_lm):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_lm, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        assert torch.allclose(forward_logits(lora, IDS, MASK), tiny_lm(IDS, MASK), atol=1e-6)


def test_bad_paths_and_impls_are_named(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*has no config.json"):
        load_causal_lm(tmp_path)
    with pytest.raises(ValueError, match="unknown impl 'vllm'"):
        load_causal_lm(llama_dir, impl="vllm")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_dtype_on_cuda_keeps_trained_weights_in_float32():
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert resolve_dtype("auto", "cuda") == half  # run only: bf16
    assert resolve_dtype("auto", "cuda", trained=True) == torch.float32  # master copy


def test_build_model_for_training_keeps_float32_weights_and_warns_on_16_bit(caplog):
    from posttrain.config import ModelConfig
    from posttrain.data.tokenizer import build_tokenizer
    from posttrain.models.factory import build_model

    tok = build_tokenizer()
    model = build_model(ModelConfig(init="tiny", device="cpu"), tok, train=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert "master copy" not in caplog.text
    with caplog.at_level("WARNING", logger="posttrain.models.factory"):
        model = build_model(ModelConfig(init="tiny", device="cpu", dtype="bfloat16"), tok, train=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "model.dtype=bfloat16" in caplog.text and "trainer.precision=bf16" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.models.factory"):
        build_model(ModelConfig(init="tiny", device="cpu", dtype="bfloat16"), tok)  # run, not trained
    assert caplog.text == ""


def test_a_folder_that_is_no_model_says_so_before_any_tokenizer(tmp_path):
    from posttrain.config import ConfigError, ModelConfig
    from posttrain.models.factory import build_model_and_tokenizer

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"model\.path: .*data' has no config\.json .*it holds train\.jsonl"):
        build_model_and_tokenizer(ModelConfig(path=str(data), device="cpu"))


@pytest.mark.parametrize("impl", ["auto", "hf"])
def test_a_reward_model_is_not_loaded_as_a_causal_lm(tmp_path, tiny_kwargs, impl):
    """Seen: GRPO given an RM's final/ as its policy failed with `unexpected ['score.weight']`
    (built-in), and transformers would have loaded it with an LM head it never trained."""
    from posttrain.models.heads import ScalarHeadModel

    rm = ScalarHeadModel.from_causal_lm(BuiltinLM(BuiltinConfig(**tiny_kwargs, pad_token_id=0)))
    rm.save_pretrained(tmp_path / "llama_rm")
    gpt2 = transformers.GPT2Config(vocab_size=61, n_embd=16, n_layer=1, n_head=2, n_positions=32, pad_token_id=0)
    transformers.GPT2ForSequenceClassification(gpt2).save_pretrained(tmp_path / "gpt2_rm")
    for name, arch in (("llama_rm", "LlamaForSequenceClassification"), ("gpt2_rm", "GPT2ForSequenceClassification")):
        with pytest.raises(ValueError, match=rf"is a reward model \({arch}\), not a causal LM"):
            load_causal_lm(tmp_path / name, impl=impl)


def test_disable_dropout_zeroes_modules_and_attention_floats(tiny_kwargs, caplog):
    """GPT-2 keeps its dropout in nn.Dropout modules; Llama passes the float
    `self.attention_dropout` to its attention kernel. Both must be 0 in train mode."""
    import logging

    from posttrain.models.loading import disable_dropout

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=61, n_embd=16, n_layer=2, n_head=2, n_positions=32,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_kwargs, attention_dropout=0.5))
    with caplog.at_level(logging.INFO, logger="posttrain.models.loading"):
        # embd + 2 layers × (attn: attn_dropout, resid_dropout; mlp: dropout); llama: 2 attentions
        assert disable_dropout(gpt2, "policy") == 7
        assert disable_dropout(llama) == 2
    assert "policy: dropout off in 7 modules" in caplog.text
    assert all(m.p == 0 for m in gpt2.modules() if isinstance(m, torch.nn.Dropout))
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in llama.model.layers)
    assert gpt2.config.resid_pdrop == 0.1  # a saved checkpoint keeps its settings
    for model in (gpt2.train(), llama.train()):
        assert torch.equal(forward_logits(model, IDS[:, :5]), forward_logits(model, IDS[:, :5]))
    assert disable_dropout(gpt2) == 0  # nothing left to switch off
