"""The configs benchmarks/gemv_kernel.py builds around the pipeline's (decode's and
decode_wide's), and how the manifest records them."""

from __future__ import annotations


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


def wide_variants(n: int, k: int) -> dict[str, object]:
    """Bucket plans around the default: the weight ring in registers, the other m-tile count,
    half the shared ring, deeper register rings ("deep")."""
    from dataclasses import replace

    from qwen35_tvm.schedules.gemv_config import wide_buckets
    from qwen35_tvm.schedules.gemv_rule import plan

    default = plan(n, k, "wide")
    other = 1 if default[-1][1].m_tiles == 2 else 2
    half = tuple(
        (limit, replace(cfg, stages=max(2, cfg.stages // 2)) if cfg.w_smem else cfg)
        for limit, cfg in default
    )
    return {
        "regs": wide_buckets(n, k, w_smem=False),
        f"m{other}": wide_buckets(n, k, m_tiles=other),
        "half": half,
        "deep": tuple((limit, deeper_register_ring(n, k, cfg)) for limit, cfg in default),
    }


def config_json(cfg) -> object:
    import dataclasses

    if cfg is None:
        return None
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return [[limit, dataclasses.asdict(c)] for limit, c in cfg]  # buckets
