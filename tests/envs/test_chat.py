"""The chat-template path: tools rendered by `apply_chat_template(tools=...)`, tool calls
parsed by `tokenizer.parse_response`, results rendered as tool messages, and a chat tool-use
episode on a tiny model. The tokenizer is the built-in byte tokenizer with a tool-aware chat
template and a response template written here (Qwen's shape: JSON inside <tool_call> tags)."""

import pytest
import torch

from posttrain.data.tokenizer import build_tokenizer
from posttrain.envs import ToolCall, ToolEnvironment, calculator, play_episodes
from posttrain.envs.chat import ChatProtocol, render_prompt
from posttrain.envs.text_protocol import MalformedCall
from posttrain.envs.tools import as_tool
from posttrain.models import BuiltinConfig, BuiltinLM
from posttrain.models.builtin import next_token_loss
from posttrain.rollout import MultiTurnLimits, SamplingParams, make_engine

TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|eos|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|eos|>"
    "{% elif m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response><|eos|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|eos|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
RESPONSE_TEMPLATE = {
    "start_anchor": "<|assistant|>",
    "fields": {
        "content": {"content": "text"},
        "tool_calls": {
            "open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
            "transform": {"type": "function", "function": {"name": "{content.name}", "arguments": "{content.arguments}"}},
        },
    },
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call>'


@pytest.fixture(scope="module")
def chat_tok():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def test_the_prompt_carries_the_tool_schemas(chat_tok):
    schema = as_tool(calculator).schema
    text = render_prompt(chat_tok, [{"role": "user", "content": "23*47?"}], [schema])
    assert text.startswith('<|bos|><|system|>Tools: {"type": "function", "function": {"name": "calculator"')
    assert text.endswith("<|user|>23*47?<|eos|><|assistant|>")


def test_tool_calls_are_parsed_by_the_response_template(chat_tok):
    protocol = ChatProtocol(chat_tok)
    assert protocol.stop == () and protocol.describe([]) is None
    assert protocol.parse_calls("Let me compute. " + CALL + CALL.replace("23*47", "1+1")) == [
        ToolCall("calculator", {"expression": "23*47"}), ToolCall("calculator", {"expression": "1+1"})
    ]
    assert protocol.parse_calls("The answer is 1081.") == []
    (bad,) = protocol.parse_calls('<tool_call>{"name": </tool_call>')
    assert isinstance(bad, MalformedCall) and "JSON" in bad.message


def test_results_render_as_the_template_renders_tool_messages(chat_tok):
    protocol = ChatProtocol(chat_tok)
    observation = protocol.format_results([("calculator", "1081")])
    assert observation == "<|user|><tool_response>1081</tool_response><|eos|><|assistant|>"
    # prompt + the model's turn (with its EOS) + observation == the template's whole chat
    chat = [{"role": "user", "content": "23*47?"}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "23*47"}}}
    whole = render_prompt(chat_tok, chat + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "name": "calculator", "content": "1081"}])
    assert render_prompt(chat_tok, chat) + CALL + "<|eos|>" + observation == whole


def test_a_tokenizer_without_a_response_template_is_refused_with_a_way_out():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="response_template"):
        ChatProtocol(tok)


def test_a_chat_tool_use_episode(chat_tok):
    """A tiny model taught one chat episode: its call is parsed, run, answered through the
    template, and its final answer ends the episode."""
    protocol = ChatProtocol(chat_tok)
    messages = [{"role": "user", "content": "23*47?"}]
    prompt = render_prompt(chat_tok, messages, [as_tool(calculator).schema])
    demo = CALL + "<|eos|>" + protocol.format_results([("calculator", "1081")]) + "1081<|eos|>"
    torch.manual_seed(0)
    model = BuiltinLM(BuiltinConfig(vocab_size=len(chat_tok), hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, eos_token_id=2, pad_token_id=0))
    ids = torch.tensor([chat_tok(prompt + demo, add_special_tokens=False)["input_ids"]])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(400):
        loss = next_token_loss(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.005:
            break

    class Calc(ToolEnvironment):
        def __init__(self):
            super().__init__(tools=[calculator], protocol=protocol)

        def score(self, answer: str) -> float:
            return float(answer.strip() == "1081")

    engine = make_engine("native", model.eval(), chat_tok)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=120)
    out, rewards, metrics = play_episodes(engine, [{"prompt": messages}], Calc, params, MultiTurnLimits(3, 300))
    assert out.prompt_ids[0] == chat_tok(prompt, add_special_tokens=False)["input_ids"]
    assert chat_tok.decode(out.response_ids[0, : int(out.total_lengths[0])]) == demo
    assert out.turns.tolist() == [2] and rewards.tolist() == [1.0] and metrics["tool_calls/mean"] == 1.0
    observation = chat_tok(protocol.format_results([("calculator", "1081")]), add_special_tokens=False)["input_ids"]
    assert int(out.lengths[0]) == int(out.total_lengths[0]) - len(observation)
