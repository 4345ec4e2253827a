"""A tiny built-in model taught one tool-use episode (a few seconds of SFT on the CPU), so the
episode loop runs a real call, a real answer and a final answer."""

import pytest
import torch

from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinConfig, BuiltinLM
from posttrain.models.builtin import next_token_loss

PROMPT = "Q: 23*47+5?"

USER_ENV = '''
from posttrain.envs import ToolEnvironment, calculator


class MyEnv(ToolEnvironment):
    """The calculator; reward 1 when the final answer ends in the row's answer."""

    def __init__(self):
        super().__init__(tools=[calculator], describe_tools=False)

    def score(self, answer):
        return float(answer.strip().endswith(str(self.row["answer"])))
'''
"""A user environment as a file (`rollout.env=ROOT/my_env.py:MyEnv`), written by `write_setup`."""


def write_setup(root, model, tok):
    """ROOT/model (the model and tokenizer) and ROOT/my_env.py (`USER_ENV`); returns ROOT."""
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "my_env.py").write_text(USER_ENV)
    return root
DEMO = " <call>calculator(23*47)</call><result>1081</result> 1081+5 <call>calculator(1081+5)</call><result>1086</result> A: 1086"


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="session")
def taught(tok) -> BuiltinLM:
    """Greedy decoding of PROMPT gives DEMO (calls, results and answer) then EOS."""
    torch.manual_seed(0)
    config = BuiltinConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = BuiltinLM(config)
    ids = torch.tensor([tok(PROMPT + DEMO)["input_ids"] + [tok.eos_token_id]])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = next_token_loss(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    return model.eval()
