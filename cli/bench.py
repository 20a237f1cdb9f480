"""`qwen35-tvm bench`: a serving benchmark over the OpenAI-compatible HTTP API.

A pure HTTP client: it never imports the runtime, the compiler or TVM, so it runs on any
machine that can reach the server. For each concurrency level it streams `num_prompts`
completions of random token-id prompts (exactly `input_len` ids, uniform in [1000, 100000)
from a seeded numpy RNG) with `max_tokens=output_len`, `ignore_eos` and `temperature: 0`
(greedy: deterministic, and the sampler's cheapest path; `temperature`, `top_p`, `top_k` and
`min_p` measure sampled traffic instead), at most `concurrency` in flight; with a finite
`request_rate` the request starts also follow a Poisson process.

Timing, per request, on the client's clock:
- TTFT: send -> the first chunk that carries a token.
- ITL: gaps between consecutive token chunks. A chunk may carry several tokens (the server
  holds back an incomplete UTF-8 character until it is whole). With `logprobs` the server
  sends a chunk for every token and lists a chunk's tokens in `logprobs.tokens`, so a gap
  over k tokens becomes k samples of gap/k and ITL is per token. Without it a chunk counts as
  one token (as vLLM's benchmark does); `tokens_per_chunk` in the report says how far off
  that is (1.0: not at all).
- TPOT: (e2e - ttft) / (output_tokens - 1), with output_tokens from the final usage chunk,
  so it is exact either way.
- E2E: send -> `[DONE]`.
A request fails on an HTTP error status, a connection error, an error object in the stream,
a missing `[DONE]` or usage chunk, or output_tokens != output_len.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from .bench_report import format_table, plot

TOKEN_RANGE = (1000, 100000)  # ordinary vocabulary pieces: no special or control tokens


@dataclass
class BenchConfig:
    url: str
    concurrency: list[int]
    input_len: int
    output_len: int
    num_prompts: int
    request_rate: float = math.inf
    api_key: str | None = None
    model: str | None = None
    seed: int = 0
    logprobs: bool = False
    timeout: float = 300.0
    temperature: float = 0.0
    top_p: float | None = None  # None: the server's default
    top_k: int | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("every concurrency level must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request-rate must be > 0 (inf: all at once)")
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError("top-k must be >= -1 (-1 or 0: off)")
        if self.min_p is not None and not 0 <= self.min_p < 1:
            raise ValueError("min-p must be in [0, 1)")


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds
    e2e: float | None = None
    output_tokens: int = 0
    chunks: int = 0
    itl: list[float] = field(default_factory=list)
    # perf_counter seconds: when the request went out and when each token chunk came, so a
    # report can line streams up and say which steps made the slow gaps
    sent: float | None = None
    arrivals: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_levels(text: str) -> list[int]:
    """'1,8,16' -> [1, 8, 16]."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not levels:
        raise ValueError("--concurrency needs at least one level")
    return levels


def random_prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    return rng.integers(*TOKEN_RANGE, size=(n, length)).tolist()


def _describe(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _http_error(status: int, raw: bytes) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace").strip()[:300]
    return f"HTTP {status}: {message}"


def _tokens_in(choice: dict[str, Any]) -> int:
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    return 1  # unknown without logprobs: see the module docstring


async def _stream(
    client: httpx.AsyncClient, cfg: BenchConfig, headers: dict[str, str], body: dict[str, Any]
) -> RequestResult:
    res = RequestResult()
    usage_tokens: int | None = None
    done = False
    start = last = res.sent = time.perf_counter()
    async with client.stream("POST", cfg.url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            res.error = _http_error(r.status_code, await r.aread())
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            now = time.perf_counter()
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                res.e2e = now - start
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = "error in stream: " + str(chunk["error"].get("message"))
                return res
            if chunk.get("usage"):
                usage_tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                k = _tokens_in(choice)
                if k == 0:
                    continue
                if res.ttft is None:
                    res.ttft = now - start  # a first chunk's extra tokens came within TTFT
                else:
                    res.itl.extend([(now - last) / k] * k)
                last = now
                res.chunks += 1
                res.arrivals.append(now)
    if not done:
        res.error = "the stream ended without [DONE]"
    elif usage_tokens is None:
        res.error = "the stream had no usage chunk"
    else:
        res.output_tokens = usage_tokens
        if usage_tokens != cfg.output_len:
            res.error = f"got {usage_tokens} output tokens, expected {cfg.output_len}"
        elif res.ttft is None:
            res.error = "no token chunk before [DONE]"
    res.ok = res.error is None
    return res


async def one_request(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str | None,
    headers: dict[str, str],
    prompt: list[int],
) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": cfg.output_len,
        "ignore_eos": True,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    knobs = (("top_p", cfg.top_p), ("top_k", cfg.top_k), ("min_p", cfg.min_p))
    body |= {k: v for k, v in knobs if v is not None}
    if cfg.logprobs:
        body["logprobs"] = 0
    try:
        return await _stream(client, cfg, headers, body)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as err:
        # Server trouble (refused, reset, timeout, malformed chunk) is a result, not a crash.
        return RequestResult(error=_describe(err))


async def run_level(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str | None,
    headers: dict[str, str],
    concurrency: int,
    rng: np.random.Generator,
) -> tuple[list[RequestResult], float, float]:
    """All prompts of one level; returns the results, the level's start (perf_counter) and
    its wall time."""
    prompts = random_prompts(rng, cfg.num_prompts, cfg.input_len)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> RequestResult:
        async with gate:
            return await one_request(client, cfg, model, headers, prompt)

    start = time.perf_counter()
    tasks = []
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(cfg.request_rate):
            await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
        tasks.append(asyncio.create_task(gated(prompt)))
    results = await asyncio.gather(*tasks)
    return list(results), start, time.perf_counter() - start


def _stats(values_ms: list[float]) -> tuple[float | None, float | None, float | None]:
    if not values_ms:
        return None, None, None
    a = np.asarray(values_ms)
    return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))


def summarize(
    results: list[RequestResult],
    duration: float,
    concurrency: int,
    input_len: int,
    origin: float,
) -> dict[str, Any]:
    """One level's row of the report; `origin` (perf_counter at the level's start) turns each
    request's send and chunk times into offsets."""

    def ms(t: float) -> float:
        return round((t - origin) * 1e3, 3)

    ok = [r for r in results if r.ok]
    duration = max(duration, 1e-9)  # all refused at once can take "no" time
    out_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    level: dict[str, Any] = {
        "concurrency": concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + input_len * len(ok)) / duration,
        "total_output_tokens": out_tokens,
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
    }
    series = {
        "ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl": [x * 1e3 for r in ok for x in r.itl],
        "e2e": [r.e2e * 1e3 for r in ok if r.e2e is not None],
    }
    for name, values in series.items():
        mean, p50, p99 = _stats(values)
        level.update({f"mean_{name}_ms": mean, f"p50_{name}_ms": p50, f"p99_{name}_ms": p99})
    level["errors"] = dict(Counter(r.error for r in results if r.error).most_common())
    level["requests"] = [
        {
            "ok": r.ok,
            "error": r.error,
            "output_tokens": r.output_tokens,
            "chunks": r.chunks,
            "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
            "tpot_ms": None if r.tpot is None else r.tpot * 1e3,
            "e2e_ms": None if r.e2e is None else r.e2e * 1e3,
            "sent_ms": None if r.sent is None else ms(r.sent),
            "chunk_ms": [ms(t) for t in r.arrivals],
        }
        for r in results
    ]
    return level


async def _model_name(
    client: httpx.AsyncClient, cfg: BenchConfig, headers: dict[str, str]
) -> str | None:
    if cfg.model is not None:
        return cfg.model
    try:
        r = await client.get(cfg.url + "/v1/models", headers=headers)
        if r.status_code != 200:
            raise RuntimeError(_http_error(r.status_code, r.content))
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError, IndexError, TypeError) as err:
        # Go on without a name: the requests then fail (or not) on their own and say why.
        print(f"warning: cannot list the server's models ({_describe(err)}); sending no model")
        return None


async def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Every concurrency level in turn; the report that --out writes."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    width = max(cfg.concurrency)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    rng = np.random.default_rng(cfg.seed)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await _model_name(client, cfg, headers)
        levels = []
        for c in cfg.concurrency:
            results, start, duration = await run_level(client, cfg, model, headers, c, rng)
            level = summarize(results, duration, c, cfg.input_len, start)
            print(
                f"concurrency {c}: {level['completed']}/{level['num_prompts']} completed "
                f"in {duration:.2f} s",
                flush=True,
            )
            levels.append(level)
    config = asdict(cfg)
    if math.isinf(cfg.request_rate):
        config["request_rate"] = None  # strict JSON has no Infinity; null means all at once
    config.pop("api_key")  # a secret has no place in a results file
    config.update(model=model, date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return {"config": config, "results": levels}


def run(cfg: BenchConfig, out: str | None = None, plot_path: str | None = None) -> dict[str, Any]:
    """Run, print the table, write the JSON and PNG if asked; returns the report."""
    report = asyncio.run(run_bench(cfg))
    print(format_table(report["results"]))
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {out}")
    if plot_path is not None and plot(report["results"], plot_path):
        print(f"plot written to {plot_path}")
    return report


def failed_requests(report: dict[str, Any]) -> int:
    return sum(level["failed"] for level in report["results"])
