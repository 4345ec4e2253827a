"""LoRA through peft: only adapters train, adapters save and load, export merges them."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from posttrain import SFTConfig, SFTTrainer
from posttrain.config import ConfigError, LoraConfig, ModelConfig, build_config
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM
from posttrain.models.factory import build_model
from posttrain.models.lora import apply_lora, merged_for_export


def _tiny():
    torch.manual_seed(0)
    return BuiltinLM.from_preset("tiny", vocab_size=262, num_hidden_layers=2)


def test_only_adapters_train_and_all_linear_skips_the_tied_head():
    model = apply_lora(_tiny(), LoraConfig(r=4, target_modules=["all-linear"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed_tokens" in n for n in trainable)
    assert any("gate_proj" in n for n in trainable)


def test_merge_for_export_matches_the_adapted_model_and_loads_in_transformers(tmp_path):
    model = apply_lora(_tiny(), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for n, p in model.named_parameters():  # make the adapter non-trivial (B starts at zero)
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 262, (2, 9))
    merged = merged_for_export(model)
    assert isinstance(merged, BuiltinLM)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), model(ids), atol=1e-5, rtol=1e-5)
        with model.disable_adapter():  # the training model still has its adapter
            assert not torch.allclose(model(ids), merged(ids), atol=1e-4)
    merged.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, merged(ids), atol=1e-4, rtol=1e-4)


def test_sft_with_lora_writes_merged_final_and_adapter(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "completion": f"Answer: {a + b}"} for a in range(8) for b in range(8)]
    cfg = build_config(SFTConfig, None, [
        "model.init=tiny", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]",
        f"trainer.output_dir={tmp_path}", "trainer.max_steps=3", "trainer.learning_rate=1e-2",
        "data.train_batch_size=16", "trainer.micro_batch_size=16", "trainer.report_to=[]", "trainer.progress=false",
    ])
    trainer = SFTTrainer(args=cfg, train_dataset=rows)
    base_before = {k: v.clone() for k, v in trainer.model.get_base_model().state_dict().items() if "lora_" not in k}
    trainer.train()
    base_after = trainer.model.get_base_model().state_dict()
    assert all(torch.equal(v, base_after[k]) for k, v in base_before.items())  # the base stays frozen
    adapter = json.loads((tmp_path / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4
    ids = torch.tensor([[1, 60, 55, 61]])
    final = BuiltinLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        torch.testing.assert_close(final(ids), trainer.model(ids), atol=1e-5, rtol=1e-5)
    # The saved adapter, loaded by peft onto the frozen base in transformers, reproduces the
    # trained model (model.init has no base folder: it is saved here).
    base = BuiltinLM(trainer.model.get_base_model().config)
    base.load_state_dict({k.replace(".base_layer", ""): v for k, v in base_after.items() if "lora_" not in k})
    base.save_pretrained(tmp_path / "base")
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    reloaded = PeftModel.from_pretrained(hf_base, tmp_path / "final" / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trainer.model(ids), atol=1e-5, rtol=1e-5)


def test_qlora_without_cuda_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU error path")
    _tiny().save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path), lora=LoraConfig(r=4, quantize="4bit"))
    with pytest.raises(ConfigError, match="need a CUDA GPU"):
        build_model(cfg, build_tokenizer())
