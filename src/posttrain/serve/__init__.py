"""An OpenAI-compatible HTTP server for a local causal LM, with batched generation:
FastAPI routes served by uvicorn.

    posttrain serve runs/sft/final --port 8000
    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "12+7=", "max_tokens": 8, "temperature": 0}'

    with ServerThread("runs/sft/final") as srv:          # port 0: any free port
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")
        judge = llm_judge(base_url=srv.base_url, model=srv.model_name)

Endpoints:
  POST /v1/completions        prompt (string, list of strings, token ids, list of token-id
                              lists) -> `text_completion` with choices[i].text
  POST /v1/chat/completions   messages -> the tokenizer's chat template with the generation
                              prompt -> `chat.completion` with choices[i].message
  GET  /v1/models             the one served model
  GET  /health                {"status": "ok", "model", "engine", "stats": batching counters}
  GET  /docs                  FastAPI's page of the request schemas
Parameters, defaults and what is refused: `protocol.py`. Responses follow OpenAI's schema
(id, object, created, model, choices with index and finish_reason "stop" | "length", usage
with prompt/completion/total tokens; completion tokens include a final EOS). Errors are
OpenAI's error object `{"error": {"message", "type", "param", "code"}}` with a 4xx status,
FastAPI's own validation errors included: 400 bad body or parameter (or a body that is not
sent as JSON), 404 unknown path or model, 405 wrong method, 413 a body over `max_body_bytes`
(announced by its Content-Length, or a chunked body once it passes the limit); 500 when generation itself fails, 503 while shutting down.

`stream: true` answers with server-sent events, `data: {chunk}` ... `data: [DONE]`, sent
while the engine decodes: after each decode step, every choice's new text (the engine's
`on_tokens`; `rollout.TextStream` holds back what may still change: half a UTF-8
character, a possible stop string), then per choice the rest of its text and a chunk
with its finish_reason. The pieces join to exactly the unstreamed text. A failure before
the first token is an HTTP error as for an unstreamed request; after it, the stream ends
with OpenAI's error object.

Log-probs (chat `logprobs: true` + `top_logprobs`, completions `logprobs: k`; `logprobs.py`):
each generated token's log softmax of the model's logits (temperature 1, before filtering,
as vLLM's default) with the k most likely, from one scoring forward of prompt + completion
on the generation thread after the call; streamed, a choice's log-probs come in one chunk
after its text.

Batching: one generation thread gathers concurrent requests for up to `batch_wait_ms`
(or `max_batch_size` rows = prompts x n) and runs requests with the same sampling
parameters in one `engine.generate` call; see `batcher.py` for the grouping rules (seeded
sampled requests run alone so their seed reproduces them). Requests wait for it on
uvicorn's event loop. The server has no authentication: it binds 127.0.0.1 unless told
otherwise.

Engines: `native` (the built-in model: the Llama, Qwen2, Qwen3 and Mistral checkpoints it
implements; the default for them) or `hf` (transformers' generate; the default for anything else).
"""

from posttrain.serve.batcher import Batcher, BatcherClosed, Generated
from posttrain.serve.protocol import ModelInfo, RequestError
from posttrain.serve.server import App, ModelServer, ServerThread, load_server, serve

__all__ = [
    "App",
    "Batcher",
    "BatcherClosed",
    "Generated",
    "ModelInfo",
    "ModelServer",
    "RequestError",
    "ServerThread",
    "load_server",
    "serve",
]
