"""The continuous-batching engine (fp32, CPU): batched logprobs equal one-at-a-time ones while
sequences join, leave and prefill in chunks; slots and pages come back whole; requests that
could never fit are refused at submit."""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.engine import Engine, StepInfo
from qwen35_tvm.runtime.generate import Generator, PromptError
from qwen35_tvm.runtime.kv_pool import gdn_bytes_per_slot, kv_bytes_per_token, plan_capacity
from qwen35_tvm.runtime.model_runner import ModelRunner
from qwen35_tvm.runtime.sampler import SamplingParams
from qwen35_tvm.runtime.sequence import Request

TOL = 2e-4  # nat, over the whole decodable vocabulary
GREEDY = SamplingParams(temperature=0.0)
_loaded: dict = {}


def loaded(compiled) -> tuple[Artifact, Generator]:
    if compiled.name not in _loaded:
        art = Artifact(compiled.artifact_dir)
        _loaded[compiled.name] = (art, Generator(art, prefill_chunk=128))
    return _loaded[compiled.name]


def prompt(length: int, decodable: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, decodable, size=length).tolist()


def capture_rows(engine: Engine) -> dict[int, list[np.ndarray]]:
    """Spy on sampling: every sampled row's log_softmax, per request, in order."""
    rows: dict[int, list[np.ndarray]] = {}
    batch_sizes: list[int] = []
    sample = engine._sample

    def spy(ready):
        batch_sizes.append(len(ready))
        for seq, logits, i in ready:
            rows.setdefault(seq.request_id, []).append(engine.sampler.logprobs(logits.rows()[i]))
        return sample(ready)

    engine._sample = spy
    rows[-1] = batch_sizes  # type: ignore[assignment]
    return rows


def run(engine: Engine, joins: dict[int, list[Request]] | None = None) -> dict[int, list]:
    """Step to the end, submitting `joins[k]` before step k; returns tokens per request."""
    tokens: dict[int, list] = {}
    step = 0
    while engine.has_work() or (joins and any(k >= step for k in joins)):
        for r in (joins or {}).get(step, []):
            engine.submit(r.prompt_ids, r.params, r.max_tokens, ignore_eos=r.ignore_eos)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return tokens


def reference_rows(gen: Generator, ids: list[int], out: list[int]) -> np.ndarray:
    """Single-sequence log_softmax rows that sampled each of `out`: prefill, then decode."""
    logits = gen.logits(ids + out[:-1], decode_from=len(ids))[len(ids) - 1 :]
    return np.stack([gen.sampler.logprobs(r) for r in logits])


def test_batch_that_grows_and_shrinks_matches_single_sequences(compiled):
    art, gen = loaded(compiled)
    # 4 running at most, so the 5th waits; prompts above 48 tokens prefill over several steps.
    engine = Engine(art, max_batch_size=4, max_total_tokens=1024, prefill_chunk=48)
    lengths, max_tokens = (1, 17, 64, 65, 130), (17, 6, 17, 11, 17)
    requests = [
        Request(prompt(n, gen.decodable, seed=n), GREEDY, m, ignore_eos=True)
        for n, m in zip(lengths, max_tokens, strict=True)
    ]
    late = [
        Request(prompt(n, gen.decodable, seed=100 + n), GREEDY, 9, ignore_eos=True) for n in (30, 3)
    ]
    rows = capture_rows(engine)
    tokens = run(engine, joins={0: requests, 4: late[:1], 7: late[1:]})
    batch_sizes = rows.pop(-1)
    assert len(set(batch_sizes)) > 2, batch_sizes  # the batch really changed size
    worst = 0.0
    for rid, req in enumerate(requests + late):
        assert len(tokens[rid]) == req.max_tokens
        ref = reference_rows(gen, req.prompt_ids, tokens[rid])
        got = np.stack(rows[rid])
        worst = max(worst, float(np.abs(got - ref).max()))
        # Greedy decode steps take the device's pick: it must be the row's argmax.
        np.testing.assert_array_equal(tokens[rid], np.argmax(got, axis=1))
    print(f"{compiled.name}: batched vs single max|dlogprob| = {worst:.3g}")
    assert worst <= TOL


def test_long_prefill_does_not_stall_decodes(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    engine = Engine(art, max_batch_size=4, max_total_tokens=512, prefill_chunk=32)
    a = engine.submit(prompt(5, gen.decodable, 1), GREEDY, 12, ignore_eos=True)
    engine.step()
    assert engine.last_step == StepInfo("prefill", 0, 5)
    b = engine.submit(prompt(130, gen.decodable, 2), GREEDY, 2, ignore_eos=True)
    steps = []
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps.append(engine.last_step)
        assert a in outs, "the running decode got no token this step"
        if b in outs:
            break
    # ceil(130 / 32) chunks, one decode of `a` each
    assert steps == [StepInfo("mixed", 1, n) for n in (32, 32, 32, 32, 2)]
    engine.step()
    assert engine.last_step == StepInfo("decode", 2, 0)


def test_a_mixed_step_decodes_inside_the_prefill_forward(tiny_compiled):
    """With one_forward (the default), a step that decodes and prefills is one `prefill` call
    with the decode rows as one-token chunks; the tokens are those of two forwards."""
    art, gen = loaded(tiny_compiled)
    got = {}
    for one in (True, False):
        engine = Engine(art, max_batch_size=3, max_total_tokens=512, prefill_chunk=24,
                        one_forward=one)  # fmt: skip
        calls = {"decode": 0, "prefill_rows": []}
        decode, prefill = engine.runner.decode, engine.runner.prefill

        def spy_decode(*a, decode=decode, calls=calls):
            calls["decode"] += 1
            return decode(*a)

        def spy_prefill(slots, tokens, rows, prefill=prefill, calls=calls):
            calls["prefill_rows"].append(sum(len(t) == 1 for t in tokens))
            return prefill(slots, tokens, rows)

        engine.runner.decode, engine.runner.prefill = spy_decode, spy_prefill
        late = Request(prompt(70, gen.decodable, 8), GREEDY, 5, ignore_eos=True)
        tokens = run(engine, joins={0: [Request(prompt(6, gen.decodable, 7), GREEDY, 12)],
                                    3: [late]})  # fmt: skip
        got[one] = tokens, calls
    (one_tokens, one_calls), (two_tokens, two_calls) = got[True], got[False]
    assert one_tokens == two_tokens
    assert max(one_calls["prefill_rows"]) == 1 and max(two_calls["prefill_rows"]) == 0
    assert two_calls["decode"] - one_calls["decode"] == 3  # the 70-token prompt's 3 chunks


def two_in_one_slot(art: Artifact, gen: Generator, zero_slots: bool = True) -> float:
    """Run X, then Y in the slot (and pages) X just freed; max |Δ| of Y's rows against Y alone
    in a fresh engine."""
    x = Request(prompt(40, gen.decodable, 11), GREEDY, 10, ignore_eos=True)
    y = Request(prompt(23, gen.decodable, 12), GREEDY, 12, ignore_eos=True)
    results = []
    for reqs in ([x, y], [y]):
        engine = Engine(art, max_batch_size=2, max_total_tokens=64, num_slots=1)
        if not zero_slots:
            engine.runner._reset = lambda *args: None
        rows = capture_rows(engine)
        run(engine, joins={0: reqs})
        results.append(np.stack(rows[len(reqs) - 1]))
    return float(np.abs(results[0] - results[1]).max())


def test_reused_slot_gives_a_fresh_engines_logprobs(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    assert two_in_one_slot(art, gen) == 0.0


def test_slot_reuse_test_fails_if_slots_are_not_zeroed(tiny_compiled):
    """The test above has teeth: skipping the reset leaks X's GDN state into Y."""
    art, gen = loaded(tiny_compiled)
    assert two_in_one_slot(art, gen, zero_slots=False) > 1e-2


def test_finished_and_aborted_requests_return_every_page_and_slot(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    engine = Engine(art, max_batch_size=3, max_total_tokens=512, num_slots=3, prefill_chunk=16)
    start = (engine.free_pages(), engine.free_slots())
    assert start[:2] == (32, 3)
    ids = [
        engine.submit(prompt(20, gen.decodable, 1), GREEDY, 40, ignore_eos=True),  # decoding
        engine.submit(prompt(90, gen.decodable, 2), GREEDY, 5),  # aborted mid-prefill
        engine.submit(prompt(7, gen.decodable, 3), GREEDY, 3),  # length
        engine.submit(prompt(9, gen.decodable, 4), GREEDY, 8, stop_token_ids=range(10**6)),
        engine.submit(prompt(5, gen.decodable, 5), GREEDY, 4),  # aborted while waiting
    ]
    reasons: dict[int, str] = {}
    for _ in range(4):
        reasons.update((o.request_id, o.finish_reason) for o in engine.step() if o.finish_reason)
    running = [s for s in engine.scheduler.running]
    assert engine.free_pages() == start[0] - sum(s.pages for s in running)
    assert engine.free_slots() == start[1] - len(running)
    assert engine.scheduler.running[1].prefilling
    assert engine.abort(ids[1]) and engine.abort(ids[4])
    assert not engine.abort(ids[4]) and not engine.abort(12345)
    for _ in range(3):
        reasons.update((o.request_id, o.finish_reason) for o in engine.step() if o.finish_reason)
    assert not engine.scheduler.running[0].prefilling
    assert engine.abort(ids[0])
    while engine.has_work():
        reasons.update((o.request_id, o.finish_reason) for o in engine.step() if o.finish_reason)
    assert reasons == {0: "abort", 1: "abort", 2: "length", 3: "stop", 4: "abort"}
    assert (engine.free_pages(), engine.free_slots()) == start
    assert sorted(engine.pool._free_page_ids) == list(range(32))  # every page id, once


def test_requests_that_could_never_fit_are_refused_at_submit(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    engine = Engine(art, max_batch_size=2, max_total_tokens=64)
    window = art.context_window
    with pytest.raises(PromptError, match="exceeds the context window"):
        engine.submit(prompt(window - 3, gen.decodable, 0), GREEDY, 4)
    with pytest.raises(PromptError, match=r"needs 5 KV pages .* pool has 4 pages"):
        engine.submit(prompt(60, gen.decodable, 0), GREEDY, 10)
    with pytest.raises(PromptError, match="empty"):
        engine.submit([], GREEDY, 4)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.submit([gen.decodable], GREEDY, 4)
    with pytest.raises(PromptError, match="token id -1 is outside"):  # an int array: numpy
        engine.submit(np.array([5, -1, gen.decodable]), GREEDY, 4)
    with pytest.raises(PromptError, match=f"token id {2**70} is outside"):  # past int64
        engine.submit([5, 2**70], GREEDY, 4)
    with pytest.raises(PromptError, match="max_tokens"):
        engine.submit([1], GREEDY, 0)
    ok = Request([1, 2], GREEDY, 2)
    with pytest.raises(PromptError):  # one bad request: nothing is submitted
        engine.generate([ok, Request(prompt(60, gen.decodable, 0), GREEDY, 10)])
    assert not engine.has_work()
    assert len(engine.generate([ok])[0].token_ids) <= 2


def test_capacity_is_reported_and_derived_from_a_byte_budget(tiny_compiled):
    art, _ = loaded(tiny_compiled)
    cfg = art.config
    n_full = cfg["layer_types"].count("full_attention")
    n_gdn = cfg["num_hidden_layers"] - n_full
    kv_token = 2 * n_full * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + (
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    )
    rec = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"] * cfg["linear_key_head_dim"]
    tickets = cfg["linear_num_key_heads"] + cfg["linear_num_value_heads"]  # decode's, int32
    gdn_slot = (n_gdn * (conv_dim * (cfg["linear_conv_kernel_dim"] - 1) + rec) + tickets) * 4
    assert kv_bytes_per_token(art) == kv_token
    assert gdn_bytes_per_slot(art) == gdn_slot
    plan = plan_capacity(art, 8 * gdn_slot + 100 * 16 * kv_token + 16 * kv_token - 1, 8)
    assert (plan.max_total_tokens, plan.num_slots) == (1600, 8)
    with pytest.raises(ValueError, match="no KV page"):
        plan_capacity(art, 8 * gdn_slot, 8)
    engine = Engine(art, max_batch_size=8, max_total_tokens=plan.max_total_tokens)
    cap = engine.capacity()
    assert cap["total_pages"] == 100 == engine.free_pages()
    assert cap["num_slots"] == 8 == engine.free_slots()
    assert cap["kv_bytes"] == 1600 * kv_token and cap["gdn_bytes"] == 8 * gdn_slot
    assert engine.runner.total_pages == cap["total_pages"]  # the pools hold what is planned


def test_seeded_sampling_and_prompt_logprobs_do_not_depend_on_the_batch(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    scored = Request(
        prompt(130, gen.decodable, 3), hot, 6, ignore_eos=True, return_prompt_logprobs=True
    )
    other = Request(
        prompt(50, gen.decodable, 4), SamplingParams(temperature=0.8, seed=1), 9, ignore_eos=True
    )
    alone = Engine(art, max_batch_size=1, prefill_chunk=48).generate([scored])[0]
    both = Engine(art, max_batch_size=4, prefill_chunk=48).generate([other, scored])[1]
    assert both.token_ids == alone.token_ids
    np.testing.assert_allclose(both.logprobs, alone.logprobs, atol=TOL)
    ref = [s.logprob for s in gen.score(scored.prompt_ids)]
    assert both.prompt_logprobs[0] is None and len(both.prompt_logprobs) == 130
    np.testing.assert_allclose(both.prompt_logprobs[1:], ref[1:], atol=TOL)


def test_top_logprobs_come_with_every_token_and_prompt_position(tiny_compiled):
    """`top_logprobs=k` reports, where each token (sampled or prompt) stood, the k most likely
    ids; greedy picks the first of them and its logprob is the first pair's."""
    art = Artifact(tiny_compiled.artifact_dir)
    engine = Engine(art, max_batch_size=2, max_total_tokens=256, prefill_chunk=8)
    gen = Generator(art)
    prompt = np.random.default_rng(5).integers(0, engine.decodable, size=20).tolist()
    rid = engine.submit(
        prompt,
        SamplingParams(temperature=0.0),
        4,
        stop_token_ids=[],
        ignore_eos=True,
        return_prompt_logprobs=True,
        top_logprobs=3,
    )
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert [len(o.top_logprobs) for o in outs] == [1, 1, 1, 1]
    for o in outs:
        (best, best_lp), *_ = o.top_logprobs[0]
        assert o.token_ids == [best] and abs(o.logprobs[0] - best_lp) < 1e-9
        assert len(o.top_logprobs[0]) == 3
    prompt_tops = outs[0].prompt_top_logprobs
    assert prompt_tops[0] is None and len(prompt_tops) == len(prompt)
    ref = gen.score(prompt, top_k=3)
    for got, want in zip(prompt_tops[1:], ref[1:], strict=True):
        assert [i for i, _ in got] == [i for i, _ in want.top]
        assert np.allclose([lp for _, lp in got], [lp for _, lp in want.top], atol=2e-4)


def test_memory_fraction_sizes_the_pools_from_free_memory(tiny_compiled, monkeypatch):
    art, _ = loaded(tiny_compiled)
    with pytest.raises(ValueError, match="memory_fraction"):
        Engine(art, max_batch_size=2, memory_fraction=1.5)
    with pytest.raises(ValueError, match="free memory"):
        Engine(art, max_batch_size=2, memory_fraction=0.5)  # the CPU reports none
    # A device reporting 64 MiB free: half of it, minus two GDN slots, in whole KV pages.
    monkeypatch.setattr(type(art.device), "available_global_memory", property(lambda _: 1 << 26))
    engine = Engine(art, max_batch_size=2, memory_fraction=0.5)
    cap = engine.capacity()
    assert cap["num_slots"] == 2
    assert cap["kv_bytes"] + cap["gdn_bytes"] <= 1 << 25
    assert cap["kv_bytes"] + cap["gdn_bytes"] > (1 << 25) - 16 * cap["kv_bytes_per_token"]


def test_graph_capture_warm_up_leaves_no_trace(tiny_compiled):
    """The start-up decode at each batch size frees its slots, and a sequence that then takes
    one of them computes exactly what it would on a fresh runner."""
    art, gen = loaded(tiny_compiled)
    ids = prompt(40, gen.decodable, seed=7)
    fresh = ModelRunner(art, max_batch_size=4, max_total_tokens=256)
    warmed = ModelRunner(art, max_batch_size=4, max_total_tokens=256)
    warmed.capture_decode_graphs([1, 2, 4])
    rows = []
    for runner in (fresh, warmed):
        runner.add_sequence(3, [4, 5, 6])  # slot 3 is the first the warm-up used
        rows.append(runner.forward([3], [ids]))
        rows.append(runner.forward([3], [[ids[0]]]))
    np.testing.assert_array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(rows[1], rows[3])


def test_uploads_land_in_their_own_buffers(tiny_compiled):
    """DeviceInputs.upload packs its arrays into one copy, then spreads them: each comes back whole,
    empty ones too, and a buffer that grows keeps no stale values."""
    art, _ = loaded(tiny_compiled)
    runner = ModelRunner(art, max_batch_size=2, max_total_tokens=64)
    rng = np.random.default_rng(3)
    for sizes in ((5, 0, 1, 70), (2, 130, 0, 3), (5, 0, 1, 70)):
        arrays = {f"a{i}": rng.integers(-9, 10**6, n) for i, n in enumerate(sizes)}
        views = runner._inputs.upload(**arrays)
        for view, want in zip(views, arrays.values(), strict=True):
            np.testing.assert_array_equal(view.numpy(), want)


def test_logits_rows_skip_the_middle_of_a_prompt():
    from qwen35_tvm.runtime.launched import logits_rows
    from qwen35_tvm.runtime.sequence import Sequence

    def seq(prompt: int, done: int, output: int = 0, every: bool = False) -> Sequence:
        s = Sequence(0, list(range(prompt)), GREEDY, 8, frozenset(), 1, every)
        s.num_computed, s.output = done, list(range(output))
        return s

    decoding, ending, middle = seq(5, 5, 1), seq(10, 4), seq(10, 0)
    rows, counts = logits_rows([(decoding, 1), (ending, 6), (middle, 3), (decoding, 1)])
    assert rows.tolist() == [0, 6, 10] and counts == [1, 1, 0, 1]
    rows, counts = logits_rows([(seq(10, 2, every=True), 3), (middle, 4)])
    assert rows.tolist() == [0, 1, 2] and counts == [3, 0]  # every row of a scored chunk
    rows, counts = logits_rows([(middle, 3), (seq(10, 0), 4)])
    assert rows.tolist() == [6] and counts == [0, 0]  # a forward has a row, unread
