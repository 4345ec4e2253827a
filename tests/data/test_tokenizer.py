"""The built-in byte-level tokenizer: round trips, special tokens, chat template marks."""

from transformers import AutoTokenizer

from posttrain.data.tokenizer import build_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
]


def test_special_tokens_and_byte_ids():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 6 + 256
    ids = tok("AB")["input_ids"]
    assert ids == [tok.bos_token_id, 6 + ord("A"), 6 + ord("B")]  # BOS, then one id per byte


def test_any_text_round_trips():
    tok = build_tokenizer()
    text = "héllo ✓\n\t 12*3=36 <not special>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_chat_template_marks_assistant_tokens():
    tok = build_tokenizer()
    out = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "4<|eos|>"  # the answer and its EOS, nothing of the user's turn
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>Be brief.<|eos|><|user|>2+2=<|eos|><|assistant|>"


def test_saved_tokenizer_loads_offline(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
    assert again.eos_token == "<|eos|>" and again.pad_token == "<|pad|>"
    out = again.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert sum(out["assistant_masks"]) == 2
