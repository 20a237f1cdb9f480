"""Our paged attention kernels (schedules/attention.py) against a plain numpy reference, on the
CPU, built with the GPU kernel's thread layout (the CPU runs its lanes one after another).

Edges: kv length 1, lengths at and across page boundaries, many split pieces merged (1-3
tokens), a few pieces (16-64 tokens) and a single piece (more tokens than the split budget),
GQA groups 1-4, head_dim 16-256, ragged prefill chunks behind earlier pages, pages scattered
over the pool; every output times its head's output gate. Mutation checks show the comparison
notices a swapped page-table entry, an off-by-one position and another head's gate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tvm

from qwen35_tvm.schedules import attention, attention_merge, kv_cache

PAGE = kv_cache.PAGE_SIZE
LAYERS, POOL_PAGES, SLOTS, TABLE_WIDTH = 2, 160, 5, 48
_built: dict = {}


def kernels(heads: int, kv_heads: int, d: int, tile_pages: int = 2):
    key = (heads, kv_heads, d, tile_pages)
    if key not in _built:
        target = tvm.target.Target("llvm")
        attend = attention.paged_attention(heads, kv_heads, d, "float32", target, tile_pages)
        _built[key] = (
            tvm.compile(kv_cache.append_kv(kv_heads, d, "float32", target), target=target),
            tvm.compile(attend, target=target),
            tvm.compile(kv_cache.assign_pages(target), target=target),
        )
    return _built[key]


def reference(q, kp, vp, table, indptr, slots, positions, layer, proj) -> np.ndarray:
    """Attention times its output gate, sigmoid of head h's gate in proj [n_tok, 2 heads d]."""
    n_tok, heads, d = q.shape
    group = heads // kp.shape[2]
    out = np.zeros(q.shape)
    for t in range(n_tok):
        slot = slots[np.searchsorted(indptr, t, side="right") - 1]
        kv = np.arange(positions[t] + 1)
        pages = table[slot, kv // PAGE]
        ks, vs = kp[layer, pages, :, kv % PAGE], vp[layer, pages, :, kv % PAGE]
        for h in range(heads):
            s = ks[:, h // group].astype(np.float64) @ q[t, h] * d**-0.5
            w = np.exp(s - s.max())
            gate = proj[t, h * 2 * d + d : (h + 1) * 2 * d].astype(np.float64)
            out[t, h] = w @ vs[:, h // group] / w.sum() / (1 + np.exp(-gate))
    return out


def attend(heads, kv_heads, d, before, chunk, seed=0, mutate=None, tile_pages=2) -> float:
    """Append a ragged step (sequence b had `before[b]` tokens and adds `chunk[b]`), attend, and
    return max |ours - reference|. `mutate` breaks one input of ours only."""
    rng = np.random.default_rng(seed)
    app, att, assign = kernels(heads, kv_heads, d, tile_pages)
    dev = tvm.cpu()

    def tensor(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    shape = (LAYERS, POOL_PAGES, kv_heads, PAGE, d)
    kp, vp = (tensor(rng.standard_normal(shape).astype("float32")) for _ in range(2))
    table = tensor(np.zeros((SLOTS, TABLE_WIDTH), "int32"))
    slots = np.array([3, 0, 4, 1][: len(before)], "int32")
    order = rng.permutation(POOL_PAGES)  # a sequence's pages are scattered over the pool
    per_seq = POOL_PAGES // len(slots)
    for i, slot in enumerate(slots):
        pages = order[i * per_seq : (i + 1) * per_seq][:TABLE_WIDTH]
        assign(table, tensor(np.array([slot], "int32")), tensor(pages.astype("int32")))
    indptr = np.concatenate([[0], np.cumsum(chunk)]).astype("int32")
    positions = np.concatenate([np.arange(b, b + c) for b, c in zip(before, chunk, strict=True)])
    positions = positions.astype("int32")
    n_tok = int(indptr[-1])
    q = rng.standard_normal((n_tok, heads, d)).astype("float32")
    proj = rng.standard_normal((n_tok, 2 * heads * d + 3)).astype("float32")  # [q_h gate_h ...]
    k, v = (rng.standard_normal((n_tok, kv_heads, d)).astype("float32") for _ in range(2))
    layer = 1
    args = [tensor(indptr), tensor(slots), tensor(positions), table, kp, vp]
    app(tensor(k), tensor(v), *args, layer)
    ref = reference(q, kp.numpy(), vp.numpy(), table.numpy(), indptr, slots, positions, layer, proj)
    if mutate == "swap_pages":
        t = table.numpy()
        t[slots[0], [0, 1]] = t[slots[0], [1, 0]]
        args[3] = tensor(t)
    elif mutate == "position_off_by_one":
        args[2] = tensor(np.maximum(positions - 1, 0))
    elif mutate == "gate_of_the_next_head":
        proj = np.roll(proj, -2 * d, axis=1)
    out = tensor(np.zeros((n_tok, heads, d), "float32"))
    ws = (
        tensor(np.zeros((attention.SPLIT_BUDGET, heads, d), "float32")),
        tensor(np.zeros((attention.SPLIT_BUDGET, heads, 2), "float32")),
    )
    att(tensor(q), *args, layer, tensor(proj), out, *ws)
    return float(np.abs(out.numpy() - ref).max())


@pytest.mark.parametrize(
    "heads, kv_heads, d",
    [(4, 2, 16), (8, 2, 32), (6, 3, 64), (4, 4, 64), (4, 1, 256)],
)
def test_decode_rows_split_and_merged(heads, kv_heads, d):
    # one token a sequence (decode): kv lengths 1, 16, 17, 33, 200, 701 -> several split
    # pieces of at least a tile (2 pages), the last one shorter (200: 6 x 2 + 1)
    for before in ([0], [15, 16], [32, 199, 0], [700]):
        err = attend(heads, kv_heads, d, before, [1] * len(before))
        assert err < 2e-5, (before, err)


@pytest.mark.parametrize("heads, kv_heads, d", [(4, 2, 16), (8, 2, 32), (6, 3, 64)])
def test_ragged_prefill_behind_earlier_pages(heads, kv_heads, d):
    # chunks that start mid-page and end on and past page boundaries, next to a decode row
    err = attend(heads, kv_heads, d, before=[0, 5, 31, 100], chunk=[16, 27, 1, 33])
    assert err < 2e-5
    # 16-64 tokens: a few pieces each (some empty), merged a column a thread
    err = attend(heads, kv_heads, d, before=[0, 40], chunk=[20, 13])
    assert err < 2e-5
    # more tokens than the split budget: one piece each, written directly
    err = attend(heads, kv_heads, d, before=[7, 0], chunk=[90, 70])
    assert err < 2e-5


@pytest.mark.parametrize("tile_pages", [1, 3])
def test_other_tile_sizes(tile_pages):
    # tiles that end past a split's last page and past the sequence's last page
    for before, chunk in (([32, 199, 0], [1, 1, 1]), ([0, 5, 31], [16, 27, 40])):
        assert attend(8, 2, 32, before, chunk, tile_pages=tile_pages) < 2e-5


@pytest.mark.parametrize("mutate", ["swap_pages", "position_off_by_one", "gate_of_the_next_head"])
def test_comparison_notices_broken_paging(mutate):
    assert attend(4, 2, 16, before=[20, 40], chunk=[3, 1], mutate=mutate) > 1e-2


def test_split_count_follows_the_token_count():
    for n, expected in ((1, 128), (16, 8), (64, 2), (128, 1), (4096, 1)):
        assert int(attention.num_splits(tvm.tirx.IntImm("int32", n))) == expected


def test_short_contexts_take_fewer_pieces():
    # (pages, splits, a tile's pages) -> (pages a piece, pieces holding keys)
    cases = {(1, 128, 2): (2, 1), (13, 42, 2): (2, 7), (69, 128, 2): (2, 35), (69, 8, 2): (9, 8),
             (2048, 128, 2): (16, 128), (5, 1, 2): (5, 1), (13, 42, 3): (3, 5)}  # fmt: skip
    for (pages, splits, tile), expected in cases.items():
        got = attention_merge.split_pages(tvm.tirx.IntImm("int32", pages), splits, tile)
        assert tuple(int(g) for g in got) == expected


def test_merge_notices_a_missing_piece(monkeypatch):
    """The merge reads only the pieces holding keys: one fewer is noticed (200 and 701 keys
    of one sequence, 7 and 22 pieces)."""
    real = attention_merge.split_pages

    def one_short(n_pages, splits, min_pages):
        per_split, live = real(n_pages, splits, min_pages)
        return per_split, tvm.tirx.max(1, live - 1)

    monkeypatch.setattr(attention_merge, "split_pages", one_short)
    monkeypatch.setitem(globals(), "_built", {})
    for before in ([199], [700]):
        assert attend(4, 2, 16, before, [1]) > 1e-2


def _ragged_merge(heads: int, d: int, ws_rows: int):
    """The merge kernel's ragged form (attention_decode_mma's, for a mixed step's decode rows)
    alone, on the CPU: (o, ws_acc, ws_ml, positions, gate, indptr, splits)."""
    from tvm.script import tirx as T

    gate_value, finish = attention.output_gate(d, "float32")
    merge = attention_merge.merge_phase(heads, d, 32, 2, ws_rows, False, gate_value, finish)

    @T.prim_func(s_tir=True)
    def ragged_merge(
        o_h: T.handle,
        acc_h: T.handle,
        ml_h: T.handle,
        pos_h: T.handle,
        gate_h: T.handle,
        ptr_h: T.handle,
        splits: T.int32,
    ):
        T.func_attr({"tirx.noalias": True})
        n_tok, n_ptr, g_width = T.int32(), T.int32(), T.int32()
        o = T.match_buffer(o_h, (n_tok, heads, d), "float32")
        ws_acc = T.match_buffer(acc_h, (ws_rows, heads, d), "float32")
        ws_ml = T.match_buffer(ml_h, (ws_rows, heads, 2), "float32")
        positions = T.match_buffer(pos_h, (n_tok,), "int32")
        gate = T.match_buffer(gate_h, (n_tok, g_width), "float32")
        indptr = T.match_buffer(ptr_h, (n_ptr,), "int32")
        merge(o, ws_acc, ws_ml, positions, gate, splits, n_ptr - 1, indptr)

    return tvm.compile(ragged_merge, target=tvm.target.Target("llvm"))


def test_ragged_merge_writes_the_one_token_sequences_rows_only() -> None:
    """A mixed step's decode rows (one-token sequences among a prefill's): the merge's unit is a
    sequence, and each one-token sequence's pieces holding keys (1, 2 and 4 of them here, one
    empty) go, gated, to its token's row; a longer sequence's rows, and pieces past those
    holding keys, are not touched. The split kernel feeding it needs mma.sync (GPU only)."""
    heads, d, splits, ws_rows = 2, 16, 4, 24
    lengths = [1, 5, 1, 1, 3]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n_tok = int(indptr[-1])
    rng = np.random.default_rng(3)
    positions = rng.integers(0, 300, n_tok).astype(np.int32)
    positions[indptr[[0, 2, 3]]] = [0, 40, 200]  # 1, 3 and 13 pages: 1, 2 and 4 pieces
    acc = rng.standard_normal((ws_rows, heads, d)).astype(np.float32)
    ml = np.stack([rng.normal(0, 3, (ws_rows, heads)), rng.uniform(0.5, 4, (ws_rows, heads))], -1)
    ml = ml.astype(np.float32)
    ml[3 * splits + 2, 1, 0] = -np.inf  # an empty piece adds nothing
    gate = rng.standard_normal((n_tok, 2 * heads * d + 2 * d)).astype(np.float32)
    o = np.full((n_tok, heads, d), 7.0, np.float32)
    want = o.copy()
    for u, pieces in ((0, 1), (2, 2), (3, 4)):
        t, rows = indptr[u], slice(u * splits, u * splits + pieces)
        m, l_, x = ml[rows, :, 0], ml[rows, :, 1], acc[rows]
        w = np.exp2(m - np.max(m, 0))[..., None]  # [pieces, heads, 1]
        val = (w * x).sum(0) / (w[..., 0] * l_).sum(0)[:, None]
        g = np.stack([gate[t, h * 2 * d + d : h * 2 * d + 2 * d] for h in range(heads)])
        want[t] = val / (1 + np.exp(-g))
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in (o, acc, ml, positions, gate, indptr)]
    _ragged_merge(heads, d, ws_rows)(*args, splits)
    np.testing.assert_allclose(args[0].numpy(), want, rtol=1e-5, atol=1e-6)


def _prefill_kernels(dtype: str, target_kind: str) -> tuple[set, set, list]:
    """The attention kernels that prefill and decode call, for a head_dim-64 config, and
    prefill's attention calls in order: (kernel, argument names, in-place indices)."""
    from tir_calls import tir_calls

    from qwen35_tvm.compile.build import build_module
    from qwen35_tvm.compile.config import ModelConfig
    from qwen35_tvm.compile.random_model import SHAPES
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.compile.vocab import VocabWidths

    raw = dict(SHAPES["tiny"], head_dim=64)
    cfg = ModelConfig.from_hf(raw)
    target, _ = make_target(target_kind, "sm_80")
    mod, _ = build_module(cfg, VocabWidths.resolve(cfg.vocab_size, 248077), dtype, target)
    names = {
        fn: {gv.name_hint for gv, f in mod.functions_items() if gv.name_hint.startswith("attn_")
             and gv.name_hint in mod[fn].script()}
        for fn in ("prefill", "decode")
    }  # fmt: skip
    calls = [c for c in tir_calls(mod["prefill"])[0] if c[0].startswith("attn_")]
    return names["prefill"], names["decode"], calls


def test_bf16_cuda_prefill_runs_on_tensor_cores_and_the_rest_on_the_split_kernel(monkeypatch):
    """bf16 CUDA: prefill's tensor-core kernel takes every sequence; with MIXED_ROWS_SPLIT it
    leaves its one-token sequences (a mixed step's decode rows) to the split kernel's ragged
    form."""
    from qwen35_tvm.schedules import attention_decode_mma

    inputs = {"attn_append_kv_qk_norm_rope"}  # q/k norms, RoPE and the K/V append: every path
    monkeypatch.setattr(attention_decode_mma, "MIXED_ROWS_SPLIT", True)
    prefill, decode, calls = _prefill_kernels("bfloat16", "cuda")
    assert prefill - inputs == {"attn_prefill_mma_mixed", "attn_decode_ragged"}, prefill
    assert decode - inputs == {"attn_decode_mma"}, decode
    # each layer: the prefill kernel, then the ragged one on its o and workspaces, in place
    pairs = [(a, b) for a, b in itertools.pairwise(calls) if b[0] == "attn_decode_ragged"]
    assert pairs and len(pairs) == sum(c[0] == "attn_prefill_mma_mixed" for c in calls)
    for (first, _, _), (_, args, inplace) in pairs:
        assert first == "attn_prefill_mma_mixed" and inplace == [9, 10, 11], (first, inplace)
        assert args[9:] == [f"attn_prefill_mixed_{i}" for i in range(3)], args
    monkeypatch.setattr(attention_decode_mma, "MIXED_ROWS_SPLIT", False)
    prefill, decode, _ = _prefill_kernels("bfloat16", "cuda")
    assert prefill - inputs == {"attn_prefill_mma"}, prefill
    assert decode - inputs == {"attn_decode_mma"}, decode
    for dtype, kind in (("float32", "cuda"), ("float32", "llvm")):
        prefill, decode, _ = _prefill_kernels(dtype, kind)
        assert "attn_paged" in prefill and "attn_prefill_mma" not in prefill, (dtype, kind)
        assert "attn_paged" in decode and "attn_decode_mma" not in decode, (dtype, kind)


def test_tensor_core_prefill_compiles_to_sass_for_each_arch(tmp_path):
    """It cannot run here (mma.sync); its numbers are checked against SDPA on the GPU by
    benchmarks/attention_kernel.py."""
    from qwen35_tvm.compile.cuda_toolchain import fatbin_arches, prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.attention_prefill import paged_prefill_mma

    target, arches = make_target("cuda", "sm_80,sm_90")
    prepare_cuda_codegen(arches)
    for skip in (False, True):  # and its form beside the ragged split kernel (mixed steps)
        func = paged_prefill_mma(16, 4, 256, target, skip_single=skip)
        tvm.compile(tvm.IRModule({"main": func}), target).export_library(str(tmp_path / "p.so"))
        assert fatbin_arches(tmp_path / "p.so")["sass"] == ["sm_80", "sm_90"]
    with pytest.raises(ValueError, match="head_dim a multiple of 64"):
        paged_prefill_mma(4, 2, 32, target)


def test_tensor_core_decode_compiles_to_sass_for_each_arch(tmp_path):
    """Like the prefill kernel, it cannot run here; benchmarks/attention_kernel.py checks it
    against SDPA on the GPU (odd lengths, one token, pieces ending mid-tile) and
    benchmarks/gpu_parity.py through the model."""
    from qwen35_tvm.compile.cuda_toolchain import fatbin_arches, prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.attention_decode_mma import blocks_per_sm, paged_decode_mma

    target, arches = make_target("cuda", "sm_80,sm_90")
    prepare_cuda_codegen(arches)
    for ragged in (False, True):  # and its form for a mixed step's decode rows
        func = paged_decode_mma(16, 4, 256, target, ragged=ragged)
        tvm.compile(tvm.IRModule({"main": func}), target).export_library(str(tmp_path / "d.so"))
        assert fatbin_arches(tmp_path / "d.so")["sass"] == ["sm_80", "sm_90"]
    # Q's 16 rows (8 KB) and two stages of 2-page K and V tiles (64 KB): 3 blocks an SM
    assert blocks_per_sm(256, 2, 2) == 3 and blocks_per_sm(256, 1, 2) == 5
    for bad in (dict(heads=4, kv_heads=2, head_dim=32), dict(heads=32, kv_heads=1, head_dim=64)):
        with pytest.raises(ValueError, match="tensor-core decode"):
            paged_decode_mma(target=target, **bad)
    with pytest.raises(ValueError, match="stages 2-8"):
        paged_decode_mma(16, 4, 256, target, stages=1)
