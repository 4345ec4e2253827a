"""The built-in decoder-only language model (seed section 一): Llama, Qwen2, Qwen3, Mistral.

Notation: B batch, T new tokens, T_kv keys attended (cached + new), H hidden
size, nh query heads, nkv key/value heads, D head dim, V vocab, L layers.

    input_ids (B, T) --embed_tokens--> (B, T, H)
      --L x [x += attn(rmsnorm(x)); x += swiglu(rmsnorm(x))]--> (B, T, H)
      --norm--> hidden states (B, T, H) --lm_head--> logits (B, T, V)

Module and parameter names are those of transformers' `LlamaForCausalLM`
(`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`, ..., `model.norm`,
`lm_head`), so state dicts map 1:1 and peft `target_modules` are the same.
`config.model_type` picks the family, whose names are Llama's plus its own:
qwen2 gives q/k/v_proj a bias; qwen3 adds `self_attn.q_norm` / `k_norm` (RMSNorm over
each head's D features of q and k, before RoPE); mistral is Llama's layers.
`save_pretrained` writes a standard checkpoint of that family that plain transformers
loads with the same logits; `from_pretrained` reads any such checkpoint whose
features it implements (see `llama_checkpoint.unsupported_features`).

Departures from the seed: RoPE uses the half-split pairing of HF Llama (see
layers.py); the input embedding and output head are tied by default but may be
untied, as many released checkpoints are; attention has grouped KV heads,
padding masks, packed documents and a KV cache (the seed has none of these).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models import llama_checkpoint as ckpt
from posttrain.models.document_rows import DocumentRows, document_rows, document_starts
from posttrain.models.kv_cache import KVCache
from posttrain.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding


@dataclass
class BuiltinConfig:
    """Sizes and constants of a BuiltinLM; field names are those of HF `LlamaConfig`."""

    vocab_size: int
    """V: number of token ids (rows of the embedding and of lm_head)."""
    hidden_size: int
    """H: width of the residual stream."""
    intermediate_size: int
    """I: width of the SwiGLU MLP (about 8/3 H by convention)."""
    num_hidden_layers: int
    """L: number of decoder blocks."""
    num_attention_heads: int
    """nh: query heads per attention layer."""
    num_key_value_heads: int | None = None
    """nkv: key/value heads (grouped-query attention when < nh; must divide nh). None = nh."""
    head_dim: int | None = None
    """D: width of each head (even). None = H // nh."""
    rms_norm_eps: float = 1e-6
    """epsilon inside the RMSNorm square root."""
    rope_theta: float = 10000.0
    """RoPE base b: pair i turns by angle m * b^(-2i/D) at position m."""
    rope_scaling: dict | None = None
    """Llama 3.1 RoPE frequency scaling (HF rope_type "llama3"): keys `factor`,
    `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`.
    None = plain RoPE."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is meant for (recorded in config.json; RoPE itself has no limit)."""
    tie_word_embeddings: bool = True
    """lm_head.weight is the embedding matrix itself (one tensor), as in the seed."""
    initializer_range: float = 0.02
    """std of the normal initialisation of linear and embedding weights."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, written to config.json for tokenizers and generate()."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence id(s) that stop generation."""
    pad_token_id: int | None = None
    """Padding id (padding is excluded by the attention mask, not by this id)."""
    model_type: str = "llama"
    """The transformers family saved and loaded (`llama_checkpoint.ARCHITECTURES`): "llama",
    "mistral" (the same layers), "qwen2" (bias on q/k/v), "qwen3" (q/k RMSNorm per head)."""

    @property
    def qkv_bias(self) -> bool:
        """q_proj, k_proj and v_proj have a bias (Qwen2; o_proj has none)."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Each query and key head is RMS-normalised over its D features before RoPE (Qwen3)."""
        return self.model_type == "qwen3"

    def __post_init__(self) -> None:
        if self.model_type not in ckpt.ARCHITECTURES:
            raise ValueError(
                f"BuiltinConfig.model_type={self.model_type!r}; choose one of {list(ckpt.ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"BuiltinConfig.{name} must be positive, got {getattr(self, name)}"
                )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"BuiltinConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"BuiltinConfig.hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"BuiltinConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            missing = set(ckpt.LLAMA3_ROPE_KEYS) - set(self.rope_scaling)
            if missing:
                raise ValueError(f"BuiltinConfig.rope_scaling lacks {sorted(missing)}")
            self.rope_scaling = {k: self.rope_scaling[k] for k in ckpt.LLAMA3_ROPE_KEYS}

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, dict] = {
    # 1,832,640 parameters at V = 320 (tied embeddings).
    "tiny": dict(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=2048,
    ),
    # 25,862,656 parameters at V = 320 (tied embeddings).
    "small": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    ),
}
"""Fresh-model sizes for `BuiltinLM.from_preset` (config key `model.init`)."""


def positions_from_mask(attention_mask: torch.Tensor, num_new: int) -> torch.Tensor:
    """Position of each of the last `num_new` tokens among the real tokens of its row.

    attention_mask (B, T_kv), 1 = real -> (B, T_new) = cumsum - 1, clamped at 0,
    so left-padded rows start at position 0 at their first real token.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions[:, -num_new:].clamp(min=0)


def attention_mask_for_sdpa(
    attention_mask: torch.Tensor | None,
    past_len: int,
    num_new: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, bool]:
    """The (mask, is_causal) pair for scaled_dot_product_attention.

    attention_mask (B, T_kv) padding mask, 1 = real key, or None. Returns a bool mask
    (B or 1, 1, T_new, T_kv), True = may attend, combining causality (key position <=
    query position) and padding; or None with is_causal telling SDPA to build the
    causal mask itself (the fast path: no padding). Packed documents are not masked
    here but regrouped (`document_rows`).
    """
    if attention_mask is None:
        if num_new == 1 or past_len == 0:
            return None, num_new > 1
    elif num_new == 1:
        # Decode step: the causal part is all True, only padding matters.
        mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T_kv)
        return mask | ~mask.any(-1, keepdim=True), False
    query_pos = torch.arange(past_len, past_len + num_new, device=device)
    key_pos = torch.arange(past_len + num_new, device=device)
    mask = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, T_new, T_kv)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    # A query with no visible key (a padding position in a left-padded row) would
    # give NaN; let it see every key instead: its output is never used.
    return mask | ~mask.any(-1, keepdim=True), False


class DecoderStack(nn.Module):
    """Embeddings, decoder blocks and final norm: HF `LlamaModel`'s (`Qwen2Model`'s, ...) counterpart."""

    def __init__(self, config: BuiltinConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config.hidden_size,
                config.intermediate_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                config.rms_norm_eps,
                qkv_bias=config.qkv_bias,
                qk_norm=config.qk_norm,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | DocumentRows | None,
        is_causal: bool,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """input_ids (B, T), position_ids (B, T) -> final-normed hidden states (B, T, H)."""
        x = self.embed_tokens(input_ids)  # (B, T, H)
        cos, sin = self.rotary_emb(position_ids, x.dtype)  # (B, T, D) each
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, is_causal, cache, i)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.norm(x)


def checkpoint_layers(decoder: DecoderStack, kwargs: dict | None = None) -> None:
    """Turn on gradient checkpointing in every block of `decoder` (see `DecoderLayer`);
    kwargs of `torch.utils.checkpoint.checkpoint`, default {"use_reentrant": False}."""
    for layer in decoder.layers:
        layer.checkpoint_kwargs = dict(kwargs or {"use_reentrant": False})


class BuiltinLM(nn.Module):
    """Decoder-only causal LM; `model(input_ids, attention_mask)` gives logits (B, T, V).

    Masks and positions (every forward):
    - attention_mask (B, T_kv), 1 = real token, covers cached + new positions;
      padded keys are never attended, so real tokens get the same logits with
      left or right padding as without.
    - position_ids (B, T) default to cumsum(attention_mask) - 1 (clamped at 0)
      over the cached + new positions, or to past_len + arange(T) without a mask.
    - Packing: with position_ids and no attention_mask (and no cache), a new
      document starts wherever positions restart (e.g. at 0) and attention
      never crosses documents: it runs per group of documents
      (`document_rows`), while everything else sees the tokens as given.
    - Incremental decoding: pass `cache=model.new_cache(B, max_len)`; each call
      appends its T new tokens to the cache (see KVCache), and attention_mask
      must then cover all cached + new positions.
    """

    def __init__(self, config: BuiltinConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()
        self.tie_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)  # as transformers initialises Qwen2's q/k/v bias

    def tie_weights(self) -> None:
        """Make lm_head.weight the embedding tensor itself when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, **overrides) -> BuiltinLM:
        """A freshly initialised model of preset size `name` (see PRESETS).

        tiny: H 192, L 4, nh = nkv 6, I 512: 1,832,640 parameters at V = 320.
        small: H 512, L 8, nh = nkv 8, I 1408: 25,862,656 parameters at V = 320.
        `overrides` replace any BuiltinConfig field (e.g. num_key_value_heads=2).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(BuiltinConfig(**{**PRESETS[name], "vocab_size": vocab_size, **overrides}))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        """Distinct trainable numbers (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder block in the backward pass (transformers' method of the same
        name; see `DecoderLayer`). kwargs go to `torch.utils.checkpoint.checkpoint`, default
        {"use_reentrant": False}."""
        checkpoint_layers(self.model, gradient_checkpointing_kwargs)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty KVCache for `batch_size` rows and up to `max_len` positions (prompt + new)."""
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers,
            batch_size,
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            dtype=dtype or self.dtype,
            device=device or self.device,
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, H), for value and reward heads.

        input_ids (B, T); attention_mask (B, past_len + T) or None; position_ids
        (B, T) or None; cache: a KVCache holding past_len positions per row, or None.
        """
        b, t = input_ids.shape
        past_len = 0 if cache is None else cache.length
        if cache is not None and cache.batch_size != b:
            raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has {b}")
        if attention_mask is not None and tuple(attention_mask.shape) != (b, past_len + t):
            raise ValueError(
                f"attention_mask must be (B, cached + new) = ({b}, {past_len + t}), "
                f"got {tuple(attention_mask.shape)}"
            )
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids[None]  # (T,) shared by all rows
        if position_ids is not None and attention_mask is None and cache is None:
            position_ids = position_ids.expand(b, t)
            if bool(document_starts(position_ids).view(b, t)[:, 1:].any()):  # packed documents
                return self.model(input_ids, position_ids, document_rows(position_ids), False, None)
        if cache is None and attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: take SDPA's causal fast path
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask, t)
            else:
                position_ids = torch.arange(past_len, past_len + t, device=input_ids.device)[None]
        position_ids = position_ids.expand(b, t)
        mask, is_causal = attention_mask_for_sdpa(attention_mask, past_len, t, input_ids.device)
        return self.model(input_ids, position_ids, mask, is_causal, cache)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Next-token logits (B, T, V); arguments as in `hidden_states`."""
        return self.lm_head(self.hidden_states(input_ids, attention_mask, position_ids, cache))

    def save_pretrained(self, path: str | Path) -> None:
        """Write a standard checkpoint of `config.model_type` (config.json,
        generation_config.json, model.safetensors) that `transformers.AutoModelForCausalLM`
        loads as is (a `LlamaForCausalLM`, `Qwen2ForCausalLM`, ...).

        With tied embeddings only `model.embed_tokens.weight` is stored, as HF does.
        """
        fields = self.config.to_dict()
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        ckpt.write_checkpoint(
            path,
            state,
            ckpt.hf_config_json(fields, self.dtype),
            ckpt.generation_config_json(fields),
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> BuiltinLM:
        """Load a Llama, Qwen2, Qwen3 or Mistral checkpoint directory (safetensors, sharded or
        not, or pytorch_model.bin).

        dtype None keeps the dtype recorded in config.json (else that of the
        stored embedding); device None means CPU. Raises ValueError naming the
        config.json field when the checkpoint needs something BuiltinLM lacks.
        """
        hf = ckpt.read_config_json(path)
        problems = ckpt.unsupported_features(hf)
        if problems:
            raise ValueError(
                f"{Path(path) / 'config.json'} cannot be loaded as a BuiltinLM: "
                + "; ".join(problems)
                + ". Use load_causal_lm(path, impl='hf')."
            )
        config = BuiltinConfig(**ckpt.builtin_fields(hf))
        # Some old checkpoints store the RoPE frequencies; they are recomputed here.
        state = ckpt.read_state_dict(path)
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        dtype = dtype or ckpt.checkpoint_dtype(hf) or state["model.embed_tokens.weight"].dtype
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        with torch.device("meta"):
            model = cls(config)
        expected = set(model.state_dict()) - (
            {"lm_head.weight"} if config.tie_word_embeddings else set()
        )
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"weights in {str(path)!r} do not match the {config.model_type} layout: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        model.model.rotary_emb.reset_inv_freq()
        model.name_or_path = str(path)  # as transformers: the tokenizer's and a LoRA base's folder
        return model.to(device or "cpu")


def next_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from the logits at position t.

    logits (B, T, V); labels (B, T) token ids, -100 = not a target;
    attention_mask (B, T), 1 = real token. Target t+1 counts when its label is
    not -100 and both positions t and t+1 are real (a padding position never
    predicts, so padding never changes the loss):

        loss = -(1/N) sum_{valid (b, t)} log softmax(logits[b, t])[labels[b, t+1]]

    Returns a float32 scalar (0 when no target is valid).
    """
    targets = labels[:, 1:]  # (B, T-1)
    valid = targets != -100
    if attention_mask is not None:
        valid = valid & attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    losses = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2),  # (B, V, T-1)
        targets.masked_fill(~valid, 0),
        reduction="none",
    )  # (B, T-1)
    return (losses * valid).sum() / valid.sum().clamp(min=1)
