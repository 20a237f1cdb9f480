"""A real uvicorn serving the app on 127.0.0.1 in a thread, shared by the server tests (this
module holds no tests itself)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from qwen35_tvm.server.app import Server, ServerConfig, build_server, create_app

KEY = "test-key"
MAX_BODY = 1 << 20


@dataclass
class Served:
    url: str
    server: Server
    initial: tuple[int, int]  # free pages and slots before any request

    @property
    def engine(self):
        return self.server.engine

    @property
    def tokenizer(self):
        return self.server.tokenizer

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        r = httpx.post(self.url + path, json=body, headers=self.headers(), timeout=60, **kwargs)
        assert r.status_code == 200, r.text
        return r

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The SSE chunks of a streamed request, checking it ends with [DONE]."""
        chunks: list[Any] = []
        with httpx.stream(
            "POST",
            self.url + path,
            json={**body, "stream": True},
            headers=self.headers(),
            timeout=60,
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    chunks.append(data if data == "[DONE]" else json.loads(data))
        assert chunks and chunks[-1] == "[DONE]"
        return chunks[:-1]

    def idle(self, timeout: float = 20.0) -> bool:
        """Wait until every page and slot is free again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = (self.engine.free_pages(), self.engine.free_slots())
            if now == self.initial and self.server.loop.num_running == 0:
                return True
            time.sleep(0.05)
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def start_server(artifact: Path, max_batch: int = 16) -> Iterator[Served]:
    cfg = ServerConfig(api_key=KEY, max_waiting=64, max_body_bytes=MAX_BODY)
    server = build_server(artifact, max_batch=max_batch, max_total_tokens=2048, cfg=cfg)
    port = free_port()
    config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    initial = (server.engine.free_pages(), server.engine.free_slots())
    try:
        yield Served(f"http://127.0.0.1:{port}", server, initial)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
