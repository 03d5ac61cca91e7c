"""Regeneration through OpenAI-compatible servers (`vllm serve`, SGLang, `transformers serve`, ...).

Each conversation is regenerated turn by turn with POST `<url>/v1/chat/completions`: the messages so
far (earlier turns already replaced by the target's answers), `max_tokens`, `temperature`, `top_p`
and `chat_template_kwargs: {"enable_thinking": data.thinking}` at the top level of the body, which is
where vLLM, SGLang and transformers serve pass it to the target's chat template. The reply's
`content` (and `reasoning_content` when the server separates the reasoning) becomes the assistant
message; `finish_reason: "length"` marks an unfinished turn.

Only the standard library: one HTTP request per call, many threads (`data.regenerate.concurrency`
conversations in flight per process, spread round-robin over `data.regenerate.urls`). A request that
fails (connection refused or reset, timeout, HTTP 5xx/429) is retried on the next URL after an
exponentially growing wait, so a server that is killed and restarted costs time, not samples. A
conversation whose request still fails after `max_retries` retries is counted as failed and left out;
the run stops once more than `max_failed_fraction` of the samples so far failed (the shard being
worked on is not written, and a rerun resumes there).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# Errors worth a retry: the server is down, restarting, overloaded or slow.
_RETRY_HTTP = {408, 429, 500, 502, 503, 504}


class RequestFailed(Exception):
    """A request that failed for good (after retries, or a 4xx that a retry would not fix)."""


@dataclass
class Stats:
    """Counters shared by the worker threads (under `lock`)."""
    requests: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failed_samples: int = 0
    last_failure: str = ""
    errors: dict = field(default_factory=dict)  # error kind -> count (retried or final)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1


def endpoint(url: str) -> str:
    """`http://host:port`, `.../v1` or the full path -> the chat completions URL."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class ServerClient:
    """Turn-by-turn regeneration of conversations against one or more servers."""

    def __init__(self, settings, thinking: bool, model: str | None):
        self.s = settings
        self.urls = [endpoint(u) for u in settings.urls]
        self.thinking = bool(thinking)
        self.model = model
        self.stats = Stats()
        self._next = 0
        self._lock = threading.Lock()

    def _url(self, attempt_offset: int = 0) -> str:
        with self._lock:
            self._next += 1
            return self.urls[(self._next + attempt_offset) % len(self.urls)]

    def body(self, messages: list[dict], seed: int) -> dict:
        s = self.s
        body = {"messages": messages, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                "chat_template_kwargs": {"enable_thinking": self.thinking}}
        if self.model:
            body["model"] = self.model
        if s.temperature > 0:
            body.update(top_p=s.top_p, seed=seed)
        return body

    def request(self, messages: list[dict], seed: int) -> dict:
        """One completion, with retries; returns the parsed response or raises RequestFailed."""
        data = json.dumps(self.body(messages, seed)).encode()
        wait = self.s.backoff_s
        for attempt in range(self.s.max_retries + 1):
            url = self._url(attempt)
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.s.timeout_s) as resp:
                    out = json.loads(resp.read())
                self.stats.add(requests=1)
                return out
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                self.stats.error(f"http {e.code}")
                if e.code not in _RETRY_HTTP:
                    raise RequestFailed(f"{url}: HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, json.JSONDecodeError) as e:
                reason = getattr(e, "reason", e)
                self.stats.error(type(reason).__name__)
            if attempt < self.s.max_retries:
                self.stats.add(retries=1)
                time.sleep(wait)
                wait = min(wait * 2, 60.0)
        raise RequestFailed(f"no answer after {self.s.max_retries + 1} attempts ({self.stats.errors})")

    def conversation(self, msgs: list[dict], seed: int) -> tuple[list[dict] | None, int]:
        """-> (regenerated conversation or None when nothing is left, unfinished turns)."""
        msgs = [dict(m) for m in msgs]
        for k in range(len(msgs)):
            if msgs[k]["role"] != "assistant":
                continue
            if k == 0:  # an assistant turn with nothing before it: no prompt to answer
                msgs = msgs[:k]
                break
            out = self.request(msgs[:k], seed * 1000 + k)
            choice = out["choices"][0]
            usage = out.get("usage") or {}
            self.stats.add(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                           completion_tokens=int(usage.get("completion_tokens") or 0))
            if choice.get("finish_reason") == "length":
                msgs = msgs[:k]  # an unfinished answer would teach a wrong ending: drop it and the rest ...
                if getattr(self.s, "keep_unfinished", False):  # ... or keep it as cut, marked (data/chat.py)
                    content = (choice.get("message") or {}).get("content") or ""
                    msgs.append({"role": "assistant", "content": content, "truncated": True})
                kept = msgs if any(m["role"] == "assistant" for m in msgs) else None
                return kept, 1
            message = choice.get("message") or {}
            new = {"role": "assistant", "content": message.get("content") or ""}
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if reasoning:
                new["reasoning_content"] = reasoning
            msgs[k] = new
        return (msgs if any(m["role"] == "assistant" for m in msgs) else None), 0

    def shard(self, convs: list[list[dict]], seed: int) -> tuple[list[list[dict]], int, int]:
        """Regenerate a shard concurrently, in input order -> (kept, unfinished turns, failed samples)."""
        def one(item):
            k, conv = item
            try:
                return self.conversation(conv, seed * 100_003 + k)
            except RequestFailed as e:
                self.stats.add(failed_samples=1)
                self.stats.last_failure = str(e)[:300]
                return "failed", 0

        with ThreadPoolExecutor(max_workers=self.s.concurrency) as pool:
            results = list(pool.map(one, enumerate(convs)))
        kept = [c for c, _ in results if c is not None and c != "failed"]
        failed = sum(1 for c, _ in results if c == "failed")
        return kept, sum(u for _, u in results), failed
