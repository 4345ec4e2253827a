"""Prompts cut before tokenising (issue #31 item 11): an RL prompt and a DPO prompt keep their
last `char_bound` characters (`collate.cut_text`, as their tokens keep the last ones), so a
30 MB prompt reaches the tokenizer as a bounded string, and a normal row gives exactly the
tokens of tokenise-then-truncate. The tokenizers are real: the built-in byte-level one (with its
chat template) and a BPE with multi-character merges trained here."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.config.rl import RLDataConfig
from posttrain.data.collate import char_bound, cut_text
from posttrain.data.preference import encode_pair, tokenize_pairs
from posttrain.data.prompts import encode_prompt, load_prompts
from posttrain.data.tokenizer import build_tokenizer

BOS = 1
WORDS = "the cat sat on the mat, 12+34=46 and thethethe " * 200  # 9,400 characters: several bounds
HUGE = "12+34=46 " * 3_500_000  # 31.5 MB on one line


def b(text: str) -> list[int]:
    """Ids of `text` in the built-in byte-level tokenizer (byte v is id 6 + v)."""
    return [6 + v for v in text.encode()]


class Recording:
    """The real tokenizer, unchanged, recording how many characters each call is given."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []

    def __call__(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self.inner(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.lengths.append(sum(len(m["content"]) for m in messages))
        return self.inner.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    """A BPE with merges up to whole words and a chat template of its own (no special tokens)."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator(["the cat sat on the mat, 12+34=46 and thethethe"] * 50,
                             trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")
    out.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    return out


def test_cut_text_keeps_the_start_or_the_end_and_returns_what_it_did_not_cut():
    messages = [{"role": "user", "content": "abcdef"}, {"role": "assistant", "content": "xy"}]
    assert cut_text("abcdef", 4) == "abcd" and cut_text("abcdef", 4, keep_end=True) == "cdef"
    assert cut_text(messages, 4, keep_end=True) == [{"role": "user", "content": "cdef"}, messages[1]]
    assert cut_text(messages, 6) is messages and cut_text("abc", None) == "abc"


@pytest.mark.parametrize("which, chat", [("builtin", False), ("builtin", True), ("bpe", False), ("bpe", True)])
def test_an_rl_prompt_cut_before_tokenising_keeps_the_tokens_of_tokenise_then_truncate(tok, bpe, which, chat):
    tokenizer = tok if which == "builtin" else bpe
    cfg = RLDataConfig(max_prompt_length=24, truncation="left")
    assert char_bound(tokenizer, 24) < len(WORDS) / 2  # the long row is cut

    def prompt(text):
        return [{"role": "user", "content": text}] if chat else text

    rows = [{"prompt": prompt(WORDS), "answer": "1"}, {"prompt": prompt("the cat"), "answer": "2"}]
    examples, stats = load_prompts([dict(r) for r in rows], tokenizer, cfg)
    # The reference: the whole prompt tokenised, then its last max_prompt_length tokens.
    full = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    assert [e["ids"] for e in examples] == [full[0][-24:], full[1]]
    assert stats["data/n_truncated"] == 1 and examples[0]["prompt"] == rows[0]["prompt"]  # rewards see it whole


@pytest.mark.parametrize("chat", [False, True])
def test_a_30_mb_rl_prompt_reaches_the_tokenizer_bounded(tok, chat):
    recording = Recording(tok)
    bound = char_bound(tok, 64)
    huge = [{"role": "user", "content": HUGE}] if chat else HUGE
    examples, stats = load_prompts([{"prompt": huge}], recording, RLDataConfig(max_prompt_length=64, truncation="left"))
    # Before: the whole 31.5 MB went to the tokenizer, to keep 64 tokens.
    assert max(recording.lengths) <= bound < 10_000
    # The ids the bounded input predicts: with this tokenizer, the last 64 bytes' (for chat
    # data, the last 62 and the template's <|eos|><|assistant|>), as the whole prompt would give.
    assert examples[0]["ids"] == encode_prompt(tok, cut_text(huge, bound, keep_end=True))[-64:]
    end_of_turn = [tok.eos_token_id, tok.convert_tokens_to_ids("<|assistant|>")]
    assert examples[0]["ids"] == (b(HUGE[-62:]) + end_of_turn if chat else b(HUGE[-64:]))
    assert stats["data/n_truncated"] == 1


def test_a_30_mb_rl_prompt_over_the_limit_is_still_an_error_naming_the_row(tok):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"list: row 1 has over \d+ characters, more than 64 tokens"):
        load_prompts([{"prompt": HUGE}], tok, RLDataConfig(max_prompt_length=64))


@pytest.mark.parametrize("which, chat", [("builtin", False), ("builtin", True), ("bpe", False), ("bpe", True)])
@pytest.mark.parametrize("max_prompt_length", [16, None])
def test_a_dpo_prompt_cut_before_tokenising_gives_the_pairs_of_tokenise_then_truncate(tok, bpe, which, chat,
                                                                                      max_prompt_length):
    """TRL keeps a long prompt's end (`truncation_mode="keep_end"`), as we do; without
    max_prompt_length a prompt over max_length drops its pair, cut or not."""
    tokenizer = tok if which == "builtin" else bpe
    assert char_bound(tokenizer, max_prompt_length or 40) < len(WORDS) / 2  # the long prompt is cut

    def row(prompt, chosen, rejected):
        if chat:
            return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]}
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}

    rows = [row(WORDS, "4", "5"), row("2+2=", "4", "5 " * 40)]
    examples, stats = tokenize_pairs(rows, tokenizer, "preference", max_length=40, max_prompt_length=max_prompt_length)
    # The reference: every side tokenised whole (no bound), then cut.
    reference = [encode_pair(r, tokenizer, "preference", 40, max_prompt_length) for r in rows]
    assert examples == [ex for ex, _, _ in reference if ex is not None]
    assert stats.n_prompt_truncated == sum(cut for _, _, cut in reference)
    assert stats.n_dropped_no_loss == sum(outcome == "no_loss" for _, outcome, _ in reference)
    assert reference[0][2] if max_prompt_length else reference[0][1] == "no_loss"  # the long prompt mattered


def test_a_30_mb_dpo_prompt_reaches_the_tokenizer_bounded(tok):
    recording = Recording(tok)
    rows = [{"prompt": HUGE, "chosen": "4", "rejected": "5"}]
    examples, stats = tokenize_pairs(rows, recording, "preference", max_length=64, max_prompt_length=32)
    bound = char_bound(tok, 32)
    assert max(recording.lengths) <= bound < 10_000  # before: 31.5 MB, twice (once per side)
    assert examples[0]["prompt_ids"] == list(tok(HUGE[-bound:])["input_ids"])[-32:] == b(HUGE[-32:])
    assert examples[0]["chosen_ids"] == b("4") + [tok.eos_token_id] and stats.n_prompt_truncated == 1
