"""schedules/nucleus.py on the CPU (through sample_pick, whose first kernel it is): each top_p
row's floor equals tests/sampling_reference.py's `nucleus_floor` exactly, at odd widths, for
nuclei of one column up to nearly the whole row, for values too close for the first pass's
buckets to part (the key passes must), ties at the cut, -inf columns and weights that round to 0,
rows loaded as vectors and (a width not a multiple of VEC) one column at a time. Rows with
top_k, or top_p 1, get no floor."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_reference import nucleus_floor
from test_sample_pick import _logits, run_kernel

from qwen35_tvm.schedules.nucleus import FIXED

PS = (0.02, 0.3, 0.8, 0.9, 0.95, 0.999)


def floors_of(logits, decodable, settings):
    rows = list(range(len(settings)))
    full = [(t, p, k, 1, 0) for t, p, k in settings]
    return run_kernel(logits, decodable, rows, full, floors=True)[2]


def expected(logits, decodable, settings):
    return np.array([nucleus_floor(logits[i, :decodable], t, p) if k < 1 and p < 1 else -np.inf
                     for i, (t, p, k) in enumerate(settings)], np.float32)  # fmt: skip


@pytest.mark.parametrize(
    "decodable, selection, scale",
    [(1003, 1024, 3.0), (1003, 1024, 0.5), (4099, 4224, 2.0), (37, 64, 1.0), (37, 66, 1.0),
     (248077, 248192, 2.0)],
)  # fmt: skip
def test_floors_equal_the_reference(decodable, selection, scale):
    rng = np.random.default_rng(decodable)
    settings = [(float(t), p, -1) for t in (0.4, 1.0, 1.7) for p in PS]
    logits = _logits(rng, len(settings), selection, decodable, scale)
    got = floors_of(logits, decodable, settings)
    want = expected(logits, decodable, settings)
    np.testing.assert_array_equal(got, want)
    # the floor is a real value of the row, and its nucleus holds top_p of the exact mass, to
    # the fixed point's unit a column (the peak weighs 1)
    for i, (t, p, _) in enumerate(settings):
        x = logits[i, :decodable].astype(np.float64)
        assert got[i] in logits[i, :decodable]
        w = np.exp((x - x.max()) / t)
        slack = decodable / FIXED + 1e-6 * w.sum()
        assert w[x >= got[i]].sum() >= p * w.sum() - slack
        assert w[x > got[i]].sum() < p * w.sum() + slack


def test_rows_without_a_nucleus_to_find_get_none():
    logits = _logits(np.random.default_rng(5), 4, 128, 100)
    settings = [(1.0, 0.9, 20), (1.0, 1.0, -1), (0.5, 0.5, 0), (1.0, 0.9, 1)]
    got = floors_of(logits, 100, settings)
    assert np.isneginf(got[[0, 1, 3]]).all() and np.isfinite(got[2])


def test_values_closer_than_a_bucket_are_parted_by_their_keys():
    # 5,000 consecutive floats (5.0 and up, 1 ulp apart): one first-pass bucket, whose keys
    # span more than one key pass's buckets, so two key passes must part them
    decodable, n = 5077, 5000
    rng = np.random.default_rng(6)
    ulps = np.float32(5.0).view(np.int32) + rng.permutation(n).astype(np.int32)
    logits = np.full((4, 5120), -np.inf, np.float32)
    logits[:, :n] = ulps.view(np.float32)[None, :]
    logits[:, n:decodable] = rng.standard_normal((4, decodable - n)) - 8.0
    settings = [(4.0, 0.5, -1), (4.0, 0.05, -1), (4.0, 0.77, -1), (4.0, 0.999, -1)]
    got = floors_of(logits, decodable, settings)
    np.testing.assert_array_equal(got, expected(logits, decodable, settings))


def test_edges_one_column_ties_and_weights_that_round_to_zero():
    logits = np.full((4, 96), 1e4, np.float32)  # pads hold the largest values
    logits[0, 0] = -3.0  # decodable 1 below: the one column is the nucleus
    logits[1, :80] = 2.0  # all tied: every column kept
    logits[2, :80] = np.where(np.arange(80) < 3, 10.0, -400.0)  # the rest weigh 0
    logits[3, :80] = -np.inf
    logits[3, [4, 9]] = [1.0, 0.0]
    got = floors_of(logits[:1], 1, [(1.0, 0.9, -1)])
    assert got[0] == -3.0
    settings = [(1.0, 0.5, -1), (1.0, 0.5, -1), (1.0, 0.9999, -1), (1.0, 0.8, -1)]
    got = floors_of(logits, 80, settings)
    assert got[1] == 2.0 and got[2] == 10.0 and got[3] == 0.0
    np.testing.assert_array_equal(got[1:], expected(logits, 80, settings)[1:])
    # a temperature near greedy's: columns 1e-4 apart weigh 2^-7 of each other
    near = np.full((2, 96), -np.inf, np.float32)
    near[:, :5] = np.float32(5.0) - np.arange(5, dtype=np.float32) * np.float32(1e-4)
    settings = [(2e-5, 0.5, -1), (2e-5, 0.999, -1)]
    got = floors_of(near, 80, settings)
    assert list(got) == [near[0, 0], near[0, 1]]
    np.testing.assert_array_equal(got, expected(near, 80, settings))
    # the top value's mass exactly top_p of the total: it alone is the nucleus
    logits[0, :2] = [0.0, -1e-9]  # both weigh 2^32
    assert floors_of(logits[:1], 2, [(1.0, 0.5, -1)])[0] == 0.0
