"""Continuous batching: requests join and leave a running batch between steps.

Each `step()` admits waiting requests that fit (pages for prompt + max_tokens and one GDN
slot, reserved whole), runs one batched decode for every sequence past its prompt and one
ragged prefill of up to `prefill_chunk` prompt tokens (one forward: the decode rows ride in the
prefill as one-token chunks), samples each sequence with its own parameters and generator
(runtime/step_sampling.py), and frees finished sequences at once. Greedy decoding runs a step
ahead of the host (runtime/launched.py, `_step_ahead`): a step is launched before the tokens
of the one before it are read: a decode step behind a decode step or behind the step where
the last prompts end, and a step of prompt chunks (with the decode rows, if any) behind either,
its decode rows fed the in-flight step's picks on the device. Rows that end (by length, or
already read) drop out of the step behind; only a step the host must feed (sampled or
constrained rows, prompt logprobs) runs synchronously.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from .artifact import Artifact
from .kv_pool import (
    CapacityPool,
    gdn_bytes_per_slot,
    kv_bytes_per_token,
    plan_from_free_memory,
)
from .launched import InFlight, LaunchAhead, StepInfo, logits_rows
from .model_runner import ModelRunner
from .request_limits import RequestLimits
from .sampler import Sampler, SamplingParams
from .scheduler import Scheduler
from .sequence import Completion, Output, Request, Sequence, Status
from .step_calibration import calibrate
from .step_costs import MIN_TOKENS, StepCosts
from .step_sampling import Picked, Ready, StepSampler

if TYPE_CHECKING:  # xgrammar loads only with the first constrained request
    from .grammar import GrammarState

log = logging.getLogger(__name__)

# Prompt tokens a step prefills at most. 16 prompts of 1,024 tokens at once on an H200 (4B):
# the last first token came 303 ms after submission with 2,048, 272 ms with 4,096 and 276 ms
# with 8,192 (docs/results/engine_chunk*.json): four prompts a step fill the chunked GDN's
# wide tiles.
PREFILL_CHUNK = 4096


class Engine(LaunchAhead):
    def __init__(
        self,
        artifact: Artifact,
        max_batch_size: int = 64,
        max_total_tokens: int | None = None,
        num_slots: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        memory_fraction: float | None = None,
        mixed_step_share: float | None = None,
        mixed_step_min_tokens: int = MIN_TOKENS,
        overlap: bool | None = None,
        one_forward: bool = True,
    ):
        """Pools: `max_total_tokens` of KV pages (default: one context window) and `num_slots`
        GDN slots (default: `max_batch_size`), or, with `memory_fraction` on a GPU, whatever
        that fraction of the device's free memory holds (`plan_capacity`). With
        `mixed_step_share`, a step beside running decodes prefills what takes about that many
        times a decode step (runtime/step_costs.py: smoother inter-token latency for serving,
        slower prompts under load), never fewer than `mixed_step_min_tokens` prompt tokens (so
        long prompts keep moving), its costs seeded at start on a GPU by timed throw-away
        steps (runtime/step_calibration.py); None: always `prefill_chunk` tokens (offline
        throughput).
        With `overlap` (default: on a GPU, where the artifact can), steady greedy decode steps
        run one ahead of the host: step N + 1 is launched before step N's tokens are read, so
        the host's work between steps hides under the GPU's (`_step_ahead`). With
        `one_forward`, a step that both decodes and prefills runs its decode rows inside the
        prefill forward, as one-token chunks: the weights stream once for both."""
        self.artifact = artifact
        self.decodable = artifact.widths.decodable
        self.page_size = page_size = artifact.page_size
        if memory_fraction is not None and max_total_tokens is None:
            plan = plan_from_free_memory(artifact, memory_fraction, max_batch_size, page_size)
            max_total_tokens, num_slots = plan.max_total_tokens, plan.num_slots
        self.max_total_tokens = max_total_tokens or artifact.context_window
        self.pool = CapacityPool(self.max_total_tokens // page_size, num_slots or max_batch_size)
        self.limits = RequestLimits(
            self.decodable,
            artifact.context_window,
            page_size,
            self.pool.total_pages,
            self.max_total_tokens,
        )
        self.scheduler = Scheduler(self.pool, max_batch_size, prefill_chunk)
        self.one_forward = one_forward
        self.costs = (
            StepCosts(
                mixed_step_share,
                mixed_step_min_tokens,
                rows_in_prefill=one_forward,
                tile_rows=artifact.prefill_tile_rows,
            )
            if mixed_step_share
            else None
        )
        self.runner = ModelRunner(
            artifact,
            max_batch_size=max_batch_size,
            max_total_tokens=self.pool.total_pages * page_size,
            num_slots=self.pool.num_slots,
        )
        # a decode batch never outnumbers the slots: no graph beyond them
        largest = min(max_batch_size, self.pool.num_slots)
        if artifact.meta.get("cuda_graph") and artifact.device_name == "cuda":
            self.runner.capture_decode_graphs(list(range(1, largest + 1)))
        if self.costs is not None and artifact.device_name == "cuda":
            calibrate(self.runner, self.costs, largest, prefill_chunk)
        can = self.runner.launches_ahead
        if overlap and not can:
            raise ValueError("overlap needs an artifact with feed_picks: recompile it")
        self.overlap = can and artifact.device_name != "cpu" if overlap is None else overlap
        self._ahead: InFlight | None = None
        self._chained_at: float | None = None  # when a step chained behind another ended
        self.sampler = Sampler(self.decodable)
        self.picker = StepSampler(self.runner, self.sampler, self.decodable)
        self._live: dict[int, Sequence] = {}
        self._pending: list[Output] = []  # abort notices, reported by the next step
        # None where the call completed no step (one only launched, or nothing to do)
        self.last_step: StepInfo | None = None
        self._next_id = 0
        self._bytes = (kv_bytes_per_token(artifact), gdn_bytes_per_slot(artifact))
        log.info("engine capacity: %s", self.capacity())

    # ---- capacity -------------------------------------------------------------------------

    def capacity(self) -> dict[str, Any]:
        kv_token, gdn_slot = self._bytes
        return {
            "max_batch_size": self.scheduler.max_batch_size,
            "prefill_chunk": self.scheduler.prefill_chunk,
            "page_size": self.page_size,
            "total_pages": self.pool.total_pages,
            "max_total_tokens": self.pool.total_pages * self.page_size,
            "num_slots": self.pool.num_slots,
            "context_window": self.artifact.context_window,
            "kv_bytes_per_token": kv_token,
            "gdn_bytes_per_slot": gdn_slot,
            "kv_bytes": self.pool.total_pages * self.page_size * kv_token,
            "gdn_bytes": self.pool.num_slots * gdn_slot,
        }

    def free_pages(self) -> int:
        """Pages not reserved by any admitted request."""
        return self.pool.free_pages

    def free_slots(self) -> int:
        return self.pool.free_slots

    # ---- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        max_tokens: int,
        stop_token_ids: Seq[int] | None = None,
        ignore_eos: bool = False,
        return_prompt_logprobs: bool = False,
        top_logprobs: int = 0,
        grammar: GrammarState | None = None,
    ) -> int:
        """Queue a request; raises `PromptError` (a ValueError) if it could never run.
        `top_logprobs` > 0 reports that many alternatives with every token's logprob;
        `grammar` (this request's own) constrains every token it samples."""
        prompt, pages = self.limits.check(prompt_ids, max_tokens)
        stops = set() if ignore_eos else set(self.artifact.eos_token_ids)
        stops.update(int(t) for t in stop_token_ids or ())
        seq = Sequence(
            request_id=self._next_id,
            prompt=prompt,
            params=params,
            max_tokens=max_tokens,
            stop_ids=frozenset(stops),
            pages=pages,
            return_prompt_logprobs=return_prompt_logprobs,
            top_logprobs=top_logprobs,
            grammar=grammar,
        )
        self._next_id += 1
        self._live[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or running request now; the next step reports it as 'abort'.
        False if it is unknown or already finished."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._release(seq)
        self._pending.append(Output(request_id, [], [], "abort"))
        return True

    def _start(self, seq: Sequence) -> None:
        self.runner.add_sequence(seq.slot, seq.page_ids)  # also zeroes the slot
        self.picker.admit(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.runner.remove_sequence(seq.slot)
        self.scheduler.finish(seq)
        del self._live[seq.request_id]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._ahead is not None

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[Output]:
        outputs, self._pending = self._pending, []
        self.last_step = None
        if self._ahead is not None:
            return outputs + self._step_ahead()
        for seq in self.scheduler.admit():
            self._start(seq)
        timed = self.costs is not None
        plan = self.scheduler.plan(self.costs.prefill_tokens if timed else None)
        ready: list[Ready] = []  # sequences to sample, with their logits
        started = time.perf_counter()
        if plan.decode and not plan.prefill and self._may_launch_ahead(plan.decode, 0):
            self._launch(plan.decode, [s.output[-1] for s in plan.decode])
            return outputs  # this step's tokens come with the next step
        if plan.prefill and self._may_mix_ahead(plan.decode, plan.prefill, 0):
            self._launch_mixed(plan, None)  # the next step can then chain behind it
            return outputs
        chunks = plan.prefill
        if plan.decode or chunks:
            kind = "mixed" if plan.decode and chunks else "decode" if plan.decode else "prefill"
            self.last_step = StepInfo(kind, len(plan.decode), sum(n for _, n in chunks))
        if plan.decode and chunks and self.one_forward:
            chunks = [(s, 1) for s in plan.decode] + chunks
        elif plan.decode:
            seqs = plan.decode
            step = self.runner.decode([s.slot for s in seqs], [s.output[-1] for s in seqs])
            for i, seq in enumerate(seqs):
                seq.num_computed += 1
                ready.append((seq, step, i))
        decoded = time.perf_counter()  # the decode step syncs: its picks are on the host
        if chunks:
            ready += self._prefill(chunks)
        if ready:
            outputs += self._sample(ready)
        if timed:
            if plan.decode and chunks is plan.prefill:
                self.costs.record_decode(len(plan.decode), decoded - started)
            if chunks:
                self.costs.record_prefill(sum(n for _, n in chunks), time.perf_counter() - decoded)
        return outputs

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Ready]:
        """One ragged forward over every chunk (a decoding sequence's is its last token);
        returns the sequences to sample now (prompt complete, or decoding), each with the
        logits row of its last token."""
        tokens = [seq.next_tokens(n) for seq, n in chunks]
        scored = [seq.prefilling and seq.return_prompt_logprobs for seq, _ in chunks]
        rows, counts = logits_rows(chunks)
        # Always `prefill` (never the decode path for one-token chunks): its logits are a
        # tensor of their own, left on the device for constrained rows to be masked there.
        step = self.runner.prefill([s.slot for s, _ in chunks], tokens, rows)
        ready, row = [], 0
        for (seq, n), every, count in zip(chunks, scored, counts, strict=True):
            if every:
                self.picker.score_prompt(seq, step.rows()[row : row + count])
            row += count
            seq.num_computed += n
            if not seq.prefilling:
                ready.append((seq, step, row - 1))
        return ready

    def _sample(self, ready: list[Ready]) -> list[Output]:
        """Each ready sequence's next token (runtime/step_sampling.py), emitted."""
        return self._emit(self.picker.pick(ready))

    def _emit(self, picked: list[Picked]) -> list[Output]:
        """Append each sequence's new token (with its logprob and, for alternatives, its logits
        row) and release the sequences it finishes; their reports."""
        outputs = []
        for seq, token, logprob, row in picked:
            k = seq.top_logprobs
            out = seq.take(token, logprob, self.sampler.top_logprobs(row, k) if k else None)
            outputs.append(out)
            if out.finish_reason is not None:
                self._release(seq)
        return outputs

    # ---- convenience ----------------------------------------------------------------------

    def submit_request(self, r: Request) -> int:
        """`submit` with the arguments gathered in a `Request`."""
        return self.submit(
            r.prompt_ids,
            r.params,
            r.max_tokens,
            r.stop_token_ids,
            r.ignore_eos,
            r.return_prompt_logprobs,
            r.top_logprobs,
            r.grammar,
        )

    def generate(self, requests: Seq[Request]) -> list[Completion]:
        """Submit every request, step until all of them finish; results in request order.
        Nothing is submitted if any request is refused."""
        for r in requests:
            self.limits.check([int(t) for t in r.prompt_ids], r.max_tokens)
        ids = [self.submit_request(r) for r in requests]
        done = {i: Completion(i) for i in ids}
        open_ids = set(ids)
        while open_ids:
            if not self.has_work():
                raise RuntimeError(f"requests {sorted(open_ids)} vanished without finishing")
            for out in self.step():
                c = done.get(out.request_id)
                if c is None:
                    continue
                c.token_ids += out.token_ids
                c.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finish_reason is not None:
                    c.finish_reason = out.finish_reason
                    open_ids.discard(out.request_id)
        return [done[i] for i in ids]
