"""The configs benchmarks/gemv_kernel.py builds around the pipeline's (decode's and
decode_wide's), the kernels it builds of them, and how the manifest records them."""

from __future__ import annotations

RMS_EPS = 1e-6  # "ours_rms": the GEMV with the RMSNorm before it folded in (no residual only)


def variants(default) -> dict[str, object]:
    """Configs around the default: warps_k halved/doubled, other ring depths and unrolls, the
    other m-tile count."""
    from dataclasses import replace

    out = {}
    for change in (
        {"warps_k": max(1, default.warps_k // 2)},
        {"warps_k": min(16, default.warps_k * 2)},
        {"stages": 2},
        {"stages": 4},
        {"unroll": 1},
        {"unroll": 4, "stages": 2},
        {"m_tiles": 3 - default.m_tiles},
    ):
        cfg = replace(default, **change)
        if cfg != default:
            out[f"m{cfg.m_tiles}w{cfg.warps_k}u{cfg.unroll}s{cfg.stages}"] = cfg
    return out


def deeper_register_ring(n: int, k: int, cfg):
    """A register-ring bucket with more weight bytes in flight: a 2-step X ring (X comes from
    L2) frees the registers of a deeper weight ring, 4-8 steps, the most warps x steps that
    still keep one wave; `cfg` where none does or the ring is in shared memory."""
    from dataclasses import replace

    from qwen35_tvm.schedules.gemv_config import SHARED_PER_SM, one_wave

    if cfg.w_smem:
        return cfg
    tries = sorted(((wk, s) for wk in (8, 4, 2, 1) for s in (8, 6, 4)),
                   key=lambda p: (-p[0] * p[1], -p[0]))  # fmt: skip
    for warps_k, stages in tries:
        deep = replace(cfg, warps_k=warps_k, stages=stages, x_stages=2)
        if warps_k * stages > cfg.warps_k * cfg.stages and one_wave(n, k, deep, SHARED_PER_SM):
            return deep
    return cfg


def x_ring_variants(n: int, k: int, default) -> dict[str, object]:
    """The 16-row bucket with an X ring as deep as the weight ring (X comes from L2, and a
    2-step X ring bounds a warp to 2 steps in flight however deep its weight ring): in
    registers 2, 3 or 5 steps deep (decode's 1-row GEMV streams best 2 deep on the H200), or the
    weight in shared memory 6 or 8 steps deep with X 4-8; only those that keep one wave. Other
    buckets as `default`."""
    from dataclasses import replace

    from qwen35_tvm.schedules.gemv_config import WIDE_SHARED_PER_SM, one_wave

    out = {}
    for name, change in (
        ("xr2", {"stages": 2, "x_stages": 0, "w_smem": False}),
        ("xr3", {"stages": 3, "x_stages": 0, "w_smem": False}),
        ("xr5", {"stages": 5, "x_stages": 0, "w_smem": False}),
        ("xs6", {"stages": 6, "x_stages": 6, "w_smem": True}),
        ("xs8", {"stages": 8, "x_stages": 8, "w_smem": True}),
        ("xs8x4", {"stages": 8, "x_stages": 4, "w_smem": True}),
    ):
        plan = []
        for limit, cfg in default:
            deep = replace(cfg, m_tiles=1, warps_k=8, unroll=1, dependent=False, **change)
            ok = limit == 16 and one_wave(n, k, deep, WIDE_SHARED_PER_SM)
            plan.append((limit, deep if ok else cfg))
        if plan != list(default):
            out[name] = tuple(plan)
    return out


def small_ring_variants(n: int, k: int, default) -> dict[str, object]:
    """Decode's 1-7 rows with the weight ring in shared memory, deeper than registers allow
    (6 steps of two 128-bit loads a lane or 8-12 of one, X 3-4 steps in registers), where one wave
    still holds every row tile."""
    from dataclasses import replace

    from qwen35_tvm.schedules.gemv_config import one_wave

    out = {}
    for stages, x_stages, unroll in ((6, 3, 2), (8, 4, 1), (12, 4, 1)):
        cfg = replace(default, stages=stages, x_stages=x_stages, unroll=unroll, w_smem=True,
                      dependent=False)  # fmt: skip
        if one_wave(n, k, cfg):
            out[f"ss{stages}x{x_stages}u{unroll}"] = cfg
    return out


def bulk_variants(n: int, k: int, default) -> dict[str, object]:
    """Decode's 1-7 rows through sm_90's bulk ring (schedules/gemv_bulk.py): 16 rows a tile, 4
    or 8 warps, `bulk` persistent blocks an SM; a stage one 64-k (unroll 2) or 128-k (unroll 4)
    step a warp, 3-8 stages; only where k is whole chunks and the blocks fit in shared memory."""
    from dataclasses import replace

    from qwen35_tvm.schedules.gemv_config import SHARED_PER_SM

    out = {}
    for warps, unroll, stages, blocks in ((8, 2, 4, 2), (8, 2, 6, 2), (8, 4, 3, 2), (4, 4, 4, 3),
                                          (4, 4, 6, 2), (4, 2, 8, 3)):  # fmt: skip
        cfg = replace(default, m_tiles=1, warps_k=warps, unroll=unroll, stages=stages,
                      x_stages=2, w_smem=False, bulk=blocks, dependent=True)  # fmt: skip
        if k % cfg.chunk == 0 and blocks * (cfg.shared_bytes + 1024) <= SHARED_PER_SM:
            out[f"bulk{blocks}w{warps}u{unroll}s{stages}"] = cfg
    return out


def wide_variants(n: int, k: int) -> dict[str, object]:
    """Bucket plans around the default: the GEMV's own plan ("gemv": every bucket the GEMV) and
    the swapped tensor-core GEMM's ("mma", gemv_config.WIDE_MMA's; where it applies); the
    GEMV's ring in registers, the other m-tile count, half the shared ring, deeper register
    rings ("deep"); the tensor-core GEMM's rings at 4-6 stages ("mma4".."mma6") and its
    weight's first tiles loaded before the wait for X's producer ("mmae"); for a narrow weight,
    its 16-, 32- and 64-row buckets with each tile's k split over 4, 6 or 8 blocks
    ("sk4".."sk8")."""
    from dataclasses import replace

    from qwen35_tvm.schedules.gemv_config import (
        SM80_SHARED_BYTES,
        WideMmaConfig,
        split_config,
        wide_buckets,
    )

    default = wide_buckets(n, k, mma=False)
    ours = wide_buckets(n, k, mma=True)
    mma = {}
    for stages in (4, 5, 6) if ours != default else ():
        plan = tuple((limit, replace(c, stages=stages) if isinstance(c, WideMmaConfig) else c)
                     for limit, c in ours)  # fmt: skip
        if all(getattr(c, "shared_bytes", 0) <= SM80_SHARED_BYTES for _, c in plan):
            mma[f"mma{stages}"] = plan
    if mma:  # the first weight tiles loaded before the wait for X's producer
        mma["mmae"] = tuple((limit, replace(c, early=True) if isinstance(c, WideMmaConfig) else c)
                            for limit, c in ours)  # fmt: skip
    for splits in (4, 6, 8) if all(not isinstance(c, WideMmaConfig) for _, c in ours) else ():
        split = {cols: split_config(n, k, cols, splits) for cols in (16, 32, 64)}
        if all(split.values()):
            mma[f"sk{splits}"] = tuple((limit, split.get(limit) or c) for limit, c in default)
    other = 1 if default[-1][1].m_tiles == 2 else 2
    half = tuple(
        (limit, replace(cfg, stages=max(2, cfg.stages // 2)) if cfg.w_smem else cfg)
        for limit, cfg in default
    )
    bulk16 = {}
    for unroll, stages in ((2, 6), (4, 3)):  # the 16-row bucket through sm_90's bulk ring
        cfg = replace(default[1][1], m_tiles=1, warps_k=8, unroll=unroll, stages=stages,
                      x_stages=2, w_smem=False, bulk=2, dependent=True)  # fmt: skip
        if k % cfg.chunk == 0:
            bulk16[f"bulk16u{unroll}s{stages}"] = (default[0], (16, cfg), *default[2:])
    return {
        **({"gemv": default, "mma": ours} if ours != default else {}),
        **mma,
        **bulk16,
        "regs": wide_buckets(n, k, mma=False, w_smem=False),
        f"m{other}": wide_buckets(n, k, mma=False, m_tiles=other),
        "half": half,
        "deep": tuple((limit, deeper_register_ring(n, k, cfg)) for limit, cfg in default),
        **x_ring_variants(n, k, default),
    }


def config_json(cfg) -> object:
    import dataclasses

    if cfg is None:
        return None
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return [[limit, dataclasses.asdict(c)] for limit, c in cfg]  # buckets


# --balance: probe shapes around N = 2,560 (160 sixteen-row tiles on 132 SMs). If an SM streams
# ~1/132 of the bandwidth however many blocks it holds, the time follows the most tiles any SM
# holds: N = 2,112 (132 tiles, one each) and 4,224 (264, two each) should stream near the
# bound, 2,560 and 2,640 (160 and 165: some SMs two) at ~61% of it. Decides whether split-K
# across blocks is worth building (docs/performance.md, session 8).
BALANCE_N, BALANCE_K = (2112, 2560, 2640, 4224), (4096, 9216)


def balance_probes() -> list[dict]:
    return [
        {"n": n, "k": k, "residual": True, "names": [f"probe.n{n}_k{k}"]}
        for k in BALANCE_K
        for n in BALANCE_N
    ]


def shape_kernels(small, rows: str, target, gate_up: bool = False) -> tuple[dict, dict, dict]:
    """{name: PrimFunc}, {name: config}, {name: why it failed} of one shape and row class;
    `gate_up`: also the SwiGLU's kernels (benchmarks/gemv_swiglu.py)."""
    import gemv_swiglu
    from tvm.s_tir import dlight as dl

    from qwen35_tvm.schedules.gemm_match import match_gemm
    from qwen35_tvm.schedules.gemv_config import default_config
    from qwen35_tvm.schedules.gemv_rule import DecodeGemv, gemv_for, plan
    from qwen35_tvm.schedules.matmul_config import ROWS_ATTR, WIDE_DECODE_CONFIG
    from qwen35_tvm.schedules.matmul_rule import MatmulMMA, gemm_for

    match = match_gemm(small)
    n, k = match.n, match.k
    func = small.with_attr(ROWS_ATTR, rows)

    def rule(*rules):
        for r in rules:  # the first that applies
            sch = r.apply(func, target, False)
            if sch is not None:
                return sch.mod["main"]
        raise RuntimeError("no rule applied")

    if rows == "small":
        default = default_config(n, k)
        configs = {"ours": default, **variants(default), **small_ring_variants(n, k, default),
                   **bulk_variants(n, k, default)}  # fmt: skip
        makers = {"ours": lambda: rule(DecodeGemv())}
        if not match.extra_params:
            makers["ours_rms"] = lambda: gemv_for(func, target, rows="small", rms_eps=RMS_EPS)
        baseline = {"dlight": lambda: rule(dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(4))}
    else:
        configs = {"ours": plan(n, k, "wide"), **wide_variants(n, k)}
        makers = {"ours": lambda: rule(DecodeGemv(rows="wide"))}
        if not match.extra_params:  # norm_fusion.FOLD_WIDE's kernels
            makers["ours_rms"] = lambda: gemv_for(func, target, rows="wide", rms_eps=RMS_EPS)
        baseline = {
            "mma_wide": lambda: rule(MatmulMMA(WIDE_DECODE_CONFIG, rows="wide")),
            # prefill's GEMM (wgmma and TMA on sm_90a, split-K where its tiles leave SMs idle)
            "wgmma": lambda: gemm_for(func, None, "default"),
        }
    for name, cfg in list(configs.items()):
        if name != "ours":
            makers[name] = lambda cfg=cfg: gemv_for(func, target, cfg)
            if "ours_rms" in makers:  # the same config with the norm folded in
                configs[f"{name}_rms"] = cfg
                makers[f"{name}_rms"] = lambda c=cfg: gemv_for(func, target, c, rms_eps=RMS_EPS)
    if gate_up:  # the default config, the SwiGLU folded in; and alone
        glu = gemv_swiglu.makers(func, target, RMS_EPS, rows)
        makers.update(glu)
        configs.update({name: configs["ours"] for name in glu if name != gemv_swiglu.ALONE})
        for name in [nm for nm in configs if nm == "gemv" or nm.startswith("mma")]:
            # decode_wide's own gate_up (norm and SwiGLU folded) under the other plans
            glu_name, cfg = f"{name}_rms{gemv_swiglu.GLU}", configs[name]
            configs[glu_name] = cfg
            makers[glu_name] = lambda c=cfg: gemv_for(func, target, c, rms_eps=RMS_EPS,
                                                      swiglu=True)  # fmt: skip
    kernels, errors = {}, {}
    for name, make in {**makers, **baseline}.items():
        try:
            with target:
                kernels[name] = make().with_attr("tirx.is_scheduled", True)
        except Exception as err:  # noqa: BLE001  keep building the others
            errors[name] = f"{type(err).__name__}: {err}"
    return kernels, {nm: config_json(configs.get(nm)) for nm in kernels}, errors
