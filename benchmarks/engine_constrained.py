"""The engine benchmark's constrained levels (benchmarks/engine_throughput.py --constrained):
the JSON schema every request is held to, its grammar, the timers of the engine's mask waits,
and a check of the device's masked pick and in-place mask."""

from __future__ import annotations

import time

import numpy as np

# Nested objects, enums, arrays and required fields; unbounded strings and arrays, so a random
# model stays inside the grammar for most of its 256 tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
        },
        "visits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"day": {"type": "integer"}, "note": {"type": "string"}},
                "required": ["day", "note"],
            },
        },
    },
    "required": ["name", "kind", "owner", "visits"],
}
SPEC = {  # as the server builds it (server/structured.py)
    "type": "structural_tag",
    "format": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 8},
}


def time_constraints(engine, states) -> dict:
    """Time spent waiting for the grammar workers' masks (what did not overlap the GPU step)
    and in the engine's whole constraint pass (waits, upload, kernels, 8 bytes a row back)."""
    timers = {"wait": 0.0, "constrain": 0.0, "steps": 0}
    inner = engine._constrain

    def constrain(ready):
        t0 = time.perf_counter()
        try:
            return inner(ready)
        finally:
            timers["constrain"] += time.perf_counter() - t0
            timers["steps"] += 1

    for g in states:
        fill = g.bitmask

        def timed(fill=fill):
            t0 = time.perf_counter()
            try:
                return fill()
            finally:
                timers["wait"] += time.perf_counter() - t0

        g.bitmask = timed
    engine._constrain = constrain
    timers["undo"] = lambda: engine.__dict__.pop("_constrain", None)
    return timers


def compiled_grammar(artifact) -> tuple:
    from tokenizers import Tokenizer

    from qwen35_tvm.runtime.grammar import GrammarCompiler

    tok = Tokenizer.from_file(str(artifact.path / "tokenizer.json"))
    compiler = GrammarCompiler(tok, artifact.widths.decodable, artifact.eos_token_ids)
    t0 = time.time()
    compiled = compiler.compile(SPEC)  # once per schema, as the server caches it
    print(f"grammar compiled in {time.time() - t0:.2f} s", flush=True)
    return compiler, compiled


def check_constrain_kernels(runner) -> dict:
    """The device's masked pick and in-place mask against numpy on random logits, with pad
    columns holding the largest values (they must be neither picked nor written)."""
    import tvm

    from qwen35_tvm.runtime.host_picks import StepLogits

    rng = np.random.default_rng(1)
    w = runner.artifact.widths
    n = min(4, runner.max_batch_size)
    logits = (rng.standard_normal((n + 2, w.selection)) * 4).astype(np.float32)
    logits[:, w.decodable :] = 1e4
    allowed = rng.random((n, w.decodable)) < 0.01
    padded = np.pad(allowed, ((0, 0), (0, -w.decodable % 32)))
    bits = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    rows = list(range(n + 1, 1, -1))
    dev = tvm.runtime.tensor(logits, runner.device)
    best, logprob = runner.constrain(StepLogits(dev), rows, bits, pick=True, mask=True)
    ref = np.where(allowed, logits[rows, : w.decodable].astype(np.float64), -np.inf)
    lsm = ref - ref.max(1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(1, keepdims=True))
    out = dev.numpy()
    return {
        "pick_ok": bool((best == ref.argmax(1)).all()),
        "logprob_max_err": float(np.abs(logprob - lsm[np.arange(n), ref.argmax(1)]).max()),
        "mask_ok": bool(np.array_equal(out[rows, : w.decodable], ref.astype(np.float32))),
        "pads_untouched": bool((out[:, w.decodable :] == 1e4).all()),
    }
