"""Prefill's two-pass chunked GDN (schedules/gdn_chunk_prep.py, gdn_chunk_scan.py) without a
GPU: where it is routed (bf16 prefill then has no gdn_input: the first kernel starts from
in_proj's rows), that both kernels lower and assemble for sm_80 and sm_90, what the scan's
serial loop holds, and the workspace both agree on. The arithmetic is checked in numpy
by tests/test_gdn_mma_emulated.py (two_pass_model) and on the H200 against a float64
recurrence by benchmarks/gdn_kernel.py."""

from __future__ import annotations

import re

import pytest
import tvm
from tir_host import host_code
from tvm.target import Target

from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
from qwen35_tvm.schedules.gdn_chunk_prep import workspace_rows
from qwen35_tvm.schedules.gdn_chunked import FEW_SEQUENCES_SCAN, two_pass

LLVM = Target("llvm")


def _cuda(arch: str) -> Target:
    prepare_cuda_codegen([arch])
    return Target({"kind": "cuda", "arch": arch}, host="llvm")


def _source(func, target: Target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    cuda = [m for m in lib.mod.imports if m.kind == "cuda"]
    assert len(cuda) == 1 and cuda[0].is_runnable(), "CUDA source fallback, not a binary"
    return cuda[0].inspect_source()


def _kernels(source: str) -> list[str]:
    """Each kernel's definition in a module's CUDA source, in order."""
    starts = [m.start() for m in re.finditer(r'extern "C" __global__ [^;]*\{', source)]
    return [source[a:b] for a, b in zip(starts, [*starts[1:], len(source)], strict=True)]


def test_routing() -> None:
    sm90 = _cuda("sm_90")
    assert two_pass(16, 32, 128, 128, sm90, "bfloat16") is not None
    assert two_pass(16, 32, 128, 128, sm90, "float32") is None  # fp32 models: one fp32 kernel
    assert two_pass(16, 32, 128, 128, LLVM, "bfloat16") is None  # the CPU too
    assert two_pass(2, 4, 16, 16, sm90, "bfloat16") is None  # head dims mma cannot tile
    assert two_pass(16, 32, 128, 128, _cuda("sm_75"), "bfloat16") is None  # no bf16 mma


def test_workspace_covers_every_chunk_number() -> None:
    # first_tile(indptr, s, C) = indptr[s] // C + s: the last sequence's last chunk number is
    # below n_tok // C + n_seq, for any lengths
    c = 64
    for lengths in ([1], [64], [65], [1, 1, 1], [63, 130, 0, 7], [1024] * 16):
        starts = [sum(lengths[:s]) for s in range(len(lengths))]
        rows = workspace_rows(sum(lengths), len(lengths), c)
        for s, n in enumerate(lengths):
            chunks = -(-n // c)
            assert chunks == 0 or (starts[s] // c + s + chunks) * c <= rows
        # and no two sequences share a chunk number
        numbers = [starts[s] // c + s + i for s, n in enumerate(lengths) for i in range(-(-n // c))]
        assert len(set(numbers)) == len(numbers)
    two = two_pass(16, 32, 128, 128, _cuda("sm_90"), "bfloat16")
    assert two.chunk == 32
    shapes = two.workspace(1024, 1)
    assert [s for s, _ in shapes] == [
        (1056, 16, 128), (1056, 16, 128), (1056, 32, 128), (1056, 32, 128), (1056, 32, 32),
        (32, 1056),
    ]  # fmt: skip


def _check_scan(scan: str, skip_single: bool) -> None:
    """One scan kernel's CUDA source."""
    # the scan's serial loop: two barriers a chunk, nothing but cp.async reads global memory
    # for the next chunk (the state is read before the loop and written after it)
    loop = scan[scan.index("for (int ch = 0;") :]
    assert scan.count("__syncthreads()") == loop.count("__syncthreads()") == 2
    assert "wait_group_0()" in loop and loop.count("ptx_cp_async") > 0
    for operand in ("w_ptr", "qb_ptr", "kb_ptr", "u_ptr", "p_ptr", "gc_ptr"):
        loads = re.findall(rf"= [^;]*\b{operand}\[", loop)
        assert loads == [], f"{operand} read in the loop other than by cp.async"
    assert "pool_ptr[" not in loop[: loop.index("__syncthreads()")]
    assert scan.rindex("griddepcontrol_launch_dependents();") < scan.index("for (int ch = 0;")
    guarded = re.search(r"if \(\(?\w+ != 1\)?\)", scan) is not None
    assert guarded == skip_single


@pytest.mark.parametrize("skip_single", [False, True])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_assemble(arch: str, skip_single: bool) -> None:
    target = _cuda(arch)
    two = two_pass(16, 32, 128, 128, target, "bfloat16", skip_single=skip_single)
    prep, scans = _source(two.prep, target), _kernels(_source(two.scan, target))
    # the scan's two kernels: 32 columns and 4 warps for a few sequences, else 64 and 8
    assert [re.search(r"__launch_bounds__\((\d+)\)", k)[1] for k in scans] == ["128", "256"]
    for scan in scans:
        _check_scan(scan, skip_single)
    # the first pass stores every workspace operand, and only then lets the scan launch:
    # released at its start, the scan's one wave of blocks landed on the SMs the prep's last
    # wave had freed first, two or three to an SM (a 1,024-token prefill's scans: 2.48 -> 1.68
    # ms on the H200)
    release = prep.rindex("griddepcontrol_launch_dependents();")
    for operand in ("w_ptr", "u_ptr", "p_ptr", "kb_ptr", "qb_ptr", "gc_ptr"):
        stores = [m.start() for m in re.finditer(rf"\b{operand}\[[^\]]*\] = ", prep)]
        assert stores and max(stores) < release, operand
    # ptxas keeps to the registers of as many blocks an SM as shared memory allows (3 on
    # sm_90, 2 on sm_80's 163 KiB)
    assert f"__launch_bounds__(256, {3 if arch == 'sm_90' else 2})" in prep
    # one-token sequences are the ragged decode kernel's: the scan then neither reads nor
    # writes their state, and the prep's blocks for them skip everything past the search
    assert ("!= 1)" in prep[prep.index("griddepcontrol_wait") :]) == skip_single


@pytest.mark.parametrize("by_key_head", [False, True])
def test_prep_blocks_a_value_head_or_a_key_head(by_key_head: bool) -> None:
    """gdn_chunked.PREP_BY_KEY_HEAD (off until measured on a GPU): one prep block a (chunk,
    key head) taking the key head's value heads (2 at 4B) in turn, q and k's loads, conv and
    norms once for them all; so the grid is chunks x key heads and every block writes its key
    head's K and Q. Off, a block a (chunk, value head), and only a key head's first value
    head's block writes its K and Q. Either way every workspace operand is stored (the values
    are checked on the GPU by benchmarks/gdn_kernel.py)."""
    target = _cuda("sm_90")
    two = two_pass(16, 32, 128, 128, target, "bfloat16", by_key_head=by_key_head)
    host = host_code(two.prep, target)
    blocks = 16 if by_key_head else 32
    assert re.search(rf"n_rows // 32 \* {blocks}, 256, T.int64", host), host[-400:]
    prep = _source(two.prep, target)
    assert ("% 2) == 0)" in prep) != by_key_head, "K and Q stores once a key head"
    for operand in ("kb_ptr", "qb_ptr", "w_ptr", "u_ptr", "p_ptr", "gc_ptr"):
        assert re.search(rf"\b{operand}\[[^\]]*\] = ", prep), operand


@pytest.mark.parametrize("interior", [False, True])
def test_prep_loads_interior_chunks_unclamped(interior: bool) -> None:
    """gdn_chunked.PREP_INTERIOR_LOADS (off until measured): a full chunk (32 tokens) whose
    conv history is its sequence's own rows (3 before it) takes loads without clamps or the
    pool select, behind one block-uniform test; other chunks keep the clamped loads."""
    target = _cuda("sm_90")
    prep = _source(two_pass(16, 32, 128, 128, target, "bfloat16", interior_loads=interior).prep,
                   target)  # fmt: skip
    test = "(hi_ptr[0] == 32) && (3 <= (lo_ptr[0] - seq_ptr[0]))"
    assert (test in prep) == interior
    assert "max(min(" in prep  # the clamped loads stay for the other chunks


def test_scan_takes_narrow_blocks_for_few_sequences() -> None:
    """The host picks the scan's kernel by the batch's size: at most FEW_SEQUENCES_SCAN[0]
    sequences get twice the blocks a sequence (32 columns, 4 warps), more the 64-column
    blocks of 8 warps; with `few=None` there is one kernel and no choice."""
    target = _cuda("sm_90")
    few, col_tile, warps = FEW_SEQUENCES_SCAN
    host = host_code(two_pass(16, 32, 128, 128, target, "bfloat16").scan, target)
    launches = re.findall(
        r"batch \* (\d+), (\d+), T.int64", host[host.index(f"if batch <= {few}:") :]
    )
    assert launches == [(str(32 * 128 // col_tile), str(32 * warps)), ("64", "256")]
    one = host_code(two_pass(16, 32, 128, 128, target, "bfloat16", few=None).scan, target)
    assert "if batch" not in one and re.findall(r"batch \* (\d+), (\d+), T.int64", one) == [
        ("64", "256")
    ]


def test_shared_memory_limits() -> None:
    with pytest.raises(ValueError, match="shared memory"):
        two_pass(16, 32, 128, 128, _cuda("sm_90"), "bfloat16", chunk=64, col_tile=64)
    with pytest.raises(ValueError, match="shared memory"):  # sm_80's 163 KiB
        two_pass(16, 32, 128, 128, _cuda("sm_80"), "bfloat16", chunk=128, col_tile=32)


def _config_128():
    """The tiny config with 128-wide GDN heads, which the two passes tile."""
    import dataclasses

    from qwen35_tvm.compile.config import ModelConfig
    from qwen35_tvm.compile.random_model import SHAPES

    return dataclasses.replace(
        ModelConfig.from_hf(SHAPES["tiny"]), linear_key_head_dim=128, linear_value_head_dim=128
    )


def _prefill_kernels(dtype: str, mixed: bool = True) -> set[str]:
    """The kernels of one GDN layer's prefill, with 128-wide heads (which tile)."""
    mod = _prefill_module(dtype, mixed)
    return {gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def _prefill_module(dtype: str, mixed: bool = True) -> tvm.IRModule:
    from tvm.relax.frontend import nn

    from qwen35_tvm.compile.layers import GatedDeltaNet, GDNState
    from qwen35_tvm.compile.model import gdn_pool_shapes

    cfg = _config_128()

    class Prefill(nn.Module):
        def __init__(self) -> None:
            self.gdn = GatedDeltaNet(cfg, 0, dtype)

        def forward(self, x, indptr, slots, conv, rec, tickets):
            state = GDNState(conv, rec, tickets)
            return self.gdn(x, indptr, slots, state, chunked=True, mixed=mixed)[0]

    conv, rec, tickets = gdn_pool_shapes(cfg, 2)
    spec = {"forward": {
        "x": nn.spec.Tensor(["n", cfg.hidden_size], dtype),
        "indptr": nn.spec.Tensor(["b1"], "int32"),
        "slots": nn.spec.Tensor(["b"], "int32"),
        "conv": nn.spec.Tensor(conv, dtype),
        "rec": nn.spec.Tensor(rec, "float32"),
        "tickets": nn.spec.Tensor(tickets, "int32"),
    }}  # fmt: skip
    with _cuda("sm_90"):
        mod, _ = Prefill().export_tvm(spec=spec)
    return mod


def test_bf16_prefill_starts_the_chunked_gdn_from_in_proj() -> None:
    """bf16 on CUDA: gdn_chunk_prep makes q, k, v and the gates from in_proj's rows itself, so
    prefill has no gdn_input kernel; fp32 models keep gdn_input and the fp32 kernel."""
    bf16 = _prefill_kernels("bfloat16")
    assert {"gdn_chunk_prep", "gdn_chunk_scan"} <= bf16 and "gdn_input" not in bf16, bf16
    fp32 = _prefill_kernels("float32")
    assert {"gdn_input", "gdn_chunked_delta_rule"} <= fp32 and "gdn_chunk_prep" not in fp32, fp32


def _o_dtypes(dtype: str) -> dict[str, str]:
    """The dtype of o in each prefill kernel that writes or reads it."""
    mod, found = _prefill_module(dtype), {}
    o = re.compile(r'\b(?:o|out): T\.Buffer\(\("?n_tok"?, \d+, \d+\), "(\w+)"\)')
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and (m := o.search(func.script())):
            found[gv.name_hint] = m.group(1)
    return found


def test_bf16_prefill_keeps_o_in_bf16() -> None:
    """gdn_chunked.core_out_dtype: with the two passes, o is bf16 from the scan and the ragged
    kernel to the gated norm (which rounds fp32 o to bf16 first: the same values, half the
    bytes); fp32 models and the CPU keep fp32."""
    from qwen35_tvm.schedules.gdn_chunked import core_out_dtype

    bf16 = _o_dtypes("bfloat16")
    want = {"gdn_chunk_scan", "gdn_delta_rule_decode_r32p4_ragged", "gdn_gated_norm"}
    assert {name: bf16.get(name) for name in want} == dict.fromkeys(want, "bfloat16"), bf16
    fp32 = _o_dtypes("float32")
    assert fp32 and set(fp32.values()) == {"float32"}, fp32
    assert core_out_dtype(16, 32, 128, 128, LLVM, "bfloat16") == "float32"


def test_mixed_rows_take_the_recurrent_kernel(monkeypatch) -> None:
    """A bf16 prefill also runs decode's recurrent kernel in its ragged form (a mixed step's
    one-token rows), and the two passes skip those rows; switched off
    (gdn_chunked.MIXED_ROWS_RECURRENT), the two passes take every row."""
    from qwen35_tvm.schedules import gdn_chunked

    bf16 = _prefill_kernels("bfloat16")
    assert {"gdn_delta_rule_decode_r32p4_ragged", "gdn_chunk_prep", "gdn_chunk_scan"} <= bf16
    monkeypatch.setattr(gdn_chunked, "MIXED_ROWS_RECURRENT", False)
    assert not any(name.endswith("_ragged") for name in _prefill_kernels("bfloat16"))


def _gdn_calls() -> tuple[list, dict]:
    """The bf16 prefill's kernel calls in order, and its call outputs (tir_calls)."""
    from tir_calls import tir_calls

    return tir_calls(_prefill_module("bfloat16")["forward"])


def test_mixed_rows_run_beside_the_scan_into_its_output(monkeypatch) -> None:
    """gdn_chunked.MIXED_ROWS_BESIDE_SCAN: the ragged kernel comes after the two passes (it runs
    beside the scan: gdn_decode's `beside`) and writes its rows of the scan's o and its
    sequences' state in place, so the gated norm reads one o with every row and the state
    chain runs prep -> scan -> ragged. Off (the default until measured): the ragged kernel
    first, the scan writing the other rows of its o."""
    from qwen35_tvm.schedules import gdn_chunked

    ragged = "gdn_delta_rule_decode_r32p4_ragged"
    for beside in (True, False):
        monkeypatch.setattr(gdn_chunked, "MIXED_ROWS_BESIDE_SCAN", beside)
        calls, outputs = _gdn_calls()
        names = [name for name, _, _ in calls]
        order = ["gdn_chunk_prep", "gdn_chunk_scan", ragged] if beside else [
            ragged, "gdn_chunk_prep", "gdn_chunk_scan"]  # fmt: skip
        assert names == [*order, "gdn_gated_norm"], names
        first, second = (2, 1) if beside else (2, 0)  # the call taking the other's o in place
        args, inplace = calls[first][1:]
        assert outputs.get(args[inplace[-1]]) == (names[second], 1), (beside, args, inplace)
        assert outputs[calls[3][1][0]] == (names[first], 1)  # the gated norm's o


def test_a_prompts_only_prefill_launches_no_decode_kernel() -> None:
    """prefill_prompts (mixed=False): the two passes take every sequence and decode's ragged
    kernel is gone; it is exported only where it differs from prefill (bf16 on CUDA, dims the
    two passes tile)."""
    from qwen35_tvm.compile.exports import export_spec, prompts_prefill_differs
    from qwen35_tvm.compile.vocab import VocabWidths

    prompts = _prefill_kernels("bfloat16", mixed=False)
    # the two passes' other form, named apart (a module holds both)
    assert {"gdn_chunk_prep_all", "gdn_chunk_scan_all"} <= prompts
    assert not any(name.endswith("_ragged") for name in prompts), prompts
    cfg = _config_128()
    assert prompts_prefill_differs(cfg, "bfloat16", _cuda("sm_90"))
    assert not prompts_prefill_differs(cfg, "float32", _cuda("sm_90"))
    assert not prompts_prefill_differs(cfg, "bfloat16", LLVM)
    widths = VocabWidths.resolve(cfg.vocab_size, cfg.vocab_size)
    assert "prefill_prompts" not in export_spec(cfg, widths, "bfloat16")
    # exported, it takes prefill's arguments (the weights packed into one, as prefill's)
    from qwen35_tvm.compile.model import Qwen35LM

    with LLVM:
        spec = export_spec(cfg, widths, "float32", prompts=True)
        mod, _, _ = Qwen35LM(cfg, widths, "float32").export_tvm(spec=spec, allow_extern=True)
    params = {name: len(mod[name].params) for name in ("prefill", "prefill_prompts")}
    assert params["prefill_prompts"] == params["prefill"] == 12, params
