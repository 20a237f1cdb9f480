"""The OpenAI-compatible HTTP server: routes over one engine loop."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.engine import Engine
from qwen35_tvm.runtime.grammar import GrammarCompiler
from qwen35_tvm.runtime.sampler import SamplingParams
from qwen35_tvm.runtime.sequence import Request as EngineRequest
from qwen35_tvm.runtime.step_costs import MIN_TOKENS, MIXED_STEP_SHARE
from qwen35_tvm.runtime.tokenizer import TextTokenizer

from . import errors
from .chat_output import OutputRules
from .chat_shaper import ChatShaper
from .chat_template import ChatRenderer
from .engine_loop import EngineLoop
from .errors import APIError, error_body
from .formats import CompletionShaper, Shaper, sse
from .limits import BodyLimit
from .markup import reveal_markup
from .metrics import Metrics, StatusCounter
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from .reasoning import Mode, prompt_mode
from .serving import Generation, collect
from .structured import constraint, tool_schemas

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    model_name: str | None = None  # default: the artifact folder's name
    max_waiting: int = 256
    max_body_bytes: int = 8 << 20


class GuardedStream(StreamingResponse):
    """A streaming response that runs `on_close` however the stream ends (done, error, or
    the client disconnecting, which starlette turns into a cancellation)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Server:
    """Everything a route needs: the tokenizer, the engine loop, metrics and settings."""

    def __init__(self, engine: Engine, tokenizer: TextTokenizer, cfg: ServerConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.model = cfg.model_name or Path(engine.artifact.path).resolve().name
        self.loop = EngineLoop(engine, max_waiting=cfg.max_waiting)
        self.metrics = Metrics(self.loop)
        self.window = engine.artifact.context_window
        # Chat answers decode their markup tags as text, to be parsed (markup.py).
        self.chat_tokenizer = reveal_markup(tokenizer)
        self.renderer = ChatRenderer(tokenizer.chat_template)
        artifact = engine.artifact
        self.grammars = GrammarCompiler(
            tokenizer.tokenizer, artifact.widths.decodable, artifact.eos_token_ids
        )

    def check(self, body: _Sampling) -> None:
        problem = body.problem()
        if problem is not None:
            raise APIError(400, problem[1], problem[0])
        if body.model is not None and body.model != self.model:
            raise APIError(
                404,
                f"the model '{body.model}' does not exist; this server has '{self.model}'",
                "model",
                "model_not_found",
            )

    def jobs(
        self,
        body: _Sampling,
        prompt: list[int],
        max_tokens: int,
        top: int,
        prompt_logprobs: bool = False,
        grammar: Any = None,
    ) -> list[EngineRequest]:
        """One engine request per choice; with a compiled `grammar`, each its own matcher."""
        jobs = []
        for i in range(body.n):
            try:
                params = SamplingParams(
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=-1 if body.top_k is None else body.top_k,
                    min_p=0.0 if body.min_p is None else body.min_p,
                    seed=None if body.seed is None else body.seed + i,  # n distinct choices
                )
            except ValueError as err:
                raise APIError(400, str(err)) from None
            jobs.append(
                EngineRequest(
                    prompt,
                    params,
                    max_tokens,
                    body.stop_token_ids,
                    body.ignore_eos,
                    prompt_logprobs,
                    top,
                    None if grammar is None else self.grammars.state(grammar),
                )
            )
        return jobs

    async def respond(
        self, body: _Sampling, gen: Generation, shaper: Shaper, request: Request
    ) -> Response:
        await gen.start()
        if not body.stream:
            await collect(gen, request)
            return JSONResponse(shaper.response())
        usage = body.stream_options is not None and body.stream_options.include_usage
        return GuardedStream(self._events(gen, shaper, usage), gen.close)

    async def _events(self, gen: Generation, shaper: Shaper, usage: bool) -> AsyncIterator[bytes]:
        try:
            if isinstance(shaper, ChatShaper):
                for chunk in shaper.role_chunks():
                    yield sse(chunk | ({"usage": None} if usage else {}))
            async for delta in gen.deltas():
                chunk = shaper.chunk(delta)
                if chunk is not None:
                    yield sse(chunk | ({"usage": None} if usage else {}))
            if usage:
                yield sse(shaper.usage_chunk())
        except APIError as err:  # the status line is gone; report it in the stream
            yield sse(error_body(err.status, err.message, err.param, err.code))
        yield sse("[DONE]")


def build_server(
    artifact_dir: str | Path,
    device: str | None = None,
    max_batch: int = 16,
    max_total_tokens: int | None = None,
    cfg: ServerConfig | None = None,
    memory_fraction: float | None = None,
    mixed_step_share: float | None = MIXED_STEP_SHARE,
    mixed_step_min_tokens: int = MIN_TOKENS,
) -> Server:
    artifact = Artifact(artifact_dir, device=device)
    if artifact.device_name == "cpu":
        memory_fraction = None  # the CPU device does not report free memory
    engine = Engine(
        artifact,
        max_batch_size=max_batch,
        max_total_tokens=max_total_tokens,
        memory_fraction=memory_fraction,
        mixed_step_share=mixed_step_share,
        mixed_step_min_tokens=mixed_step_min_tokens,
    )
    return Server(engine, TextTokenizer.from_dir(artifact_dir), cfg or ServerConfig())


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not server.loop.alive():
            server.loop.start()
        yield
        server.loop.stop()

    app = FastAPI(
        title="qwen35-tvm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=server.cfg.max_body_bytes)
    app.add_middleware(StatusCounter, metrics=server.metrics)

    async def auth(request: Request) -> None:
        key = server.cfg.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer KEY')",
                code="invalid_api_key",
            )

    secured = [Depends(auth)]

    @app.get("/health")
    async def health() -> Response:
        ok = server.loop.alive()
        return JSONResponse(
            {"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503
        )

    @app.get("/metrics", dependencies=secured)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=secured)
    async def models() -> dict[str, Any]:
        card = {
            "id": server.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "qwen35-tvm",
            "max_model_len": server.window,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=secured)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check(body)
        tok = server.tokenizer
        raw = body.prompts()
        prompts = [tok.encode(p) if isinstance(p, str) else p for p in raw]
        texts = [p if isinstance(p, str) else tok.decode(p) for p in raw]
        if not all(prompts):
            raise APIError(400, "the prompt encodes to no tokens", "prompt")
        max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        scored = body.echo and body.logprobs is not None
        # max_tokens 0 still samples one token (the engine needs one); it is dropped.
        jobs = [
            server.jobs(body, p, max(max_tokens, 1), body.logprobs or 0, scored) for p in prompts
        ]
        gen = Generation(
            server.loop,
            tok,
            server.metrics,
            prompts,
            jobs,
            body.stop_strings(),
            discard_output=max_tokens == 0,
        )
        shaper = CompletionShaper(
            tok, server.model, gen, body.logprobs, echo=body.echo, prompt_texts=texts
        )
        return await server.respond(body, gen, shaper, request)

    @app.post("/v1/chat/completions", dependencies=secured)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        server.check(body)
        tok = server.chat_tokenizer
        schemas = tool_schemas(body)
        text = server.renderer.render(body)
        mode = prompt_mode(text)
        spec = constraint(body, schemas, reasoning=mode is Mode.REASONING)
        grammar = None
        if spec is not None:
            try:  # off the event loop: a new schema can take a while to compile
                grammar = await asyncio.to_thread(server.grammars.compile, spec[0])
            except ValueError as err:
                raise APIError(400, f"cannot compile a grammar: {err}", spec[1]) from None
        prompt = tok.encode(text)
        max_tokens = body.limit() or server.window - len(prompt)
        if max_tokens < 1:
            raise APIError(
                400,
                f"the conversation ({len(prompt)} tokens) fills the context "
                f"window of {server.window} tokens",
                "messages",
            )
        top = body.top_logprobs or 0
        jobs = [server.jobs(body, prompt, max_tokens, top, grammar=grammar)]
        gen = Generation(server.loop, tok, server.metrics, [prompt], jobs, body.stop_strings())
        rules = OutputRules(
            mode,
            schemas if schemas and body.tool_choice != "none" else None,
            None if body.parallel_tool_calls else 1,
        )
        shaper = ChatShaper(tok, server.model, gen, top if body.logprobs else None, rules=rules)
        return await server.respond(body, gen, shaper, request)

    return app


def serve(
    artifact_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str | None = None,
    max_batch: int = 16,
    max_total_tokens: int | None = None,
    cfg: ServerConfig | None = None,
    memory_fraction: float | None = None,
    mixed_step_share: float | None = MIXED_STEP_SHARE,
    mixed_step_min_tokens: int = MIN_TOKENS,
) -> None:
    """Load the artifact and serve until interrupted."""
    import uvicorn

    server = build_server(
        artifact_dir,
        device,
        max_batch,
        max_total_tokens,
        cfg,
        memory_fraction,
        mixed_step_share,
        mixed_step_min_tokens,
    )
    uvicorn.run(create_app(server), host=host, port=port, log_level="info")
