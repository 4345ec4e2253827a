"""Checkpoints and run directories: atomic save and exact resume (`files`), and which run a
checkpoint belongs to (`runs`). See each module."""

from posttrain.checkpoint.files import (
    CHECKPOINTS,
    COMPLETE,
    FINAL,
    STATE_JSON,
    STATE_PT,
    RunModels,
    atomic_dir,
    find_latest_checkpoint,
    load_checkpoint,
    load_weights,
    resolve_resume,
    save_checkpoint,
    save_final,
    save_tokenizer,
)
from posttrain.checkpoint.runs import (
    BUILT_MODEL,
    RESUME_MAY_CHANGE,
    RUN_OUTPUTS,
    RunRecord,
    check_resume,
    claim_run_dir,
    model_signature,
    remove_run,
)

__all__ = [
    "BUILT_MODEL",
    "CHECKPOINTS",
    "COMPLETE",
    "FINAL",
    "RESUME_MAY_CHANGE",
    "RUN_OUTPUTS",
    "RunModels",
    "RunRecord",
    "STATE_JSON",
    "STATE_PT",
    "atomic_dir",
    "check_resume",
    "claim_run_dir",
    "find_latest_checkpoint",
    "load_checkpoint",
    "load_weights",
    "model_signature",
    "remove_run",
    "resolve_resume",
    "save_checkpoint",
    "save_final",
    "save_tokenizer",
]
