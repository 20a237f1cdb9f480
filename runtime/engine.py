"""Continuous batching: requests join and leave a running batch between steps.

Each `step()` admits waiting requests that fit (pages for prompt + max_tokens and one GDN
slot, reserved whole), runs one batched decode for every sequence past its prompt and one
ragged prefill of up to `prefill_chunk` prompt tokens, samples each sequence with its own
parameters and generator, and frees finished sequences at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np

from .artifact import Artifact
from .generate import PromptError
from .grammar import apply_bitmask  # numpy only: xgrammar loads with the first grammar
from .kv_pool import (
    CapacityPlan,
    CapacityPool,
    gdn_bytes_per_slot,
    kv_bytes_per_token,
    pages_for,
    plan_capacity,
)
from .model_runner import ModelRunner, StepLogits
from .sampler import Sampler, SamplingParams, is_effectively_greedy, make_rng
from .scheduler import Scheduler
from .sequence import Completion, Output, Request, Sequence, Status
from .step_costs import StepCosts

if TYPE_CHECKING:  # xgrammar loads only with the first constrained request
    from .grammar import GrammarState

log = logging.getLogger(__name__)

# Prompt tokens a step prefills at most. 16 prompts of 1,024 tokens at once on an H200 (4B):
# the last first token came 303 ms after submission with 2,048, 272 ms with 4,096 and 276 ms
# with 8,192 (docs/results/engine_chunk*.json): four prompts a step fill the chunked GDN's
# wide tiles.
PREFILL_CHUNK = 4096

# A sequence to sample, the logits of its step and its row among them.
Ready = tuple[Sequence, StepLogits, int]


class Engine:
    def __init__(
        self,
        artifact: Artifact,
        max_batch_size: int = 64,
        max_total_tokens: int | None = None,
        num_slots: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        memory_fraction: float | None = None,
        mixed_step_share: float | None = None,
    ):
        """Pools: `max_total_tokens` of KV pages (default: one context window) and `num_slots`
        GDN slots (default: `max_batch_size`), or, with `memory_fraction` on a GPU, whatever
        that fraction of the device's free memory holds (`plan_capacity`). With
        `mixed_step_share`, a step beside running decodes prefills what takes about that many
        times a decode step (runtime/step_costs.py: smoother inter-token latency for serving,
        slower prompts under load); None: always `prefill_chunk` tokens (offline throughput)."""
        self.artifact = artifact
        self.decodable = artifact.widths.decodable
        self.page_size = page_size = artifact.page_size
        if memory_fraction is not None and max_total_tokens is None:
            plan = _plan_from_free_memory(artifact, memory_fraction, max_batch_size, page_size)
            max_total_tokens, num_slots = plan.max_total_tokens, plan.num_slots
        self.max_total_tokens = max_total_tokens or artifact.context_window
        self.pool = CapacityPool(self.max_total_tokens // page_size, num_slots or max_batch_size)
        self.scheduler = Scheduler(self.pool, max_batch_size, prefill_chunk)
        self.costs = StepCosts(mixed_step_share) if mixed_step_share else None
        self.runner = ModelRunner(
            artifact,
            max_batch_size=max_batch_size,
            max_total_tokens=self.pool.total_pages * page_size,
            num_slots=self.pool.num_slots,
        )
        if artifact.meta.get("cuda_graph") and artifact.device_name == "cuda":
            # a decode batch never outnumbers the slots: no graph beyond them
            largest = min(max_batch_size, self.pool.num_slots)
            self.runner.capture_decode_graphs(list(range(1, largest + 1)))
        self.sampler = Sampler(self.decodable)
        self._live: dict[int, Sequence] = {}
        self._pending: list[Output] = []  # abort notices, reported by the next step
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
        prompt = [int(t) for t in prompt_ids]
        pages = self._check(prompt, max_tokens)
        stops = set() if ignore_eos else set(self.artifact.eos_token_ids)
        stops.update(int(t) for t in stop_token_ids or ())
        seq = Sequence(
            request_id=self._next_id,
            prompt=prompt,
            params=params,
            rng=make_rng(params.seed),
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

    def _check(self, prompt: list[int], max_tokens: int) -> int:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise PromptError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not prompt:
            raise PromptError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.decodable]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary [0, {self.decodable})")
        total = len(prompt) + max_tokens
        window = self.artifact.context_window
        if total > window:
            raise PromptError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context window of {window} tokens"
            )
        pages = pages_for(total, self.page_size)
        if pages > self.pool.total_pages:
            raise PromptError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs {pages} KV "
                f"pages but the engine's whole pool has {self.pool.total_pages} pages "
                f"(max_total_tokens={self.max_total_tokens}, page size {self.page_size})"
            )
        return pages

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or running request now; the next step reports it as 'abort'.
        False if it is unknown or already finished."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._release(seq)
        self._pending.append(Output(request_id, [], [], "abort"))
        return True

    def _release(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.runner.remove_sequence(seq.slot)
        self.scheduler.finish(seq)
        del self._live[seq.request_id]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[Output]:
        outputs, self._pending = self._pending, []
        for seq in self.scheduler.admit():
            self.runner.add_sequence(seq.slot, seq.page_ids)  # also zeroes the slot
        timed = self.costs is not None
        plan = self.scheduler.plan(self.costs.prefill_tokens if timed else None)
        ready: list[Ready] = []  # sequences to sample, with their logits
        started = time.perf_counter()
        if plan.decode:
            seqs = plan.decode
            step = self.runner.decode([s.slot for s in seqs], [s.output[-1] for s in seqs])
            for i, seq in enumerate(seqs):
                seq.num_computed += 1
                ready.append((seq, step, i))
        decoded = time.perf_counter()  # the decode step syncs: its picks are on the host
        if plan.prefill:
            ready += self._prefill(plan.prefill)
        if ready:
            outputs += self._sample(ready)
        if timed:
            if plan.decode:
                self.costs.record_decode(len(plan.decode), decoded - started)
            if plan.prefill:
                tokens = sum(n for _, n in plan.prefill)
                self.costs.record_prefill(tokens, time.perf_counter() - decoded)
        return outputs

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Ready]:
        """One ragged forward over every chunk; returns the sequences whose prompt is now
        complete, with the logits row of their last prompt token."""
        tokens = [seq.next_tokens(n) for seq, n in chunks]
        positions, offset = [], 0
        for seq, n in chunks:
            # Rows at every position only where prompt logprobs are asked for.
            if seq.return_prompt_logprobs:
                positions += range(offset, offset + n)
            else:
                positions.append(offset + n - 1)
            offset += n
        # Always `prefill` (never the decode path for one-token chunks): its logits are a
        # tensor of their own, left on the device for constrained rows to be masked there.
        step = self.runner.prefill(
            [s.slot for s, _ in chunks], tokens, np.asarray(positions, dtype=np.int32)
        )
        ready, row = [], 0
        for seq, n in chunks:
            if seq.return_prompt_logprobs:
                self._score_prompt(seq, step.rows()[row : row + n])
                row += n
            else:
                row += 1
            seq.num_computed += n
            if not seq.prefilling:
                ready.append((seq, step, row - 1))
        return ready

    def _score_prompt(self, seq: Sequence, rows: np.ndarray) -> None:
        """Row j of the chunk predicts the prompt token after position start + j."""
        start = seq.num_computed
        if start == 0:
            seq.prompt_logprobs.append(None)  # nothing predicts the first token
            seq.prompt_top_logprobs.append(None)
        for j, row in enumerate(rows):
            nxt = start + j + 1
            if nxt < len(seq.prompt):
                lp = self.sampler.logprobs(row)[seq.prompt[nxt]]
                seq.prompt_logprobs.append(float(lp))
                if seq.top_logprobs:
                    seq.prompt_top_logprobs.append(self.sampler.top_logprobs(row, seq.top_logprobs))

    def _wants_pick(self, seq: Sequence) -> bool:
        return not seq.top_logprobs and is_effectively_greedy(seq.params, self.decodable)

    def _sample(self, ready: list[Ready]) -> list[Output]:
        """A greedy sequence that wants no alternatives takes the pick the device made; the
        others copy their whole row to the host and sample it there. A constrained row never
        takes the plain pick (it ignores the grammar): `_constrain` masks it first."""
        constrained = self._constrain(ready)
        picked: list[tuple[int, float, np.ndarray | None]] = []
        for seq, logits, i in ready:
            done = constrained.get((id(logits), i))
            if isinstance(done, tuple):  # the masked pick, made on the device
                picked.append((done[0], done[1], None))
                continue
            if done is None and logits.best is not None and self._wants_pick(seq):
                picked.append((int(logits.best[i]), float(logits.best_logprob[i]), None))
                continue
            row = logits.rows()[i]
            if isinstance(done, np.ndarray):  # logits on the host, or no device kernels
                apply_bitmask(row, done, self.decodable)  # the row is this sequence's alone
            token = self.sampler.sample(row, seq.params, seq.rng)
            picked.append((token, float(self.sampler.logprobs(row)[token]), row))
        outputs = []
        for (seq, _, _), (token, logprob, row) in zip(ready, picked, strict=True):
            seq.output.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)  # also starts the next mask, overlapping the next step
            reason = None
            if token in seq.stop_ids:
                reason = "stop"
            elif len(seq.output) >= seq.max_tokens:
                reason = "length"
            first = len(seq.output) == 1 and seq.return_prompt_logprobs
            k = seq.top_logprobs
            outputs.append(
                Output(
                    seq.request_id,
                    [token],
                    [logprob],
                    reason,
                    list(seq.prompt_logprobs) if first else None,
                    [self.sampler.top_logprobs(row, k)] if k else None,
                    list(seq.prompt_top_logprobs) if first and k else None,
                )
            )
            if reason is not None:
                self._release(seq)
        return outputs

    def _constrain(self, ready: list[Ready]) -> dict[tuple[int, int], Any]:
        """Apply the bitmasks of the constrained rows, per step, where the logits are. Keyed
        by (id(step), row): a (token, logprob) picked on the device; True, masked in place on
        the device; a bitmask the host applies (logits already on the host, or an artifact
        without the kernels). Rows whose grammar allows everything are left out."""
        groups: dict[int, tuple[StepLogits, list[tuple[int, np.ndarray, bool]]]] = {}
        for seq, logits, i in ready:
            bits = seq.grammar.bitmask() if seq.grammar is not None else None
            if bits is not None:  # waited for the worker, which ran while the GPU stepped
                entry = (i, bits, self._wants_pick(seq))
                groups.setdefault(id(logits), (logits, []))[1].append(entry)
        done: dict[tuple[int, int], Any] = {}
        limit = self.runner.max_batch_size
        for key, (logits, rows) in groups.items():
            if not (self.runner.constrains_on_device and logits.on_device):
                done.update(((key, i), bits) for i, bits, _ in rows)
                continue
            for part in (rows[k : k + limit] for k in range(0, len(rows), limit)):
                ids, masks, wants = zip(*part, strict=True)
                picks = self.runner.constrain(
                    logits, list(ids), np.stack(masks), pick=any(wants), mask=not all(wants)
                )
                for j, i in enumerate(ids):
                    done[key, i] = (int(picks[0][j]), float(picks[1][j])) if wants[j] else True
        return done

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
            self._check([int(t) for t in r.prompt_ids], r.max_tokens)
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


def _plan_from_free_memory(
    artifact: Artifact, fraction: float, max_batch_size: int, page_size: int
) -> CapacityPlan:
    """Size the pools from `fraction` of the device memory free now (weights already loaded);
    the rest is left for activations and the compiled functions' workspace."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
    free = artifact.device.available_global_memory
    if not free:
        raise ValueError(f"{artifact.device_name} does not report its free memory")
    return plan_capacity(artifact, int(free * fraction), max_batch_size, page_size)
