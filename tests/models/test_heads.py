"""ScalarHeadModel: pooling, padding, copies, HF checkpoint parity both ways, head init, LoRA."""

import json
import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from posttrain.models import BuiltinConfig, BuiltinLM
from posttrain.models.heads import ScalarHeadModel, default_init_std, last_token_index

transformers = pytest.importorskip("transformers")

PAD = 0
IDS = torch.tensor([[5, 17, 3, 60, 42, 8], [2, 9, 44, 1, 12, 51], [7, 7, 30, 11, 4, 19]])
RIGHT = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
LEFT = RIGHT.flip(-1)  # the same lengths, padded on the left


@pytest.fixture
def lm(tiny_kwargs, randomize):
    config = BuiltinConfig(**tiny_kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    return randomize(BuiltinLM(config), seed=3).eval()


@pytest.fixture
def rm(lm):
    torch.manual_seed(0)
    return ScalarHeadModel.from_causal_lm(lm).eval()


def left_padded(ids, mask):
    """Move each row's real tokens to the right end (same tokens, left padding)."""
    out = torch.full_like(ids, PAD)
    for b, n in enumerate(mask.sum(-1).tolist()):
        out[b, ids.shape[1] - n :] = ids[b, :n]
    return out


def test_last_token_index_right_left_and_full_rows():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 0]
    assert last_token_index(mask.bool()).tolist() == [2, 4, 4, 0]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        last_token_index(torch.tensor([[1, 0], [0, 0]]))


def test_scores_are_values_at_the_last_real_token(rm):
    with torch.no_grad():
        values = rm.values(IDS, RIGHT)
        scores = rm.scores(IDS, RIGHT)
        no_mask = rm.scores(IDS)
    assert values.shape == (3, 6) and values.dtype == torch.float32
    assert scores.tolist() == [values[0, 2].item(), values[1, 5].item(), values[2, 4].item()]
    assert no_mask.tolist() == rm.values(IDS)[:, -1].tolist()
    assert torch.equal(rm(IDS, attention_mask=RIGHT), values)  # forward = values (critic)


def test_padding_never_changes_a_score(rm):
    with torch.no_grad():
        alone = [rm.scores(IDS[b : b + 1, :n]).item() for b, n in enumerate(RIGHT.sum(-1).tolist())]
        right = rm.scores(IDS, RIGHT)
        left = rm.scores(left_padded(IDS, RIGHT), LEFT)
    torch.testing.assert_close(right, torch.tensor(alone), atol=1e-5, rtol=0)
    torch.testing.assert_close(left, torch.tensor(alone), atol=1e-5, rtol=0)


def test_from_causal_lm_copies_the_backbone_and_drops_the_lm_head(lm, rm):
    lm_storage = {p.data_ptr() for p in lm.parameters()}
    assert not lm_storage & {p.data_ptr() for p in rm.parameters()}
    assert not any("lm_head" in k for k in rm.state_dict())
    with torch.no_grad():  # the same hidden states as the source LM ...
        torch.testing.assert_close(
            rm.hidden_states(IDS, RIGHT), lm.hidden_states(IDS, RIGHT), atol=0, rtol=0
        )
        before = lm(IDS)
        for p in rm.parameters():  # ... and training the copy leaves the LM alone
            p.add_(1.0)
        assert torch.equal(lm(IDS), before)


def test_head_init_std_and_zero_init(lm):
    assert default_init_std(32) == pytest.approx(1 / math.sqrt(33))  # 0.17408, H = 32
    torch.manual_seed(0)
    wide = ScalarHeadModel.from_causal_lm(BuiltinLM.from_preset("tiny", vocab_size=8))  # H = 192
    assert wide.score.weight.std().item() == pytest.approx(1 / math.sqrt(193), rel=0.15)
    assert wide.score.weight.dtype == torch.float32 and wide.score.bias is None
    critic = ScalarHeadModel.from_causal_lm(lm, init_std=0.0)
    assert torch.count_nonzero(critic.score.weight) == 0
    assert torch.count_nonzero(critic.values(IDS)) == 0


HF_SCRIPT = textwrap.dedent(
    """
    import sys, json, torch
    from transformers import AutoModelForSequenceClassification
    path, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(ids).logits  # no attention_mask: HF finds the last non-pad token itself
    assert "posttrain" not in sys.modules
    print(json.dumps({"class": type(model).__name__, "logits": logits.tolist()}))
    """
)


def test_saved_model_loads_in_plain_transformers_with_the_same_scores(rm, tmp_path):
    rm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert (config["id2label"], config["pad_token_id"]) == ({"0": "LABEL_0"}, PAD)
    padded = IDS.masked_fill(RIGHT == 0, PAD)  # real tokens are never the pad id
    result = subprocess.run(
        [sys.executable, "-c", HF_SCRIPT, str(tmp_path), json.dumps(padded.tolist())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["class"] == "LlamaForSequenceClassification"
    hf = torch.tensor(out["logits"]).squeeze(-1)  # (B, 1) pooled logits -> (B,)
    with torch.no_grad():
        ours = rm.scores(padded, RIGHT)
    assert (hf - ours).abs().max() <= 1e-4


def test_save_and_load_round_trip_is_exact(rm, tmp_path):
    rm.save_pretrained(tmp_path)
    loaded = ScalarHeadModel.from_pretrained(tmp_path)
    assert loaded.is_builtin
    expected = rm.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded.scores(IDS, RIGHT), rm.scores(IDS, RIGHT))


def test_hf_backbone_matches_builtin_and_round_trips(rm, tmp_path):
    rm.save_pretrained(tmp_path / "rm")
    hf = ScalarHeadModel.from_pretrained(tmp_path / "rm", impl="hf")
    assert not hf.is_builtin and type(hf.backbone).__name__ == "LlamaModel"
    assert hf.state_dict().keys() == rm.state_dict().keys()  # the same HF layout
    with torch.no_grad():
        expected = rm.scores(IDS, RIGHT)
        # left padding too: positions come from the mask, not from HF's arange
        torch.testing.assert_close(hf.scores(IDS, RIGHT), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            hf.scores(left_padded(IDS, RIGHT), LEFT), expected, atol=1e-5, rtol=0
        )
    hf.save_pretrained(tmp_path / "hf")  # through LlamaForSequenceClassification.save_pretrained
    again = ScalarHeadModel.from_pretrained(tmp_path / "hf", impl="hf")
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in again.state_dict().items())


def test_from_causal_lm_on_a_hf_model(lm, rm, tmp_path):
    lm.save_pretrained(tmp_path)
    hf_lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    critic = ScalarHeadModel.from_causal_lm(hf_lm)
    assert critic.config.architectures == ["LlamaForSequenceClassification"]
    assert critic.config.num_labels == 1
    assert not {p.data_ptr() for p in hf_lm.parameters()} & {
        p.data_ptr() for p in critic.parameters()
    }
    with torch.no_grad():
        critic.score.weight.copy_(rm.score.weight)
        torch.testing.assert_close(
            critic.values(IDS, RIGHT)[RIGHT.bool()],
            rm.values(IDS, RIGHT)[RIGHT.bool()],
            atol=1e-5,
            rtol=0,
        )


@pytest.mark.parametrize("impl", ["builtin", "hf"])
def test_a_causal_lm_checkpoint_gets_a_fresh_head_with_a_warning(lm, tmp_path, caplog, impl):
    lm.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="posttrain.models.heads"):
        model = ScalarHeadModel.from_pretrained(tmp_path, impl=impl)
    assert f"no score head in {tmp_path}; initialising it" in caplog.text
    assert model.score.weight.shape == (1, 32) and model.score.weight.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(
            model.hidden_states(IDS), lm.hidden_states(IDS), atol=1e-5, rtol=0
        )


def test_save_without_pad_id_writes_eos_and_warns(tiny_kwargs, tmp_path, caplog):
    model = ScalarHeadModel.from_causal_lm(BuiltinLM(BuiltinConfig(**tiny_kwargs, eos_token_id=2)))
    with caplog.at_level(logging.WARNING, logger="posttrain.models.heads"):
        model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == 2
    assert "pad_token_id is unset" in caplog.text


def test_bad_checkpoints_are_named(rm, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ScalarHeadModel.from_pretrained(tmp_path)
    rm.score = torch.nn.Linear(32, 2, bias=False)  # a two-label classifier
    rm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"score.weight has shape \(2, 32\)"):
        ScalarHeadModel.from_pretrained(tmp_path)


def test_lora_trains_only_adapters_and_the_head(rm):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["score"])
    model = peft.get_peft_model(rm.train(), config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "score.modules_to_save" in n for n in trainable)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    chosen, rejected = IDS[:2], IDS[1:]  # Bradley-Terry on two pairs
    losses = []
    for _ in range(10):
        loss = -torch.nn.functional.logsigmoid(model.scores(chosen) - model.scores(rejected)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # it learns the preference, not just "params changed"
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


@pytest.mark.parametrize("impl", ["builtin", "hf"])
def test_a_stored_head_is_required_when_asked(lm, rm, tmp_path, impl):
    """head="stored" (scoring) refuses a causal LM, naming what it is, before loading weights;
    head="fresh" ignores a stored head."""
    from posttrain.models.heads import MissingScoreHead

    lm.save_pretrained(tmp_path / "lm")
    with pytest.raises(MissingScoreHead, match=r"is a causal LM \(LlamaForCausalLM\), not a reward model"):
        ScalarHeadModel.from_pretrained(tmp_path / "lm", impl=impl, head="stored")
    rm.save_pretrained(tmp_path / "rm")
    stored = ScalarHeadModel.from_pretrained(tmp_path / "rm", impl=impl, head="stored")
    assert torch.equal(stored.score.weight, rm.score.weight)
    fresh = ScalarHeadModel.from_pretrained(tmp_path / "rm", impl=impl, head="fresh", init_std=0.0)
    assert not fresh.score.weight.any()
    with pytest.raises(ValueError, match="unknown head"):
        ScalarHeadModel.from_pretrained(tmp_path / "rm", head="random")


def test_a_reward_model_on_an_hf_base_saves_as_that_architecture(tmp_path):
    """A Qwen2 base gives a Qwen2ForSequenceClassification checkpoint (not Llama's), which
    transformers loads with the same score."""
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    torch.manual_seed(0)
    rm = ScalarHeadModel.from_causal_lm(transformers.Qwen2ForCausalLM(config))
    rm.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits[:, 0], rm.scores(ids, torch.ones_like(ids)))
