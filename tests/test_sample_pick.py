"""schedules/sample_pick.py on the CPU: token for token against tests/sampling_reference.py
(the same hash, the same float32 steps) over many seeds, counters and settings, at the edges
(fewer decodable columns than chunks or than k, ties, -inf columns, pads holding the largest
values), and its draws against the exact distributions they sample (top_k + top_p, and
Gumbel-max over the whole row)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from sampling_reference import draw

from qwen35_tvm.runtime.device_sampling import seed_words
from qwen35_tvm.schedules.sample_pick import K_MAX, sample_pick, workspace_shapes

LLVM = tvm.target.Target("llvm")
_LIBS: dict[tuple[int, int], tvm.runtime.Module] = {}


def func_name(nucleus_rows: bool) -> str:
    return "sample_pick_nucleus" if nucleus_rows else "sample_pick"


def run_kernel(logits: np.ndarray, decodable: int, rows, settings, floors: bool = False,
               nucleus_rows: bool = True) -> tuple[np.ndarray, ...]:  # fmt: skip
    """settings[i] = (temperature, top_p, top_k, seed, counter[, min_p]) for logits row rows[i];
    returns (best, logprob) over the whole batch, -7 / 0 where no row was drawn, and with
    `floors` each listed row's nucleus floor (schedules/nucleus.py; the workspace starts at
    -7). `nucleus_rows` False: the form without the nucleus kernels."""
    key = (decodable, logits.shape[1], nucleus_rows)
    if key not in _LIBS:
        func = sample_pick(decodable, logits.shape[1], LLVM, nucleus_rows)
        _LIBS[key] = tvm.compile(tvm.IRModule({"main": func}), LLVM)
    n, dev = len(rows), tvm.cpu()
    floats = np.array([[t, p, (m or [0.0])[0]] for t, p, _, _, _, *m in settings], np.float32)
    ints = np.array([[k, *seed_words(s), c] for _, _, k, s, c, *_ in settings], np.int32)
    best = tvm.runtime.tensor(np.full(logits.shape[0], -7, np.int32), dev)
    logprob = tvm.runtime.tensor(np.zeros(logits.shape[0], np.float32), dev)
    ws = [tvm.runtime.empty(shape, dt, dev) for shape, dt in workspace_shapes(n)]
    ws[3].copyfrom(np.full(n, -7, np.float32))
    args = [logits, np.asarray(rows, np.int32), floats, ints]
    fn = _LIBS[key][func_name(nucleus_rows)]
    fn(*(tvm.runtime.tensor(a, dev) for a in args), best, logprob, *ws)
    return (best.numpy(), logprob.numpy()) + ((ws[3].numpy(),) if floors else ())


def expect(logits, decodable, rows, settings):
    out = [draw(logits[r], decodable, t, p, k, *seed_words(s), c, *m)
           for r, (t, p, k, s, c, *m) in zip(rows, settings, strict=True)]  # fmt: skip
    return np.array([o[0] for o in out]), np.array([o[1] for o in out])


def _logits(rng, batch, selection, decodable, scale=3.0):
    x = (rng.standard_normal((batch, selection)) * scale).astype(np.float32)
    x[:, decodable:] = 1e4  # pads hold the largest values: a leak would win every draw
    return x


@pytest.mark.parametrize("decodable, selection", [(1003, 1024), (50, 128), (300, 300)])
def test_tokens_equal_the_reference(decodable, selection):
    rng = np.random.default_rng(decodable)
    logits = _logits(rng, 9, selection, decodable)
    settings = [
        (0.7, 0.8, 20, 1234, 0),  # Qwen3.5's suggested settings
        (1.0, 0.95, 20, 1234, 1),
        (0.3, 1.0, 5, -1, 17),
        (1.5, 0.5, K_MAX, 2**63 - 1, 3),
        (1.0, 1.0, -1, 99, 4),  # top_k off: Gumbel-max
        (0.6, 1.0, 0, 99, 5),
        (2.0, 1.0, 1, 7, 6),  # top_k 1: the argmax
        (1.0, 0.9, -1, 8, 7),  # top_p alone: Gumbel-max over the nucleus
        (0.7, 0.3, 0, 9, 8),
    ]
    rows = [6, 0, 3, 2, 5, 1, 4, 8, 7]
    best, logprob = run_kernel(logits, decodable, rows, settings)
    want, want_lp = expect(logits, decodable, rows, settings)
    np.testing.assert_array_equal(best[rows], want)
    assert (best[rows] < decodable).all()
    np.testing.assert_allclose(logprob[rows], want_lp, atol=2e-5)
    assert best[rows[6]] == np.argmax(logits[4, :decodable])


def test_min_p_tokens_equal_the_reference():
    # min_p after top_p, over the k best or (top_k off) every column at min_p of the peak's
    # weight or more; min_p 1 leaves only the peak
    decodable, selection = 1003, 1024
    logits = _logits(np.random.default_rng(9), 8, selection, decodable, scale=1.0)
    settings = [(1.0, 1.0, -1, 1, 0, 0.1), (0.7, 0.9, -1, 2, 1, 0.2), (1.0, 1.0, 20, 3, 2, 0.3),
                (0.8, 0.5, 40, 4, 3, 0.05), (1.0, 1.0, -1, 5, 4, 1.0), (1.0, 1.0, 9, 6, 5, 1.0),
                (2.0, 0.99, 0, 7, 6, 0.5), (1.0, 1.0, -1, 8, 7, 0.0)]  # fmt: skip
    rows = [3, 0, 7, 1, 5, 2, 6, 4]
    best, _ = run_kernel(logits, decodable, rows, settings)
    want, _ = expect(logits, decodable, rows, settings)
    np.testing.assert_array_equal(best[rows], want)
    peaks = logits[:, :decodable].argmax(axis=1)
    assert best[rows[4]] == peaks[rows[4]] and best[rows[5]] == peaks[rows[5]]
    # the form without nucleus kernels serves min_p over the k best
    k_rows = [i for i, st in enumerate(settings) if st[2] >= 1]
    plain, _ = run_kernel(logits, decodable, [rows[i] for i in k_rows],
                          [settings[i] for i in k_rows], nucleus_rows=False)  # fmt: skip
    np.testing.assert_array_equal(plain[[rows[i] for i in k_rows]], want[k_rows])


def test_many_counters_and_seeds():
    decodable, selection = 1003, 1024
    rng = np.random.default_rng(1)
    logits = _logits(rng, 24, selection, decodable, scale=1.0)  # flat-ish: many candidates
    settings = [(float(rng.uniform(0.2, 2.0)), float(rng.choice([1.0, 0.9, 0.5])),
                 int(rng.choice([-1, 1, 3, 20, 40, K_MAX])), int(rng.integers(-2**40, 2**40)),
                 int(rng.integers(0, 2**31)))
                for _ in range(24)]  # fmt: skip
    rows = list(rng.permutation(24))
    best, _ = run_kernel(logits, decodable, rows, settings)
    want, _ = expect(logits, decodable, rows, settings)
    np.testing.assert_array_equal(best[rows], want)


def test_only_listed_rows_are_written():
    logits = _logits(np.random.default_rng(2), 5, 128, 100)
    best, logprob = run_kernel(logits, 100, [3, 1], [(1.0, 1.0, 10, 5, 0)] * 2)
    assert list(best[[0, 2, 4]]) == [-7, -7, -7] and not logprob[[0, 2, 4]].any()


def test_the_form_without_nucleus_kernels_draws_the_same():
    # the runtime's form for batches without a top_p-only row: the same draws, and the
    # nucleus workspace left as it was (its five kernels are not there)
    rng = np.random.default_rng(8)
    logits = _logits(rng, 6, 1024, 1003)
    settings = [(0.7, 0.8, 20, 11, 3), (1.3, 1.0, -1, 12, 4), (1.0, 0.5, 64, 13, 5),
                (0.5, 1.0, 1, 14, 6), (2.0, 0.99, 7, 15, 7), (1.0, 1.0, 0, 16, 8)]  # fmt: skip
    rows = [5, 0, 3, 2, 4, 1]
    plain = run_kernel(logits, 1003, rows, settings, floors=True, nucleus_rows=False)
    full = run_kernel(logits, 1003, rows, settings, floors=True)
    np.testing.assert_array_equal(plain[0], full[0])
    np.testing.assert_array_equal(plain[1], full[1])
    assert (plain[2] == -7).all() and np.isneginf(full[2]).all()
    want, _ = expect(logits, 1003, rows, settings)
    np.testing.assert_array_equal(plain[0][rows], want)


def test_ties_go_to_the_lower_id_and_minus_inf_never_wins():
    decodable = 300
    logits = np.full((1, 320), -np.inf, np.float32)
    logits[0, [5, 77, 150, 299]] = 2.0  # four tied tokens, the rest -inf
    logits[0, decodable:] = 50.0
    # top_k 2 of four ties: the two lowest ids, whatever the draw
    got = {int(run_kernel(logits, decodable, [0], [(1.0, 1.0, 2, s, 0)])[0][0]) for s in range(40)}
    assert got == {5, 77}
    got = {int(run_kernel(logits, decodable, [0], [(1.0, 1.0, -1, s, 0)])[0][0]) for s in range(40)}
    assert got == {5, 77, 150, 299}  # Gumbel-max: any of the live ones, never a -inf column
    # k past the live columns: only the live ones, each drawn
    got = {int(run_kernel(logits, decodable, [0], [(1.0, 1.0, K_MAX, s, 1)])[0][0])
           for s in range(60)}  # fmt: skip
    assert got == {5, 77, 150, 299}


def _frequencies(logits_row, decodable, setting, draws):
    t, p, k, seed, *m = setting
    logits = np.repeat(logits_row[None], draws, axis=0)
    best, _ = run_kernel(logits, decodable, list(range(draws)),
                         [(t, p, k, seed, c, *m) for c in range(draws)])  # fmt: skip
    return np.bincount(best, minlength=decodable) / draws


def _target(x, t, p, k, min_p=0.0):
    """The host sampler's distribution, in float64: temperature, top_k, top_p, min_p."""
    y = x.astype(np.float64) / t
    order = np.lexsort((np.arange(len(y)), -y))
    if k >= 1:
        order = order[:k]
    w = np.exp(y[order] - y[order[0]])
    cut = int(np.searchsorted(np.cumsum(w), p * w.sum())) + 1
    cut = min(cut, int((w >= min_p).sum()))
    out = np.zeros(len(y))
    out[order[:cut]] = w[:cut] / w[:cut].sum()
    return out


@pytest.mark.parametrize(
    "setting",
    [(0.8, 0.9, 6, 11), (1.3, 1.0, -1, 12), (1.0, 0.7, 20, 13), (1.2, 0.8, -1, 14),
     (1.0, 1.0, -1, 15, 0.2), (0.9, 0.95, 12, 16, 0.3)],
)  # fmt: skip
def test_draws_follow_the_distribution(setting):
    """Chi-square over 3,000 draws (counters 0..2,999): a wrong filter, a skewed draw or
    noise that is not Gumbel's moves it far past its 99.9% bound."""
    decodable, draws = 37, 3000
    x = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    x[decodable:] = 30.0
    got = _frequencies(x, decodable, setting, draws)
    want = _target(x[:decodable], *setting[:3], *setting[4:])
    live = want > 0
    assert got[~live].sum() == 0
    chi2 = draws * ((got[live] - want[live]) ** 2 / want[live]).sum()
    dof = int(live.sum()) - 1
    bound = dof + 3.1 * np.sqrt(2 * dof) + 10  # ~99.9% for these dof
    assert chi2 < bound, (chi2, bound, dof)
