"""Scalar-head models: a decoder backbone plus a linear H -> 1 head, for critics and reward models.

Notation: B batch, T tokens, H hidden size.

    input_ids (B, T) --backbone--> final-normed hidden states (B, T, H)
      --score (H -> 1, no bias)--> values (B, T)             critic: one value per position
      --pick the last valid token--> scores (B,)              reward model: one per sequence

The layout is transformers' `LlamaForSequenceClassification` (`model.*` backbone, `score`
head, no bias), so the state dict of a `ScalarHeadModel` is that of the HF checkpoint,
`peft` sees the same module names (`modules_to_save=["score"]`), and a built-in backbone
saves as a standard `*ForSequenceClassification` checkpoint of its family (Llama, Qwen2,
Qwen3, Mistral) that plain `transformers.AutoModelForSequenceClassification` loads with
the same pooled scores.

Two backbones:
- built-in: the `DecoderStack` of a `BuiltinLM` (embeddings, blocks, final norm; no
  lm_head), run through `BuiltinLM.hidden_states` so masks and positions mean the same.
- Hugging Face: the base model of any decoder `*ForSequenceClassification` class whose head
  is called `score` (Llama, Qwen2/3, Mistral, Gemma, GPT-2, ...), stored under the class's
  `base_model_prefix`, and saved back through that class's own `save_pretrained`.

`rm.score` is the head (`nn.Linear`), as in HF; the sequence scores are `rm.scores(...)`.

Head initialisation (a fresh head: `from_causal_lm`, or a checkpoint without one): normal
with std 1/sqrt(H + 1), the reward-model init of Stiennon et al. 2020 ("Learning to
summarize", p. 11) used by TRL's reward-modeling example and open-instruct; its initial
outputs are O(1/sqrt(H)) times the hidden-state norm, so the first preference losses sit
near log 2. `init_std=0.0` gives a zero head instead (every value starts at 0), an option
for critics; HF's own default is normal(0, initializer_range=0.02).

Departures from HF: `scores` pools at the last position where `attention_mask` is 1, so
left and right padding both work and a pad id that also occurs as a real token (pad = eos)
cannot move the pooled position; HF pools at the last token that is not `pad_token_id`.
Both agree on right-padded input whose real tokens never equal the pad id. Positions
default to cumsum(attention_mask) - 1 for both backbones (HF Llama counts padding), so a
left-padded row gets the same values as an unpadded one.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.models import llama_checkpoint as ckpt
from posttrain.models.builtin import (
    BuiltinConfig,
    BuiltinLM,
    DecoderStack,
    checkpoint_layers,
    positions_from_mask,
)
from posttrain.models.loading import IMPLS, checkpointing_method, resolve_dtype
from posttrain.models.lora import is_peft, merged_for_export

logger = logging.getLogger(__name__)

SCORE_KEY = "score.weight"
HEAD_SOURCES = ("auto", "stored", "fresh")


class MissingScoreHead(ValueError):
    """A checkpoint read as a trained reward model or critic holds no score head."""


def describe_checkpoint(hf: dict) -> str:
    """What config.json says a checkpoint is, for error messages: "a causal LM (LlamaForCausalLM)"."""
    arch = ckpt.architecture(hf)
    if arch is None:
        return "a model whose config.json names no architecture"
    kind = "a causal LM" if arch.endswith(("ForCausalLM", "LMHeadModel")) else "a model"
    return f"{kind} ({arch})"


def require_score_head(path: str | Path, hf: dict | None = None) -> None:
    """Raise `MissingScoreHead`, saying what the checkpoint is, unless its weights hold a
    trained score head (`score.weight`). Reads the weights' names only, not the weights.

    The weights decide, not config.json: a `*ForSequenceClassification` config whose
    weights lack the head would get a random one from transformers too.
    """
    hf = ckpt.read_config_json(path) if hf is None else hf
    if SCORE_KEY in ckpt.weight_names(path):
        return
    raise MissingScoreHead(
        f"{path} is {describe_checkpoint(hf)}, not a reward model: its weights have no trained "
        f"score head ({SCORE_KEY})"
    )


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row: attention_mask (B, T), 1 = real -> (B,) long.

    Works for right padding ([1, 1, 1, 0] -> 2), left padding ([0, 1, 1, 1] -> 3) and
    both at once. Raises ValueError for a row without a real token.
    """
    mask = attention_mask.bool()
    empty = ~mask.any(-1)
    if bool(empty.any()):
        raise ValueError(
            f"rows {empty.nonzero().flatten().tolist()} of attention_mask have no real token"
        )
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * mask).argmax(-1)  # the largest masked position is unique


def default_init_std(hidden_size: int) -> float:
    """1 / sqrt(H + 1): the std of a fresh score head (see the module docstring)."""
    return 1.0 / math.sqrt(hidden_size + 1)


class ScalarHeadModel(nn.Module):
    """A backbone with a linear scalar head: `values` (B, T) for critics, `scores` (B,) for RMs.

    Build one with `from_causal_lm` (a critic/RM initialised from a policy or SFT model),
    `from_pretrained` (a saved RM/critic, any HF `*ForSequenceClassification` checkpoint with
    one label, or a plain causal LM whose head is then initialised), or directly from a
    backbone module (a `DecoderStack` with its `BuiltinConfig`, or an HF base model with the
    HF config of its sequence-classification class).
    """

    def __init__(
        self,
        backbone: nn.Module,
        config: Any,
        base_model_prefix: str = "model",
        init_std: float | None = None,
    ):
        super().__init__()
        # BuiltinConfig, or the HF config of the *ForSequenceClassification class.
        self.config = config
        self.base_model_prefix = base_model_prefix
        setattr(self, base_model_prefix, backbone)
        weight = next(backbone.parameters())
        self.score = nn.Linear(
            self.hidden_size, 1, bias=False, device=weight.device, dtype=weight.dtype
        )
        self.init_score(init_std)

    @property
    def backbone(self) -> nn.Module:
        """The decoder without its LM head (registered under `base_model_prefix`, as in HF)."""
        return getattr(self, self.base_model_prefix)

    @property
    def is_builtin(self) -> bool:
        return isinstance(self.backbone, DecoderStack)

    @property
    def hidden_size(self) -> int:
        if self.is_builtin:
            return self.config.hidden_size
        return self.config.get_text_config().hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each backbone layer in the backward pass (see `DecoderLayer`, or the
        transformers backbone's own method)."""
        if self.is_builtin:
            checkpoint_layers(self.backbone, gradient_checkpointing_kwargs)
        else:
            checkpointing_method(self.backbone)(gradient_checkpointing_kwargs or {"use_reentrant": False})

    def init_score(self, std: float | None = None) -> None:
        """Re-initialise the head: normal(0, std), std None = 1/sqrt(H + 1), 0.0 = zeros."""
        std = default_init_std(self.hidden_size) if std is None else std
        with torch.no_grad():
            self.score.weight.normal_(0.0, std)  # std 0 fills zeros

    # --- forward -----------------------------------------------------------------------

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, H); arguments as in `values`."""
        if self.is_builtin:
            # BuiltinLM.hidden_states reads nothing of its module but `self.model` (the
            # DecoderStack), which this module also holds: borrowing the method keeps one
            # copy of the mask/position/packing logic without carrying an unused lm_head.
            return BuiltinLM.hidden_states(self, input_ids, attention_mask, position_ids)
        if position_ids is None and attention_mask is not None:
            position_ids = positions_from_mask(attention_mask, input_ids.shape[1])
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        return out.last_hidden_state

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One value per position, float32 (B, T): the critic's V(prefix up to t).

        input_ids (B, T); attention_mask (B, T), 1 = real token (values at padded
        positions are unspecified); position_ids (B, T), default cumsum(mask) - 1.
        """
        hidden = self.hidden_states(input_ids, attention_mask, position_ids)  # (B, T, H)
        return self.score(hidden).squeeze(-1).float()

    forward = values

    def scores(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The reward model's score of each sequence, float32 (B,): the value at its last
        real token, index `last_token_index(attention_mask)` (left or right padding).

        input_ids (B, T); attention_mask (B, T), 1 = real token; None = no padding.
        """
        values = self.values(input_ids, attention_mask)  # (B, T)
        if attention_mask is None:
            return values[:, -1]
        index = last_token_index(attention_mask).to(values.device)
        return values.gather(1, index[:, None]).squeeze(1)

    # --- construction ------------------------------------------------------------------

    @classmethod
    def from_causal_lm(cls, lm: nn.Module, init_std: float | None = None) -> ScalarHeadModel:
        """A critic / reward model initialised from a causal LM (BuiltinLM or HF, peft or not).

        The backbone is a deep copy (a LoRA adapter is merged into the copy first), so the
        new model shares no tensor with `lm`; the LM head is dropped; the score head is
        fresh: normal(0, init_std), init_std None = 1/sqrt(H + 1), 0.0 = zeros.
        """
        source = merged_for_export(lm) if is_peft(lm) else lm
        owned = source is not lm  # merged_for_export already made a copy
        if isinstance(source, BuiltinLM):
            decoder = source.model if owned else copy.deepcopy(source.model)
            return cls(decoder, copy.deepcopy(source.config), "model", init_std)
        config = copy.deepcopy(source.config)
        config.num_labels = 1
        skeleton = _hf_skeleton(config)
        config.architectures = [type(skeleton).__name__]
        base = source.base_model
        return cls(
            base if owned else copy.deepcopy(base), config, skeleton.base_model_prefix, init_std
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        impl: str = "auto",
        head: str = "auto",
        init_std: float | None = None,
    ) -> ScalarHeadModel:
        """Load a reward model / critic, a `*ForSequenceClassification` checkpoint with one
        label, or a plain causal LM (its LM head is dropped).

        head: what becomes of the score head. "auto": the stored one, else (a causal LM) a
        fresh one, with a warning: the start of reward-model training. "stored": the stored
        one, else `MissingScoreHead` (scoring with an untrained head means nothing).
        "fresh": a fresh one, whatever is stored. A fresh head is normal(0, init_std),
        init_std None = 1/sqrt(H + 1), 0.0 = zeros.

        dtype None keeps the checkpoint's dtype; device None means CPU. impl as in
        `load_causal_lm`: "builtin" (Llama, Qwen2, Qwen3, Mistral), "hf", or "auto" (builtin when
        BuiltinLM implements every feature of the checkpoint).
        """
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
        if head not in HEAD_SOURCES:
            raise ValueError(f"unknown head {head!r}; choose one of {HEAD_SOURCES}")
        hf = ckpt.read_config_json(path)  # names the path when it is not a model dir
        if head == "stored":
            require_score_head(path, hf)  # before loading any weight
        dtype = None if dtype is None else resolve_dtype(dtype, device or "cpu")
        if impl == "auto":
            impl = "hf" if ckpt.unsupported_features(hf) else "builtin"
        if impl == "builtin":
            model, stored = cls._load_builtin(path, hf, dtype)
        else:
            model, stored = cls._load_hf(path, dtype)
        if head != "fresh":
            _load_score(model, stored, path, init_std)
        elif init_std is not None:  # "fresh": `cls(...)` made a default-initialised head
            model.init_score(init_std)
        model.name_or_path = str(path)  # as transformers: the tokenizer's and a LoRA base's folder
        return model.to(device or "cpu")

    @classmethod
    def _load_builtin(
        cls, path: str | Path, hf: dict, dtype: torch.dtype | None
    ) -> tuple[ScalarHeadModel, torch.Tensor | None]:
        """The model with its backbone loaded, and the stored score weight (None: none)."""
        problems = ckpt.unsupported_features(hf)
        if problems:
            raise ValueError(
                f"{Path(path) / 'config.json'} cannot be loaded with a built-in backbone: "
                + "; ".join(problems)
                + ". Use impl='hf'."
            )
        config = BuiltinConfig(**ckpt.builtin_fields(hf))
        state = ckpt.read_state_dict(path)
        score = state.pop(SCORE_KEY, None)
        state.pop("lm_head.weight", None)  # a causal LM's head: not part of the backbone
        # Some old checkpoints store the RoPE frequencies; they are recomputed here.
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        dtype = dtype or ckpt.checkpoint_dtype(hf) or state["model.embed_tokens.weight"].dtype
        decoder_state = {
            k.removeprefix("model."): v.to(dtype) if v.is_floating_point() else v
            for k, v in state.items()
            if k.startswith("model.")
        }
        with torch.device("meta"):
            decoder = DecoderStack(config)
        expected = set(decoder.state_dict())
        missing = sorted(expected - set(decoder_state))
        unexpected = sorted(set(decoder_state) - expected) + sorted(
            k for k in state if not k.startswith("model.")
        )
        if missing or unexpected:
            raise ValueError(
                f"weights in {str(path)!r} do not match the {config.model_type} layout: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        decoder.load_state_dict(decoder_state, assign=True)
        decoder.rotary_emb.reset_inv_freq()
        return cls(decoder, config, "model"), score

    @classmethod
    def _load_hf(
        cls, path: str | Path, dtype: torch.dtype | None
    ) -> tuple[ScalarHeadModel, torch.Tensor | None]:
        from transformers import AutoModelForSequenceClassification

        hf_model, info = AutoModelForSequenceClassification.from_pretrained(
            str(path),
            num_labels=1,
            dtype=dtype or "auto",
            local_files_only=True,
            output_loading_info=True,
        )
        head = getattr(hf_model, "score", None)
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"{type(hf_model).__name__} (from {path}) has no `score` head; ScalarHeadModel "
                "takes decoder *ForSequenceClassification models (Llama, Qwen, Mistral, Gemma, GPT-2, ...)"
            )
        prefix = hf_model.base_model_prefix
        model = cls(getattr(hf_model, prefix), hf_model.config, prefix)
        return model, None if SCORE_KEY in info["missing_keys"] else head.weight.detach()

    # --- saving ------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> None:
        """Write an HF checkpoint that `transformers.AutoModelForSequenceClassification` loads.

        Built-in backbone: a standard `LlamaForSequenceClassification` (`Qwen2...`, ...) checkpoint
        (config.json with num_labels 1 and pad_token_id, weights `model.*` + `score.weight`).
        HF backbone: its *ForSequenceClassification class's own `save_pretrained`.
        HF pools at the last token that is not pad_token_id, so config.json must name one:
        without one in the config, the EOS id is written, with a warning.
        """
        if self.is_builtin:
            fields = {**self.config.to_dict(), "pad_token_id": _pad_token_id(self.config)}
            config = {
                **ckpt.hf_config_json(fields, self.dtype),
                "architectures": [ckpt.sequence_classifier(self.config.model_type)],
                "id2label": {"0": "LABEL_0"},
                "label2id": {"LABEL_0": 0},
            }
            ckpt.write_checkpoint(
                path, self.state_dict(), config, ckpt.generation_config_json(fields)
            )
            return
        wrapper = _hf_skeleton(self.config)
        setattr(wrapper, self.base_model_prefix, self.backbone)
        wrapper.score = self.score
        text_config = wrapper.config.get_text_config()
        text_config.pad_token_id = _pad_token_id(text_config)
        wrapper.save_pretrained(str(path))


def _hf_skeleton(config: Any) -> nn.Module:
    """The *ForSequenceClassification model of `config` on the meta device (no memory),
    checked to have a `score` head; its submodules are replaced before any use."""
    from transformers import AutoModelForSequenceClassification

    try:
        with torch.device("meta"):
            skeleton = AutoModelForSequenceClassification.from_config(config)
    except ValueError as err:
        raise ValueError(
            f"model type {config.model_type!r} has no sequence-classification class: {err}"
        ) from None
    if not isinstance(getattr(skeleton, "score", None), nn.Linear):
        raise ValueError(
            f"{type(skeleton).__name__} has no `score` head; ScalarHeadModel takes decoder "
            "*ForSequenceClassification models (Llama, Qwen, Mistral, Gemma, GPT-2, ...)"
        )
    return skeleton


def _load_score(
    model: ScalarHeadModel, weight: torch.Tensor | None, path: str | Path, init_std: float | None
) -> None:
    """Copy a stored (1, H) head into `model`, or keep the fresh head it was built with
    (re-initialised with `init_std` when given) and say so."""
    if weight is None:
        if init_std is not None:
            model.init_score(init_std)
        std = default_init_std(model.hidden_size) if init_std is None else init_std
        logger.warning("no score head in %s; initialising it (normal, std %.4g)", path, std)
        return
    if tuple(weight.shape) != (1, model.hidden_size):
        raise ValueError(
            f"{path}: score.weight has shape {tuple(weight.shape)}; a reward model or critic "
            f"needs one output, (1, {model.hidden_size})"
        )
    with torch.no_grad():
        model.score.weight.copy_(weight)


def _pad_token_id(config: Any) -> int:
    """config.pad_token_id, else the (first) EOS id with a warning, for HF's pooling."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        raise ValueError(
            "config.pad_token_id and eos_token_id are both unset; set model.config.pad_token_id "
            "(the tokenizer's pad id) before saving: transformers pools scores at the last non-pad token"
        )
    logger.warning(
        "config.pad_token_id is unset; saving pad_token_id=%d (the EOS id). transformers pools at "
        "the last token that is not the pad id, so a sequence ending in EOS is scored one token "
        "earlier there than by ScalarHeadModel.scores",
        eos,
    )
    return eos
