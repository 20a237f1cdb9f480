"""Prometheus metrics, on a registry of the app's own (several apps can live in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qwen35_tvm.runtime.engine import StepInfo

from .engine_loop import EngineLoop

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# a decode step takes a few ms; a mixed one should stay within ~2x of it
_STEP = (0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.03,
         0.05, 0.1, 0.25, 0.5, 1.0)  # fmt: skip
# a mixed step's prompt tokens end where a prefill GEMM tile (128 rows) does, or not
_TOKENS = (16, 32, 64, 112, 128, 240, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self, loop: EngineLoop) -> None:
        self.registry = reg = CollectorRegistry()
        p = "qwen35_"
        self.requests = Counter(
            p + "requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=reg,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens submitted", registry=reg)
        self.generated_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=reg)

        def histogram(name: str, doc: str, buckets: tuple, labels: tuple = ()) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=reg)

        self.ttft = histogram("time_to_first_token_seconds", "Submit to first token", _LATENCY)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean time per token after the first", _LATENCY
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Submit to last token", _LATENCY)
        self.step_seconds = histogram(
            "engine_step_seconds",
            "Wall time of an engine step, by kind: decode, mixed (decodes beside prompt tokens)"
            " or prefill",
            _STEP,
            ("kind",),
        )
        self.step_prompt_tokens = histogram(
            "engine_step_prompt_tokens", "Prompt tokens of a step that also decodes", _TOKENS
        )
        loop.on_step = self.observe_step
        engine = loop.engine
        gauges: dict[str, tuple[str, Any]] = {
            "num_requests_running": ("Sequences running", lambda: loop.num_running),
            "num_requests_waiting": ("Sequences waiting", lambda: loop.num_waiting),
            "kv_pages_used": (
                "KV pages reserved",
                lambda: engine.pool.total_pages - engine.free_pages(),
            ),
            "kv_pages_total": ("KV pages in the pool", lambda: engine.pool.total_pages),
            "gdn_slots_used": (
                "GDN state slots in use",
                lambda: engine.pool.num_slots - engine.free_slots(),
            ),
            "gdn_slots_total": ("GDN state slots", lambda: engine.pool.num_slots),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(p + name, doc, registry=reg).set_function(fn)

    def observe(self, ttft: float | None, e2e: float, generated: int) -> None:
        """One finished sequence: its latencies and token count."""
        self.generated_tokens.inc(generated)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if generated > 1:
                self.tpot.observe((e2e - ttft) / (generated - 1))

    def observe_step(self, step: StepInfo, seconds: float) -> None:
        """One engine step (on the engine thread): what the inter-token gaps are made of."""
        self.step_seconds.labels(step.kind).observe(seconds)
        if step.kind == "mixed":
            self.step_prompt_tokens.observe(step.prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware counting every HTTP response by route and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def spy(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, spy)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.requests.labels(route, str(status["code"])).inc()


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
