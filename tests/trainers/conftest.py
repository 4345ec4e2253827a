"""What the trainer tests share: one torch thread per test, the built-in tokenizer, the Ray
session of the Ray test files (one per file), and a tiny model taught to play GuessNumber."""

import pytest
import torch

from posttrain.data.tokenizer import build_tokenizer
from posttrain.distributed.ray_session import RaySession

from .ray_procs import raylets, wait_gone


@pytest.fixture(scope="module")
def ray_session():
    pytest.importorskip("ray")
    session = RaySession(None, num_cpus=4)  # 4 logical CPUs on CI's 2 cores: room for 3 pools
    marker = session.temp_dir
    try:
        yield session
    finally:
        own = raylets(marker)
        session.close()
        assert not wait_gone(own), "a raylet outlived ray.shutdown()"


@pytest.fixture(scope="module")
def tok():
    """The built-in byte tokenizer."""
    return build_tokenizer()


GUESS_PROMPT = "Guess."
GUESS_ROWS = [{"prompt": GUESS_PROMPT, "secret": s, "low": 1, "high": 3} for s in (1, 2, 3, 2)]


@pytest.fixture(scope="module")
def guesser():
    """A float64 model taught (100 AdamW steps) to play GuessNumber over 1..3 on the byte
    tokenizer: sampled at temperature 1 it guesses 1, 2 or 3, reads `<result>higher</result>`
    and guesses again, so a group's episodes differ in turns and rewards."""
    from posttrain.data.tokenizer import build_tokenizer
    from posttrain.envs import GuessNumber
    from posttrain.models import BuiltinConfig, BuiltinLM
    from posttrain.models.builtin import next_token_loss

    tok = build_tokenizer()
    intro = GuessNumber().reset({"secret": 2, "low": 1, "high": 3})
    plays = [f" <call>guess({a})</call><result>{'higher' if a < 2 else 'lower'}</result> <call>guess(2)</call>"
             for a in (1, 3)] + [" <call>guess(2)</call>"]
    seqs = [torch.tensor([tok(GUESS_PROMPT + intro + p)["input_ids"] + [tok.eos_token_id]]) for p in plays]
    torch.manual_seed(0)
    model = BuiltinLM(BuiltinConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    for _ in range(100):
        loss = sum(next_token_loss(model(x), x) for x in seqs) / len(seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), tok
