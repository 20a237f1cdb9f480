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


def wide_variants(n: int, k: int) -> dict[str, object]:
    """Bucket plans around the default: the weight ring in registers, the other m-tile count,
    half the shared ring."""
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
    }


def config_json(cfg) -> object:
    import dataclasses

    if cfg is None:
        return None
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return [[limit, dataclasses.asdict(c)] for limit, c in cfg]  # buckets
