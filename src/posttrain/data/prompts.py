"""RL prompt data: read, validate and tokenize prompt rows, and collate them left-padded.

A prompt row is `prompt` (a string, or chat messages) plus any columns (`answer`, `tests`,
...), which reach reward functions as keyword arguments (TRL's convention).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.config.core import ConfigError
from posttrain.config.rl import RLDataConfig
from posttrain.data.collate import char_bound, cut_text, left_pad
from posttrain.data.formats import validate_rows
from posttrain.data.sources import load_rows


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt: a string with the tokenizer's special tokens (BOS), or chat
    messages through the chat template with the generation prompt."""
    if isinstance(prompt, list):
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def load_prompts(source: Any, tokenizer: Any, cfg: RLDataConfig) -> tuple[list[dict], dict[str, float]]:
    """Read, validate and tokenize prompt rows → examples {ids, prompt, columns} and counts.

    Too-long prompts follow `data.truncation` (error naming the row, keep the last
    tokens, or drop); counts go to the metrics as data/*. A prompt is cut to its last
    `char_bound(max_prompt_length)` characters before it is tokenised (`collate.cut_text`): a
    longer one is over max_prompt_length tokens either way, and its last tokens are the same,
    so a 30 MB prompt costs milliseconds. A column missing from some rows is None there
    (reward functions get every column for every row, as TRL)."""
    rows = load_rows(source)
    missing = next((i for i, r in enumerate(rows) if isinstance(r, Mapping) and cfg.prompt_key not in r), None)
    if missing is not None:
        found = ", ".join(map(str, rows[missing])) or "no columns"
        raise ConfigError(
            f"data.prompt_key: {rows.locate(missing)} has no column {cfg.prompt_key!r} (found {found}); "
            "set data.prompt_key=COLUMN to read the prompts from another column")
    if cfg.prompt_key != "prompt":
        for r in rows:
            r["prompt"] = r.pop(cfg.prompt_key)
    validate_rows(rows, "prompt", rows.name)
    examples, truncated, dropped = [], 0, 0
    bound = char_bound(tokenizer, cfg.max_prompt_length)
    for i, row in enumerate(rows):
        prompt = cut_text(row["prompt"], bound, keep_end=True)
        ids = encode_prompt(tokenizer, prompt)
        if len(ids) > cfg.max_prompt_length:
            if cfg.truncation == "error":
                size = f"{len(ids)} tokens" if prompt is row["prompt"] else f"over {bound} characters"
                raise ConfigError(
                    f"data.max_prompt_length: the prompt of {rows.locate(i)} has {size}, more "
                    f"than {cfg.max_prompt_length} tokens; raise it or set data.truncation=left|drop")
            if cfg.truncation == "drop":
                dropped += 1
                continue
            ids, truncated = ids[-cfg.max_prompt_length :], truncated + 1
        columns = {k: v for k, v in row.items() if k != "prompt"}
        examples.append({"ids": ids, "prompt": row["prompt"], "columns": columns})
    if not examples:
        raise ConfigError(f"data.train_files: no prompt left in {rows.name} (all {dropped} dropped as too long)")
    keys = list(dict.fromkeys(k for e in examples for k in e["columns"]))  # every batch gets every column
    for e in examples:
        e["columns"] = {k: e["columns"].get(k) for k in keys}
    stats = {"data/n_rows": float(len(rows)), "data/n_truncated": float(truncated), "data/n_dropped": float(dropped)}
    return examples, stats


def collate_prompts(examples: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """Examples → the prompt fields of an RL batch: prompt_ids (B, P) left-padded, prompt_mask
    (B, P), the raw prompts and the columns (`RLBatch.from_prompts` wraps them)."""
    ids, mask = left_pad([e["ids"] for e in examples], pad_id)
    columns = {k: [e["columns"][k] for e in examples] for k in examples[0]["columns"]}
    return {"prompt_ids": ids, "prompt_mask": mask, "prompts": [e["prompt"] for e in examples], "columns": columns}
