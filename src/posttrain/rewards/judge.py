"""LLM-as-a-judge reward: ask an OpenAI-compatible server to grade each completion.

    judge = llm_judge(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-7B-Instruct")
    judge(prompts, completions, None, answer=answers)   # [0.7, None, 1.0, ...]

One `POST {base_url}/chat/completions` per completion (vLLM, SGLang, TGI, llama.cpp and
OpenAI all serve it), at most `concurrency` in flight per judge, with the standard library
only (`urllib.request`, `json`, daemon threads).

What each sample gets:
  - the parsed score / max_score, e.g. "... Score: 7" → 0.7 (the LAST match of `score_regex`,
    since judges reason first and grade last);
  - None when the reply holds no score, or one outside [0, max_score]: the judge did answer,
    so this is not an infrastructure failure, but it is no grade either; the sample is left
    out of the judge's mean and counted in `reward/<name>/unparsed`;
  - a `JudgeError` in its place when the request still fails after `max_retries` retries
    (connection refused, timeout, HTTP 408/409/429/5xx) or fails for good (other 4xx, a
    malformed body): the runner gives it the failure reward and counts it as an error,
    without re-running the samples that worked.
Retries back off exponentially: `backoff_s · 2^k` before retry k (0, 1, ...), or the server's
`Retry-After` when it is shorter than 60 s. The runner's `timeout_s` must cover a whole batch:
in the worst case ceil(B / concurrency) · (max_retries + 1) · timeout_s plus the backoff waits.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "JudgeError", "LLMJudge", "llm_judge"]

DEFAULT_JUDGE_TEMPLATE = """\
You are grading a response to a question. Judge its correctness first, then its clarity.

Question:
{question}

{reference}Response:
{response}

Explain your grade briefly, then finish with a line of the form "Score: N", where N is an \
integer from 0 (wrong or useless) to {max_score} (correct and clear)."""
_REFERENCE = "Reference answer (correct):\n{answer}\n\n"
_RETRY_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))


class JudgeError(RuntimeError):
    """A judge request that failed for good; stands in for that sample's reward."""


class LLMJudge:
    """A reward function grading each completion with an LLM judge (`llm_judge` is this class).

    Args:
        base_url: the OpenAI-compatible API root, e.g. "http://127.0.0.1:8000/v1".
        model: the model name the server expects.
        prompt_template: `str.format` template with {question} (the prompt's last message),
            {response}, {answer} ("" without an `answer` column), {reference} (a "Reference
            answer" paragraph, or "" without one), {max_score}, and any other column by name.
        score_regex: finds the score; its first group is the number. The last match counts.
        max_score: the top of the judge's scale; rewards are score / max_score in [0, 1].
        api_key_env: the NAME of the environment variable holding the API key (sent as
            `Authorization: Bearer ...`), so keys never sit in configs; None sends no key.
        timeout_s: per-request timeout.
        max_retries: retries of a request after a connection error, timeout, 408/409/429/5xx.
        backoff_s: wait before the first retry, doubled for each further one.
        concurrency: the most requests this judge has in flight at once.
        temperature, max_tokens: sampling settings sent with each request.
        system_prompt: an optional system message before the grading prompt.

    Besides being called like any reward function, `pop_metrics()` returns and resets the
    counters since its last call (requests, retries, unparsed, failed); the runner logs them
    as `reward/<name>/<counter>`.
    """

    __name__ = "llm_judge"

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt_template: str = DEFAULT_JUDGE_TEMPLATE,
        score_regex: str = r"Score:\s*\**\s*(-?\d+(?:\.\d+)?)",
        max_score: float = 10.0,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        temperature: float = 0.0,
        max_tokens: int = 512,
        system_prompt: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_score <= 0 or concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError(
                "need max_score > 0, concurrency >= 1, max_retries >= 0, timeout_s > 0"
            )
        self.score_pattern = re.compile(score_regex)
        if self.score_pattern.groups < 1:
            raise ValueError(f"score_regex needs a group capturing the number: {score_regex!r}")
        self.api_key = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise ValueError(f"llm_judge: environment variable {api_key_env!r} is not set")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.prompt_template = prompt_template
        self.max_score = float(max_score)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.concurrency = concurrency
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.system_prompt = system_prompt
        # One judge may be called from several threads at once (the runner's per-sample
        # retries), so the limit on requests in flight is per judge, not per call.
        self._slots = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Any = None,
        **columns: Any,
    ) -> list[float | None | JudgeError]:
        from posttrain.rewards.base import RUN_KWARGS, completion_text, map_in_daemon_threads

        requests = [
            self.render(
                completion_text(prompts[i]),
                completion_text(c),
                {k: v[i] for k, v in columns.items() if v is not None and k not in RUN_KWARGS},
            )
            for i, c in enumerate(completions)
        ]
        replies, errors, _ = map_in_daemon_threads(self._ask, requests, self.concurrency)
        out: list[float | None | JudgeError] = []
        for reply, error in zip(replies, errors):
            if error is not None:
                self._count("failed")
                out.append(error if isinstance(error, JudgeError) else JudgeError(repr(error)))
                continue
            score = self.parse_score(reply)
            if score is None:
                self._count("unparsed")
            out.append(score)
        return out

    def render(self, question: str, response: str, row: Mapping[str, Any]) -> str:
        """The judge prompt for one sample; any column can appear in a custom template."""
        answer = row.get("answer")
        fields = {
            **row,
            "question": question,
            "response": response,
            "answer": "" if answer is None else answer,
            "reference": "" if answer is None else _REFERENCE.format(answer=answer),
            "max_score": f"{self.max_score:g}",
        }
        try:
            return self.prompt_template.format_map(fields)
        except KeyError as e:
            raise ValueError(
                f"llm_judge prompt_template uses {{{e.args[0]}}}, which is neither a column nor "
                f"one of question, response, answer, reference, max_score; columns: {sorted(row)}"
            ) from None

    def parse_score(self, reply: str) -> float | None:
        """The last score in the reply divided by max_score, or None if absent or out of range."""
        found = self.score_pattern.findall(reply)
        if not found:
            return None
        last = found[-1]
        value = float(last[0] if isinstance(last, tuple) else last)
        if not (math.isfinite(value) and 0.0 <= value <= self.max_score):
            return None
        return value / self.max_score

    def pop_metrics(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return {k: float(counts[k]) for k in ("requests", "retries", "unparsed", "failed")}

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _ask(self, content: str) -> str:
        """The judge's reply to one prompt, retrying transient failures; raises JudgeError."""
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        body = json.dumps(
            {
                "model": self.model,
                "messages": messages,
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.max_retries + 1):
            try:
                return self._post(body, headers)
            except _Transient as e:
                problem = e
                if attempt < self.max_retries:
                    self._count("retries")
                    time.sleep(e.retry_after or self.backoff_s * 2**attempt)
        raise JudgeError(f"{self.url}: {problem} (after {self.max_retries} retries)")

    def _post(self, body: bytes, headers: dict[str, str]) -> str:
        """The reply text; raises _Transient for what a retry may fix, JudgeError otherwise."""
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        self._count("requests")
        try:
            with self._slots, urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
            if e.code not in _RETRY_STATUS:
                raise JudgeError(f"{self.url}: {detail}") from None
            raise _Transient(detail, _retry_after(e.headers.get("Retry-After"))) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise _Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        except json.JSONDecodeError as e:
            raise JudgeError(f"{self.url}: reply is not JSON ({e})") from None
        try:
            return str(payload["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"{self.url}: unexpected reply {str(payload)[:300]}") from None


class _Transient(Exception):
    """A failure a retry may fix; `retry_after` is the server's requested wait (0: none)."""

    def __init__(self, problem: str, retry_after: float = 0.0) -> None:
        super().__init__(problem)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float:
    """Seconds from a Retry-After header (0 when absent, unparseable or 60 s or more)."""
    try:
        seconds = float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
    return seconds if 0 < seconds < 60 else 0.0


# A factory in the registry's sense: options in, reward function out.
llm_judge = LLMJudge
