"""The engine's overlapped stepping (fp32, CPU): steps launched ahead of the host
(test_launch_ahead.py) give exactly the tokens of synchronous stepping, through stops, length
limits, joins, sampled requests and aborts, and the comparison fails where the rows a launch
takes are wrong."""

from __future__ import annotations

import numpy as np
import tvm
from test_engine import GREEDY, loaded, prompt

from qwen35_tvm.runtime.engine import Engine
from qwen35_tvm.runtime.model_runner import ModelRunner
from qwen35_tvm.runtime.sampler import SamplingParams
from qwen35_tvm.runtime.sequence import Request


def _requests(decodable: int) -> list[Request]:
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    shapes = [(5, 40, GREEDY), (40, 1, GREEDY), (17, 2, GREEDY), (3, 9, sampled), (70, 20, GREEDY)]
    return [
        Request(prompt(n, decodable, seed=10 + n), params, m, ignore_eos=True)
        for n, m, params in shapes
    ]


def _run(art, joins: dict[int, list[Request]], overlap: bool, stops=None, abort=None):
    """Step to the end, submitting joins[k] before step k (and aborting request `abort` once
    it has 3 tokens); per request its tokens, logprobs and finish reason, and how many decode
    steps were launched ahead."""
    engine = Engine(art, max_batch_size=3, max_total_tokens=1024, prefill_chunk=32, overlap=overlap)
    launched = []  # decode launches' tokens (None: fed on the device); ("mixed", fed rows)
    launch, mixed = engine.runner.launch_decode, engine.runner.launch_prefill
    engine.runner.launch_decode = lambda s, t, rows=None: launched.append(t) or launch(s, t, rows)
    engine.runner.launch_prefill = lambda s, t, r, f: (
        launched.append(("mixed", f)) or mixed(s, t, r, f)
    )
    got: dict[int, list] = {}
    step = 0
    while engine.has_work() or any(k >= step for k in joins):
        for r in joins.get(step, []):
            stop = (stops or {}).get(len(got))
            got[engine.submit(r.prompt_ids, r.params, r.max_tokens, stop, r.ignore_eos)] = [
                [],
                [],
                None,
            ]
        for out in engine.step():
            entry = got[out.request_id]
            entry[0] += out.token_ids
            entry[1] += out.logprobs
            entry[2] = out.finish_reason
            if out.request_id == abort and len(entry[0]) == 3:
                engine.abort(abort)
        step += 1
    assert (engine.free_pages(), engine.free_slots()) == (64, 3)  # all returned
    return got, launched


def _assert_same(got: dict, want: dict) -> None:
    """The same tokens and finish reasons; logprobs to fp32 rounding (a joining request can
    meet the others in a different step, and a mixed step decodes inside the prefill)."""
    assert {k: (v[0], v[2]) for k, v in got.items()} == {k: (v[0], v[2]) for k, v in want.items()}
    for k, v in want.items():
        np.testing.assert_allclose(got[k][1], v[1], rtol=0, atol=1e-5)


def test_overlapped_engine_gives_the_tokens_of_synchronous_stepping(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    reqs = _requests(gen.decodable)
    joins = {0: reqs[:3], 12: reqs[3:4], 16: reqs[4:]}
    want, none = _run(art, joins, overlap=False)
    assert none == []
    # request 0 stops at its 25th token, request 4 at its 12th: the step launched behind each
    # is dropped
    stops = {0: [want[0][0][24]], 4: [want[4][0][11]]}
    want, _ = _run(art, joins, overlap=False, stops=stops)
    got, launched = _run(art, joins, overlap=True, stops=stops)
    _assert_same(got, want)
    assert [want[i][2] for i in range(5)] == ["stop", "length", "length", "length", "stop"]
    assert launched.count(None) >= 6, launched  # steps really ran ahead, fed on the device


def _join_during_decodes(decodable: int, second_max: int = 30) -> dict[int, list[Request]]:
    """Two greedy requests decode (the second for `second_max` tokens); a third's 70-token
    prompt joins them at step 4 (chunks of 32: three mixed steps, behind a decode step and
    then behind each other)."""
    reqs = [
        Request(prompt(n, decodable, seed=n), GREEDY, m, ignore_eos=True)
        for n, m in ((6, 30), (11, second_max))
    ]
    return {0: reqs, 4: [Request(prompt(70, decodable, seed=2), GREEDY, 8, ignore_eos=True)]}


def test_mixed_steps_run_ahead_between_decodes(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    joins = _join_during_decodes(gen.decodable)
    want, _ = _run(art, joins, overlap=False)
    got, launched = _run(art, joins, overlap=True)
    _assert_same(got, want)
    # the opening step of the two prompts, then the three mixed steps: every chunk ahead
    mixed = [t[1] for t in launched if isinstance(t, tuple)]
    assert mixed == [[], [0, 1], [0, 1], [0, 1]], launched


def test_the_decode_after_the_last_prompt_ends_is_fed_on_the_device(tiny_compiled):
    """Where the joining prompt's last chunk ends, the decode behind that mixed step launches
    before the host reads it, its rows (the two decoding and the new one) fed that step's
    picks; before, the host read the mixed step first and launched with its tokens."""
    art, gen = loaded(tiny_compiled)
    joins = _join_during_decodes(gen.decodable)
    want, _ = _run(art, joins, overlap=False)
    got, launched = _run(art, joins, overlap=True)
    _assert_same(got, want)
    last_mixed = max(i for i, t in enumerate(launched) if isinstance(t, tuple))
    assert launched[last_mixed + 1] is None, launched


def test_a_row_ending_by_length_leaves_the_mixed_chain(tiny_compiled):
    """The second request's 6th and last token comes from the second mixed step: the third
    mixed step, launched before that is read, leaves it out and still chains (before, a row
    sure to stop there made the host read the step and launch the next with its tokens)."""
    art, gen = loaded(tiny_compiled)
    joins = _join_during_decodes(gen.decodable, second_max=6)
    want, _ = _run(art, joins, overlap=False)
    got, launched = _run(art, joins, overlap=True)
    _assert_same(got, want)
    mixed = [t[1] for t in launched if isinstance(t, tuple)]
    assert mixed == [[], [0, 1], [0, 1], [0]], launched
    assert all(t is None for t in launched if not isinstance(t, tuple)), launched


def _changes_tokens(art, joins: dict, method: str, wrap) -> bool:
    """Whether overlapped stepping with ModelRunner.`method` replaced by `wrap(real)` gives
    other tokens than synchronous stepping (a comparison's teeth)."""
    want, _ = _run(art, joins, overlap=False)
    real = getattr(ModelRunner, method)
    setattr(ModelRunner, method, wrap(real))
    try:
        got, _ = _run(art, joins, overlap=True)
    finally:
        setattr(ModelRunner, method, real)
    return {k: v[0] for k, v in got.items()} != {k: v[0] for k, v in want.items()}


def test_the_comparison_fails_when_a_decode_behind_a_prefill_takes_other_rows(tiny_compiled):
    """Teeth for the test above: the decode behind the last mixed step fed its rows' picks in
    reverse changes what comes out."""
    art, gen = loaded(tiny_compiled)

    def reversed_picks(real):
        def run(self, slots, tokens, picks=None):
            if picks is not None:
                picks = tvm.runtime.tensor(picks.numpy()[::-1].copy())
            return real(self, slots, tokens, picks)

        return run

    assert _changes_tokens(art, _join_during_decodes(gen.decodable), "_run_decode", reversed_picks)


def _staggered_ends(decodable: int) -> dict[int, list[Request]]:
    """Three greedy requests together, ending after 5, 9 and 14 tokens; nothing joins."""
    return {
        0: [
            Request(prompt(n, decodable, seed=n), GREEDY, m, ignore_eos=True)
            for n, m in ((7, 5), (12, 9), (3, 14))
        ]
    }


def test_the_chain_goes_on_past_a_finished_request(tiny_compiled):
    """The prompts' step launched ahead, then every decode fed on the device, past each
    request's end; before, the host read the step where one ended and launched the rest with
    its tokens."""
    art, gen = loaded(tiny_compiled)
    joins = _staggered_ends(gen.decodable)
    want, _ = _run(art, joins, overlap=False)
    got, launched = _run(art, joins, overlap=True)
    _assert_same(got, want)
    assert launched[0] == ("mixed", []) and set(launched[1:]) == {None}, launched


def test_an_abort_mid_chain_leaves_the_others_fed_on_the_device(tiny_compiled):
    """The longest request aborted at its 3rd token: the others' tokens are the synchronous
    ones, the aborted one stops at 3, and the chain goes on with the rows left."""
    art, gen = loaded(tiny_compiled)
    joins = _staggered_ends(gen.decodable)
    want, _ = _run(art, joins, overlap=False, abort=2)
    got, launched = _run(art, joins, overlap=True, abort=2)
    _assert_same(got, want)
    assert (len(got[2][0]), got[2][2]) == (3, "abort")
    assert launched[0] == ("mixed", []) and set(launched[1:]) == {None}, launched


def test_the_comparison_fails_when_the_rows_left_take_other_picks(tiny_compiled):
    """Teeth for the test above: the rows left fed their picks in reverse."""
    art, gen = loaded(tiny_compiled)

    def reverse(real):
        return lambda self, rows: real(self, rows[::-1])

    assert _changes_tokens(art, _staggered_ends(gen.decodable), "_gather", reverse)


def test_a_step_of_prompts_alone_launches_ahead_too(tiny_compiled):
    """Two prompts at once: the first step prefills both (nothing decodes yet) and launches
    ahead with the host's tokens; the short prompt ends there, and the mixed steps behind it
    take its row's token from the step in flight (before, the host read the first step)."""
    art, gen = loaded(tiny_compiled)
    d = gen.decodable
    joins = {0: [Request(prompt(n, d, seed=n), GREEDY, 12, ignore_eos=True) for n in (6, 70)]}
    want, _ = _run(art, joins, overlap=False)
    got, launched = _run(art, joins, overlap=True)
    _assert_same(got, want)
    mixed = [t[1] for t in launched if isinstance(t, tuple)]
    assert mixed == [[], [0], [0]], launched  # host tokens, then row 0 of the step in flight


class _Watched:
    """A launch's picks that note when the engine reads them."""

    def __init__(self, picks, read: list[bool]):
        self.picks, self.read, self.at = picks, read, len(read)
        read.append(False)

    def wait(self):
        self.read[self.at] = True
        return self.picks.wait()


def test_a_long_prompt_alone_chains_its_chunks(tiny_compiled):
    """One 70-token prompt, chunks of 32, nothing decoding: each chunk's step, and then each
    decode, launches while the step before it is still unread (before, the step after a chunk
    that ends no prompt waited for the host to read it)."""
    art, gen = loaded(tiny_compiled)
    req = Request(prompt(70, gen.decodable, seed=4), GREEDY, 5, ignore_eos=True)
    want, _ = _run(art, {0: [req]}, overlap=False)
    engine = Engine(art, max_batch_size=3, max_total_tokens=1024, prefill_chunk=32, overlap=True)
    read: list[bool] = []
    behind: list[bool] = []  # a launch's: was the step before it still unread

    def watched(launch):
        def run(*args):
            behind.append(bool(read) and not read[-1])
            return _Watched(launch(*args), read)

        return run

    engine.runner.launch_prefill = watched(engine.runner.launch_prefill)
    engine.runner.launch_decode = watched(engine.runner.launch_decode)
    rid = engine.submit(req.prompt_ids, req.params, req.max_tokens, None, True)
    tokens = []
    while engine.has_work():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
    assert tokens == want[0][0]
    assert behind == [False] + [True] * 6, behind  # 3 chunks, then decodes for tokens 2-5


def test_the_comparison_fails_when_mixed_rows_take_each_others_picks(tiny_compiled):
    """Teeth for the test above: decode rows fed their neighbour's pick (past the runner's
    check of the rows it was given) change what comes out."""
    art, gen = loaded(tiny_compiled)

    def reverse(real):
        return lambda self, s, t, rows, fed: real(self, s, t, rows, fed[::-1])

    assert _changes_tokens(art, _join_during_decodes(gen.decodable), "_run_prefill", reverse)


def test_steps_of_prompt_chunks_take_the_prompts_prefill(tiny_compiled):
    """A step whose chunks all hold more than one token runs prefill_prompts, one with any
    one-token chunk (a decode row, a one-token prompt) prefill; the CPU artifact has no
    prefill_prompts (it would equal prefill), so both name the same function there."""
    art, _ = loaded(tiny_compiled)
    runner = ModelRunner(art, max_batch_size=4, max_total_tokens=1024, num_slots=4)
    assert runner._prefill_prompts is runner._prefill
    plain, calls = runner._prefill, []
    runner._prefill = lambda *args: calls.append("prefill") or plain(*args)
    runner._prefill_prompts = lambda *args: calls.append("prefill_prompts") or plain(*args)
    runner.add_sequence(0, [0, 1])
    runner.add_sequence(1, [2, 3])
    runner.prefill([0, 1], [[5, 6, 7], [8, 9]], np.array([2, 4]))
    runner.prefill([0, 1], [[5], [8, 9, 10]], np.array([0, 3]))
    runner.prefill([1], [[11]], np.array([0]))
    assert calls == ["prefill_prompts", "prefill", "prefill"]
