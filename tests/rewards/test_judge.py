"""llm_judge against a real OpenAI-compatible HTTP server on 127.0.0.1 that the tests start.

The server grades by content: a response containing `score=N` gets a reply ending in
"Score: N", `noscore` gets a reply without one, `slow` makes it sleep before answering.
It can fail its first k requests with a given status and records what it was sent and how
many requests it had in flight at once.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.rewards import JudgeError, RewardRunner, llm_judge, resolve_reward


class FakeJudgeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.fail_first, self.fail_status = 0, 500
        self.delay_s, self.slow_s = 0.0, 0.0
        self.seen: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def handle_error(self, request, client_address):
        pass  # a client that timed out closed its socket; the write fails, as it should

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: FakeJudgeServer

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.seen.append(
                {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
            )
            failing = srv.fail_first > 0
            srv.fail_first -= failing
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            prompt = body["messages"][-1]["content"]
            time.sleep(srv.delay_s + (srv.slow_s if "slow" in prompt else 0.0))
        finally:
            with srv.lock:
                srv.in_flight -= 1
        if self.path != "/v1/chat/completions":
            return self._send(404, {"error": "not found"})
        if failing:
            return self._send(srv.fail_status, {"error": "overloaded"})
        found = re.search(r"score=(\d+)", prompt)
        text = f"Looks fine.\nScore: {found[1]}" if found else "I cannot grade this."
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = FakeJudgeServer()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def judge_for(server, **options):
    options.setdefault("backoff_s", 0.01)
    return llm_judge(base_url=server.base_url, model="judge-7b", **options)


def test_scores_are_parsed_and_normalised(server):
    judge = judge_for(server)
    out = judge(
        ["What is 6*7?", "Q2", "Q3"],
        ["42 score=7", "score=10", "noscore"],
        None,
        answer=["42", "x", "y"],
    )
    assert out == [0.7, 1.0, None]  # "Score: 7" / 10; no score → None (not a failure)
    assert judge.pop_metrics() == {"requests": 3.0, "retries": 0.0, "unparsed": 1.0, "failed": 0.0}
    assert judge.pop_metrics()["requests"] == 0.0  # popped
    first = next(s for s in server.seen if "What is 6*7?" in s["body"]["messages"][-1]["content"])
    assert first["path"] == "/v1/chat/completions"
    assert first["body"]["model"] == "judge-7b" and first["body"]["temperature"] == 0.0
    content = first["body"]["messages"][-1]["content"]
    assert "Reference answer (correct):\n42" in content and "Response:\n42 score=7" in content
    assert first["auth"] is None


def test_template_without_answer_column_and_custom_template(server):
    judge = judge_for(server)
    judge(
        [[{"role": "user", "content": "Say hi"}]], [[{"role": "assistant", "content": "score=3"}]]
    )
    content = server.seen[-1]["body"]["messages"][-1]["content"]
    assert "Reference answer" not in content and "Question:\nSay hi" in content
    custom = judge_for(
        server, prompt_template="Grade {response} for {topic} out of {max_score}", max_score=5
    )
    assert custom(["q"], ["score=4"], None, topic=["maths"]) == [0.8]
    assert server.seen[-1]["body"]["messages"][-1]["content"] == "Grade score=4 for maths out of 5"
    with pytest.raises(ValueError, match=r"uses \{topic\}"):
        custom(["q"], ["x"], None)


def test_parse_score_takes_the_last_match_and_rejects_out_of_range(server):
    judge = judge_for(server)
    assert judge.parse_score("Score: 2 at first... final Score: **8**") == 0.8
    assert judge.parse_score("Score: 11") is None and judge.parse_score("Score: -1") is None
    assert judge.parse_score("no grade") is None


def test_retries_after_server_errors(server):
    server.fail_first = 2
    judge = judge_for(server, max_retries=3)
    assert judge(["q"], ["score=6"]) == [0.6]
    assert judge.pop_metrics()["retries"] == 2.0
    server.fail_first, server.fail_status = 1, 429
    assert judge(["q"], ["score=5"]) == [0.5]


def test_gives_up_after_max_retries_and_runner_fails_only_that_sample(server):
    server.fail_first = 3  # one worker, in order: sample 0 fails twice, sample 1 once
    judge = judge_for(server, max_retries=1, concurrency=1)
    out = judge(["q", "q"], ["score=9", "score=4"])
    assert isinstance(out[0], JudgeError) and "HTTP 500" in str(out[0])
    assert out[1] == 0.4
    server.seen.clear()
    server.fail_first = 2
    runner = RewardRunner(
        [
            resolve_reward(
                {
                    "name": "llm_judge",
                    "base_url": server.base_url,
                    "model": "m",
                    "max_retries": 1,
                    "backoff_s": 0.01,
                    "concurrency": 1,
                }
            )
        ],
        failure_reward=-1.0,
    )
    result = runner.score(["q"], ["score=9"], None)
    assert result.per_function["llm_judge"] == [-1.0]
    assert result.metrics["reward/llm_judge/errors"] == 1.0
    assert result.metrics["reward/llm_judge/failed"] == 1.0
    assert len(server.seen) == 2  # no per-sample re-run of the batch


def test_client_errors_are_not_retried(server):
    server.fail_first, server.fail_status = 1, 400
    judge = judge_for(server, max_retries=3)
    out = judge(["q"], ["score=1"])
    assert isinstance(out[0], JudgeError) and "HTTP 400" in str(out[0])
    assert len(server.seen) == 1


def test_timeout_gives_failure_without_blocking_other_samples(server):
    server.slow_s = 2.0
    judge = judge_for(server, timeout_s=0.3, max_retries=0)
    runner = RewardRunner([("judge", judge)], failure_reward=0.0, timeout_s=5.0)
    start = time.monotonic()
    result = runner.score(["q", "q"], ["slow score=9", "score=8"], None)
    assert time.monotonic() - start < 1.5
    assert result.per_function["judge"] == [0.0, 0.8]
    assert result.metrics["reward/judge/errors"] == 1.0


def test_connection_refused_is_retried_then_fails():
    judge = llm_judge(base_url="http://127.0.0.1:9/v1", model="m", max_retries=2, backoff_s=0.01)
    out = judge(["q"], ["score=1"])
    assert isinstance(out[0], JudgeError) and "after 2 retries" in str(out[0])
    assert judge.pop_metrics()["retries"] == 2.0


def test_concurrency_limit_is_respected(server):
    server.delay_s = 0.1
    judge = judge_for(server, concurrency=3)
    start = time.monotonic()
    out = judge(["q"] * 9, [f"score={i}" for i in range(9)])
    elapsed = time.monotonic() - start
    assert out == [i / 10 for i in range(9)]
    assert server.max_in_flight == 3  # in parallel, but never more than the limit
    assert 0.29 < elapsed < 0.9  # 3 rounds of 0.1 s


def test_api_key_is_read_from_the_named_variable(server, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    judge_for(server, api_key_env="MY_JUDGE_KEY")(["q"], ["score=1"])
    assert server.seen[-1]["auth"] == "Bearer sk-test"
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(ValueError, match="'MY_JUDGE_KEY' is not set"):
        judge_for(server, api_key_env="MY_JUDGE_KEY")
