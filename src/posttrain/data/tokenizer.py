"""The built-in tokenizer: byte-level, so any text round-trips, with chat special tokens.

It is a real `transformers` fast tokenizer built locally with `tokenizers` (no download):
256 byte tokens plus a few special tokens, a BOS added on plain encoding, and a chat
template whose assistant turns are wrapped in `{% generation %}` marks, so that
`apply_chat_template(..., return_assistant_tokens_mask=True)` gives the assistant-only
loss mask. Saved beside a model, `AutoTokenizer.from_pretrained(dir)` loads it offline.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS.values()]

# Each turn is `<|role|>content<|eos|>`; only the assistant's content and its EOS sit inside
# the generation marks, so the model learns to stop and never learns the user's text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|eos|>{% endgeneration %}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>"
    "{% else %}"
    "{{ raise_exception('unknown chat role ' ~ message['role'] ~ '; use system, user or assistant') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_chars() -> list[str]:
    """The printable stand-in for each byte 0..255 used by byte-level pre-tokenizers (GPT-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer: ids 0..5 are special tokens, 6 + b is byte b.

    Special tokens: `<|pad|>` (0), `<|bos|>` (1), `<|eos|>` (2), and the role markers
    `<|system|>`, `<|user|>`, `<|assistant|>` used by the chat template.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + b for b, ch in enumerate(_byte_chars())})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
