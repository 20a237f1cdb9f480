"""The bridge between asyncio handlers and the engine, which runs on one thread of its own.

Handlers put commands into an inbox (thread-safe) and wake the thread; the thread applies
them between steps, steps while there is work and hands each output to the asyncio queue of
the request it belongs to. Only this thread ever touches the engine's mutable state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from qwen35_tvm.runtime.engine import Engine, StepInfo
from qwen35_tvm.runtime.sequence import Output, Request, TopLogprobs

log = logging.getLogger(__name__)

# The engine thread drops the GIL while the GPU works (TVM's calls release it) and needs it back
# the moment the step's results land; with CPython's default 5 ms switch interval it can wait
# that long behind the event loop formatting SSE chunks. A shorter interval bounds the wait.
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class Delta:
    """One engine output, with the alternatives recorded for it."""

    output: Output
    tops: list[TopLogprobs]
    prompt_tops: list[TopLogprobs | None] | None
    at: float  # time.monotonic() when the step finished


class EngineFailure(RuntimeError):
    """The engine raised while stepping; the requests it was running are lost."""


class QueueFull(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, engine: Engine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._routes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Read by other threads (metrics, admission); written by the engine thread only.
        self.num_waiting = 0
        self.num_running = 0
        self._queued = 0  # sequences submitted but not yet seen by the engine thread
        self._queued_lock = threading.Lock()
        # called on the engine thread after each step() that completed a step, with its wall
        # seconds (the metrics' step histograms)
        self.on_step: Callable[[StepInfo, float], None] | None = None

    # ---- asyncio side ---------------------------------------------------------------------

    def start(self) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, jobs: Seq[Request]) -> tuple[list[int], asyncio.Queue]:
        """Queue every job or none; returns their request ids and the queue their `Delta`s
        arrive on. Raises `QueueFull`, or the engine's `PromptError` for a refused prompt."""
        if self.num_waiting + self._queued + len(jobs) > self.max_waiting:
            raise QueueFull(f"{self.num_waiting + self._queued} requests are already waiting")
        queue: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._queued_lock:
            self._queued += len(jobs)
        self._inbox.append(("submit", list(jobs), done, asyncio.get_running_loop(), queue))
        self._wake.set()
        ids = await asyncio.wrap_future(done)
        return ids, queue

    def abort(self, request_ids: Seq[int]) -> None:
        if request_ids:
            self._inbox.append(("abort", list(request_ids)))
            self._wake.set()

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain()
            if not self.engine.has_work():
                self._wake.wait(1.0)
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as err:  # keep serving: fail what was running, start afresh
                log.exception("engine step failed")
                self._fail_all(EngineFailure(f"the engine failed: {err}"))
                continue
            done = self.engine.last_step
            if done is not None and self.on_step is not None:
                self.on_step(done, time.perf_counter() - started)
            now = time.monotonic()
            self._count()  # before delivering, so no client sees a count older than its output
            for out in outputs:
                self._deliver(out, now)
        self._fail_all(EngineFailure("the server is shutting down"))

    def _drain(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "submit":
                self._submit(*cmd[1:])
            else:
                for rid in cmd[1]:
                    self._routes.pop(rid, None)
                    self.engine.abort(rid)  # its 'abort' output is dropped: no route
        self._count()

    def _submit(
        self,
        jobs: list[Request],
        done: concurrent.futures.Future,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue,
    ) -> None:
        ids: list[int] = []
        try:
            for job in jobs:
                rid = self.engine.submit_request(job)
                ids.append(rid)
        except Exception as err:  # all or nothing: take back the ones already queued
            for rid in ids:
                self.engine.abort(rid)
            done.set_exception(err)
        else:
            for rid in ids:
                self._routes[rid] = (loop, queue)
            done.set_result(ids)
        finally:
            with self._queued_lock:
                self._queued -= len(jobs)

    def _deliver(self, out: Output, now: float) -> None:
        rid = out.request_id
        tops = out.top_logprobs or []
        prompt_tops = out.prompt_top_logprobs if out.prompt_logprobs else None
        if out.finish_reason is not None:
            route = self._routes.pop(rid, None)
        else:
            route = self._routes.get(rid)
        if route is not None:
            self._post(route, Delta(out, tops, prompt_tops, now))

    def _post(self, route: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: Any) -> None:
        loop, queue = route
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, err: Exception) -> None:
        for rid, route in list(self._routes.items()):
            self._post(route, err)
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of request %d failed", rid)
        self._routes.clear()
        self._count()

    def _count(self) -> None:
        self.num_waiting = len(self.engine.scheduler.waiting)
        self.num_running = len(self.engine.scheduler.running)
