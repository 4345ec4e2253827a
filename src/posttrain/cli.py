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


def _train_commands() -> list[TrainCommand]:
    from posttrain.config import SFTConfig

    return [
        TrainCommand("sft", "supervised fine-tuning (or pretraining the built-in model)", SFTConfig, _run_sft),
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
        epilog="tasks: " + ", ".join(sorted(TASKS)) + "\nexample: posttrain data make arithmetic --out data/arith digits=2",
    )
    make.add_argument("task", help="task name: " + ", ".join(sorted(TASKS)))
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--n-train", type=int, default=20000, help="training rows (default 20000)")
    make.add_argument("--n-test", type=int, default=500, help="held-out rows (default 500)")
    make.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    make.add_argument("options", nargs="*", metavar="key=value", help="task options, e.g. digits=2 difficulty=hard")
    make.set_defaults(handler=_handle_data_make)


def _handle_data_make(args: argparse.Namespace) -> int:
    from posttrain.config.core import parse_override
    from posttrain.data.tasks import make_task

    options = dict(parse_override(o) for o in args.options)
    info = make_task(args.task, args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed, **options)
    print(f"wrote {info['n_train']} train and {info['n_test']} test rows of {args.task} to {args.out}")
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
    except (FileNotFoundError, ValueError) as err:
        print(f"posttrain {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
