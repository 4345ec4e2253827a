"""A user's own model, brought as a TRL user brings it: a transformers module or folder with
its own tokenizer, LoRA from `model.lora` or TRL's `peft_config`, and the adapter a run saves
loaded back by peft.

The model: a tiny Llama (vocab 11, one layer) with a word-level tokenizer, saved in a folder.
"""

import json
import logging

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    RewardTrainer,
    RMConfig,
    SFTConfig,
    SFTTrainer,
)
from posttrain.checkpoint import save_tokenizer
from posttrain.config import ConfigError, LoraConfig, build_config
from posttrain.models.lora import is_peft, lora_from_peft

from .words import WORDS, word_tokenizer

ROWS = [{"prompt": " ".join(WORDS[(i + k) % 8] for k in range(3)), "completion": WORDS[i % 8]} for i in range(8)]
PAIRS = [{"prompt": "a b", "chosen": "c", "rejected": "d"}, {"prompt": "e f", "chosen": "g", "rejected": "h"}]


def llama_config():
    return LlamaConfig(vocab_size=11, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       initializer_range=0.2)  # O(1) logits: a wrong or missing adapter cannot hide below 1e-5


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    """The folder of the user's model: a random tiny Llama and its word-level tokenizer."""
    path = tmp_path_factory.mktemp("user_model")
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def sft_config(run_dir, *overrides):
    return build_config(SFTConfig, None, [
        f"trainer.output_dir={run_dir}", "trainer.max_steps=2", "trainer.learning_rate=1e-2",
        "data.train_batch_size=4", "trainer.micro_batch_size=4", "trainer.report_to=[]", "trainer.progress=false",
        *overrides,
    ])


def grpo_config(run_dir, *overrides):
    return build_config(GRPOConfig, None, [
        f"trainer.output_dir={run_dir}", "trainer.max_steps=1", "rollout.n=2", "rollout.max_new_tokens=2",
        "data.train_batch_size=2", "actor.micro_batch_size=4", "trainer.report_to=[]", "trainer.progress=false",
        *overrides,
    ])


def first_word_is_a(prompts, completions, completion_ids, **columns):
    return [float(bool(ids) and ids[0] == 3) for ids in completion_ids]


def loaded(path):
    return LlamaForCausalLM.from_pretrained(str(path), local_files_only=True)


# --- item 1: the tokenizer ---------------------------------------------------------------


def preference_trainer(cls, config_cls, model, run_dir, **kwargs):
    args = build_config(config_cls, None, [f"trainer.output_dir={run_dir}", "trainer.report_to=[]",
                                           "data.train_batch_size=2", "trainer.micro_batch_size=2"])
    return cls(model, args=args, train_dataset=PAIRS, **kwargs)


TRAINERS = {
    "sft": lambda model, run: SFTTrainer(model, args=sft_config(run), train_dataset=ROWS),
    "grpo": lambda model, run: GRPOTrainer(model, reward_funcs=[first_word_is_a], args=grpo_config(run),
                                           train_dataset=ROWS),
    "dpo": lambda model, run: preference_trainer(DPOTrainer, DPOConfig, model, run),
    "rm": lambda model, run: preference_trainer(RewardTrainer, RMConfig, model, run),
}


@pytest.mark.parametrize("command", list(TRAINERS))
def test_a_module_without_processing_class_trains_with_the_tokenizer_of_its_folder(user_model, tmp_path, command):
    trainer = TRAINERS[command](loaded(user_model), tmp_path)
    assert trainer.tokenizer.get_vocab() == word_tokenizer().get_vocab()  # 11 words, not 262 bytes
    if command == "sft":
        assert trainer.train_examples[0]["input_ids"][:4] == [1, 3, 4, 5]  # <bos> a b c


def test_a_module_built_in_memory_without_processing_class_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"processing_class: .*LlamaForCausalLM built in memory.*Pass its tokenizer"):
        SFTTrainer(LlamaForCausalLM(llama_config()), args=sft_config(tmp_path), train_dataset=ROWS)


def test_a_module_whose_folder_has_no_tokenizer_is_refused(tmp_path):
    LlamaForCausalLM(llama_config()).save_pretrained(tmp_path / "weights_only")
    with pytest.raises(ConfigError, match=r"processing_class: the model passed in was loaded from .*weights_only, "
                                          r"but .*weights_only holds no tokenizer"):
        SFTTrainer(loaded(tmp_path / "weights_only"), args=sft_config(tmp_path / "run"), train_dataset=ROWS)


def test_saved_tokenizer_configs_hold_no_loading_arguments(user_model, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(AutoTokenizer.from_pretrained(str(user_model), local_files_only=True), tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "local_files_only" not in config and "is_local" not in config
    assert config["eos_token"] == "<eos>"


# --- item 2: LoRA on a module passed in ----------------------------------------------------


def lora_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def test_lora_on_a_module_passed_to_sft_trains_only_adapters_and_saves_one(user_model, tmp_path, caplog):
    args = sft_config(tmp_path, "model.lora.r=2", "model.lora.target_modules=[q_proj,v_proj]")
    trainer = SFTTrainer(loaded(user_model), args=args, train_dataset=ROWS)
    assert is_peft(trainer.model)
    names = lora_names(trainer.model)
    assert len(names) == 4 and all("lora_" in n for n in names)  # A and B of q_proj and v_proj, one layer
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert trained == (2 * 32 + 32 * 2) + (2 * 32 + 16 * 2)  # A (r, in) + B (out, r); q: 32->32, v: 32->16
    frozen = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    with caplog.at_level(logging.INFO, logger="posttrain.trainers.sft"):
        trainer.train()
    assert f"({trained:,} trained)" in caplog.text  # the SFT log line counts the adapters
    after = trainer.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in frozen.items())
    params = dict(trainer.model.named_parameters())
    assert all(params[n].abs().sum() > 0 for n in names if "lora_B" in n)  # B starts at 0: the adapters trained
    assert (tmp_path / "final" / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_on_a_module_passed_to_grpo_trains_only_adapters_and_saves_one(user_model, tmp_path):
    trainer = GRPOTrainer(loaded(user_model), reward_funcs=[first_word_is_a],
                          args=grpo_config(tmp_path, "model.lora.r=2", "model.lora.target_modules=[q_proj]"),
                          train_dataset=ROWS)
    assert is_peft(trainer.model)
    assert len(lora_names(trainer.model)) == 2 and all("lora_" in n for n in lora_names(trainer.model))
    frozen = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    trainer.train()
    after = trainer.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in frozen.items())
    assert (tmp_path / "final" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_peft_model_with_model_lora_too_is_refused(user_model, tmp_path):
    wrapped = peft.get_peft_model(loaded(user_model), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="already has peft adapters"):
        SFTTrainer(wrapped, args=sft_config(tmp_path, "model.lora.r=4"), train_dataset=ROWS)


# --- item 4: the saved adapter loads in peft -----------------------------------------------


@pytest.mark.parametrize("given", ["model.path", "module by a relative path"])
def test_a_runs_adapters_load_in_peft_with_the_trained_logits(user_model, tmp_path, monkeypatch, caplog, given):
    """model.path of a Llama runs the built-in implementation (peft would record BuiltinLM as
    the base class); a module loaded from a relative path would leave that path as the base."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # peft looks for a tokenizer on the Hub otherwise
    lora = ["model.lora.r=2", "model.lora.alpha=8", "trainer.save_steps=2"]
    if given == "model.path":
        trainer = SFTTrainer(str(user_model), args=sft_config(tmp_path / "run", *lora), train_dataset=ROWS)
    else:
        monkeypatch.chdir(user_model.parent)
        trainer = SFTTrainer(loaded(user_model.name), args=sft_config(tmp_path / "run", *lora), train_dataset=ROWS)
    with caplog.at_level(logging.INFO, logger="posttrain.trainers.sft"):
        trainer.train()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert f"({trained:,} trained)" in caplog.text  # the SFT log line counts the adapters, not only the total
    ids = torch.tensor([[1, 3, 4, 5, 6]])
    with torch.no_grad():
        out = trainer.model(ids)
        expected = out if torch.is_tensor(out) else out.logits
        with trainer.model.disable_adapter():
            out = trainer.model(ids)
            assert (expected - (out if torch.is_tensor(out) else out.logits)).abs().max() > 1e-3  # the adapter acts
        for folder in ("final/adapter", "checkpoints/step-2"):
            adapter = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "run" / folder))
            torch.testing.assert_close(adapter(ids).logits, expected, atol=1e-5, rtol=1e-5)
    config = json.loads((tmp_path / "run" / "final" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(user_model.resolve())
    tokenizer_config = json.loads((tmp_path / "run" / "final" / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tokenizer_config and "is_local" not in tokenizer_config


# --- item 11: TRL's peft_config ------------------------------------------------------------


def test_peft_config_maps_onto_model_lora():
    given = peft.LoraConfig(r=4, lora_alpha=32, lora_dropout=0.05, target_modules=["v_proj", "q_proj"],
                            task_type="CAUSAL_LM")
    assert lora_from_peft(given, LoraConfig(), "llama") == LoraConfig(
        r=4, alpha=32.0, dropout=0.05, target_modules=["q_proj", "v_proj"])
    # target_modules None: peft's default for the model type; "all-linear" passes through.
    assert lora_from_peft(peft.LoraConfig(r=2), LoraConfig(), "qwen2").target_modules == ["q_proj", "v_proj"]
    assert lora_from_peft(peft.LoraConfig(target_modules="all-linear"), LoraConfig(), "llama").target_modules == [
        "all-linear"]
    assert lora_from_peft(peft.LoraConfig(r=2, modules_to_save=["score"], task_type="SEQ_CLS"), LoraConfig(),
                          "llama", classifier=True).r == 2


@pytest.mark.parametrize("given, match", [
    (peft.LoraConfig(r=2, use_dora=True), "peft_config: use_dora is not supported"),
    (peft.LoraConfig(r=2, bias="all", use_rslora=True), "peft_config: bias, use_rslora are not supported"),
    (peft.LoraConfig(r=2, task_type="SEQ_CLS"), "peft_config.task_type='SEQ_CLS'"),
    (peft.LoraConfig(r=2, modules_to_save=["lm_head"]), r"peft_config.modules_to_save=\['lm_head'\]"),
    (peft.LoraConfig(r=2, target_modules=r".*q_proj"), "a regex is not supported"),
    (peft.IA3Config(), "only a peft.LoraConfig is supported, got IA3Config"),
])
def test_peft_config_fields_that_cannot_be_honoured_are_refused(given, match):
    with pytest.raises(ConfigError, match=match):
        lora_from_peft(given, LoraConfig(), "llama")


def test_trainers_take_peft_config(user_model, tmp_path):
    given = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(str(user_model), args=sft_config(tmp_path), train_dataset=ROWS, peft_config=given)
    assert trainer.args.model.lora == LoraConfig(r=2, alpha=4.0, target_modules=["q_proj"])  # config.yaml shows it
    assert len(lora_names(trainer.model)) == 2
    # A reward model takes TRL's sequence-classification config; its score head trains in full.
    rm_config = peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS", modules_to_save=["score"])
    rm = preference_trainer(RewardTrainer, RMConfig, str(user_model), tmp_path / "rm", peft_config=rm_config)
    names = lora_names(rm.model)  # q_proj's A and B, and the score head
    assert len(names) == 3 and sum("q_proj.lora_" in n for n in names) == 2
    assert any("score.modules_to_save" in n for n in names)
    with pytest.raises(ConfigError, match="model.lora.r: is 4 and peft_config is given too"):
        SFTTrainer(str(user_model), args=sft_config(tmp_path, "model.lora.r=4"), train_dataset=ROWS,
                   peft_config=given)
