"""Programmatic dependent launch (schedules/pdl.py): a kernel launched with it may run beside
its producer until it waits, so the launch attribute must go exactly to kernels that wait, and
nothing an earlier kernel writes may be touched before the wait. Checked on the CUDA source of
the tiny model's library (built here, no GPU) and on hand-made kernels that break the rule."""

from __future__ import annotations

import re

import pytest

from qwen35_tvm.compile.cuda_toolchain import guard_sm90_asm
from qwen35_tvm.compile.pipeline import DYN_SHARED_TAG, PDL_TAG, tag_dependent_launch

WAIT = "tvm_builtin_ptx_griddepcontrol_wait();"
GDN_DECODE = "gdn_delta_rule_decode"
PREFETCH = "tvm_builtin_ptx_prefetch_global_L2("
# pdl.wait_at_end's guard: thread 0 of block 0 only
FIRST_THREAD = "(((int)blockIdx.x) == 0) && (((int)threadIdx.x) == 0))"
# kernels that read before their wait, by name: what they may read there
EARLY_READS = {
    # the recurrent state, the conv history, the slots
    rf"{GDN_DECODE}.*": {"pool_ptr", "conv_ptr", "slots_ptr", "w_ptr"},
    # the step's inputs, to find a split's pages (and prefetch them: not a touch)
    r"attn_paged_kernel": {"indptr_ptr", "slots_ptr", "positions_ptr", "table_ptr"},
    # its merge: the pieces' count from positions, qkv_proj's output gates
    r"attn_(paged|decode_mma)_kernel_1": {"positions_ptr", "gate_ptr"},
    # the tensor-core split kernel: its pages, and its first tile's K/V where no key of this
    # step is in it (cp.async into shared memory)
    r"attn_decode_mma_kernel": {
        "indptr_ptr",
        "slots_ptr",
        "positions_ptr",
        "table_ptr",
        "kp_ptr",
        "vp_ptr",
    },
}
KERNEL = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\) \{'
)


def kernels(source: str) -> dict[str, tuple[list[str], str]]:
    """{kernel name: (pointer parameter names, body)} of a CUDA translation unit."""
    found = list(KERNEL.finditer(source))
    out = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(source)
        params = re.findall(r"\*\s*__restrict__\s+(\w+)", m.group(2))
        out[m.group(1)] = (params, source[m.end() : end])
    return out


def touched_before_wait(params: list[str], body: str) -> list[str]:
    """Global buffers a kernel touches before its wait, other than by an L2 prefetch."""
    head = body[: body.index(WAIT)]
    head = re.sub(re.escape(PREFETCH) + r"[^;]*;", "", head)
    return [p for p in params if re.search(rf"\b{p}\b", head)]


def test_decode_kernels_wait_before_touching_activations(cuda_library) -> None:
    source = cuda_library.source
    found = kernels(source)
    waiting = {name for name, (_, body) in found.items() if WAIT in body}
    # every family of the decode step waits: its first kernel, norms (the final one, and
    # prefill's without weight), GEMVs (and decode_wide's 8-row one), GDN, attention, logits,
    # the pick
    for family in ("decode_inputs", "rms_norm", "rms_scale", "small_kernel", "wide_kernel",
                   "gdn_input", "gdn_delta_rule", "gdn_gated_norm", "attn_append_kv",
                   "attn_paged", "logits", "greedy_pick"):  # fmt: skip
        assert any(family in name for name in waiting), family
    # decode_wide's 16-row kernels (the weight ring in registers) wait, its 32- and 64-row ones
    # (the ring in shared memory) start after their producers (gemv_config.wide_config)
    wide = {name: int(name[-1]) for name in found if re.search(r"_wide_kernel_\d$", name)}
    assert {bucket for name, bucket in wide.items() if name in waiting} == {1}, wide
    assert set(wide.values()) == {1, 2, 3}
    for name in waiting:
        params, body = found[name]
        assert body.count(WAIT) == 1, name
        early = next((e for k, e in EARLY_READS.items() if re.fullmatch(k, name)), None)
        if early is not None:  # reads, and only reads, what was written two or more kernels
            # back (schedules/pdl.py)
            assert set(touched_before_wait(params, body)) == early, name
            head = body[: body.index(WAIT)]
            assert not [p for p in params if re.search(rf"\b{p}\[[^;=]*\] = ", head)], name
            continue
        assert touched_before_wait(params, body) in ([], ["w_ptr"]), name
        if touched_before_wait(params, body):  # only a GEMV's weight, only prefetched
            assert PREFETCH in body[: body.index(WAIT)], name


def test_decode_and_decode_wide_take_their_gdn_layouts(cuda_library) -> None:
    """decode keeps gdn.ROWS x gdn.PARTS blocks and the gated norm, decode_wide
    gdn_decode.WIDE_LAYOUT's without it: both kernels are in the library, each waiting on its
    producer, and only decode's takes tickets."""
    from qwen35_tvm.schedules.gdn_decode import NAME, WIDE_LAYOUT

    source = cuda_library.source
    found = kernels(source)
    # the tiny model's 16 value columns a head take 16-row blocks: WIDE_LAYOUT's parts show
    wide = [n for n in found if re.fullmatch(rf"{NAME}_r\d+p{WIDE_LAYOUT['parts']}_kernel", n)]
    assert len(wide) == 1, sorted(n for n in found if NAME in n)
    for name in (f"{NAME}_gated_kernel", wide[0]):
        assert WAIT in found[name][1], name
        assert ("tickets_ptr" in found[name][0]) == (name == f"{NAME}_gated_kernel"), name


def test_prefill_kernels_wait_before_touching_anything() -> None:
    """The tensor-core kernels the tiny model does not reach (4B shapes): the chunked GDN and
    the prefill attention wait first too. Prefill's GEMMs are checked above."""
    import tvm
    from tvm.target import Target

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.schedules.attention_prefill import paged_prefill_mma
    from qwen35_tvm.schedules.gdn_chunked import two_pass

    prepare_cuda_codegen(["sm_90"])
    target = Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    gdn = two_pass(16, 32, 128, 128, target, "bfloat16")
    funcs = {
        "gdn prep": gdn.prep,
        "gdn scan": gdn.scan,
        "attention": paged_prefill_mma(16, 4, 256, target),
    }
    for what, func in funcs.items():
        lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
        source = next(m for m in lib.mod.imports if m.kind == "cuda").inspect_source()
        found = kernels(guard_sm90_asm(source))
        assert found, what
        for name, (params, body) in found.items():
            assert body.count(WAIT) == 1, name
            assert touched_before_wait(params, body) == [], name


def test_tensor_core_decode_reads_only_old_keys_before_its_wait() -> None:
    """The 4B-shaped kernel (the tiny model's head_dim takes the SIMT one): its early K/V copy
    sits under the test that the tile ends before this step's first position."""
    import tvm
    from tvm.target import Target

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.schedules.attention_decode_mma import paged_decode_mma

    prepare_cuda_codegen(["sm_90"])
    target = Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    lib = tvm.compile(tvm.IRModule({"main": paged_decode_mma(16, 4, 256, target)}), target)
    source = next(m for m in lib.mod.imports if m.kind == "cuda").inspect_source()
    found = kernels(guard_sm90_asm(source))
    assert set(found) == {"attn_decode_mma_kernel", "attn_decode_mma_kernel_1"}
    for name, (params, body) in found.items():
        assert body.count(WAIT) == 1, name
        early = next(e for k, e in EARLY_READS.items() if re.fullmatch(k, name))
        assert set(touched_before_wait(params, body)) == early, name
        head = body[: body.index(WAIT)]
        assert not [p for p in params if re.search(rf"\b{p}\[[^;=]*\] = ", head)], name
    # the first K/V copy before the wait sits in a branch on the flag made from this step's
    # first position of the sequence
    head = found["attn_decode_mma_kernel"][1].split(WAIT)[0]
    flag = re.search(r"(info_ptr\[\d\]) = .*positions_ptr\[indptr_ptr\[", head)
    assert flag, "no flag from the sequence's first position"
    condition = head[: head.index("kp_ptr")].rsplit("if (", 1)[1].split("{")[0]
    assert f"0 < {flag.group(1)}" in condition, condition


def test_ragged_gdn_kernel_beside_the_scan_waits_once_at_its_end() -> None:
    """A mixed step's decode rows (4B-shaped; the tiny model's heads do not take the two
    passes): the ragged kernel's `beside` form runs beside the scan before it, so it touches
    everything before its one wait, which only thread 0 of block 0 makes after its last store,
    with nothing after it but the release. Its other form, and decode_wide's, still wait
    first."""
    import tvm
    from tvm.target import Target

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.schedules.gdn_decode import WIDE_LAYOUT, decode_delta_rule

    prepare_cuda_codegen(["sm_90"])
    target = Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    bodies = {}
    for ragged, beside in ((True, True), (True, False), (False, False)):
        with target:
            func = decode_delta_rule(16, 32, 128, 128, 4, 1e-6, "bfloat16", target,
                                     **WIDE_LAYOUT, gated=False, ragged=ragged,
                                     beside=beside)  # fmt: skip
        lib = tvm.compile(tvm.IRModule({"main": func}), target)
        source = next(m for m in lib.mod.imports if m.kind == "cuda").inspect_source()
        ((name, (params, body)),) = kernels(guard_sm90_asm(source)).items()
        assert body.count(WAIT) == 1, name
        bodies[ragged, beside] = params, body
    params, body = bodies[True, True]
    head, tail = body.split(WAIT)
    assert {"x_ptr", "pool_ptr", "o_ptr"} <= set(touched_before_wait(params, body))
    assert not [p for p in params if re.search(rf"\b{p}\b", tail)], tail
    assert head.rsplit("if (", 1)[1].startswith(FIRST_THREAD), head[-200:]
    assert "launch_dependents" in tail
    early = ["conv_ptr", "pool_ptr", "slots_ptr", "w_ptr"]
    assert touched_before_wait(*bodies[False, False]) == early
    assert touched_before_wait(*bodies[True, False]) == ["conv_ptr", "indptr_ptr", *early[1:]]


def test_mixed_rows_attention_runs_beside_the_prefill_kernel() -> None:
    """A mixed step's decode rows (4B heads): the prefill kernel leaves one-token sequences
    alone, and decode's tensor-core kernel in its ragged form takes them. Its split kernel
    touches everything before its one wait, made after its last store by thread 0 of block 0
    only; its merge still waits first, as does the prefill kernel."""
    import tvm
    from tvm.target import Target

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.schedules.attention_decode_mma import paged_decode_mma
    from qwen35_tvm.schedules.attention_prefill import paged_prefill_mma

    prepare_cuda_codegen(["sm_90"])
    target = Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")

    def compiled(func) -> dict:
        lib = tvm.compile(tvm.IRModule({"main": func}), target)
        return kernels(guard_sm90_asm(next(m for m in lib.mod.imports if m.kind == "cuda")
                                      .inspect_source()))  # fmt: skip

    found = compiled(paged_decode_mma(16, 4, 256, target, ragged=True))
    assert set(found) == {"attn_decode_ragged_kernel", "attn_decode_ragged_kernel_1"}
    params, body = found["attn_decode_ragged_kernel"]
    assert body.count(WAIT) == 1
    head, tail = body.split(WAIT)
    assert {"q_ptr", "kp_ptr", "vp_ptr", "ws_acc_ptr", "ws_ml_ptr"} <= set(
        touched_before_wait(params, body)
    )
    assert not [p for p in params if re.search(rf"\b{p}\b", tail)], tail
    assert head.rsplit("if (", 1)[1].startswith(FIRST_THREAD), head[-200:]
    params, body = found["attn_decode_ragged_kernel_1"]
    assert body.count(WAIT) == 1
    assert set(touched_before_wait(params, body)) <= {"positions_ptr", "gate_ptr", "indptr_ptr"}
    for skip in (True, False):
        ((name, (params, body)),) = [
            item for item in compiled(paged_prefill_mma(16, 4, 256, target, skip_single=skip))
            .items() if not item[0].endswith("_1")
        ]  # fmt: skip
        assert name == ("attn_prefill_mma_mixed_kernel" if skip else "attn_prefill_mma_kernel")
        assert body.count(WAIT) == 1 and touched_before_wait(params, body) == [], name
        # its sequence's token count tested against 1 (the sequence is info[0])
        count = r"indptr_ptr\[\(info_ptr\[0\] \+ 1\)\] - indptr_ptr\[info_ptr\[0\]\]\)"
        assert bool(re.search(count + " == 1", body)) == skip, name


def test_the_checker_catches_a_read_or_write_before_the_wait() -> None:
    params = ["x_ptr", "out_ptr", "w_ptr"]
    good = f"  {PREFETCH}(&(w_ptr[8])));\n  {WAIT}\n  out_ptr[0] = x_ptr[0];\n"
    assert touched_before_wait(params, good) == []
    read = f"  float v = x_ptr[0];\n  {WAIT}\n  out_ptr[0] = v;\n"
    assert touched_before_wait(params, read) == ["x_ptr"]
    write = f"  out_ptr[0] = 0.f;\n  {WAIT}\n"
    assert touched_before_wait(params, write) == ["out_ptr"]
    weight_load = f"  float v = w_ptr[0];\n  {WAIT}\n"  # a load, not a prefetch: flagged too
    assert touched_before_wait(params, weight_load) == ["w_ptr"]


def test_library_launches_with_the_attribute(cuda_library) -> None:
    out, source = cuda_library.artifact_dir, cuda_library.source
    lib = (out / "model.so").read_bytes()
    waiting = sum(WAIT in body for _, body in kernels(source).values())
    assert lib.count(PDL_TAG.encode()) == waiting > 0
    # sm_80 has no griddepcontrol: its SASS and PTX are built without it (the build passed)
    assert "#if __CUDA_ARCH__ >= 900" in guard_sm90_asm(source)


def _device_module(with_wait: bool, dyn_shared: bool):
    import tvm
    from tvm.script import tirx as T

    from qwen35_tvm.schedules.pdl import release_dependents, wait_for_producers

    @T.prim_func(s_tir=True)
    def add1(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        for bx in T.thread_binding(2, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("x"):
                    T.reads()
                    T.writes()
                    T.evaluate(wait_for_producers(with_wait))
                    T.evaluate(release_dependents(with_wait))
                    b[bx * 128 + tx] = a[bx * 128 + tx] + T.float32(1)

    tags = ["blockIdx.x", "threadIdx.x"] + ([DYN_SHARED_TAG] if dyn_shared else [])
    kernel = add1.with_attr("tirx.kernel_launch_params", tags)
    return tvm.IRModule({"add1_kernel": kernel})


@pytest.mark.parametrize("dyn_shared", [False, True])
def test_tag_goes_to_waiting_kernels_only(dyn_shared: bool) -> None:
    tagged = tag_dependent_launch(_device_module(True, dyn_shared))["add1_kernel"]
    tags = [str(t) for t in tagged.attrs["tirx.kernel_launch_params"]]
    assert PDL_TAG in tags
    assert tags[-1] == (DYN_SHARED_TAG if dyn_shared else PDL_TAG)  # dyn shared stays last
    plain = tag_dependent_launch(_device_module(False, dyn_shared))["add1_kernel"]
    assert PDL_TAG not in [str(t) for t in plain.attrs["tirx.kernel_launch_params"]]


def test_sm90_asm_is_guarded_line_by_line() -> None:
    code = '{\n  asm volatile("griddepcontrol.wait;" :  :  : "memory");\n}\n'
    guarded = guard_sm90_asm(code)
    assert guarded.splitlines()[1:4] == [
        "#if __CUDA_ARCH__ >= 900",
        '  asm volatile("griddepcontrol.wait;" :  :  : "memory");',
        "#endif",
    ]
    assert guard_sm90_asm("mma.sync") == "mma.sync"
