"""Configurations of the decode GEMV (schedules/gemv.py) and how the pipeline picks them: one
config for decode's 1-7 rows ("small"), one per batch bucket for decode_wide's 8-64 ("wide")."""

from __future__ import annotations

from dataclasses import dataclass

from .wgmma_config import BLOCK_K, BLOCK_M, SM80_SHARED_BYTES, THREADS, WgmmaConfig

VEC = 8  # bf16 elements of one 128-bit load
# bf16 after each row of a bulk stage: a row pitch of 64 bytes past a multiple of 128 puts the
# two rows of a quarter-warp's 128-bit reads in different banks
BULK_PAD = 32
TILE_COLS = 8  # batch rows of one n-tile: mma's n8
MAX_N_TILES = 8  # 64 batch rows a pass: decode_wide's largest batch reads the weight once
# The GPU the grid is sized for: H100/H200 SXM (an A100 has 108 SMs); a library is built
# without one, so this cannot be read from the device.
SMS = 132
MAX_THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # H100/H200; each resident block also takes 1 KB of it
BLOCK_RESERVED = 1024
# what decode_wide's weight rings may take of it: the rest of the 256 KB stays L1, where the
# blocks of an SM meet the same X
WIDE_SHARED_PER_SM = 160 * 1024
MAX_REGISTERS = 232  # per thread: 255, less a margin for est_registers' error
# A decode GEMV of more row tiles than SMs, but at most this many, starts after its producer
# ends instead of beside it (schedules/pdl.py): some SMs then take two blocks, and launched
# early, which ones is left to where the producer's blocks free room first. 4B's n = 2,560
# projections (160 tiles: down, o_proj, out_proj): c1 TPOT 2.814 / 2.828 -> 2.789 ms, and 2.787
# with their dependents still released early (engine_gemv2560_experiment.json,
# engine_gemv2560_a2_experiment.json; c16 unchanged). 9B's (256+ tiles) keep the overlap: not
# measured there.
START_AFTER_PRODUCER_TILES = SMS * 3 // 2
# decode_wide's 32- and 64-row buckets of the wide projections as a swapped tensor-core GEMM
# (schedules/gemv_wide_mma.py) rather than the GEMV (wide_mma_config says where and why)
WIDE_MMA = True
# ... and which of its buckets (batch columns) of the narrow projections (n = 2,560 / 4,096:
# 20-32 row tiles) split each tile's k over blocks (WideMmaConfig.splits): none. 16 and 32 rows
# were measured slower (split_config); 64 rows, where the GEMV streams at 37-40% of copy
# bandwidth against cuBLAS's 72-74% (H100), is built and not yet measured
WIDE_SPLIT_K: frozenset[int] = frozenset()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # ceil(a / b)


def resident_bytes(cfg: GemvConfig | WideMmaConfig) -> int:
    """Shared memory one resident block of `cfg` takes from its SM."""
    return cfg.shared_bytes + BLOCK_RESERVED


@dataclass(frozen=True)
class GemvConfig:
    m_tiles: int = 1  # m16 weight tiles a warp owns
    warps_k: int = 8  # warps of a block, splitting its k steps between them
    unroll: int = 2  # 128-bit loads per lane per weight row and k step
    stages: int = 2  # k steps of weight loads in flight per warp
    n_tiles: int = 1  # n8 batch tiles a pass applies each weight fragment to
    # k steps of X loads in flight (0: as many as the weight's): X comes from L2, the weight
    # from HBM, so a shallower X ring frees registers for a deeper weight ring
    x_stages: int = 0
    # the weight ring in shared memory, filled by cp.async, instead of registers: bytes in
    # flight no longer cost registers (which 64 batch columns' X and accumulators need)
    w_smem: bool = False
    # k steps a warp prefetches into L2 before it waits for its producer (schedules/pdl.py)
    prefetch_steps: int = 4
    # launched beside its producer, waiting inside (schedules/pdl.py); False: launched once
    # the producer has ended
    dependent: bool = True
    # sm_90: the weight ring in shared memory, a stage of `stages` = a block's rows x one step
    # a warp, filled by one cp.async.bulk a row (schedules/gemv_bulk.py), and the grid
    # persistent, `bulk` blocks an SM, the ring running on across a block's row tiles (0: off)
    bulk: int = 0

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    @property
    def cols(self) -> int:
        return TILE_COLS * self.n_tiles  # batch rows one pass takes

    @property
    def step(self) -> int:
        return 4 * VEC * self.unroll  # k per step: 4 lanes of a row, `unroll` loads each

    @property
    def threads(self) -> int:
        return 32 * self.warps_k

    @property
    def x_ring(self) -> int:
        return self.x_stages or self.stages

    @property
    def x_ring_regs(self) -> int:
        """X's ring beside a weight ring in registers: the deepest, up to x_ring, that divides
        stages, since a step's X slot there is its weight slot mod the depth, fixed at compile
        time. Only a bulk config's differs (4B's n = 2,560: 3 stages, 2 X): sm_90's bulk ring
        takes x_ring, and its sm_80 code, the register ring, takes this."""
        return max(d for d in range(1, self.x_ring + 1) if self.stages % d == 0)

    @property
    def chunk(self) -> int:
        """k of a bulk stage: one step of each warp."""
        return self.warps_k * self.step

    @property
    def shared_bytes(self) -> int:
        """The partial sums of one n-tile, and the weight ring if it is in shared memory (a
        bulk ring's stages, each row padded by BULK_PAD, and its 2 mbarriers a stage)."""
        ring = self.stages * self.unroll * 2 * self.m_tiles * 32 * 16 if self.w_smem else 0
        bulk = self.stages * (self.rows * (self.chunk + BULK_PAD) * 2 + 16) if self.bulk else 0
        return self.warps_k * (ring + TILE_COLS * self.rows * 4) + bulk

    def check(self) -> None:
        """Raise ValueError if the kernel cannot be built with these numbers."""
        if not (1 <= self.m_tiles <= 4 and 1 <= self.warps_k <= 32):
            raise ValueError(f"{self}: m_tiles 1-4, warps_k 1-32")
        if not (1 <= self.unroll <= 8 and 1 <= self.stages <= (16 if self.w_smem else 8)):
            raise ValueError(f"{self}: unroll 1-8, stages 1-8 (1-16 in shared memory)")
        if not 0 <= self.prefetch_steps <= 16:
            raise ValueError(f"{self}: prefetch_steps 0-16")
        if not 1 <= self.n_tiles <= MAX_N_TILES:
            raise ValueError(f"{self}: n_tiles 1-{MAX_N_TILES}")
        # the X slot of a step must be known at compile time inside the unrolled ring
        if not 0 <= self.x_stages <= self.stages:
            raise ValueError(f"{self}: x_stages 0-stages")
        if not (self.w_smem or self.bulk) and self.stages % self.x_ring:
            raise ValueError(f"{self}: x_stages must divide stages (weight ring in registers)")
        if self.bulk and (self.w_smem or not 1 <= self.bulk <= 4 or self.stages < 2):
            raise ValueError(f"{self}: bulk 1-4 blocks an SM, 2+ stages, not with w_smem")


@dataclass(frozen=True)
class WideMmaConfig:
    """A decode_wide bucket as a swapped tensor-core GEMM (schedules/gemv_wide_mma.py): `cols`
    batch rows a block (wgmma's N), a ring of `stages` k tiles."""

    cols: int = 16
    stages: int = 6
    # sm_90a: the ring's first weight tiles load before the wait for X's producer
    early: bool = False
    # sm_90a: blocks a row tile's k is split over, their partials summed in split order by
    # the last to finish (schedules/split_tickets.py); sm_80 runs the tile whole in split 0
    splits: int = 1
    # launched beside its producer, waiting inside (schedules/pdl.py); False: launched once
    # the producer has ended, so its blocks take no SM room from the producer's tail, and
    # releasing its dependents at once (the GDN kernel behind in_proj then loads its state)
    dependent: bool = True

    @property
    def wgmma(self) -> WgmmaConfig:
        return WgmmaConfig(block_n=self.cols, stages=self.stages, tma=True)

    @property
    def square_chunks(self) -> int:
        """16-byte chunks of a k tile's X rows that one thread squares for a folded norm:
        thread t takes chunks t + THREADS * i, of row (t + THREADS * i) // 8."""
        return cdiv(self.cols * BLOCK_K // 8, THREADS)

    @property
    def shared_bytes(self) -> int:
        # the ring, then at most: the up values handed over, the squares, the rows' 1 / rms
        extra = (THREADS // 2 * self.cols // 2 + THREADS * self.square_chunks + self.cols) * 4
        return self.wgmma.shared_bytes + extra

    def check(self) -> None:
        if self.cols not in (16, 32, 64):
            raise ValueError(f"{self}: cols 16, 32 or 64")
        if not 1 <= self.splits <= 16:
            raise ValueError(f"{self}: splits 1-16")
        if self.early and not self.dependent:
            raise ValueError(f"{self}: loading early needs a dependent launch")
        self.wgmma.check()
        if self.shared_bytes > SM80_SHARED_BYTES:  # the launch is sm_80's too
            raise ValueError(f"{self}: {self.shared_bytes} bytes of shared memory")


# (largest batch, config) pairs, ascending; the last also takes every larger batch
Buckets = tuple[tuple[int, GemvConfig | WideMmaConfig], ...]


def est_registers(cfg: GemvConfig) -> int:
    """Registers a lane needs (fitted to ptxas 13.0 on sm_90): the load rings and the
    accumulators plus ~24."""
    shared = cfg.w_smem or cfg.bulk
    w_ring = 1 if shared else cfg.stages  # in shared memory: one step in registers
    ring = (w_ring * 2 * cfg.m_tiles + cfg.x_ring * cfg.n_tiles) * cfg.unroll * 4
    extra = 8 if shared else 0  # addresses of the shared ring
    return 24 + extra + cdiv(ring * 115, 100) + 4 * cfg.m_tiles * (cfg.n_tiles - 1)


def register_cap(threads: int, blocks: int) -> int:
    """Registers a thread gets with `blocks` blocks of `threads` on an SM, as ptxas budgets
    under __launch_bounds__: each of the 4 schedulers holds a quarter of the register file
    for its share of the warps, in steps of 8 registers a thread."""
    warps = cdiv(cdiv(threads, 32) * blocks, 4)  # a scheduler's
    return min(255, REGISTERS_PER_SM // 4 // (warps * 32) // 8 * 8)


def bulk_grid(tiles: int, cfg: GemvConfig) -> int:
    """Blocks of a bulk config's persistent grid over `tiles` row tiles."""
    return min(tiles, SMS * cfg.bulk)


def min_blocks_per_sm(n: int, cfg: GemvConfig) -> int:
    """Blocks an SM must hold for every row tile to run in one wave on SMS multiprocessors
    (every block streams its rows' whole k, so a second wave would nearly double the time);
    passed to ptxas as __launch_bounds__' second argument, so registers cannot prevent it.
    Lowered where the register budget would fall below `est_registers` (spills cost more)."""
    if cfg.bulk:
        return cfg.bulk
    need = cdiv(cdiv(n, cfg.rows), SMS)
    most = min(MAX_THREADS_PER_SM // cfg.threads, 32, SHARED_PER_SM // resident_bytes(cfg))
    while most > 1 and register_cap(cfg.threads, most) < est_registers(cfg):
        most -= 1
    return max(1, min(need, most))


def one_wave(n: int, k: int, cfg: GemvConfig, shared: int = SHARED_PER_SM) -> bool:
    """Whether every row tile runs in one wave, each warp with at least one k step, within
    the register file and `shared` bytes of shared memory an SM."""
    blocks = min_blocks_per_sm(n, cfg)
    fits = cdiv(n, cfg.rows) <= SMS * blocks and blocks * resident_bytes(cfg) <= shared
    return fits and cfg.warps_k <= cdiv(k, cfg.step) and est_registers(cfg) <= MAX_REGISTERS


def starts_beside_producer(tiles: int) -> bool:
    """Whether a grid of `tiles` row tiles is a dependent launch (schedules/pdl.py)."""
    return not SMS < tiles <= START_AFTER_PRODUCER_TILES


def default_config(n: int, k: int) -> GemvConfig:
    """Two m-tiles a block for wide weights (half the X loads per weight byte), one for narrow
    ones (more blocks); then the most k-splitting warps (8, 4, 2, 1), and the deepest ring (3
    or 2 steps), that keep every row tile in one wave, with at least one k step a warp. Grids
    of SMS to START_AFTER_PRODUCER_TILES row tiles are not dependent launches."""
    m_tiles = 2 if n >= 8192 else 1
    dependent = starts_beside_producer(cdiv(n, 16 * m_tiles))
    for warps_k in (8, 4, 2, 1):
        for stages in (3, 2):
            cfg = GemvConfig(m_tiles=m_tiles, warps_k=warps_k, stages=stages, dependent=dependent)
            if one_wave(n, k, cfg):
                return cfg
    return GemvConfig(m_tiles=m_tiles, warps_k=1, dependent=dependent)


def decode_bulk_config(n: int, k: int) -> GemvConfig | None:
    """Decode's GEMV through sm_90's bulk ring, for the shapes it was measured on (4B; H100,
    docs/performance.md session 36: c1 TPOT 3.369 -> 3.083 ms, a step's span 3,390 -> 3,082
    µs): the hidden-width outputs (o_proj, out_proj, down: 160 one-tile blocks, 2 an SM, 3
    stages of 128 k a warp) and the hidden-width inputs (in_proj, qkv, gate_up: 4 warps, 396
    persistent blocks, 4 stages). None elsewhere. Grids of one-tile blocks suffer from their
    dependents launching early (a register-ring gate_up behind a bulk out_proj: +450 µs a step),
    so the two go together."""
    base = dict(m_tiles=1, x_stages=2, dependent=True)
    if n == 2560 and k in (4096, 9216):
        return GemvConfig(warps_k=8, unroll=4, stages=3, bulk=2, **base)
    if k == 2560 and n in (10240, 12352, 18432):
        return GemvConfig(warps_k=4, unroll=4, stages=4, bulk=3, **base)
    return None


def wide_config(
    n: int, k: int, n_tiles: int, w_smem: bool = True, m_tiles: int | None = None
) -> GemvConfig:
    """One bucket of decode_wide: `n_tiles` batch tiles a pass, the weight ring in shared
    memory (or registers). X bytes read from L2 per weight byte are cols / rows per warp, so
    2 m-tiles a warp where that still gives every SM a row tile, else 1, unless `m_tiles` is
    given (4 read less X but measured slower in the engine: c16 TPOT 4.351 -> 4.297 ms with 2,
    and 4.323 with 2 for N = 2,560 too, which leaves SMs idle; engine_wide_mtiles.json); then
    the most weight bytes in flight (k-splitting warps x ring depth) in one wave, with a
    two-step X ring where it fits.

    A bucket with the ring in registers starts beside its producer where decode's GEMV would
    (starts_beside_producer): in_proj's early release lets the GDN kernel behind it load its
    state under in_proj's tail (H100, c16 TPOT 5.02 -> 4.91-4.93 ms in three runs, greedy
    tokens identical; docs/results/engine_w16_h100_s28.json). Shared-ring buckets, launched
    early, landed unevenly on the SMs the producer still held (1.3-1.5x slower, H200), and so
    did the n = 2,560 grids (c16 TPOT 6.74 ms: two blocks an SM on the first to free up, where
    one SM streams ~45 GB/s; engine_w16all_h100_s28.json)."""
    if n_tiles == 1:
        return default_config(n, k)
    rings = (8, 6, 4, 3) if w_smem else (4, 3, 2)
    tries = sorted(
        ((wk, s) for wk in (8, 4, 2, 1) for s in rings), key=lambda p: (-p[0] * p[1], -p[0])
    )
    for mt in (m_tiles,) if m_tiles else (2, 1):
        if not m_tiles and mt > 1 and (cdiv(n, 16 * mt) < SMS or 4 * mt * n_tiles > 128):
            continue  # SMs left idle, or the accumulators alone past half the registers
        for warps_k, stages in tries:
            for x_stages in (2, 1) if w_smem else (0,):
                beside = not w_smem and starts_beside_producer(cdiv(n, 16 * mt))
                cfg = GemvConfig(mt, warps_k, 1, stages, n_tiles, x_stages, w_smem,
                                 dependent=beside)  # fmt: skip
                if one_wave(n, k, cfg, WIDE_SHARED_PER_SM):
                    return cfg
    return GemvConfig(m_tiles or 1, 1, 1, 2, n_tiles, int(w_smem), w_smem, dependent=False)


def ring_in_registers(n: int, k: int, n_tiles: int) -> bool:
    """Where the weight ring of a decode_wide bucket goes by default: registers for the 16-row
    bucket of every 4B shape and of 9B's narrow n (at batch 16 the sweep measured 1.06-1.37x
    over the shared ring: docs/results/gemv_kernel_wide.json, "regs"); shared memory
    elsewhere, where 32-64 columns of X need the registers (and 9B's in_proj, 12352 x 4096,
    measured 0.94x in registers)."""
    return n_tiles == 2 and (n <= 4096 or k <= 2560)


def wide_mma_config(n: int, k: int, cols: int) -> WideMmaConfig | None:
    """The swapped tensor-core GEMM's bucket of `cols` (32 or 64) rows for a weight of n rows
    (a SwiGLU's too: 64 outputs a block, so the same n / 128 blocks), or None where the GEMV
    streams better. Its blocks must give most SMs one (n = 2,560 would leave 112 of 132
    idle). The ring: the deepest (6 stages; 4 at 64 rows) with which one wave holds every
    block, as two blocks an SM must for gate_up's 144 (6 stages, one an SM: 77.2% of copy
    bandwidth at 16 rows against 85.5 with 5 and 87.0 with 4; H100, alone:
    docs/results/gemv_kernel_wide_mma_h100_s43.json).

    16 rows keep the GEMV. Alone on an H100 the GEMM won there too (in_proj 84.0% against
    81.0), but in the H200's engine it lost: c16's decode step 3.655 -> 3.844 ms (in the step
    in_proj took 29 µs a call and gate_up 36, against the GEMVs' 21 and 31 in session 34's
    profile), while c32's went 4.990 -> 4.869 and c64's 7.938 -> 7.640
    (docs/results/wide_mma_h200_s44/). No launch mode saves it (H100, c16 4.79 ms with the
    GEMV): launched after its producer, the GEMM leaves the GDN kernel behind in_proj
    unreleased until it ends (4.93, wide_nodep_h100_s45/); releasing it at once, the GDN
    kernel's state loads slow in_proj's GEMM instead (in_proj alone: 4.86, wide_rel_h100_s45/)."""
    tiles = cdiv(n, BLOCK_M)
    if k % (2 * BLOCK_K):
        return None
    if tiles < SMS // 2:
        return split_config(n, k, cols) if cols in WIDE_SPLIT_K else None
    if cols < 32:
        return None
    per_sm = cdiv(tiles, SMS)
    for stages in (6, 5, 4, 3) if cols < 64 else (4, 3):
        cfg = WideMmaConfig(cols, stages)
        if per_sm * resident_bytes(cfg) <= SHARED_PER_SM:
            return cfg
    return None


def split_config(n: int, k: int, cols: int, splits: int | None = None) -> WideMmaConfig | None:
    """A narrow weight's bucket of `cols` rows with each row tile's k split over `splits`
    blocks (default: the most, up to 8, that keep one block an SM: 6 for 4B's 20 tiles, 4 for
    9B's 32), each with at least two k tiles (else None); 6-stage rings (4 at 64 rows),
    launched after the producer's end. At 16 and 32 rows measured and off (H100,
    docs/results/split_k_h100_s45/, wide_nodep_h100_s45/): alone at 16 rows it streams down at
    70.5-71.1% of copy bandwidth and out_proj at 58.0-59.5% against the GEMV's 73.6 and 68.6;
    in the engine c16 TPOT is 4.787 -> 4.880 ms. A dependent launch was far worse (6.404 ms):
    its blocks, resident while gate_up ran, held the SMs gate_up's later blocks needed."""
    tiles, k_tiles = cdiv(n, BLOCK_M), k // BLOCK_K
    splits = splits or min(8, SMS // tiles, k_tiles // 2)
    if splits < 2 or 2 * splits > k_tiles:
        return None
    # 64 columns: 4 stages, within sm_80's shared memory as wide_mma_config's 64-row rings
    return WideMmaConfig(cols, 6 if cols < 64 else 4, splits=splits, dependent=False)


def wide_buckets(n: int, k: int, mma: bool | None = None, **options) -> Buckets:
    """decode_wide's buckets: 8 rows as decode's GEMV, then 16, 32 and 64 columns a pass (a
    batch past 64 takes more blocks): the swapped tensor-core GEMM where `wide_mma_config`
    gives one and `mma` (None: WIDE_MMA), else the GEMV, whose options go to wide_config;
    without `w_smem`, `ring_in_registers` places each bucket's weight ring."""
    mma = WIDE_MMA if mma is None else mma

    def bucket(t: int) -> GemvConfig | WideMmaConfig:
        if mma and t > 1 and (cfg := wide_mma_config(n, k, 8 * t)) is not None:
            return cfg
        placed = {} if "w_smem" in options else {"w_smem": not ring_in_registers(n, k, t)}
        return wide_config(n, k, t, **options, **placed)

    return tuple((8 * t, bucket(t)) for t in (1, 2, 4, MAX_N_TILES))
