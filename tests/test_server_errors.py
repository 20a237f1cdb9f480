"""Malformed requests each get a 4xx in OpenAI's error shape, naming the field, and leave the
server healthy; a full queue answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_server_harness import KEY, MAX_BODY, Served, start_server

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "hi", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

# (path, body: dict -> JSON, bytes -> sent as is, headers override, status, param)
CASES: list[tuple[str, object, dict | None, int, str | None]] = [
    (C, {"prompt": 3}, None, 400, "prompt"),
    (C, {"prompt": ""}, None, 400, "prompt"),
    (C, {"prompt": []}, None, 400, "prompt"),
    (C, {"prompt": [[]]}, None, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, None, 400, "prompt"),
    (C, {"prompt": [-1]}, None, 400, "prompt"),
    (C, {"prompt": [10**7]}, None, 400, "prompt"),
    (C, {"prompt": [1] * 5000, "max_tokens": 1}, None, 400, "prompt"),
    (C, {"prompt": "a " * 100_000}, None, 400, "prompt"),
    (C, {"prompt": None}, None, 400, "prompt"),
    (C, {"max_tokens": 2}, None, 400, "prompt"),
    (C, {**OK, "max_tokens": -1}, None, 400, "max_tokens"),
    (C, {**OK, "max_tokens": "5"}, None, 400, "max_tokens"),
    (C, {**OK, "max_tokens": 0}, None, 400, "max_tokens"),
    (C, {**OK, "max_tokens": 4096}, None, 400, "prompt"),
    (C, {**OK, "temperature": -0.1}, None, 400, "temperature"),
    (C, {**OK, "temperature": "hot"}, None, 400, "temperature"),
    (C, {**OK, "temperature": 3}, None, 400, "temperature"),
    (C, {**OK, "top_p": 0}, None, 400, "top_p"),
    (C, {**OK, "top_p": 1.5}, None, 400, "top_p"),
    (C, {**OK, "top_k": -2}, None, 400, "top_k"),
    (C, {**OK, "top_k": 1.5}, None, 400, "top_k"),
    (C, {**OK, "min_p": 1.0}, None, 400, "min_p"),
    (C, {**OK, "n": 0}, None, 400, "n"),
    (C, {**OK, "n": 100}, None, 400, "n"),
    (C, {**OK, "logprobs": 21}, None, 400, "logprobs"),
    (C, {**OK, "logprobs": -1}, None, 400, "logprobs"),
    (C, {**OK, "logprobs": True}, None, 400, "logprobs"),
    (C, {**OK, "stop": 5}, None, 400, "stop"),
    (C, {**OK, "stop": [""]}, None, 400, "stop"),
    (C, {**OK, "stop_token_ids": [-3]}, None, 400, "stop_token_ids.0"),
    (C, {**OK, "stream": "yes"}, None, 400, "stream"),
    (C, {**OK, "echo": "true"}, None, 400, "echo"),
    (C, {**OK, "seed": 1.5}, None, 400, "seed"),
    (C, {**OK, "bogus": 1}, None, 400, "bogus"),
    (C, {**OK, "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    (C, {**OK, "stream": True, "stream_options": {"usage": 1}}, None, 400, "stream_options.usage"),
    (C, {**OK, "best_of": 3}, None, 400, "best_of"),
    (C, {**OK, "presence_penalty": 0.5}, None, 400, "presence_penalty"),
    (C, b"{bad json", None, 400, None),
    (C, b"[1, 2]", None, 400, None),
    (C, b"", None, 400, None),
    (C, {**OK, "model": "gpt-4"}, None, 404, "model"),
    (C, OK, {}, 401, None),
    (C, OK, {"Authorization": "Bearer wrong"}, 401, None),
    (C, OK, {"Authorization": KEY}, 401, None),
    (C, {"prompt": "x" * (MAX_BODY + 10)}, None, 413, None),
    (CHAT, {"messages": []}, None, 400, "messages"),
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}, None, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "age": 3}]}, None, 400, "messages.0.age"),
    (CHAT, {"messages": "hello"}, None, 400, "messages"),
    (CHAT, {"max_tokens": 3}, None, 400, "messages"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, None, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, None, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": 3}, None, 400, "logprobs"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, None, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 5000}, None, 400, "prompt"),
    (CHAT, {"messages": MSG, "prompt": "x"}, None, 400, "prompt"),
    (CHAT, {"messages": MSG, "model": "other"}, None, 404, "model"),
    ("/v1/nothing", OK, None, 404, None),
    ("/metrics", None, {}, 401, None),
    ("/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
]


@pytest.fixture(scope="module")
def served(tiny_random_artifact):
    with start_server(tiny_random_artifact) as s:
        yield s


def send(served: Served, path: str, body: object, headers: dict | None) -> httpx.Response:
    hdrs = served.headers() if headers is None else headers
    if body is None:
        return httpx.get(served.url + path, headers=hdrs, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {**hdrs, "Content-Type": "application/json"}
    return httpx.post(served.url + path, content=data, headers=hdrs, timeout=60)


def test_malformed_requests_get_openai_shaped_4xx(served: Served):
    assert len(CASES) >= 30
    failures = []
    for path, body, headers, status, param in CASES:
        r = send(served, path, body, headers)
        err = r.json().get("error", {}) if r.headers.get("content-type") else {}
        ok = (
            r.status_code == status
            and isinstance(err.get("message"), str)
            and err["message"]
            and set(err) == {"message", "type", "param", "code"}
            and (param is None or err["param"] == param)
        )
        if not ok:
            failures.append((path, str(body)[:80], r.status_code, r.text[:300]))
    assert not failures, "\n".join(map(str, failures))
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    assert served.post("/v1/completions", OK).json()["choices"][0]["finish_reason"]
    assert served.idle()
    metrics = served.get("/metrics").text
    assert 'qwen35_requests_total{route="/v1/completions",status="400"}' in metrics


def test_a_full_queue_answers_503_with_retry_after(served: Served, monkeypatch):
    # Each long request needs most of the 128-page pool, so while one runs the next waits;
    # with room for one waiting request, a third finds the queue full.
    monkeypatch.setattr(served.server.loop, "max_waiting", 1)
    url = served.url + "/v1/completions"
    long = {"prompt": "hi", "max_tokens": 1900, "ignore_eos": True}

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60, headers=served.headers()) as client:
            async with client.stream("POST", url, json={**long, "stream": True}) as running:
                lines = running.aiter_lines()  # kept: dropping it would close the stream
                await lines.__anext__()  # admitted and decoding
                waiting = asyncio.ensure_future(client.post(url, json=long))
                for _ in range(1000):
                    if served.server.loop.num_waiting:
                        break
                    await asyncio.sleep(0.01)
                refused = await client.post(url, json=OK)
                waiting.cancel()
        return refused

    r = asyncio.run(main())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    assert served.idle()
    monkeypatch.undo()
    assert served.post("/v1/completions", OK).status_code == 200
    too_many = send(served, "/v1/completions", {**OK, "prompt": ["a"] * 64, "n": 16}, None)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
