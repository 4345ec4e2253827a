"""The chat-template path for HF chat models: tools in the prompt, tool calls parsed, tool
results rendered as the template renders tool messages.

    protocol = ChatProtocol(tokenizer)                      # needs tokenizer.response_template
    prompt = render_prompt(tokenizer, messages, tools=env.schemas)
    calls = protocol.parse_calls(turn_text)                 # [ToolCall(name, {arguments})]
    observation = protocol.format_results([("calculator", "1081")])

- Rendering: `tokenizer.apply_chat_template(messages, tools=schemas,
  add_generation_prompt=True)`; the schemas are `get_json_schema`'s (tools.py), the format
  transformers documents for `tools=`.
- Parsing: transformers 5.x parses a generation back into a message with
  `tokenizer.parse_response(text, schema, prefix=...)`, driven by the tokenizer's
  `response_template` (saved in tokenizer_config.json; model repositories add theirs).
  `tool_calls` of the message become `ToolCall`s with dict arguments. A response the
  template cannot parse (a tool call that is not JSON) is one `MalformedCall`.
- Results: a chat model ends every turn with its end-of-turn token (the tokenizer's EOS,
  which the episode loop keeps in the trajectory), so the episode continues with what the
  template writes after an assistant message: the tool messages
  (`{"role": "tool", "name": ..., "content": ...}`) and the next generation prompt. That
  text is found by rendering a conversation with a placeholder assistant message, with and
  without the tool messages, and cutting after the placeholder and its EOS. A template
  whose rendering of earlier messages changes when tool messages follow cannot be cut so
  and is an error, never a silently wrong trajectory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from posttrain.envs.text_protocol import MalformedCall
from posttrain.envs.tools import ToolCall

_PLACEHOLDER = "POSTTRAIN-ASSISTANT-TURN"


def render_prompt(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
    """The prompt text of a chat with its tools, ending in the generation prompt."""
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=False
    )


class ChatProtocol:
    """Tool calls in the model family's own format (module docstring).

    Args:
        tokenizer: a chat tokenizer with a chat template that renders `tool` messages.
        response_template: the parsing spec; default `tokenizer.response_template`.
    """

    stop: tuple[str, ...] = ()
    """No stop string: the turn ends on the model's end-of-turn token (EOS)."""

    def __init__(self, tokenizer, response_template: dict | None = None):
        template = response_template if response_template is not None else getattr(tokenizer, "response_template", None)
        if template is None:
            raise ValueError(
                "the tokenizer has no response_template, so its tool calls cannot be parsed; pass "
                "ChatProtocol(tokenizer, response_template=...) (see transformers' response parsing docs) "
                "or use the plain-text protocol"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatProtocol needs a tokenizer with a chat template")
        self.tokenizer, self.template = tokenizer, template
        user = [{"role": "user", "content": "u"}]
        with_prompt = render_prompt(tokenizer, user)
        self.turn_prefix = with_prompt[len(tokenizer.apply_chat_template(user, tokenize=False)) :]

    def parse_calls(self, text: str) -> list[ToolCall | MalformedCall]:
        """The tool calls of one assistant turn (its text as generated, EOS left out)."""
        try:
            message = self.tokenizer.parse_response(text, self.template, prefix=self.turn_prefix)
        except ValueError as e:
            return [MalformedCall(text, f"tool calls must be JSON ({str(e).splitlines()[0]})")]
        calls: list[ToolCall | MalformedCall] = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function", call)
            arguments = fn.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(fn.get("name"), str) or not isinstance(arguments, dict):
                calls.append(MalformedCall(json.dumps(call), "a tool call needs a name and JSON object arguments"))
            else:
                calls.append(ToolCall(fn["name"], arguments))
        return calls

    def format_results(self, results: Sequence[tuple[str, str]]) -> str:
        """What the template writes after an assistant turn for these tool results (name,
        text), through the next generation prompt."""
        chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PLACEHOLDER}]
        tools = [{"role": "tool", "name": name, "content": text} for name, text in results]
        base = self.tokenizer.apply_chat_template(chat, tokenize=False)
        full = render_prompt(self.tokenizer, chat + tools)
        end = base.index(_PLACEHOLDER) + len(_PLACEHOLDER)
        eos = self.tokenizer.eos_token or ""
        if eos and full.startswith(eos, end):
            end += len(eos)
        if full[:end] != base[:end]:
            raise ValueError("the chat template renders the assistant turn differently when tool messages follow")
        return full[end:]

    def describe(self, schemas: Sequence[dict]) -> str | None:
        """Nothing to append: the tools reach the model through the chat template."""
        return None
