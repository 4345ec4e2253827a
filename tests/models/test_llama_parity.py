"""Acceptance: BuiltinLM checkpoints are Llama checkpoints, both ways, with the same logits.

(a) BuiltinLM.save_pretrained -> plain transformers in a fresh process that never
imports posttrain; (b) transformers LlamaForCausalLM.save_pretrained -> BuiltinLM.
fp32 logits must agree to 1e-4 (observed: about 1e-6).
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from posttrain.models import BuiltinConfig, BuiltinLM

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
IDS = torch.tensor([[5, 17, 3, 60, 42, 8, 8, 1, 33], [2, 9, 44, 0, 12, 51, 7, 29, 18]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])  # row 0 left-padded
LLAMA3 = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=4
)

HF_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    spec = torch.load(sys.argv[1])
    out = {}
    for name, path in spec["dirs"].items():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True, output_loading_info=True)
        assert not any(info.values()), (name, info)
        with torch.no_grad():
            out[name] = {
                "class": type(model).__name__,
                "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
                "plain": model(spec["ids"]).logits,
                "padded": model(spec["ids"], attention_mask=spec["mask"]).logits,
            }
    assert "posttrain" not in sys.modules
    torch.save(out, sys.argv[2])
    """
)

BUILTIN_CASES = {
    "tied_mha": dict(num_key_value_heads=4),
    "untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa": dict(num_key_value_heads=2),
    "gqa_llama3_head_dim": dict(
        num_key_value_heads=1,
        head_dim=12,
        rope_theta=500000.0,
        rope_scaling=LLAMA3,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module")
def builtin_saved(tmp_path_factory, tiny_kwargs, randomize):
    """Save each BUILTIN_CASES model, load all of them in one plain-transformers process."""
    root = tmp_path_factory.mktemp("builtin_to_hf")
    models, dirs = {}, {}
    for seed, (name, overrides) in enumerate(BUILTIN_CASES.items()):
        config = BuiltinConfig(**{**tiny_kwargs, **overrides, "bos_token_id": 1, "eos_token_id": 2})
        models[name] = randomize(BuiltinLM(config), seed).eval()
        dirs[name] = str(root / name)
        models[name].save_pretrained(dirs[name])
    torch.save({"dirs": dirs, "ids": IDS, "mask": MASK}, root / "spec.pt")
    result = subprocess.run(
        [sys.executable, "-c", HF_SCRIPT, str(root / "spec.pt"), str(root / "out.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return models, dirs, torch.load(root / "out.pt")


@pytest.mark.parametrize("name", list(BUILTIN_CASES))
def test_saved_builtin_loads_in_plain_transformers_with_same_logits(builtin_saved, name):
    models, _, hf = builtin_saved
    model, out = models[name], hf[name]
    assert out["class"] == "LlamaForCausalLM"
    assert out["tied"] == model.config.tie_word_embeddings
    with torch.no_grad():
        plain, padded = model(IDS), model(IDS, attention_mask=MASK)
    assert (plain - out["plain"]).abs().max() <= ATOL
    real = MASK.bool()  # HF's outputs at padded positions are unspecified
    assert (padded[real] - out["padded"][real]).abs().max() <= ATOL


def test_tied_checkpoint_stores_the_embedding_once(builtin_saved):
    _, dirs, _ = builtin_saved
    with safe_open(f"{dirs['tied_mha']}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    with safe_open(f"{dirs['untied']}/model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()
    config = json.loads(open(f"{dirs['gqa_llama3_head_dim']}/config.json").read())
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
    assert (config["model_type"], config["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (config["head_dim"], config["num_key_value_heads"], config["dtype"]) == (
        12,
        1,
        "float32",
    )


@pytest.fixture(scope="session")
def hf_llama(tiny_kwargs, randomize):
    """hf_llama(seed, **LlamaConfig overrides) -> a randomized tiny LlamaForCausalLM."""

    def build(seed: int, **overrides):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            **{**tiny_kwargs, "max_position_embeddings": 64, **overrides}
        )
        return randomize(transformers.LlamaForCausalLM(config), seed).eval()

    return build


HF_CASES = {
    "tied_gqa": dict(tie_word_embeddings=True),
    "untied_mha": dict(num_key_value_heads=4, rms_norm_eps=1e-5),
    "llama3_head_dim": dict(
        head_dim=16, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}
    ),
}


def assert_same_logits(hf_model, model):
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]] * 2)  # packed documents
    with torch.no_grad():
        pairs = [
            (hf_model(IDS).logits, model(IDS)),
            (
                hf_model(IDS, attention_mask=MASK).logits[MASK.bool()],
                model(IDS, attention_mask=MASK)[MASK.bool()],
            ),
            # transformers detects packing only without its generation cache
            (
                hf_model(IDS, position_ids=position_ids, use_cache=False).logits,
                model(IDS, position_ids=position_ids),
            ),
        ]
    for expected, got in pairs:
        assert (expected - got).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(HF_CASES))
def test_transformers_llama_loads_into_builtin_with_same_logits(tmp_path, hf_llama, name):
    hf_model = hf_llama(3, **HF_CASES[name])
    hf_model.save_pretrained(tmp_path)
    model = BuiltinLM.from_pretrained(tmp_path)
    assert model.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert (
        model.lm_head.weight is model.model.embed_tokens.weight
    ) == model.config.tie_word_embeddings
    assert all(p.requires_grad for p in model.parameters())
    assert_same_logits(hf_model, model)


def test_module_and_parameter_names_are_hf_llama_names(tiny_lm, hf_llama):
    hf_model = hf_llama(0, tie_word_embeddings=True)
    assert set(tiny_lm.state_dict()) == set(hf_model.state_dict())
    linear = {n for n, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linear == {n for n, m in tiny_lm.named_modules() if isinstance(m, torch.nn.Linear)}


def test_sharded_bin_and_old_style_configs_load(tmp_path, hf_llama):
    hf_model = hf_llama(4, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3})
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same_logits(hf_model, BuiltinLM.from_pretrained(tmp_path / "sharded"))

    old = tmp_path / "old"
    old.mkdir()
    torch.save(hf_model.state_dict(), old / "pytorch_model.bin")
    config = json.loads((tmp_path / "sharded" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}  # transformers 4 layout
    (old / "config.json").write_text(json.dumps(config))
    assert_same_logits(hf_model, BuiltinLM.from_pretrained(old))


def test_dtype_on_load(tmp_path, tiny_lm):
    tiny_lm.to(torch.bfloat16).save_pretrained(tmp_path)
    assert BuiltinLM.from_pretrained(tmp_path).dtype == torch.bfloat16
    model = BuiltinLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.dtype == torch.float32 and model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters.rope_type='linear'",
        ),
        ({"model_type": "gemma"}, "model_type='gemma'"),
    ],
)
def test_unsupported_llama_features_are_named(tmp_path, tiny_lm, change, message):
    tiny_lm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        BuiltinLM.from_pretrained(tmp_path)
