"""decode_wide's swapped tensor-core GEMM (schedules/gemv_wide_mma.py), checked without a GPU:
its CPU variant (the GPU's blocks, thread maps and epilogue, accumulators from memory) against
numpy at edge shapes, with the residual, the folded RMSNorm and the SwiGLU; mutations of its
maps are caught; the sm_90a ring, emulated, streams the right weight rows onto the batch; and
both arches' code builds without spills. The values on the GPU are checked by
benchmarks/gemv_kernel.py (--rows wide) against torch."""

from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest
import tvm
from test_matmul_wgmma import _emulate

from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import gemv_config, gemv_wide_mma
from qwen35_tvm.schedules.gemv import gemv_kernel
from qwen35_tvm.schedules.gemv_config import GemvConfig, WideMmaConfig, wide_buckets
from qwen35_tvm.schedules.matmul_wgmma import BLOCK_K, SM80_SHARED_BYTES
from qwen35_tvm.schedules.split_k import k_range
from qwen35_tvm.schedules.split_tickets import PRELUDE, SLOT_FLOATS, SLOTS

LLVM = tvm.target.Target("llvm")
BF16 = ml_dtypes.bfloat16
EPS = 1e-6


def _exact(rng: np.random.Generator, shape) -> np.ndarray:
    """Multiples of 1/8 in [-1, 1]: every product and fp32 sum here is exact."""
    return (rng.integers(-8, 9, shape) / 8).astype(BF16)


def _run(
    n: int, k: int, batch: int, cols: int, kind: str, splits: int = 1, last: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(kernel's, numpy's) output of one bucket config on the CPU. `kind`: plain, residual
    (+ a [batch, n] bf16 extra), rms (the folded norm) or swiglu (with the norm). `last`: a
    split bucket takes every batch."""
    rng = np.random.default_rng(n * 7 + k + batch + cols)
    x, w = _exact(rng, (batch, k)), _exact(rng, (n, k))
    xf, wf = x.astype(np.float32), w.astype(np.float32)
    ref = xf @ wf.T
    kw: dict = {}
    arrays = [x, w]
    if kind == "residual":
        y = _exact(rng, (batch, n))
        arrays.append(y)
        kw = dict(
            extra_shapes=("mn",),
            extra_dtypes=("bfloat16",),
            epilogue=lambda acc, r, c, e: acc + tvm.tirx.Cast("float32", e[0][r, c]),
        )
        ref = ref + y.astype(np.float32)
    if kind in ("rms", "swiglu"):
        kw["rms_eps"] = EPS
        ref = ref / np.sqrt((xf**2).mean(1, keepdims=True) + EPS)
    n_out = n
    if kind == "swiglu":
        kw["swiglu"] = True
        n_out = n // 2
        gate, up = ref[:, :n_out], ref[:, n_out:]
        ref = gate / (1 + np.exp(-gate)) * up
    plan = ((cols, WideMmaConfig(cols, stages=4, splits=splits)), (1 << 30, WideMmaConfig(64, 4)))
    func = gemv_kernel(n, k, LLVM, plan[0][1] if splits == 1 or last else plan, **kw)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    args = [tvm.runtime.tensor(a) for a in [*arrays, np.zeros((batch, n_out), np.float32)]]
    lib["main"](*args)
    return args[-1].numpy(), ref


# (n, k, batch, cols, kind): a partial last row tile, one and several batch blocks (rows past
# the batch in the last), a batch of one, the three bucket widths
CASES = [
    (200, 256, 1, 16, "plain"),
    (200, 256, 17, 16, "residual"),
    (136, 128, 16, 16, "rms"),
    (130, 128, 33, 32, "rms"),
    (130, 128, 64, 64, "residual"),
    (130, 128, 65, 64, "rms"),
    (200, 256, 9, 16, "swiglu"),  # 100 outputs: the second block's 64 half empty
    (300, 128, 40, 32, "swiglu"),
    (256, 128, 64, 64, "swiglu"),
]


@pytest.mark.parametrize("n, k, batch, cols, kind", CASES)
def test_cpu_variant_matches_numpy(n, k, batch, cols, kind) -> None:
    got, ref = _run(n, k, batch, cols, kind)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


# a narrow weight's k split: uneven runs (8 k tiles in 3: 2, 3, 3), a batch of one, a full
# 16-row block, a partial 32- and 64-row one, a partial last row tile
SPLIT_CASES = [(300, 512, 1, 16, 3), (300, 512, 16, 16, 3), (256, 1024, 20, 32, 8),
               (300, 768, 50, 64, 6)]  # fmt: skip


@pytest.mark.parametrize("n, k, batch, cols, splits", SPLIT_CASES)
def test_split_tiles_sum_their_k_runs(n, k, batch, cols, splits) -> None:
    """The CPU variant sums the splits' partials in split order over split_k.k_range's runs,
    as the GPU's last block does."""
    got, ref = _run(n, k, batch, cols, "residual", splits)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("batch, cols", [(33, 16), (129, 64)])
def test_a_last_split_bucket_runs_later_batch_blocks_whole(batch: int, cols: int) -> None:
    """The workspace and tickets hold one batch block: a split bucket that takes every batch
    splits its first block's tiles and runs later blocks' whole (the CPU variant as the GPU)."""
    got, ref = _run(300, 512, batch, cols, "residual", 3, last=True)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_split_runs_that_miss_a_tile_are_caught(monkeypatch) -> None:
    monkeypatch.setattr(gemv_wide_mma, "k_range", lambda z, s, t: (z * t // s, t // s))
    got, ref = _run(300, 512, 16, 16, "residual", 3)
    assert not np.allclose(got, ref, rtol=1e-3)


def test_split_rule_runs_and_slots(monkeypatch) -> None:
    """The narrow weights' (20-32 row tiles) buckets named in gemv_config.WIDE_SPLIT_K split
    each tile's k over blocks, one an SM, 2+ k tiles each, in runs that cover k in order;
    every (tile, split, accumulator, thread) of them has its own workspace slot. Other buckets
    keep the GEMV."""
    narrow = ((2560, 4096), (2560, 9216), (4096, 4096), (4096, 12288))
    monkeypatch.setattr(gemv_config, "WIDE_SPLIT_K", frozenset())
    assert not any(isinstance(c, WideMmaConfig) for n, k in narrow for _, c in wide_buckets(n, k))
    monkeypatch.setattr(gemv_config, "WIDE_SPLIT_K", frozenset({64}))
    assert [type(c) for _, c in wide_buckets(2560, 9216)] == [GemvConfig] * 3 + [WideMmaConfig]
    monkeypatch.setattr(gemv_config, "WIDE_SPLIT_K", frozenset({16, 32, 64}))
    for n, k in narrow:
        plan = wide_buckets(n, k)
        assert [type(c) for _, c in plan] == [GemvConfig] + [WideMmaConfig] * 3
        tiles, k_tiles = n // 128, k // BLOCK_K
        for limit, cfg in plan[1:]:
            cfg.check()  # buildable: within sm_80's shared memory too
            s, n_acc = cfg.splits, cfg.cols // 2
            assert limit == cfg.cols and 1 < s and tiles * s <= gemv_config.SMS
            runs = [k_range(z, s, k_tiles) for z in range(s)]
            assert [a for a, _ in runs] == [0, *np.cumsum([c for _, c in runs])[:-1]]
            assert sum(c for _, c in runs) == k_tiles and min(c for _, c in runs) >= 2
            slots = {gemv_wide_mma.split_slot(bx, z, j, t, s, n_acc)
                     for bx in range(tiles) for z in range(s) for j in range(n_acc)
                     for t in range(256)}  # fmt: skip
            assert len(slots) == tiles * s * n_acc * 256 and max(slots) < SLOTS * SLOT_FLOATS
    assert gemv_config.split_config(2560, 256, 16, 3) is None  # 4 k tiles: 3 splits too many
    for n, k in ((12352, 2560), (18432, 2560)):  # wide weights: no split
        assert all(getattr(c, "splits", 1) == 1 for _, c in wide_buckets(n, k))


def _source(n: int, k: int, plan=None, **kw) -> str:
    """The CUDA source of the sm_80 + sm_90 build of `plan` (default: the pipeline's buckets)."""
    target, _ = make_target("cuda", "sm_80,sm_90")
    plan = gemv_config.wide_buckets(n, k, mma=True) if plan is None else plan
    func = gemv_kernel(n, k, target, plan, out_dtype="bfloat16", **kw)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "g")}), target=target)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    return cuda.inspect_source()


def _split_source() -> str:
    plan = ((8, GemvConfig()), (16, WideMmaConfig(16, 6, splits=6)), (1 << 30, GemvConfig()))

    def add(acc, r, c, e):
        return acc + tvm.tirx.Cast("float32", e[0][r, c])

    residual = dict(extra_shapes=("mn",), extra_dtypes=("bfloat16",), epilogue=add)
    return _source(2560, 4096, plan, **residual)


def test_split_kernel_reduces_after_the_last_ticket_in_split_order() -> None:
    """sm_90a: a split stores its partial, then (between barriers) thread 0 takes the tile's
    ticket; the block holding ticket splits - 1 loads the six splits' slots in order, resets
    the ticket, and only it stores outputs. sm_80: split 0 runs the tile whole."""
    src = _split_source()
    (body,) = [c for c in src.split("__global__")[1:] if "{\n" in c[:400] and "blockIdx.z" in c]
    at = body.index("qwen35_sm90a()")
    ring, rest = body[at:].split("} else {", 1)
    store, take = ring.index("qwen35_ws_store("), ring.index("qwen35_ticket_take(")
    syncs = [m.start() for m in re.finditer(r"__syncthreads\(\)", ring)]
    assert store < max(s for s in syncs if s < take) and any(s > take for s in syncs)
    last = ring.index("bool last = (ticket_ptr[0] == 5)")
    loop = ring.index("for (int zz = 0; zz < 6; ++zz)")
    assert take < last < loop < ring.index("qwen35_ws_load(")
    assert last < ring.index("qwen35_ticket_reset(")
    z0 = rest.index("if (((int)blockIdx.z) == 0) {")
    assert "mma.sync" in rest[z0:] and "mma.sync" not in rest[:z0]
    mine = body.index("bool mine = (ticket_ptr[0] == 5)")
    assert mine > body.index("qwen35_ticket_reset(") and body.index("out_ptr[", mine) > mine
    assert "out_ptr[" not in body[:mine]


def test_a_last_split_bucket_keeps_later_batch_blocks_off_the_workspace() -> None:
    """sm_90a, a split bucket that takes every batch: only batch block 0 stores partials, takes
    tickets and sums the workspace; a later block's split 0 runs every k tile and stores."""
    plan = ((8, GemvConfig()), (1 << 30, WideMmaConfig(64, 4, splits=6, dependent=False)))
    source = _source(2560, 9216, plan)
    (body,) = [c for c in source.split("__global__")[1:] if "blockIdx.z" in c]
    ring = body[body.index("qwen35_sm90a()") :]
    y0 = "if (((int)blockIdx.y) == 0) {"
    for call in ("qwen35_ws_store(", "qwen35_ticket_take("):  # each inside block 0's branch
        at = ring.index(call)
        assert "}" not in ring[ring.rindex(y0, 0, at) + len(y0) : at], call
    assert "bool last = ((ticket_ptr[0] == 5) && (((int)blockIdx.y) == 0));" in ring
    assert "int count = (144 - (((int)(((int)blockIdx.y) == 0)) * 120));" in ring
    assert "if ((((int)blockIdx.y) == 0) || (((int)blockIdx.z) == 0)) {" in ring


def test_only_split_kernels_carry_the_ticket_globals() -> None:
    """The tickets and workspace (8.6 MB of device globals) go only into translation units
    that call them, not into every library."""
    from qwen35_tvm.compile.cuda_toolchain import translation_unit

    assert PRELUDE in translation_unit(_split_source())
    assert PRELUDE not in translation_unit(_source(12352, 2560, rms_eps=EPS))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_split_kernel_compiles_without_spills(tmp_path) -> None:
    from qwen35_tvm.compile.cuda_toolchain import guard_sm90_asm
    from qwen35_tvm.schedules.sm90a import SM90A_PRELUDE

    (tmp_path / "g.cu").write_text(SM90A_PRELUDE + PRELUDE + guard_sm90_asm(_split_source()))
    for arch in ("sm_90a", "sm_80"):
        cmd = ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o",
               str(tmp_path / f"{arch}.cubin"), str(tmp_path / "g.cu")]  # fmt: skip
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        assert set(re.findall(r"(\d+) bytes spill stores", info)) == {"0"}, (arch, info)


def test_gate_and_up_rows_swapped_are_caught(monkeypatch) -> None:
    """A block's first 64 rows must be gate rows, its last 64 their up rows."""
    right = gemv_wide_mma.paired_row
    monkeypatch.setattr(gemv_wide_mma, "paired_row", lambda bx, r, n: right(bx, (r + 64) % 128, n))
    got, ref = _run(300, 128, 40, 32, "swiglu")
    assert not np.allclose(got, ref, rtol=1e-3)


def test_squares_summed_for_the_wrong_row_are_caught(monkeypatch) -> None:
    """A batch row's 1 / rms sums the chunks the stage hook squared for that row."""
    right = gemv_wide_mma.row_chunk
    monkeypatch.setattr(gemv_wide_mma, "row_chunk", lambda row, c: right(row + c // 7, c))
    got, ref = _run(130, 128, 33, 32, "rms")
    assert not np.allclose(got, ref, rtol=1e-3)


@pytest.mark.parametrize("n_out, batch", [(100, 9), (64, 16), (200, 70)])
def test_emulated_ring_pairs_gate_and_up_rows(n_out: int, batch: int) -> None:
    """sm_90a's ring with the weight as A in two boxes (gate rows, then up rows n_out on):
    result row 128 bx + r is weight row 64 bx + r % 64 (+ n_out from r = 64), rows past the
    weight read as zeros, edge tiles and a second batch block included."""
    rng = np.random.default_rng(n_out + batch)
    w = rng.integers(-3, 4, (2 * n_out, 128)).astype(np.float64)
    x = rng.integers(-3, 4, (batch, 128)).astype(np.float64)
    cfg = WideMmaConfig(16).wgmma
    got = _emulate(w, x, cfg, base=16 * 37, a_pair=n_out)
    rows = np.arange(len(got))
    src = rows // 128 * 64 + rows % 64 + rows % 128 // 64 * n_out
    ref = np.where((src < len(w))[:, None], w[np.minimum(src, len(w) - 1)] @ x.T, 0)
    np.testing.assert_array_equal(got, ref)


def test_pipeline_takes_it_where_its_blocks_fill_the_gpu(monkeypatch) -> None:
    """With gemv_config.WIDE_MMA: the 32- and 64-row buckets of 4B's and 9B's wide projections
    (in_proj, qkv, gate_up); the 8- and 16-row ones, and the n = 2,560 / 4,096 ones (20-32
    blocks), keep the GEMV; every config fits sm_80's launch. Without it, none."""
    assert not any(isinstance(c, WideMmaConfig) for _, c in wide_buckets(12352, 2560, mma=False))
    monkeypatch.setattr(gemv_config, "WIDE_MMA", False)
    assert not any(isinstance(c, WideMmaConfig) for _, c in wide_buckets(12352, 2560))
    monkeypatch.setattr(gemv_config, "WIDE_MMA", True)
    for n, k in ((12352, 2560), (10240, 2560), (18432, 2560), (24576, 4096), (16448, 4096)):
        kinds = [type(c) for _, c in wide_buckets(n, k)]
        assert kinds == [GemvConfig, GemvConfig, WideMmaConfig, WideMmaConfig], (n, k)
        blocks = -(-n // 128)
        for _, cfg in wide_buckets(n, k)[1:]:
            if isinstance(cfg, WideMmaConfig):
                # one wave holds every block: two an SM where there are more blocks than SMs
                per_sm = -(-blocks // gemv_config.SMS)
                assert per_sm * (cfg.shared_bytes + 1024) <= gemv_config.SHARED_PER_SM
                assert cfg.shared_bytes <= SM80_SHARED_BYTES and cfg.stages >= 3
    for n, k in ((2560, 4096), (2560, 9216), (4096, 4096), (4096, 12288)):
        assert not any(isinstance(c, WideMmaConfig) for _, c in wide_buckets(n, k)), (n, k)


def test_kernels_branch_to_the_ring_on_sm90a_and_to_mma_sync_elsewhere() -> None:
    src = _source(18432, 2560, rms_eps=EPS, swiglu=True)
    bodies = [c for c in src.split("__global__")[1:] if c.split("\n", 1)[0].endswith("{")]
    ring = [b for b in bodies if "qwen35_sm90a()" in b]
    assert len(bodies) == 4 and len(ring) == 2  # the 8- and 16-row buckets are the GEMV
    for body in ring:
        at = body.index("qwen35_sm90a()")
        assert "cp_async_bulk_tensor" in body[at:] and "mma.sync" in body[at:]
    assert {re.search(r"m64n(\d+)k16", b).group(1) for b in ring} == {"32", "64"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("n, kw", [(12352, {"rms_eps": EPS}),
                                   (18432, {"rms_eps": EPS, "swiglu": True})])  # fmt: skip
def test_both_arches_compile_without_spills(tmp_path, n, kw) -> None:
    from qwen35_tvm.compile.cuda_toolchain import guard_sm90_asm
    from qwen35_tvm.schedules.sm90a import SM90A_PRELUDE

    (tmp_path / "g.cu").write_text(SM90A_PRELUDE + guard_sm90_asm(_source(n, 2560, **kw)))
    for arch in ("sm_90a", "sm_80"):
        cmd = ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o",
               str(tmp_path / f"{arch}.cubin"), str(tmp_path / "g.cu")]  # fmt: skip
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        assert re.findall(r"(\d+) bytes spill stores", info) == ["0"] * 4, (arch, info)


@pytest.mark.parametrize("early, dependent", [(False, True), (True, True), (False, False)])
def test_early_loads_the_first_weight_tiles_before_the_wait(early: bool, dependent: bool) -> None:
    """With `early`, sm_90a's branch issues its first (weight) tensor copies before it waits
    for X's producer, and its X copies after; sm_80's waits first. Without, both wait first.
    A launch that is not dependent never waits (the pipeline then launches it after its
    producer's end: schedules/pdl.py) and releases its dependents first."""
    cfg = WideMmaConfig(16, early=early, dependent=dependent)
    source = _source(12352, 2560, cfg, rms_eps=EPS)
    (body,) = [c for c in source.split("__global__")[1:] if "{\n" in c[:400]]
    at = body.index("qwen35_sm90a()")
    ring, rest = body[at:].split("} else {", 1)
    copies = [m.start() for m in re.finditer(r"cp_async_bulk_tensor\w*\(", ring)]
    wait = ring.find("griddepcontrol_wait()")
    if not dependent:
        assert "griddepcontrol_wait" not in body and copies
        assert body.index("griddepcontrol_launch_dependents()") < at
    elif early:
        assert 0 < copies[0] < wait < copies[-1] and rest.index("griddepcontrol_wait()") < 400
    else:
        assert wait < 0 and body.index("griddepcontrol_wait()") < at


def test_early_loads_need_a_dependent_launch() -> None:
    with pytest.raises(ValueError, match="dependent launch"):
        WideMmaConfig(16, early=True, dependent=False).check()
