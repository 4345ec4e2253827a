"""Acceptance: Qwen2, Qwen3 and Mistral checkpoints are BuiltinLM checkpoints, both ways, with
transformers' logits (as test_llama_parity.py for Llama), and decode the same with a KV cache.

Tiny configs built here (no downloads): Qwen2 has a bias on q/k/v; Qwen3 RMS-normalises each
query and key head before RoPE, with a head_dim (12) that is not hidden / heads (32 / 4 = 8).
fp32 logits agree to 1e-4 (observed: 0 unpadded, ~4e-6 left-padded).
"""

import json

import pytest
import torch

from posttrain.models import BuiltinConfig, BuiltinLM, load_causal_lm
from posttrain.models.heads import ScalarHeadModel

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
IDS = torch.tensor([[5, 17, 3, 60, 42, 8, 8, 1, 33], [2, 9, 44, 0, 12, 51, 7, 29, 18]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])  # row 0 left-padded
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]] * 2)  # three documents per row
FAMILIES = {  # model_type: (transformers config class name, extra config fields)
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 12}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
}
CASES = [(family, tied) for family in FAMILIES for tied in (True, False)]


def hf_model(tiny_kwargs, randomize, family: str, tied: bool, seed: int = 3):
    """A randomized tiny transformers model of `family` (O(1) logits, biases included)."""
    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        **tiny_kwargs, max_position_embeddings=64, tie_word_embeddings=tied, **extra
    )
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), seed).eval()


def assert_same_logits(hf, model):
    """Plain, left-padded (real positions) and packed (position_ids restart) logits agree."""
    with torch.no_grad():
        pairs = [
            (hf(IDS).logits, model(IDS)),
            (hf(IDS, attention_mask=MASK).logits[MASK.bool()], model(IDS, attention_mask=MASK)[MASK.bool()]),
            (hf(IDS, position_ids=PACKED, use_cache=False).logits, model(IDS, position_ids=PACKED)),
        ]
    for expected, got in pairs:
        assert (expected - got).abs().max() <= ATOL


@pytest.mark.parametrize("family,tied", CASES)
def test_transformers_checkpoint_loads_into_builtin_with_same_logits(tmp_path, tiny_kwargs, randomize, family, tied):
    hf = hf_model(tiny_kwargs, randomize, family, tied)
    hf.save_pretrained(tmp_path)
    model = load_causal_lm(tmp_path, device="cpu", dtype="float32")  # impl=auto picks the built-in model
    assert isinstance(model, BuiltinLM) and model.config.model_type == family
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert set(model.state_dict()) == set(hf.state_dict())
    assert_same_logits(hf, model)


@pytest.mark.parametrize("family,tied", CASES)
def test_builtin_saves_a_checkpoint_transformers_loads_with_same_logits(tmp_path, tiny_kwargs, randomize, family, tied):
    extra = {"head_dim": 12} if family == "qwen3" else {}
    config = BuiltinConfig(**tiny_kwargs, model_type=family, tie_word_embeddings=tied, **extra)
    model = randomize(BuiltinLM(config), 5).eval()
    model.save_pretrained(tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    assert not any(info.values()), info
    assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "mistral": "MistralForCausalLM"}[family]
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tied
    assert_same_logits(hf.eval(), model)
    again = BuiltinLM.from_pretrained(tmp_path)  # and back: the same tensors
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_qwen_layers_have_their_family_parameters(tiny_kwargs):
    qwen2 = BuiltinLM(BuiltinConfig(**tiny_kwargs, model_type="qwen2")).model.layers[0].self_attn
    assert qwen2.q_proj.bias is not None and qwen2.v_proj.bias is not None and qwen2.o_proj.bias is None
    assert not qwen2.q_proj.bias.any()  # zeros at init, as transformers
    qwen3 = BuiltinLM(BuiltinConfig(**tiny_kwargs, model_type="qwen3", head_dim=12)).model.layers[0].self_attn
    assert qwen3.q_proj.bias is None and qwen3.q_norm.weight.shape == qwen3.k_norm.weight.shape == (12,)
    assert qwen3.q_proj.weight.shape == (4 * 12, 32) and qwen3.o_proj.weight.shape == (32, 4 * 12)
    with pytest.raises(ValueError, match="model_type='gemma'"):
        BuiltinConfig(**tiny_kwargs, model_type="gemma")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_kv_cache_decoding_equals_the_full_forward(tiny_kwargs, randomize, family):
    extra = {"head_dim": 12} if family == "qwen3" else {}
    model = randomize(BuiltinLM(BuiltinConfig(**tiny_kwargs, model_type=family, **extra)), 1).eval()
    with torch.no_grad():
        full = model(IDS, attention_mask=MASK)
        cache = model.new_cache(2, 9)
        steps = [model(IDS[:, :4], attention_mask=MASK[:, :4], cache=cache)]
        for t in range(4, 9):
            steps.append(model(IDS[:, t : t + 1], attention_mask=MASK[:, : t + 1], cache=cache))
    got = torch.cat(steps, dim=1)
    assert (got - full)[MASK.bool()].abs().max() <= 1e-5


def test_reward_model_of_a_qwen3_backbone_saves_as_qwen3(tmp_path, tiny_kwargs, randomize):
    lm = BuiltinLM(BuiltinConfig(**tiny_kwargs, model_type="qwen3", head_dim=12, pad_token_id=0))
    rm = ScalarHeadModel.from_causal_lm(randomize(lm, 2))
    rm.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForSequenceClassification"]
    again = ScalarHeadModel.from_pretrained(tmp_path, head="stored")
    assert again.is_builtin and torch.equal(again.scores(IDS, MASK), rm.scores(IDS, MASK))


@pytest.mark.parametrize(
    "family,change,message",
    [
        ("mistral", {"sliding_window": 16}, "sliding_window=16 < max_position_embeddings=64"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                   "layer_types": None}, "sliding_window=16"),
        ("qwen3", {"attention_bias": True}, "attention_bias=true"),
        ("qwen2", {"model_type": "gemma"}, "model_type='gemma'"),
    ],
)
def test_what_builtin_lacks_is_refused_by_name_and_auto_falls_back_to_hf(tmp_path, tiny_kwargs, family, change,
                                                                          message):
    BuiltinLM(BuiltinConfig(**tiny_kwargs, model_type=family, max_position_embeddings=64)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        BuiltinLM.from_pretrained(tmp_path)
    if change.get("model_type") is None and "attention_bias" not in change:  # the weights still fit transformers
        assert not isinstance(load_causal_lm(tmp_path, device="cpu"), BuiltinLM)


def test_a_window_no_shorter_than_the_context_is_no_window(tmp_path, tiny_kwargs):
    """Mistral with sliding_window >= max_position_embeddings never slides within its context."""
    BuiltinLM(BuiltinConfig(**tiny_kwargs, model_type="mistral", max_position_embeddings=64)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    assert isinstance(load_causal_lm(tmp_path, device="cpu"), BuiltinLM)
