"""`posttrain eval` and `posttrain generate`: load a model, sample from it, score or print."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import unicodedata
from pathlib import Path
from typing import Any


def _add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """Model loading and sampling flags shared by `eval` and `generate`."""
    p.add_argument("model", help="local Hugging Face model directory (config.json, weights, tokenizer), or a "
                   "run directory (e.g. runs/demo/rl), whose final/ model is used")
    p.add_argument("--n", type=int, default=1, metavar="K", help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling temperature; 0 = greedy (default: 0 with --n 1, else 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help=f"most generated tokens per sample (default {max_new_tokens})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--engine", choices=["native", "hf", "vllm"], default=None,
                   help="rollout engine (default: native for the checkpoints the built-in model runs: Llama, Qwen2, Qwen3, Mistral; else hf)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype (default auto: bfloat16 on CUDA when supported, else float32)")
    p.add_argument("--env", default=None, metavar="SPEC",
                   help="play multi-turn episodes with this environment: a built-in name (arithmetic_tools, "
                   "guess_number), 'module:Class' or 'file.py:Class'; --max-new-tokens is then per model turn")
    p.add_argument("--tool", action="append", default=[], metavar="SPEC", dest="tools",
                   help="a tool of the episodes (repeatable): calculator, python, 'module:function' or "
                   "'file.py:function'; alone, the tools make a ToolEnvironment")
    p.add_argument("--max-turns", type=int, default=4, metavar="N", help="episodes: most model turns (default 4)")
    p.add_argument("--max-total-tokens", type=int, default=512, metavar="N",
                   help="episodes: most trajectory tokens after the prompt (default 512)")


def _add_eval_commands(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="sample a model on a dataset and report accuracy, pass@k, lengths and rewards",
        description="Sample --n completions of every prompt in --data, score them with reward functions "
        "and report accuracy, pass@k (unbiased estimator), response length, truncation rate and reward "
        "statistics. Writes OUT/eval.json (metrics + settings) and OUT/samples.jsonl (one line per sample). "
        "MODEL may be a run directory RUN: its RUN/final model is evaluated. "
        "OUT defaults to runs/eval/NAME, NAME from the model folder: the run's name for RUN/final "
        "(runs/sft/final -> runs/eval/sft), RUN-step-N for RUN/checkpoints/step-N, else the folder's name. "
        "An OUT that already holds an eval is refused unless --overwrite.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            rewards: --task NAME scores with task_reward(task=NAME) (a bundled task or rg:<name>); each
            --reward adds a function: a built-in name (math_accuracy, exact_match, task_reward, ...),
            'module:function', 'file.py:function', or a JSON dict with options, e.g.
            --reward '{"name": "format_reward", "pattern": "^<answer>.*</answer>$"}'.
            Default: task_reward when the rows have a `task` column, else env_reward with --env/--tool
            (the environment's reward), else math_accuracy (needs `answer`).
            A sample is correct when its total (weighted) reward >= --correct-threshold (1.0 by default,
            where a 0/1 verifier such as task_reward or math_accuracy says right; with only functions
            that declare no correctness notion, e.g. reward_model, say what correct means with it).
            episodes: with --env SPEC and/or --tool SPEC every sample is a multi-turn episode; the report
            adds turns/mean, turns/max, tool_calls/mean, tool/errors, tool/timeouts, env/reward/mean.

            examples:
              posttrain eval runs/grpo/final --data data/arith/test.jsonl --task arithmetic --n 8 --out runs/eval
              posttrain eval MODEL --data gsm8k_test.jsonl --reward math_accuracy --n 4 --temperature 0.6
              posttrain eval runs/grpo_tools/final --data data/tools/test.jsonl --env arithmetic_tools --n 4"""),
    )
    _add_sampling_args(ev, max_new_tokens=256)
    ev.add_argument("--data", required=True, metavar="FILE",
                    help="prompts: JSONL/JSON/Parquet/CSV file, glob or saved datasets folder with a `prompt` column")
    ev.add_argument("--reward", action="append", default=[], metavar="SPEC",
                    help="a reward function (repeatable); see below")
    ev.add_argument("--reward-weights", type=float, nargs="+", default=None, metavar="W",
                    help="one weight per reward function, in order (default all 1.0)")
    ev.add_argument("--task", default=None, metavar="NAME", help="score with this task's verifier (overrides the rows' `task`)")
    ev.add_argument("--correct-threshold", type=float, default=None, metavar="X",
                    help="a sample is correct when its total reward >= this (default 1.0)")
    ev.add_argument("--num-examples", type=int, default=None, metavar="N", help="evaluate only the first N rows (default all)")
    ev.add_argument("--batch-size", type=int, default=32, metavar="B", help="prompts per generation call (default 32)")
    ev.add_argument("--reward-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a reward function may take per batch (default 60)")
    ev.add_argument("--out", default=None, metavar="DIR",
                    help="output directory (default runs/eval/NAME, see above)")
    ev.add_argument("--overwrite", action="store_true", help="replace the eval.json and samples.jsonl already in OUT")
    ev.set_defaults(handler=_handle_eval)

    gen = sub.add_parser(
        "generate",
        help="sample completions of one prompt",
        description="Sample --n completions of PROMPT and print them. With --chat the prompt is sent as a "
        "user message through the tokenizer's chat template (with the generation prompt). With --env / --tool "
        "each sample is a multi-turn episode, printed turn by turn ([model] and [env] blocks).",
    )
    _add_sampling_args(gen, max_new_tokens=128)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--row", default=None, metavar="JSON",
                     help="episodes: more columns of the row the environment is reset on, e.g. '{\"answer\": \"6359\"}'")
    gen.set_defaults(handler=_handle_generate)


def _sampling_checks(args: argparse.Namespace) -> float:
    """Validate the shared sampling flags before any model is loaded; the temperature to use."""
    for flag in ("n", "max_new_tokens", "batch_size", "num_examples", "max_turns", "max_total_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n == 1 else 1.0)
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    return temperature


RUN_DIR_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints", "final")
"""What a training command writes to its run directory (besides final/, which may be missing)."""


def resolve_model_dir(model: str) -> str:
    """MODEL as given when it is a model directory (or not a directory: `read_config_json`
    reports that); a run directory's `final/` model; an error naming the path when the run
    directory has no final/ (the run has not finished), listing its checkpoints if any."""
    path = Path(model)
    if not path.is_dir() or (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return model
    final = path / "final"
    if final.is_dir():
        return str(final)
    if not any((path / name).exists() for name in RUN_DIR_MARKERS):
        return model
    steps = sorted((path / "checkpoints").glob("step-*"), key=lambda p: (len(p.name), p.name))  # step-9 < step-10
    hint = f"; pass a checkpoint instead, e.g. {steps[-1]}" if steps else ""
    raise FileNotFoundError(f"{model} is a run directory without a final model: {final} does not exist "
                            f"(the run has not finished){hint}")


def _load_model(args: argparse.Namespace) -> tuple[Any, Any]:
    from posttrain.config import ModelConfig
    from posttrain.config.sections import check_device
    from posttrain.models.factory import build_model_and_tokenizer
    from posttrain.models.llama_checkpoint import read_config_json
    from posttrain.rollout import model_impl_for

    check_device(args.device, "--device")
    read_config_json(args.model)  # a clear error when MODEL is not a model directory
    impl = model_impl_for(args.engine or "auto", "auto")  # --engine hf: a transformers model
    return build_model_and_tokenizer(ModelConfig(path=args.model, impl=impl, device=args.device, dtype=args.dtype))


def _episodes(args: argparse.Namespace) -> tuple[Any, Any]:
    """(environment factory, limits) of --env / --tool, or (None, None) without them;
    checked before any model is loaded."""
    if args.env is None and not args.tools:
        return None, None
    from posttrain.envs import episode_factory
    from posttrain.rollout import MultiTurnLimits

    return episode_factory(args.env, args.tools), MultiTurnLimits(args.max_turns, args.max_total_tokens)


def _make_engine(args: argparse.Namespace, model: Any, tokenizer: Any) -> tuple[str, Any]:
    """--engine, else native for the built-in model and hf otherwise; vLLM reads MODEL itself."""
    from posttrain.rollout import engine_kind_for, make_engine

    kind = args.engine or engine_kind_for(model)
    opts = {"model_path": args.model} if kind == "vllm" else {}
    return kind, make_engine(kind, model, tokenizer, **opts)


def _reward_specs(args: argparse.Namespace, rows: Any) -> list[Any]:
    """--task and --reward specs, else the default: task_reward with a `task` column, else the
    environment's reward with --env / --tool (env_reward), else math_accuracy."""
    specs: list[Any] = [{"name": "task_reward", "task": args.task}] if args.task else []
    for spec in args.reward:
        specs.append(json.loads(spec) if spec.lstrip().startswith("{") else spec)
    if not specs and any(r.get("task") for r in rows):
        specs = ["task_reward"]
    if not specs:
        specs = ["env_reward"] if args.env is not None or args.tools else ["math_accuracy"]
    needs_answer = {"task_reward", "math_accuracy"} & {s if isinstance(s, str) else s.get("name") for s in specs}
    if needs_answer:
        missing = next((i for i, r in enumerate(rows) if "answer" not in r), None)
        if missing is not None:
            raise ValueError(
                f"{rows.locate(missing)}: no `answer` column for {', '.join(sorted(needs_answer))}; "
                "add one or pass --reward SPEC"
            )
    return specs


def default_eval_dir(model: str) -> Path:
    """runs/eval/NAME for a model folder: RUN for RUN/final, RUN-step-N for
    RUN/checkpoints/step-N, else the folder's own name."""
    path = Path(model).resolve()
    if path.name == "final":
        name = path.parent.name
    elif path.parent.name == "checkpoints":
        name = f"{path.parent.parent.name}-{path.name}"
    else:
        name = path.name
    return Path("runs") / "eval" / name


def _eval_out(args: argparse.Namespace) -> Path:
    """Where eval writes; an earlier eval there is refused unless --overwrite."""
    out = Path(args.out) if args.out else default_eval_dir(args.model)
    found = [f for f in ("eval.json", "samples.jsonl") if (out / f).exists()]
    if found and not args.overwrite:
        raise ValueError(f"{out} already holds an eval ({', '.join(found)}); pass --out DIR for a new "
                         "folder, or --overwrite to replace it")
    return out


def _handle_eval(args: argparse.Namespace) -> int:
    from posttrain.data.sources import load_rows
    from posttrain.evaluation import evaluate
    from posttrain.rewards import RewardRunner

    temperature = _sampling_checks(args)
    args.model = resolve_model_dir(args.model)
    out = _eval_out(args)
    rows = load_rows(args.data)
    missing = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if missing is not None:
        raise ValueError(f"{rows.locate(missing)}: no `prompt` column (eval needs prompt rows, as TRL's GRPO)")
    specs = _reward_specs(args, rows)
    runner = RewardRunner.from_specs(specs, weights=args.reward_weights, timeout_s=args.reward_timeout)
    environment, limits = _episodes(args)
    rows = rows[: args.num_examples] if args.num_examples else rows
    threshold = _correct_threshold(args.correct_threshold, runner, episodes=environment is not None)
    model, tokenizer = _load_model(args)
    kind, engine = _make_engine(args, model, tokenizer)
    report = evaluate(
        model, tokenizer, rows, runner, n=args.n, temperature=temperature, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, engine=engine, seed=args.seed, top_p=args.top_p,
        correct_threshold=threshold, progress=True, environment=environment, limits=limits,
    )
    report.settings.update({"engine": kind, "model": args.model, "data": args.data, "reward_specs": specs})
    if environment is not None:
        report.settings.update({"env": args.env, "tools": args.tools})
    replaced = (out / "eval.json").exists() or (out / "samples.jsonl").exists()
    paths = report.write(out)
    print(report.table())
    print(f"{'replaced' if replaced else 'wrote'} {paths['eval']} and {paths['samples']} ({len(report.samples)} samples)")
    return 0


def _correct_threshold(given: float | None, runner: Any, episodes: bool) -> float:
    """--correct-threshold, 1.0 when not given; then, unless a reward function declares a
    correctness notion (`is_correctness`) or episodes score with their environment's reward,
    a note that accuracy and pass@k are a threshold on scores that define none."""
    declared = any(getattr(fn, "is_correctness", False) for _, fn in runner.functions)
    if given is None and not declared and not episodes:
        print(f"note: no reward function here ({', '.join(runner.names)}) declares a correctness notion "
              "(is_correctness, as task_reward, math_accuracy, exact_match and code_tests do): accuracy and pass@k "
              "count samples whose total reward is >= 1.0; pass --correct-threshold X to say what correct means "
              "for these scores", file=sys.stderr)
    return 1.0 if given is None else given


def _handle_generate(args: argparse.Namespace) -> int:
    from posttrain.evaluation import prompt_input
    from posttrain.rollout import SamplingParams

    temperature = _sampling_checks(args)
    args.model = resolve_model_dir(args.model)
    environment, limits = _episodes(args)
    row = json.loads(args.row) if args.row else {}
    if not isinstance(row, dict):
        raise ValueError(f"--row must be a JSON object, got {args.row}")
    model, tokenizer = _load_model(args)
    _, engine = _make_engine(args, model, tokenizer)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    params = SamplingParams(n=args.n, temperature=temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    if environment is not None:
        from posttrain.envs import play_episodes

        episodes, rewards, _ = play_episodes(engine, [{**row, "prompt": prompt}], environment, params, limits)
        for i in range(len(episodes)):
            print(episode_text(episodes, i, tokenizer, float(rewards[i]), args.n))
        return 0
    out = engine.generate([prompt_input(tokenizer, prompt)], params)
    for i, (text, length, reason) in enumerate(zip(out.texts, out.lengths.tolist(), out.finish_reason)):
        print(f"--- sample {i + 1}/{args.n} ({length} tokens, finish: {reason}) ---")
        print(printable(text))
    return 0


def episode_text(episodes: Any, i: int, tokenizer: Any, reward: float, n: int) -> str:
    """Episode i turn by turn: a header, then one `[model]` or `[env]` block per stretch of
    the trajectory's tokens (response_mask 1 or 0)."""
    length, mask = int(episodes.total_lengths[i]), episodes.response_mask[i].tolist()
    ids = episodes.response_ids[i, :length].tolist()
    head = (f"--- episode {i + 1}/{n} ({int(episodes.turns[i])} model turns, {int(episodes.lengths[i])} model + "
            f"{length - int(episodes.lengths[i])} environment tokens, finish: {episodes.finish_reason[i]}, "
            f"environment reward: {'none' if reward != reward else f'{reward:g}'}) ---")
    lines, start = [head], 0
    for t in range(1, length + 1):
        if t == length or mask[t] != mask[start]:
            who = "[model]" if mask[start] else "[env]  "
            lines.append(f"{who} {printable(tokenizer.decode(ids[start:t], skip_special_tokens=True))}")
            start = t
    return "\n".join(lines)


def printable(text: str) -> str:
    """`text` with its control characters other than newline and tab written as escapes
    (\\r, \\x1b, ...), so a terminal shows what the model wrote instead of obeying it (a
    carriage return or an escape sequence would overwrite lines or swallow the newline)."""
    return "".join(
        c.encode("unicode_escape").decode() if c not in "\n\t" and unicodedata.category(c) == "Cc" else c
        for c in text
    )
