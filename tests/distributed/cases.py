"""The runs the data-parallel tests compare, built the same way in one process and under
torchrun (`python -m torch.distributed.run ... tests/distributed/cases.py SPEC.json`).

Each case trains 3 optimizer steps in float64. SFT and DPO take global batches of 3 in
micro-batches of 1: under 2 ranks one rank has 2 rows (2 passes), the other 1 (1 pass), so
the zero-weighted extra pass and the global normalisation are both exercised; RM takes 6 in
micro-batches of 2 (padded rows, 2 passes on each rank).
- sft: the built-in model (tied embeddings), SFT on prompt/completion rows of mixed lengths;
- rm: a tiny HF `LlamaForCausalLM` under a fresh score head, Bradley-Terry with margins;
- dpo: the built-in model with LoRA (peft), the reference being the adapter-disabled policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from posttrain import DPOConfig, DPOTrainer, RewardTrainer, RMConfig, SFTConfig, SFTTrainer
from posttrain.config import build_config
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM

SFT_ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b) + " ok" * (a % 3)} for a, b in
            [(2, 3), (10, 4), (7, 8), (1, 1), (12, 30), (5, 5), (9, 0), (3, 14)]]
PAIR_ROWS = [
    {"prompt": "2+3=", "chosen": "5", "rejected": "6", "margin": 0.5},
    {"prompt": "10-4=", "chosen": "6", "rejected": "14 or so", "margin": 0.0},
    {"prompt": "7*8=", "chosen": "56", "rejected": "54", "margin": 1.5},
    {"prompt": "1+1=", "chosen": "2", "rejected": "11", "margin": -1.0},
    {"prompt": "9-9=", "chosen": "0", "rejected": "nine", "margin": 0.2},
    {"prompt": "6*7=", "chosen": "42", "rejected": "24", "margin": 0.0},
]
CONFIGS = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig}
UNITS = {"sft": "tokens", "rm": "pairs", "dpo": "pairs"}


def builtin_lm(tok, seed: int = 0) -> BuiltinLM:
    torch.manual_seed(seed)
    lm = BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.no_grad():  # O(1) logits, so a wrong normalisation cannot hide
        for name, p in lm.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return lm.double()


def hf_llama(tok, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).double()


def config(command: str, run_dir: Path, strategy: str, **over):
    base = {"data.train_batch_size": 6 if command == "rm" else 3, "trainer.micro_batch_size": 2 if command == "rm" else 1, "trainer.max_steps": 3,
            "trainer.output_dir": str(run_dir), "trainer.report_to": [], "trainer.progress": False,
            "data.max_length": 64, "trainer.learning_rate": 1e-2, "trainer.warmup_steps": 1,
            "trainer.strategy": strategy, "trainer.max_grad_norm": 0.5}
    if command == "dpo":
        base["model.lora.r"] = 4
    if command == "rm":
        base["algorithm.center_rewards_coefficient"] = 0.1
    base.update(over)
    return build_config(CONFIGS[command], None, [f"{k}={v}" for k, v in base.items()])


def train(command: str, run_dir: Path, strategy: str, **over):
    """Train one case (3 steps unless `trainer.max_steps` says otherwise); returns the trainer."""
    tok = build_tokenizer()
    args = config(command, run_dir, strategy, **over)
    if command == "sft":
        trainer = SFTTrainer(builtin_lm(tok), args=args, train_dataset=SFT_ROWS, processing_class=tok)
    elif command == "rm":
        trainer = RewardTrainer(hf_llama(tok), args=args, train_dataset=PAIR_ROWS, processing_class=tok)
    else:
        trainer = DPOTrainer(builtin_lm(tok), args=args, train_dataset=PAIR_ROWS, processing_class=tok)
        trainer.model.double()  # the adapters too: the comparison is in float64
    trainer.train()
    return trainer


def float32_grads(strategy: str, out: Path | None) -> dict[str, torch.Tensor]:
    """One SGD step (lr 1, no clipping) of SFT in float32 through `train_step`: −Δθ is the
    gradient of the global batch. Written to `out` (rank 0) as full tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain import distributed
    from posttrain.data.collate import pad_collate, tokenize_dataset
    from posttrain.trainers.batches import EpochBatches
    from posttrain.trainers.sft import lm_loss
    from posttrain.training.core import train_step

    tok = build_tokenizer()
    ctx = distributed.init_from_env(strategy)
    model = builtin_lm(tok).float()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    examples, _ = tokenize_dataset(SFT_ROWS, tok, "prompt_completion", 64, True, False, "truncate")
    batches = EpochBatches(examples, 5, 2, lambda ex: pad_collate(ex, tok.pad_token_id), shuffle=False)
    wrapped = distributed.wrap(model, strategy, ctx)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError(f"{strategy} untied the embeddings")
    collective = distributed.Collective(ctx.world_size, ctx.device) if ctx else None
    if ctx:
        batches.shard(ctx.rank, ctx.world_size, collective)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(model, batches.next_step(), lambda m, b: wrapped.loss(lm_loss, b), optimizer, None, 0.0,
               "fp32", collective)
    after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    grads = {k: before[k] - after[k] for k in after} if after else {}
    if out is not None and (ctx is None or ctx.is_main):
        torch.save(grads, out)
    return grads


def main(spec_file: str) -> None:
    """Run every job of the spec (all ranks in step), then leave the group."""
    from posttrain import distributed

    spec = json.loads(Path(spec_file).read_text())
    try:
        for job in spec["jobs"]:
            if job["kind"] == "train":
                train(job["command"], Path(job["run_dir"]), job["strategy"], **job.get("over", {}))
            else:
                float32_grads(job["strategy"], Path(job["out"]))
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
