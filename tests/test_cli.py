"""The command line: help texts, `data make`, and errors that exit cleanly."""

import json

import pytest

from posttrain.cli import main


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("sft", "data"):
        assert cmd in out


def test_command_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert "trainer.learning_rate (float, default 0.0001)" in out
    assert "Peak learning rate" in out
    assert "model.lora.r (int, default 0)" in out


def test_data_make_writes_deterministic_jsonl(tmp_path, capsys):
    assert main(["data", "make", "arithmetic", "--out", str(tmp_path / "a"), "--n-train", "50", "--n-test", "10", "digits=1"]) == 0
    assert main(["data", "make", "arithmetic", "--out", str(tmp_path / "b"), "--n-train", "50", "--n-test", "10", "digits=1"]) == 0
    a = (tmp_path / "a" / "train.jsonl").read_bytes()
    assert a == (tmp_path / "b" / "train.jsonl").read_bytes()
    rows = [json.loads(line) for line in a.decode().splitlines()]
    assert len(rows) == 50 and {"prompt", "answer", "completion"} <= rows[0].keys()
    assert "wrote 50 train and 10 test rows" in capsys.readouterr().out


def test_unknown_task_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["data", "make", "arithmetc", "--out", str(tmp_path)]) == 1
    assert "arithmetic" in capsys.readouterr().err


def test_print_config_resolves_preset_and_overrides(capsys):
    assert main(["sft", "--config", "recipes/sft_arithmetic.yaml", "trainer.max_steps=7", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "init: tiny" in out


def test_generate_on_a_lora_adapter_points_to_export_merge_lora(tmp_path, capsys):
    adapter = tmp_path / "lora" / "final"  # what a model.lora.r > 0 run saves: the adapter alone
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "base_model_name_or_path": None}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    assert main(["generate", str(adapter), "1+1=", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "is a LoRA adapter" in err and f"posttrain export {adapter} --merge-lora --out" in err
    assert "Traceback" not in err


def test_generate_on_a_device_that_is_not_there_is_a_config_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "1+1=", "--device", "gpu"]) == 2
    assert "--device: 'gpu' is not a device" in capsys.readouterr().err


def test_a_run_that_stops_itself_is_one_line_and_exit_1(tmp_path, capsys):
    main(["data", "make", "arithmetic", "--out", str(tmp_path / "d"), "--n-train", "40", "--n-test", "4"])
    capsys.readouterr()
    # An absurd learning rate: the first update overflows the weights, later losses are NaN.
    code = main(["sft", "model.init=tiny", f"data.train_files=[{tmp_path / 'd' / 'train.jsonl'}]",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.max_steps=6", "trainer.learning_rate=1e30",
                 "trainer.warmup_steps=0", "trainer.max_grad_norm=0", "trainer.max_bad_steps=2",
                 "trainer.report_to=[]", "trainer.progress=false", "data.train_batch_size=4",
                 "trainer.micro_batch_size=4"])
    err = capsys.readouterr().err
    assert code == 1
    assert "posttrain sft: stopped: the loss or gradient norm was NaN/inf for 2 consecutive steps" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_rl_under_torchrun_is_refused_on_every_rank_before_its_run_folder(tmp_path, capsys, monkeypatch, command):
    """Two torchrun processes of `posttrain grpo` would be two runs over one folder (rank 1
    "resumed" rank 0's checkpoint): each rank refuses, pointing to Ray, and writes nothing.
    The Python API refuses the same way."""
    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.config import ConfigError, build_config

    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    run = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert main([command, "model.init=tiny", f"data.train_files=[{data}]", f"trainer.output_dir={run}",
                     "reward.functions=[math_accuracy]", "trainer.report_to=[]", "trainer.max_steps=1",
                     "data.train_batch_size=1", "rollout.n=2", "actor.micro_batch_size=2", "rollout.max_new_tokens=2"]) == 2
        err = capsys.readouterr().err
        assert f"posttrain {command}: config error: posttrain {command} runs in one process, but this is " \
               f"rank {rank} of WORLD_SIZE=2 (torchrun)" in err
        assert "trainer.backend=ray trainer.n_workers_per_node=N" in err
        assert not run.exists()
    cfg = build_config(GRPOConfig, None, ["model.init=tiny", f"trainer.output_dir={run}", "trainer.report_to=[]"])
    with pytest.raises(ConfigError, match="posttrain grpo runs in one process.*trainer.backend=ray"):
        GRPOTrainer(reward_funcs=["math_accuracy"], args=cfg, train_dataset=[{"prompt": "1+1=", "answer": "2"}])
    assert not run.exists()


@pytest.mark.parametrize("argv", [
    ["data", "make", "arithmetic", "--out", "{tmp}/out"],
    ["data", "make-preferences", "--task", "arithmetic", "--out", "{tmp}/out"],
    ["eval", "{tmp}/model", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/out"],
    ["generate", "{tmp}/model", "1+1="],
    ["report", "{tmp}/out"],
    ["export", "{tmp}/model", "--out", "{tmp}/out"],
    ["serve", "{tmp}/model", "--port", "0"],
    ["vllm-serve", "--model", "{tmp}/model", "--port", "0"],
    ["demo", "--quick", "--out", "{tmp}/out"],
], ids=lambda argv: "-".join(argv[:2]))
def test_every_one_process_command_is_refused_under_torchrun(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"posttrain {argv[0]} runs in one process, but this is rank 1 of WORLD_SIZE=2" in err
    assert "launch it once, without torchrun" in err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 folder (the hf engine's kind) whose config.json has a key transformers
    warns about with a FutureWarning (`rope_scaling`, as configs written by older tools)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from posttrain.data.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("gpt2")
    tok = build_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "rope_scaling": None}))
    return path


def posttrain_cli(*args, cwd):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "posttrain.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def assert_quiet(stderr):
    assert "Loading weights" not in stderr and "Writing model shards" not in stderr, stderr
    assert "Loading checkpoint shards" not in stderr and "FutureWarning" not in stderr, stderr


@pytest.mark.slow  # 40 s: four processes that each load transformers
def test_transformers_noise_stays_out_of_runs_export_and_serve(gpt2_dir, tmp_path):
    import os
    import re
    import signal
    import subprocess
    import sys

    from posttrain.data.tasks import make_task

    data = make_task("arithmetic", tmp_path / "data", n_train=4, n_test=0, seed=0, digits=1)["train"]
    run = posttrain_cli("sft", f"model.path={gpt2_dir}", f"data.train_files=[{data}]", "trainer.max_steps=1",
                        "data.train_batch_size=2", "trainer.micro_batch_size=2", f"trainer.output_dir={tmp_path / 'run'}",
                        "trainer.report_to=[]", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "SFT: 4 examples" in run.stderr and "finished at step 1" in run.stderr  # posttrain's own lines stay
    assert_quiet(run.stderr)
    export = posttrain_cli("export", gpt2_dir, "--out", tmp_path / "exported", cwd=tmp_path)
    assert export.returncode == 0 and "exported" in export.stdout, export.stderr
    assert_quiet(export.stderr)
    generate = posttrain_cli("generate", gpt2_dir, "12+3=", "--max-new-tokens", "2", cwd=tmp_path)
    assert generate.returncode == 0 and "--- sample 1/1" in generate.stdout, generate.stderr
    assert_quiet(generate.stderr)
    serve = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", str(gpt2_dir), "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready = serve.stdout.readline()
        assert re.search(r"at http://127\.0\.0\.1:\d+/v1", ready), ready + serve.stderr.read()
        serve.send_signal(signal.SIGINT)
        _, stderr = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert_quiet(stderr)


def test_a_recipe_runs_as_typed_on_the_users_own_model_and_data(tmp_path, monkeypatch, caplog):
    """`posttrain grpo --config grpo model.path=<own model> data.train_files=[<own data>]`: the
    recipe's arithmetic held-out file, eval task and run folder give way (they stopped this
    run before), said in one line; the run goes to runs/grpo."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.data.tokenizer import build_tokenizer

    tok, model_dir = build_tokenizer(), tmp_path / "my_model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "What is 4+4?", "answer": "8"}]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="posttrain"):
        code = main(["grpo", "--config", "grpo", f"model.path={model_dir}", "data.train_files=[mine.jsonl]",
                     "trainer.max_steps=1", "data.train_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4",
                     "actor.micro_batch_size=4", "trainer.report_to=[]", "trainer.progress=false"])
    assert code == 0
    dropped = [r.getMessage() for r in caplog.records if "task settings are dropped" in r.getMessage()]
    assert dropped == ["recipe grpo: data.train_files names your own data, so the recipe's task settings are "
                       "dropped: data.eval_files=[data/arith/test.jsonl], eval.task=arithmetic, "
                       "trainer.output_dir=runs/grpo_arithmetic (runs go to trainer.output_dir=runs/grpo); "
                       "set any of them on the command line to keep it"]
    run = tmp_path / "runs" / "grpo"
    assert (run / "final" / "config.json").is_file()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_a_batch_far_beyond_the_data_is_refused_before_the_model_is_built(tmp_path, capsys, command):
    # Before: minutes in the divisor hint, then every step gathered 1e9 rows (a 39 GB allocation).
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1), "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    own = ["trainer.micro_batch_size=1000000000"] if command == "sft" else ["reward.functions=[task_reward]"]
    code = main([command, "model.init=tiny", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path / 'run'}",
                 "data.train_batch_size=1000000000", *own, "trainer.report_to=[]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (f"posttrain {command}: config error: data.train_batch_size: 1000000000 is far beyond the data: 8 training "
            "examples, so one step would pass over them 125,000,000 times (more than 16)") in err
