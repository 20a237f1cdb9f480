"""The decode GEMV's GPU data movement (schedules/gemv.py), emulated lane by lane in numpy with
the kernel's own index maps, without a GPU: the register ring or the cp.async weight ring in
shared memory (groups land only when waited for: a read before its wait sees NaN), the X ring,
128-bit load addresses, mma fragments (the PTX ISA's m16n8k16 layouts), n-tiles, the partial
sums of the k-splitting warps and the stores, n-tile by n-tile.

Mutations: a wrong fragment map, a wait that lets a step's weights be read before they land,
X rows that disagree with the output rows, and a dropped n-tile each make the checks fail.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qwen35_tvm.schedules import gemv_body, gemv_bulk, gemv_config, gemv_store
from qwen35_tvm.schedules.gemm_layout import acc_coords
from qwen35_tvm.schedules.gemv_config import TILE_COLS, GemvConfig, cdiv
from qwen35_tvm.schedules.gemv_layout import load_row

_LANES = np.arange(32)
_G, _Q = _LANES // 4, _LANES % 4
_E8, _E4 = np.arange(8), np.arange(4)
# PTX ISA, mma.m16n8k16 .bf16: (row, k) of A's a0..a7, (k, n) of B's b0..b3, (row, n) of C's
_A_ROW, _A_K = _G[:, None] + 8 * (_E8 // 2 % 2), 2 * _Q[:, None] + _E8 % 2 + 8 * (_E8 // 4)
_B_K, _B_N = 2 * _Q[:, None] + _E4 % 2 + 8 * (_E4 // 2), np.broadcast_to(_G[:, None], (32, 4))
_C_ROW, _C_N = _G[:, None] + 8 * (_E4 // 2), 2 * _Q[:, None] + _E4 % 2


def _mma(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The [32, 4] accumulator fragments of A [32, 8] (16 x 16) times B [32, 4] (16 x 8)."""
    am, bm = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    am[_A_ROW, _A_K] = a
    bm[_B_K, _B_N] = b
    return (am @ bm)[_C_ROW, _C_N]


class _Warp:
    """One warp of one block: its loads, rings and accumulators."""

    def __init__(self, x, w, cfg: GemvConfig, wk: int, tile: int, col: int):
        self.x, self.w, self.cfg, self.wk, self.tile, self.col = x, w, cfg, wk, tile, col
        (self.batch, self.k), self.n = x.shape, w.shape[0]
        self.n_steps = cdiv(self.k, cfg.step)
        u, mt, nt = cfg.unroll, cfg.m_tiles, cfg.n_tiles
        self.w_ring = np.full((cfg.stages, 32, u, 2 * mt, 8), np.nan)  # registers or shared
        self.x_ring = np.full((cfg.x_ring, 32, u, nt, 8), np.nan)
        self.acc = np.zeros((32, 4 * mt * nt))
        self.groups: list[list] = []  # committed cp.async groups, oldest first

    def step(self, j: int) -> int:
        return gemv_body.warp_step(j, self.wk, self.cfg.warps_k)

    def _k0(self, ks: int, u: int, lane: int) -> int:
        return gemv_body.load_k(ks, u, gemv_body.lane_coords(lane)[1], self.cfg.step)

    def _w(self, ks: int, u: int, h: int, lane: int) -> np.ndarray:
        k0, g = self._k0(ks, u, lane), gemv_body.lane_coords(lane)[0]
        row = min(gemv_body.load_row(self.tile, h, g, self.cfg.m_tiles), self.n - 1)
        return self.w[row, k0 : k0 + 8] if k0 < self.k else np.zeros(8)

    def load_w(self, d: int, ks: int) -> None:
        for lane, u, h in np.ndindex(32, self.cfg.unroll, 2 * self.cfg.m_tiles):
            if ks < self.n_steps:
                self.w_ring[d, lane, u, h] = self._w(ks, u, h, lane)

    def load_x(self, d: int, ks: int) -> None:
        for lane, u, j in np.ndindex(32, self.cfg.unroll, self.cfg.n_tiles):
            if ks < self.n_steps:
                k0, g = self._k0(ks, u, lane), gemv_body.lane_coords(lane)[0]
                row = min(gemv_body.x_row(self.col, j, g), self.batch - 1)
                self.x_ring[d, lane, u, j] = self.x[row, k0 : k0 + 8] if k0 < self.k else 0

    def copy_w(self, d: int, ks: int) -> None:
        """cp.async into slot d, landing at a later wait; zeros past k are stored at once."""
        group = []
        for lane, u, h in np.ndindex(32, self.cfg.unroll, 2 * self.cfg.m_tiles):
            if ks < self.n_steps:
                if self._k0(ks, u, lane) < self.k:
                    group.append(((d, lane, u, h), self._w(ks, u, h, lane)))
                else:
                    self.w_ring[d, lane, u, h] = 0
        self.groups.append(group)

    def wait(self, pending: int) -> None:
        while len(self.groups) > pending:
            for where, value in self.groups.pop(0):
                self.w_ring[where] = value

    def product(self, w_regs: np.ndarray, dx: int, ks: int) -> None:
        """w_regs [32, unroll, 2 m_tiles, 8]: the step's weights as the lanes hold them."""
        mt, nt = self.cfg.m_tiles, self.cfg.n_tiles
        for u in range(self.cfg.unroll) if ks < self.n_steps else ():
            for m, s in np.ndindex(mt, 2):
                src = [gemv_body.frag_source(m, s, e) for e in range(8)]
                a = np.stack([[w_regs[ln, u, h, v] for h, v in src] for ln in range(32)])
                for j in range(nt):
                    at = gemv_body.acc_index(m, j, 0, nt)
                    b = self.x_ring[dx, :, u, j, s * 4 : s * 4 + 4]
                    self.acc[:, at : at + 4] += _mma(a, b)

    def run(self) -> np.ndarray:
        """accumulate_regs or accumulate_smem; the accumulators [32 lanes, 4 m_tiles n_tiles]."""
        cfg, stages, xr = self.cfg, self.cfg.stages, self.cfg.x_ring
        per_warp = cdiv(self.n_steps, cfg.warps_k)
        if not cfg.w_smem:
            xr = cfg.x_ring_regs
            for d in range(stages):
                self.load_w(d, self.step(d))
            for d in range(xr):
                self.load_x(d, self.step(d))
            for it in range(cdiv(per_warp, stages)):
                for d in range(stages):
                    j = it * stages + d
                    self.product(self.w_ring[d], d % xr, self.step(j))
                    self.load_w(d, self.step(j + stages))
                    self.load_x(d % xr, self.step(j + xr))
            return self.acc
        for d in range(stages):
            self.copy_w(d, self.step(d))
        for d in range(xr):
            self.load_x(d, self.step(d))
        for it in range(cdiv(per_warp, xr)):
            for d in range(xr):
                j = it * xr + d
                slot = j % stages
                self.wait(gemv_body.groups_in_flight(stages))
                self.product(self.w_ring[slot].copy(), d, self.step(j))
                self.copy_w(slot, self.step(j + stages))
                self.load_x(d, self.step(j + xr))
        return self.acc


def _store(out: np.ndarray, accs: list, cfg: GemvConfig, tile: int, col: int) -> None:
    """A tile's warps' accumulators through the partial sums into `out`, n-tile by n-tile."""
    (batch, n), rb, nt = out.shape, cfg.rows, cfg.n_tiles
    for t in range(nt):
        part = np.full((cfg.warps_k, TILE_COLS, rb), np.nan)
        for wk, lane, m, e in np.ndindex(cfg.warps_k, 32, cfg.m_tiles, 4):
            er, ec = acc_coords(lane, e)
            part[wk, ec, m * 16 + er] = accs[wk][lane, gemv_body.acc_index(m, t, e, nt)]
        for o in range(rb * TILE_COLS):  # every thread's o in the store loop
            r, b = o % rb, gemv_store.out_row(col, t, o // rb)
            if tile * rb + r < n and b < batch:
                out[b, tile * rb + r] = part[:, o // rb, r].sum()


def _emulate_gpu(x: np.ndarray, w: np.ndarray, cfg: GemvConfig, sm80: bool = False) -> np.ndarray:
    """Every pass and row tile: its warps, then the partial sums and stores. `sm80`: a bulk
    config's code for sm_80, the register ring a tile at a time."""
    if cfg.bulk and not sm80:
        return _emulate_bulk(x, w, cfg)
    (batch, _), n = x.shape, w.shape[0]
    out = np.full((batch, n), np.nan)
    for p in range(cdiv(batch, cfg.cols)):
        for tile in range(cdiv(n, cfg.rows)):
            accs = [_Warp(x, w, cfg, wk, tile, p * cfg.cols).run() for wk in range(cfg.warps_k)]
            _store(out, accs, cfg, tile, p * cfg.cols)
    return out


class _BulkRing:
    """One persistent block's bulk ring (schedules/gemv_bulk.py): stages in shared memory that
    thread 0 fills a chunk at a time, and the stages' mbarriers as phase counts. A wait passes
    where the hardware's would (the phase's parity differs from the count's); one that would
    block forever raises."""

    def __init__(self, w: np.ndarray, cfg: GemvConfig, blk: int, grid: int, chunks: int):
        self.w, self.cfg, self.blk, self.grid, self.chunks = w, cfg, blk, grid, chunks
        self.ring = np.full(gemv_bulk.stage_offset(cfg.stages, 0, 0, cfg), np.nan)
        self.full, self.empty = [0] * cfg.stages, [0] * cfg.stages  # completed phases

    def fill(self, gs: int) -> None:
        cfg, slot = self.cfg, gs % self.cfg.stages
        tile, c = gemv_bulk.ring_step_tile(gs, self.blk, self.grid, self.chunks)
        for r in range(cfg.rows):
            at = gemv_bulk.stage_offset(slot, r, 0, cfg)
            row = min(tile * cfg.rows + r, self.w.shape[0] - 1)
            self.ring[at : at + cfg.chunk] = self.w[row, c * cfg.chunk : (c + 1) * cfg.chunk]
        self.full[slot] += 1  # the copies land

    def wait(self, phases: list[int], gs: int) -> None:
        if phases[gs % self.cfg.stages] % 2 == gemv_bulk.ring_phase(gs, self.cfg.stages):
            raise RuntimeError(f"ring step {gs}: the wait would never return")

    def read(self, gs: int, wk: int) -> np.ndarray:
        """Warp wk's weights of ring step gs as its lanes hold them: [32, unroll, 2 mt, 8]."""
        cfg, slot = self.cfg, gs % self.cfg.stages
        regs = np.empty((32, cfg.unroll, 2 * cfg.m_tiles, 8))
        for lane, u, h in np.ndindex(*regs.shape[:3]):
            g, q = gemv_bulk.lane_coords(lane)
            at = gemv_bulk.stage_offset(slot, gemv_bulk.load_row(0, h, g, cfg.m_tiles),
                                        gemv_bulk.chunk_k(u, q, wk, cfg), cfg)  # fmt: skip
            regs[lane, u, h] = self.ring[at : at + 8]
        return regs


def _emulate_bulk(x: np.ndarray, w: np.ndarray, cfg: GemvConfig) -> np.ndarray:
    """Every pass and persistent block: thread 0 fills the first stages, then each of the
    block's tiles takes its chunks in ring order (all warps wait, read, mma and arrive; thread
    0 refills the stage once every thread has), then its stores."""
    (batch, k), n = x.shape, w.shape[0]
    tiles, chunks, xr = cdiv(n, cfg.rows), k // cfg.chunk, cfg.x_ring
    grid = gemv_config.bulk_grid(tiles, cfg)
    out = np.full((batch, n), np.nan)
    for p, blk in np.ndindex(cdiv(batch, cfg.cols), grid):
        ring = _BulkRing(w, cfg, blk, grid, chunks)
        total = cdiv(tiles - blk, grid) * chunks
        for s in range(min(cfg.stages, total)):
            ring.fill(s)
        for i in range(cdiv(tiles - blk, grid)):
            tile = blk + i * grid
            warps = [_Warp(x, w, cfg, wk, tile, p * cfg.cols) for wk in range(cfg.warps_k)]
            for warp in warps:
                for d in range(xr):
                    warp.load_x(d, warp.step(d))
            for c in range(chunks):
                gs, slot = i * chunks + c, (i * chunks + c) % cfg.stages
                ring.wait(ring.full, gs)
                for warp in warps:
                    warp.product(ring.read(gs, warp.wk), c % xr, warp.step(c))
                    warp.load_x(c % xr, warp.step(c + xr))
                ring.empty[slot] += 1  # every thread has arrived
                if gs + cfg.stages < total:
                    ring.wait(ring.empty, gs)
                    ring.fill(gs + cfg.stages)
            _store(out, [warp.acc for warp in warps], cfg, tile, p * cfg.cols)
    return out


def _exact(rng: np.random.Generator, shape) -> np.ndarray:
    """Multiples of 1/8 in [-1, 1], as float64: every product and sum here is exact."""
    return (rng.integers(-8, 9, shape) / 8).astype(ml_dtypes.bfloat16).astype(np.float64)


def _check(n: int, k: int, batch: int, cfg: GemvConfig, sm80: bool = False) -> bool:
    """Whether the emulated kernel gives x · wᵀ exactly."""
    rng = np.random.default_rng(n + k + batch)
    x, w = _exact(rng, (batch, k)), _exact(rng, (n, k))
    return bool(np.array_equal(_emulate_gpu(x, w, cfg, sm80), x @ w.T))


SMEM = dict(w_smem=True, unroll=1)
EMULATED = [
    # decode's configs: the weight ring in registers, one n-tile
    (40, 200, 7, GemvConfig(m_tiles=1, warps_k=3, stages=3)),
    (72, 64, 3, GemvConfig(m_tiles=2, warps_k=2, unroll=1)),
    (24, 136, 1, GemvConfig(m_tiles=1, warps_k=1, unroll=4, stages=1)),
    # decode_wide's: n-tiles, both rings, X rings shallower than the weight's, k tails
    (40, 200, 33, GemvConfig(m_tiles=1, warps_k=3, unroll=1, stages=2, n_tiles=2)),
    (72, 200, 9, GemvConfig(m_tiles=2, warps_k=2, stages=4, n_tiles=2, x_stages=2)),
    (40, 200, 16, GemvConfig(m_tiles=1, warps_k=3, stages=5, n_tiles=2, x_stages=2, **SMEM)),
    (72, 136, 33, GemvConfig(m_tiles=2, warps_k=2, stages=3, n_tiles=8, x_stages=1, **SMEM)),
    (64, 96, 64, GemvConfig(m_tiles=4, warps_k=2, stages=2, n_tiles=4, x_stages=2, **SMEM)),
    # an X ring as deep as the shared weight ring; decode's rows through a shared ring
    (40, 200, 16, GemvConfig(m_tiles=1, warps_k=3, stages=4, n_tiles=2, x_stages=4, **SMEM)),
    (40, 200, 5, GemvConfig(m_tiles=1, warps_k=3, stages=6, x_stages=3, **SMEM)),
]
# sm_90's bulk ring, on 3 SMs (few_sms) so that persistent blocks take several tiles: chunks
# fewer and more than the stages, one step a warp each, a partial last tile, two passes
BULK = [
    (16 * 11, 192, 3, GemvConfig(m_tiles=1, warps_k=3, unroll=2, stages=4, x_stages=2, bulk=1)),
    (16 * 8 - 5, 128, 1, GemvConfig(m_tiles=1, warps_k=1, unroll=2, stages=3, x_stages=2, bulk=2)),
    (32 * 5, 128, 9, GemvConfig(m_tiles=2, warps_k=2, unroll=1, stages=2, x_stages=1, bulk=1)),
]
N_TILED = [case for case in EMULATED if case[3].n_tiles > 1]


@pytest.mark.parametrize("n, k, batch, cfg", EMULATED)
def test_emulated_gpu_kernel_computes_x_times_w_transposed(n, k, batch, cfg) -> None:
    assert _check(n, k, batch, cfg)


@pytest.fixture
def few_sms(monkeypatch):
    monkeypatch.setattr(gemv_config, "SMS", 3)


@pytest.mark.parametrize("n, k, batch, cfg", BULK)
def test_emulated_bulk_ring_computes_x_times_w_transposed(few_sms, n, k, batch, cfg) -> None:
    assert gemv_config.bulk_grid(cdiv(n, cfg.rows), cfg) < cdiv(n, cfg.rows)  # persistent
    assert _check(n, k, batch, cfg)


# sm_80's code of a bulk config (its register ring) at 4B's shapes' configs: n = 2,560's has
# 3 weight stages and 2 of X, which once put two steps' X in one slot (session 38's sm_80 parity)
SM80_OF_BULK = [*BULK] + [
    (40, k, batch, gemv_config.decode_bulk_config(n, k))
    for n, k in ((2560, 4096), (12352, 2560))
    for batch in (1, 5)
]


@pytest.mark.parametrize("n, k, batch, cfg", SM80_OF_BULK)
def test_emulated_sm80_code_of_a_bulk_config(n, k, batch, cfg) -> None:
    assert cfg.bulk and _check(n, k, batch, cfg, sm80=True)


@pytest.mark.parametrize(
    "module, name, wrong",
    [
        # a warp reads another warp's step of the chunk
        (gemv_bulk, "chunk_k", lambda u, q, wk, cfg: (wk + 1) % cfg.warps_k * cfg.step
         + u * 32 + q * 8),  # fmt: skip
        # refills go to the block's next tile in the grid's order, not its own
        (gemv_bulk, "ring_step_tile", lambda gs, blk, grid, chunks: (blk + gs // chunks,
                                                                     gs % chunks)),  # fmt: skip
        # the wait's parity one phase off: the first wait never returns
        (gemv_bulk, "ring_phase", lambda gs, stages: (gs // stages + 1) % 2),
        # the lanes read another row of the stage than the producer put there for them
        (gemv_bulk, "load_row", lambda tile, h, g, mt: load_row(tile, h, (g + 1) % 8, mt)),
    ],
)
def test_bulk_ring_mutations_are_caught(few_sms, monkeypatch, module, name, wrong) -> None:
    monkeypatch.setattr(module, name, wrong)
    caught = []
    for case in BULK:
        try:
            caught.append(not _check(*case))
        except RuntimeError:  # a wait that would never return
            caught.append(True)
    # every case but a one-warp block's, where no other warp's step exists
    assert caught == [True, name != "chunk_k", True], name


def test_wrong_fragment_map_is_caught(monkeypatch) -> None:
    # swap the two k halves of A only: A and B no longer agree on the physical k
    right = gemv_body.frag_source
    monkeypatch.setattr(gemv_body, "frag_source", lambda m, s, e: right(m, 1 - s, e))
    assert not _check(*EMULATED[0])
    assert not _check(*EMULATED[6])


def test_early_read_of_the_shared_ring_is_caught(monkeypatch) -> None:
    # one more group left pending: each step reads its slot before the weights land
    monkeypatch.setattr(gemv_body, "groups_in_flight", lambda stages: stages)
    for case in (EMULATED[5], *EMULATED[-2:]):  # X ring shallower, as deep, decode's rows
        assert not _check(*case), case


def test_wrong_column_mapping_is_caught(monkeypatch) -> None:
    # n-tile j loads X rows col + 8 g + j (a transposed map) while its sums go to col + 8 j + c
    monkeypatch.setattr(gemv_body, "x_row", lambda col, j, g: col + g * 8 + j)
    for case in N_TILED:
        assert not _check(*case), case


def test_dropped_n_tile_is_caught(monkeypatch) -> None:
    # the last n-tile's products land in the first's accumulators (and are read from there)
    right = gemv_body.acc_index
    monkeypatch.setattr(
        gemv_body, "acc_index", lambda m, j, e, nt: right(m, j % max(nt - 1, 1), e, nt)
    )
    for case in N_TILED:
        assert not _check(*case), case


def test_pass_skipping_an_n_tile_is_caught(monkeypatch) -> None:
    # passes advance by one n-tile more than they compute: rows between passes are lost
    monkeypatch.setattr(GemvConfig, "cols", property(lambda c: 8 * (c.n_tiles + 1)))
    assert not _check(40, 200, 33, EMULATED[3][3])  # three passes of two n-tiles
    assert not _check(72, 136, 9, EMULATED[1][3])  # decode's config: two passes


def test_ring_offsets_are_disjoint_and_conflict_free() -> None:
    """Each (warp, slot, load, row set, lane) owns 8 elements of the shared ring, inside it, and
    the 32 lanes of a load are 16 bytes apart (a 128-bit access without bank conflicts)."""
    cfg = GemvConfig(m_tiles=2, warps_k=3, unroll=2, stages=3, n_tiles=8, w_smem=True)
    offs = [gemv_body.ring_offset(*i, cfg) for i in np.ndindex(3, 3, 2, 4, 32)]
    size = cfg.warps_k * cfg.stages * cfg.unroll * 2 * cfg.m_tiles * 32 * 8
    assert sorted(offs) == list(range(0, size, 8))
    lanes = [gemv_body.ring_offset(1, 2, 1, 3, lane, cfg) for lane in range(32)]
    assert np.all(np.diff(lanes) == 8)
