"""`posttrain serve`: the real HTTP server (uvicorn) on 127.0.0.1 at an ephemeral port with a
tiny saved model, asked through the official `openai` client as a real client would:
answers equal the rollout engine's, streams concatenate to the unstreamed text, concurrent
requests are batched and each still gets its own answer, bad requests get OpenAI-style 4xx
errors, and `llm_judge` works against it."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import openai
import pytest
import torch

from posttrain.data.tokenizer import build_tokenizer
from posttrain.evaluation import prompt_input
from posttrain.models import BuiltinConfig, BuiltinLM
from posttrain.rewards import llm_judge
from posttrain.rollout import SamplingParams, make_engine
from posttrain.serve import Batcher, ServerThread

NAME = "tiny"
PROMPTS = ["12+3=", "hello world, how are", "a", "7*8=", "The cat", "xyz", "1", "what is 2+2?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer model with O(1) logits (greedy has no near-ties) and the built-in tokenizer."""
    tok = build_tokenizer()
    config = BuiltinConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = BuiltinLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    """The reference: the native engine over the same weights, called directly."""
    return make_engine("native", BuiltinLM.from_pretrained(model_dir), build_tokenizer())


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(model_dir, served_model_name=NAME, batch_wait_ms=5)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def client(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    try:
        yield client
    finally:
        client.close()


def request(srv, method, path, body=None, headers=None):
    """(status, JSON reply, response headers) of a raw request; `body` may be raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(
        method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    reply = conn.getresponse()
    raw = reply.read()
    conn.close()
    return reply.status, json.loads(raw) if raw else None, reply.headers


def greedy(engine, prompts, max_tokens=8, **params):
    return engine.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=max_tokens, **params)
    )


def test_health_and_models(server, client):
    status, health, _ = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == NAME
    assert health["engine"] == "native" and "generate_calls" in health["stats"]
    assert [m.id for m in client.models.list()] == [NAME]


def test_greedy_completion_equals_the_engine(client, engine):
    reply = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    ref = greedy(engine, PROMPTS[:1])
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.model == NAME and isinstance(reply.created, int)
    [choice] = reply.choices
    assert choice.model_dump() == {
        "index": 0,
        "text": ref.texts[0],
        "logprobs": None,
        "finish_reason": "length",
    }
    prompt_tokens = len(ref.prompt_ids[0])
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        prompt_tokens,
        8,
        prompt_tokens + 8,
    )
    # A list of prompts, and token ids, give the same answers.
    several = client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [c.text for c in several.choices] == greedy(engine, PROMPTS[:3]).texts
    assert [c.index for c in several.choices] == [0, 1, 2]
    ids = client.completions.create(
        model=NAME, prompt=ref.prompt_ids[0], max_tokens=8, temperature=0
    )
    assert ids.choices[0].text == ref.texts[0]


def test_n_samples_with_a_seed_are_the_engines_and_repeatable(client, engine):
    body = dict(model=NAME, prompt=PROMPTS[1], n=2, temperature=1.0, seed=7, max_tokens=6)
    first, second = client.completions.create(**body), client.completions.create(**body)
    ref = engine.generate(
        [PROMPTS[1]], SamplingParams(n=2, temperature=1.0, seed=7, max_new_tokens=6)
    )
    assert [c.text for c in first.choices] == ref.texts
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices == second.choices
    assert first.usage.completion_tokens == 12


def test_stop_string_ends_a_completion(client, engine):
    reply = client.completions.create(
        model=NAME, prompt="1", max_tokens=8, temperature=0, stop=["22"]
    )
    ref = greedy(engine, ["1"], stop=("22",))
    assert ref.finish_reason == ["stop"]  # the greedy text of "1" holds "22"
    assert reply.choices[0].text == ref.texts[0] and "22" not in ref.texts[0]
    assert reply.choices[0].finish_reason == "stop"


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "7*8="}]


def test_chat_completion_applies_the_chat_template(client, engine):
    reply = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0
    )
    ids = prompt_input(build_tokenizer(), MESSAGES)
    ref = greedy(engine, [ids])
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == ref.texts[0]
    assert reply.usage.prompt_tokens == len(ids)
    # Content as a list of text parts is the same conversation.
    parts = [
        MESSAGES[0],
        {
            "role": "user",
            "content": [{"type": "text", "text": "7*"}, {"type": "text", "text": "8="}],
        },
    ]
    same = client.chat.completions.create(model=NAME, messages=parts, max_tokens=8, temperature=0)
    assert same.choices == reply.choices


def test_stream_concatenates_to_the_unstreamed_completion(client):
    body = dict(model=NAME, prompt=PROMPTS[3], max_tokens=8, temperature=0)
    whole = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(**body, stream=True))
    assert len(chunks) > 1 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_concatenates_to_the_unstreamed_message(client):
    body = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, n=2, seed=3)
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for choice in whole.choices:
        deltas = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert len(deltas) > 1 and deltas[0].delta.role == "assistant"
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
        assert deltas[-1].finish_reason == choice.finish_reason


def model_logprobs(model_dir, prompt_ids, completion_ids):
    """log softmax(logits) of each completion token after the prompt, (T, V), from a forward of
    the saved model itself (no engine, no server code)."""
    model = BuiltinLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)


def test_completion_logprobs_are_the_models_log_softmax(client, engine, model_dir):
    """`logprobs: 3` (sampled at temperature 0.7): each token's log softmax of the model's
    logits (temperature 1, as vLLM's default), and the 3 most likely with the chosen one."""
    reply = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0.7, seed=5,
                                      logprobs=3)
    tok = build_tokenizer()
    lp = reply.choices[0].logprobs
    ref = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.7, seed=5, max_new_tokens=6))
    ids = ref.response_ids[0].tolist()
    assert lp.tokens == [tok.decode([i]) for i in ids] and len(ids) == reply.usage.completion_tokens == 6
    assert lp.text_offset == [len(tok.decode(ids[:t], skip_special_tokens=True)) for t in range(6)]
    want = model_logprobs(model_dir, ref.prompt_ids[0], ids)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), want[torch.arange(6), ids], atol=1e-5, rtol=0)
    for t, (chosen, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        best = want[t].topk(3)
        expected = {tok.decode([i]): v for i, v in zip(best.indices.tolist(), best.values.tolist())}
        assert set(top) == set(expected) | {chosen}
        assert all(abs(top[k] - v) < 1e-5 for k, v in expected.items() if k != chosen)
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_streamed_and_not_are_the_same(client, engine, model_dir):
    """Chat `logprobs: true, top_logprobs: 2`: OpenAI's content entries, greedy so the chosen
    token tops its list; streamed, the same entries arrive in one chunk after the text."""
    body = dict(model=NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body).choices[0]
    content = whole.logprobs.content
    ref = greedy(engine, [prompt_input(build_tokenizer(), MESSAGES)], max_tokens=5)
    ids = ref.response_ids[0].tolist()
    want = model_logprobs(model_dir, ref.prompt_ids[0], ids)
    assert [e.token for e in content] == [build_tokenizer().decode([i]) for i in ids]
    joined = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")  # random bytes: not all UTF-8
    assert joined == whole.message.content == ref.texts[0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in content]), want[torch.arange(5), ids],
                               atol=1e-5, rtol=0)
    for e, row in zip(content, want):
        assert [t.token for t in e.top_logprobs][0] == e.token and len(e.top_logprobs) == 2
        assert e.top_logprobs[1].logprob == pytest.approx(float(row.topk(2).values[1]), abs=1e-5)
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    assert streamed == content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content


def test_token_bytes_of_byte_level_and_sentencepiece_tokenizers():
    """`bytes` of a logprobs entry: a byte-level token's bytes (half a character each for
    "é"), a SentencePiece piece with ▁ as a space, its byte fallback's byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from posttrain.serve.logprobs import token_bytes

    tok = build_tokenizer()
    assert [token_bytes(tok, i) for i in tok("é", add_special_tokens=False)["input_ids"]] == [b"\xc3", b"\xa9"]
    assert token_bytes(tok, tok.eos_token_id) == tok.eos_token.encode()
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "\u2581": 258, "a": 259, "\u2581a": 260}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    sp = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
    ids = sp("a é", add_special_tokens=False)["input_ids"]
    assert [token_bytes(sp, i) for i in ids] == [b" a", b" ", b"\xc3", b"\xa9"]  # the text " a é"


def test_stream_is_server_sent_events_ending_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    reply = conn.getresponse()
    assert reply.status == 200 and reply.getheader("Content-Type").startswith("text/event-stream")
    raw = reply.read().decode()
    conn.close()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(model_dir, client):
    prompts = [f"{i}+{i % 7}=" if i % 2 else f"word {i} is" for i in range(32)]
    alone = [  # one at a time, so each runs in a call of its own
        client.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in prompts
    ]
    srv = ServerThread(model_dir, served_model_name=NAME, batch_wait_ms=300)
    together = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
    try:
        replies: dict[int, str] = {}
        start = threading.Barrier(len(prompts))

        def ask(i):
            start.wait()
            reply = together.completions.create(
                model=NAME, prompt=prompts[i], max_tokens=6, temperature=0
            )
            replies[i] = reply.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = srv.stats()
    finally:
        together.close()
        srv.close()
    assert [replies.get(i) for i in range(len(prompts))] == alone
    assert stats["requests"] == len(prompts) and stats["generate_calls"] < len(prompts), stats
    assert stats["max_batch_rows"] > 1 and max(map(int, stats["requests_per_call"])) > 1, stats


def test_a_cancelled_request_is_not_generated_and_the_batcher_goes_on(engine):
    ref = greedy(engine, PROMPTS[:1], max_tokens=4)
    batcher = Batcher(engine, batch_wait_ms=200)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        gone = batcher.submit(ref.prompt_ids, params)
        assert gone.cancel()  # still waiting for its batch
        assert batcher.submit(ref.prompt_ids, params).result(timeout=60).texts == ref.texts
        assert batcher.stats()["requests"] == 1
    finally:
        batcher.close()


def test_a_bad_request_raises_the_clients_error_with_our_message(client):
    with pytest.raises(
        openai.BadRequestError, match="`temperature`: Input should be greater"
    ) as bad:
        client.completions.create(model=NAME, prompt="x", temperature=-0.5)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="`max_tokens` asks for 1000000 more"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="the model `gpt-4` does not exist") as missing:
        client.completions.create(model="gpt-4", prompt="x")
    assert missing.value.code == "model_not_found"


BAD_REQUESTS = [
    # (method, path, body, status, param, message fragment)
    ("POST", "/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("POST", "/v1/completions", b"", 400, None, "body is empty"),
    ("POST", "/v1/completions", {"max_tokens": 4}, 400, "prompt", "`prompt`: Field required"),
    ("POST", "/v1/completions", {"prompt": 5}, 400, "prompt", "`prompt`: must be a string"),
    ("POST", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "outside [0, 262)"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "temperature": -0.5},
        400,
        "temperature",
        "greater than or equal to 0",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "temperature": "hot"},
        400,
        "temperature",
        "number",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
        "greater than or equal to 1",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 10**6},
        400,
        "max_tokens",
        "context is 2048 tokens",
    ),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4.5}, 400, "max_tokens", "integer"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 65}, 400, "n", "less than or equal to 64"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop[0]", "at least 1"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "1"}, 400, "seed", "valid integer"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", "less than 18446744073709551616"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed", "greater than or equal to"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", "integer"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "needs `logprobs`: true"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    (
        "POST",
        "/v1/chat/completions",
        {"prompt": "x"},
        400,
        "messages",
        "`messages`: Field required",
    ),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user"}]},
        400,
        "messages[0].content",
        "Field required",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
        '{"type": "text", "text": str}',
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages",
        "unknown chat role robot",
    ),
    ("GET", "/v1/nothing", None, 404, None, "unknown path /v1/nothing"),
    ("GET", "/v1/completions", None, 405, None, "GET is not allowed on /v1/completions; use POST"),
    ("POST", "/health", {}, 405, None, "POST is not allowed on /health"),
    ("DELETE", "/v1/models", None, 405, None, "use GET"),
]


@pytest.mark.parametrize("method, path, body, status, param, fragment", BAD_REQUESTS)
def test_bad_requests_get_4xx_with_a_message(server, method, path, body, status, param, fragment):
    got, reply, headers = request(server, method, path, body)
    assert got == status, reply
    assert list(reply) == ["error"], reply  # OpenAI's shape, never FastAPI's {"detail": ...}
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"] and error["param"] == param, error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    if status == 405:
        assert headers["Allow"] in ("GET", "POST")


def test_a_form_body_is_refused_with_a_hint(server):
    got, reply, _ = request(
        server,
        "POST",
        "/v1/completions",
        b'{"prompt": "x"}',
        {"Content-Type": "application/x-www-form-urlencoded"},  # what curl -d sends
    )
    assert got == 400 and "Content-Type: application/json" in reply["error"]["message"]


def test_body_too_large_is_413_and_the_server_keeps_serving(server, client):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(1 << 30))  # announced, never sent
    conn.endheaders()
    reply = conn.getresponse()
    assert reply.status == 413 and "limit" in json.loads(reply.read())["error"]["message"]
    conn.close()
    reply = client.completions.create(model=NAME, prompt="x", max_tokens=1)
    assert reply.choices[0].finish_reason in ("stop", "length")


def chunked_post(srv, chunks):
    """(status, JSON reply) of a POST whose body is sent in `chunks` (no Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=iter(chunks), encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def test_a_chunked_body_is_limited_too_and_a_small_one_is_served(model_dir):
    srv = ServerThread(model_dir, served_model_name=NAME, batch_wait_ms=5, max_body_bytes=1000)
    try:
        body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1}).encode()
        got, reply = chunked_post(srv, [body[:10], body[10:]])
        assert got == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")
        got, reply = chunked_post(srv, [b"{" + b" " * 600, b" " * 600 + b"}"])
        assert got == 413 and "chunked request body passed 1202 bytes; the limit is 1000" in reply["error"]["message"]
        got, reply = chunked_post(srv, [body])  # still serving
        assert got == 200
    finally:
        srv.close()


def test_llm_judge_talks_to_the_server(server):
    before = server.stats()["requests"]
    judge = llm_judge(
        base_url=server.base_url, model=NAME, max_tokens=6, max_retries=0, timeout_s=30
    )
    scores = judge(["What is 2+2?", "What is 3+3?"], ["4", "6"], None, answer=["4", "6"])
    # The tiny random model never writes "Score: N": the judge got replies but no grade.
    assert scores == [None, None]
    assert judge.pop_metrics() == {"requests": 2.0, "retries": 0.0, "unparsed": 2.0, "failed": 0.0}
    assert server.stats()["requests"] == before + 2


def test_cli_serve_prints_the_url_and_stops_on_ctrl_c(model_dir):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain.cli",
            "serve",
            str(model_dir),
            "--port",
            "0",
            "--served-model-name",
            NAME,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
                break
        assert match, "".join(lines)
        with urllib.request.urlopen(f"{match.group(1)}/health", timeout=30) as r:
            assert json.loads(r.read())["model"] == NAME
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "shutting down" in rest and "Traceback" not in rest


class PausedEngine:
    """The served engine, pausing after each decode step (up to `wait_s`) until the client
    has its first chunk; `steps_before_seen` counts the steps decoded until then."""

    def __init__(self, engine, wait_s=2.0):
        self.engine, self.tokenizer, self.wait_s = engine, engine.tokenizer, wait_s
        self.seen = threading.Event()
        self.steps_before_seen = 0

    def generate(self, prompts, params, on_tokens=None):
        def hook(rows, tokens):
            on_tokens(rows, tokens)
            if not self.seen.is_set():
                self.steps_before_seen += 1
                self.seen.wait(self.wait_s)

        return self.engine.generate(prompts, params, on_tokens=hook if on_tokens else None)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_sends_text_as_it_is_decoded(server, client, chat):
    max_tokens = 8
    body = dict(model=NAME, max_tokens=max_tokens, temperature=0)
    if chat:
        create, body["messages"] = client.chat.completions.create, MESSAGES
        def text(c): return c.choices[0].delta.content or ""
        whole = create(**body).choices[0].message.content
    else:
        create, body["prompt"] = client.completions.create, PROMPTS[0]
        def text(c): return c.choices[0].text
        whole = create(**body).choices[0].text
    batcher = server.server.app.batcher
    paused = batcher.engine = PausedEngine(batcher.engine)
    try:
        stream = iter(create(**body, stream=True))
        chunks = [next(stream)]
        paused.seen.set()
        chunks += list(stream)
    finally:
        batcher.engine = paused.engine
    # The first chunk reached the client while the engine was still decoding ...
    assert 1 <= paused.steps_before_seen < max_tokens
    assert text(chunks[0])
    # ... and the rest came in several pieces, in order, the same text as unstreamed.
    pieces = [text(c) for c in chunks]
    assert sum(bool(p) for p in pieces) >= 3
    assert "".join(pieces) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_batched_streaming_jobs_each_hear_their_own_rows(engine):
    batcher = Batcher(engine, batch_wait_ms=200)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=5)
        prompts = [greedy(engine, [p]).prompt_ids for p in PROMPTS[:3]]
        heard = [{} for _ in prompts]

        def listener(i):
            return lambda rows, toks: [heard[i].setdefault(r, []).append(t) for r, t in zip(rows, toks)]

        jobs = [batcher.submit(p, dataclasses.replace(params, n=2 if i == 1 else 1), listener(i))
                for i, p in enumerate(prompts)]
        results = [j.result(timeout=60) for j in jobs]
        assert batcher.stats()["generate_calls"] == 1
    finally:
        batcher.close()
    tok = build_tokenizer()
    for got, result in zip(heard, results):
        assert sorted(got) == list(range(len(result.texts)))
        assert [tok.decode(got[r], skip_special_tokens=True) for r in sorted(got)] == result.texts


def test_cli_serve_stops_on_ctrl_c_at_once_even_when_started_with_sigint_ignored(model_dir):
    """A background job of a non-interactive shell starts with SIGINT ignored; a Ctrl-C
    sent as soon as the URL is printed (before uvicorn installs its handlers) was then lost
    and the server never stopped. Three tries, each signalled right after the URL line."""
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "posttrain.cli", "serve", str(model_dir), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        try:
            first = proc.stdout.readline()
            assert re.search(r"at http://127\.0\.0\.1:\d+/v1", first), first + proc.stdout.read()
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert "shutting down" in rest and "Traceback" not in rest, rest
