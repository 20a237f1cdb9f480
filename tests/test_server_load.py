"""Many clients at once: 32 concurrent streams all finish with the text each gets alone, and
clients that hang up mid-answer free every KV page and GDN slot while the server serves on."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from test_server_harness import Served, start_server

PROMPTS = ["The sky is", "1, 2, 3,", "def main():", "Bonjour", "Once upon"]


@pytest.fixture(scope="module")
def served(tiny_random_artifact):
    with start_server(tiny_random_artifact) as s:
        yield s


async def stream_text(client: httpx.AsyncClient, served: Served, body: dict) -> tuple[str, dict]:
    text, last = "", {}
    async with client.stream(
        "POST",
        served.url + "/v1/completions",
        json={**body, "stream": True},
        headers=served.headers(),
    ) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: ") :])
        if chunk["choices"]:
            text += chunk["choices"][0]["text"]
        last = chunk
    return text, last


async def hang_up(served: Served, body: dict, after: int) -> int:
    """Read `after` chunks of a stream, then drop the connection."""
    seen = 0
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST",
            served.url + "/v1/completions",
            json={**body, "stream": True},
            headers=served.headers(),
        ) as r:
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= after:
                    break
    return seen


def generated_tokens(served: Served) -> float:
    found = re.search(r"^qwen35_generation_tokens_total (\S+)$", served.get("/metrics").text, re.M)
    assert found
    return float(found.group(1))


def test_32_concurrent_streams_all_finish_with_their_solo_text(served: Served):
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    solo = {
        p: served.post("/v1/completions", {**body, "prompt": p}).json()["choices"][0]["text"]
        for p in PROMPTS
    }

    async def main() -> list[tuple[str, dict]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            opts = {"stream_options": {"include_usage": True}}
            return await asyncio.gather(
                *(
                    stream_text(client, served, {**body, **opts, "prompt": PROMPTS[i % 5]})
                    for i in range(32)
                )
            )

    results = asyncio.run(main())
    for i, (text, last) in enumerate(results):
        assert text == solo[PROMPTS[i % 5]]
        assert last["usage"]["completion_tokens"] == 8
    assert served.idle()


def test_clients_that_hang_up_free_their_pages_and_slots(served: Served, monkeypatch):
    aborted: list[int] = []
    abort = served.engine.abort

    def spy(request_id: int) -> bool:
        aborted.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(served.engine, "abort", spy)
    before = generated_tokens(served)
    body = {"prompt": "Tell me a long story", "max_tokens": 60, "ignore_eos": True}

    async def main() -> list[int]:
        return await asyncio.gather(*(hang_up(served, body, after=2) for _ in range(20)))

    assert all(seen == 2 for seen in asyncio.run(main()))
    assert served.idle(), (served.engine.free_pages(), served.engine.free_slots())
    assert len(aborted) == 20  # each one stopped, none left to run out its max_tokens
    assert generated_tokens(served) - before < 20 * 60 / 2  # they were stopped, not finished
    # A whole (non-streamed) request whose client gives up is aborted as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            served.url + "/v1/completions",
            json={**body, "max_tokens": 1500},
            headers=served.headers(),
            timeout=httpx.Timeout(60, read=0.5),
        )
    assert served.idle(timeout=10) and len(aborted) == 21
    text = served.post("/v1/completions", {**body, "max_tokens": 3}).json()
    assert text["usage"]["completion_tokens"] == 3
    assert httpx.get(served.url + "/health").status_code == 200
