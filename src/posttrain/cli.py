"""The `posttrain` command line.

Training commands take an optional YAML preset and dotted overrides, as in veRL:

    posttrain sft --config recipes/sft_arithmetic.yaml trainer.max_steps=200 model.init=tiny

Every key is checked before any model is loaded; `posttrain CMD --help` lists them all.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.config import ConfigError, build_config, iter_fields
from posttrain.config.core import type_name


@dataclass(frozen=True)
class TrainCommand:
    """A training command: its config tree and the function that runs it."""

    name: str
    summary: str
    config_cls: type
    run: Callable[[Any], Any]


def _run_sft(cfg: Any) -> Any:
    from posttrain.trainers.sft import run_sft

    return run_sft(cfg)


def _run_rl(cfg: Any) -> Any:
    from posttrain.trainers.rl import run_rl

    return run_rl(cfg)


def _train_commands() -> list[TrainCommand]:
    from posttrain.config import GRPOConfig, PPOConfig, SFTConfig

    return [
        TrainCommand("sft", "supervised fine-tuning (or pretraining the built-in model)", SFTConfig, _run_sft),
        TrainCommand("grpo", "online RL without a critic: GRPO, DAPO, GSPO, Dr.GRPO, RLOO, REINFORCE++", GRPOConfig, _run_rl),
        TrainCommand("ppo", "online RL with a critic: PPO (GAE)", PPOConfig, _run_rl),
    ]


def options_help(config_cls: type) -> str:
    """Every option of a config tree with its type, default and documentation."""
    lines = ["options (set as key=value; lists as key=[a,b]):"]
    section = None
    for key, tp, default, doc in iter_fields(config_cls):
        head = key.split(".")[0]
        if head != section:
            section = head
            lines.append("")
        shown = repr(default)
        lines.append(f"  {key} ({type_name(tp)}, default {shown})")
        lines += textwrap.wrap(doc, width=88, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)




def _add_train_command(sub: Any, cmd: TrainCommand) -> None:
    p = sub.add_parser(
        cmd.name,
        help=cmd.summary,
        description=f"posttrain {cmd.name}: {cmd.summary}.\n\n{(cmd.config_cls.__doc__ or '').strip()}",
        epilog=options_help(cmd.config_cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="YAML", help="a preset from recipes/ (or your own); overrides win over it")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.max_steps=100")
    p.set_defaults(handler=lambda args: _handle_train(cmd, args))


def _handle_train(cmd: TrainCommand, args: argparse.Namespace) -> int:
    cfg = build_config(cmd.config_cls, args.config, args.overrides)
    if args.print_config:
        import yaml

        from posttrain.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    cmd.run(cfg)
    return 0


def _add_data_commands(sub: Any) -> None:
    from posttrain.data.tasks import TASKS

    data = sub.add_parser("data", help="make bundled synthetic datasets")
    data_sub = data.add_subparsers(dest="data_command", metavar="{make}", required=True)
    make = data_sub.add_parser(
        "make",
        help="write train/test JSONL for a bundled verifiable task",
        description="Write OUT/train.jsonl and OUT/test.jsonl (prompt, answer, completion) for a task. "
        "Deterministic for a given seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="tasks: " + ", ".join(sorted(TASKS)) + ", or rg:<name> for a reasoning-gym dataset "
        "(pip install 'posttrain[tasks]'; its config fields and answer_format=line|tag as options)"
        "\nexamples: posttrain data make arithmetic --out data/arith digits=2"
        "\n          posttrain data make rg:basic_arithmetic --out data/rg_arith max_terms=3",
    )
    make.add_argument("task", help="task name: " + ", ".join(sorted(TASKS)) + ", or rg:<name> (reasoning-gym)")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--n-train", type=int, default=20000, help="training rows (default 20000)")
    make.add_argument("--n-test", type=int, default=500, help="held-out rows (default 500)")
    make.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    make.add_argument("options", nargs="*", metavar="key=value", help="task options, e.g. digits=2 difficulty=hard")
    make.set_defaults(handler=_handle_data_make)


def _handle_data_make(args: argparse.Namespace) -> int:
    from posttrain.config.core import parse_override

    if args.task.startswith("rg:"):
        from posttrain.data.tasks.reasoning_gym import make_rg_task as make_task
    else:
        from posttrain.data.tasks import make_task

    options = dict(parse_override(o) for o in args.options)
    info = make_task(args.task, args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed, **options)
    print(f"wrote {info['n_train']} train and {info['n_test']} test rows of {args.task} to {args.out}")
    return 0


def _add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """Model loading and sampling flags shared by `eval` and `generate`."""
    p.add_argument("model", help="local Hugging Face model directory (config.json, weights, tokenizer)")
    p.add_argument("--n", type=int, default=1, metavar="K", help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling temperature; 0 = greedy (default: 0 with --n 1, else 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help=f"most generated tokens per sample (default {max_new_tokens})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--engine", choices=["native", "hf", "vllm"], default=None,
                   help="rollout engine (default: native for Llama checkpoints the built-in model runs, else hf)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype (default auto: bfloat16 on CUDA when supported, else float32)")


def _add_eval_commands(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="sample a model on a dataset and report accuracy, pass@k, lengths and rewards",
        description="Sample --n completions of every prompt in --data, score them with reward functions "
        "and report accuracy, pass@k (unbiased estimator), response length, truncation rate and reward "
        "statistics. Writes OUT/eval.json (metrics + settings) and OUT/samples.jsonl (one line per sample).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            rewards: --task NAME scores with task_reward(task=NAME) (a bundled task or rg:<name>); each
            --reward adds a function: a built-in name (math_accuracy, exact_match, task_reward, ...),
            'module:function', 'file.py:function', or a JSON dict with options, e.g.
            --reward '{"name": "format_reward", "pattern": "^<answer>.*</answer>$"}'.
            Default: task_reward when the rows have a `task` column, else math_accuracy (needs `answer`).
            A sample is correct when its total (weighted) reward >= --correct-threshold.

            examples:
              posttrain eval runs/grpo/final --data data/arith/test.jsonl --task arithmetic --n 8 --out runs/eval
              posttrain eval MODEL --data gsm8k_test.jsonl --reward math_accuracy --n 4 --temperature 0.6"""),
    )
    _add_sampling_args(ev, max_new_tokens=256)
    ev.add_argument("--data", required=True, metavar="FILE",
                    help="prompts: JSONL/JSON/Parquet/CSV file, glob or saved datasets folder with a `prompt` column")
    ev.add_argument("--reward", action="append", default=[], metavar="SPEC",
                    help="a reward function (repeatable); see below")
    ev.add_argument("--reward-weights", type=float, nargs="+", default=None, metavar="W",
                    help="one weight per reward function, in order (default all 1.0)")
    ev.add_argument("--task", default=None, metavar="NAME", help="score with this task's verifier (overrides the rows' `task`)")
    ev.add_argument("--correct-threshold", type=float, default=1.0, metavar="X",
                    help="a sample is correct when its total reward >= this (default 1.0)")
    ev.add_argument("--num-examples", type=int, default=None, metavar="N", help="evaluate only the first N rows (default all)")
    ev.add_argument("--batch-size", type=int, default=32, metavar="B", help="prompts per generation call (default 32)")
    ev.add_argument("--reward-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a reward function may take per batch (default 60)")
    ev.add_argument("--out", default=None, metavar="DIR", help="output directory (default runs/eval/<model dir name>)")
    ev.set_defaults(handler=_handle_eval)

    gen = sub.add_parser(
        "generate",
        help="sample completions of one prompt",
        description="Sample --n completions of PROMPT and print them. With --chat the prompt is sent as a "
        "user message through the tokenizer's chat template (with the generation prompt).",
    )
    _add_sampling_args(gen, max_new_tokens=128)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.set_defaults(handler=_handle_generate)


def _sampling_checks(args: argparse.Namespace) -> float:
    """Validate the shared sampling flags before any model is loaded; the temperature to use."""
    for flag in ("n", "max_new_tokens", "batch_size", "num_examples"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n == 1 else 1.0)
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    return temperature


def _load_model(args: argparse.Namespace) -> tuple[Any, Any]:
    from posttrain.config import ModelConfig
    from posttrain.models.factory import build_model_and_tokenizer
    from posttrain.models.llama_checkpoint import read_config_json

    read_config_json(args.model)  # a clear error when MODEL is not a model directory
    return build_model_and_tokenizer(ModelConfig(path=args.model, device=args.device, dtype=args.dtype))


def _make_engine(args: argparse.Namespace, model: Any, tokenizer: Any) -> tuple[str, Any]:
    """--engine, else native for the built-in model and hf otherwise; vLLM reads MODEL itself."""
    from posttrain.evaluation import engine_kind_for
    from posttrain.rollout import make_engine

    kind = args.engine or engine_kind_for(model)
    opts = {"model_path": args.model} if kind == "vllm" else {}
    return kind, make_engine(kind, model, tokenizer, **opts)


def _reward_specs(args: argparse.Namespace, rows: Any) -> list[Any]:
    """--task and --reward specs, else the default: task_reward with a `task` column, else math_accuracy."""
    import json

    specs: list[Any] = [{"name": "task_reward", "task": args.task}] if args.task else []
    for spec in args.reward:
        specs.append(json.loads(spec) if spec.lstrip().startswith("{") else spec)
    if not specs:
        specs = ["task_reward"] if any(r.get("task") for r in rows) else ["math_accuracy"]
    needs_answer = {"task_reward", "math_accuracy"} & {s if isinstance(s, str) else s.get("name") for s in specs}
    if needs_answer:
        missing = next((i for i, r in enumerate(rows) if "answer" not in r), None)
        if missing is not None:
            raise ValueError(
                f"{rows.locate(missing)}: no `answer` column for {', '.join(sorted(needs_answer))}; "
                "add one or pass --reward SPEC"
            )
    return specs


def _handle_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from posttrain.data.sources import load_rows
    from posttrain.evaluation import evaluate
    from posttrain.rewards import RewardRunner

    temperature = _sampling_checks(args)
    rows = load_rows(args.data)
    missing = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if missing is not None:
        raise ValueError(f"{rows.locate(missing)}: no `prompt` column (eval needs prompt rows, as TRL's GRPO)")
    specs = _reward_specs(args, rows)
    runner = RewardRunner.from_specs(specs, weights=args.reward_weights, timeout_s=args.reward_timeout)
    rows = rows[: args.num_examples] if args.num_examples else rows
    model, tokenizer = _load_model(args)
    kind, engine = _make_engine(args, model, tokenizer)
    report = evaluate(
        model, tokenizer, rows, runner, n=args.n, temperature=temperature, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, engine=engine, seed=args.seed, top_p=args.top_p,
        correct_threshold=args.correct_threshold, progress=True,
    )
    report.settings.update({"engine": kind, "model": args.model, "data": args.data, "reward_specs": specs})
    out = Path(args.out) if args.out else Path("runs") / "eval" / Path(args.model).resolve().name
    paths = report.write(out)
    print(report.table())
    print(f"wrote {paths['eval']} and {paths['samples']} ({len(report.samples)} samples)")
    return 0


def _handle_generate(args: argparse.Namespace) -> int:
    from posttrain.evaluation import prompt_input
    from posttrain.rollout import SamplingParams

    temperature = _sampling_checks(args)
    model, tokenizer = _load_model(args)
    _, engine = _make_engine(args, model, tokenizer)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    params = SamplingParams(n=args.n, temperature=temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    out = engine.generate([prompt_input(tokenizer, prompt)], params)
    for i, (text, length, reason) in enumerate(zip(out.texts, out.lengths.tolist(), out.finish_reason)):
        print(f"--- sample {i + 1}/{args.n} ({length} tokens, finish: {reason}) ---")
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for language models: SFT, reward models, DPO and online RL, "
        "runnable end to end on a CPU with a built-in model and bundled tasks.",
        epilog="Run `posttrain COMMAND --help` for a command's options.",
    )
    from posttrain import __version__

    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in _train_commands():
        _add_train_command(sub, cmd)
    _add_data_commands(sub)
    _add_eval_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # key=value words may come before or after --flags; argparse only takes one run of them.
    args, extra = parser.parse_known_args(argv)
    field = next((f for f in ("overrides", "options") if hasattr(args, f)), None)
    stray = [w for w in extra if field is None or "=" not in w or w.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(args, field, [*getattr(args, field), *extra])
    try:
        return args.handler(args)
    except ConfigError as err:
        print(f"posttrain {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ImportError, ValueError) as err:
        print(f"posttrain {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
