"""What the artifact exports from compile/model.py's Qwen35LM: each function's argument shapes
(symbolic batch, token and pool sizes), and the marks that let each decode function be captured
as one CUDA graph per batch size."""

from __future__ import annotations

from tvm import IRModule
from tvm.relax.frontend import nn
from tvm.target import Target

from ..schedules import gdn_chunked, greedy
from .config import ModelConfig
from .model import F32, gdn_pool_shapes, kv_pool_shapes
from .vocab import VocabWidths


def prompts_prefill_differs(cfg: ModelConfig, dtype: str, target: Target) -> bool:
    """Whether Qwen35LM.prefill_prompts is another function than prefill: where the chunked
    GDN's two passes leave a mixed step's one-token rows to decode's kernel (bf16 on CUDA).
    The attention's such rows (attention_decode_mma.MIXED_ROWS_SPLIT) follow the same split:
    where only they would differ, prefill serves prompts too, its ragged kernel idle."""
    return gdn_chunked.MIXED_ROWS_RECURRENT and gdn_chunked.two_pass_applies(
        cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
        cfg.linear_value_head_dim, target, dtype,
    )  # fmt: skip


def export_spec(cfg: ModelConfig, widths: VocabWidths, dtype: str, prompts: bool = False) -> dict:
    """The functions the artifact exports, with their argument shapes; `prompts`: also
    prefill_prompts (`prompts_prefill_differs`)."""
    conv, rec, tickets = gdn_pool_shapes(cfg, "n_slots")
    pool, table = kv_pool_shapes(cfg, "n_pages", "n_slots", "pages_per_seq")
    state = {
        "k_pool": nn.spec.Tensor(list(pool), dtype),
        "v_pool": nn.spec.Tensor(list(pool), dtype),
        "page_table": nn.spec.Tensor(list(table), "int32"),
        "conv_pool": nn.spec.Tensor(list(conv), dtype),
        "rec_pool": nn.spec.Tensor(list(rec), F32),
        "gdn_tickets": nn.spec.Tensor(list(tickets), "int32"),
    }
    packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
    no_params = {"$": {"param_mode": "none", "effect_mode": "none"}}
    # A step's logits, the rows among them that are constrained, and one bitmask row each.
    constrained = {
        "logits": nn.spec.Tensor(["batch", widths.selection], F32),
        "rows": nn.spec.Tensor(["n"], "int32"),
        "bitmask": nn.spec.Tensor(["n", greedy.mask_words(widths.decodable)], "int32"),
    }
    sampled = {
        "logits": nn.spec.Tensor(["batch", widths.selection], F32),
        "rows": nn.spec.Tensor(["n"], "int32"),
        "floats": nn.spec.Tensor(["n", 3], F32),
        "ints": nn.spec.Tensor(["n", 4], "int32"),
        "best_out": nn.spec.Tensor(["batch"], "int32"),
        "logprob_out": nn.spec.Tensor(["batch"], F32),
        **no_params,
    }
    prefill = {
        "input_ids": nn.spec.Tensor(["n_tok"], "int32"),
        "indptr": nn.spec.Tensor(["n_ptr"], "int32"),
        "slots": nn.spec.Tensor(["n_seq"], "int32"),
        "positions": nn.spec.Tensor(["n_tok"], "int32"),
        "logit_positions": nn.spec.Tensor(["n_out"], "int32"),
        **state,
        **packed,
    }
    return {
        "prefill": prefill,
        **({"prefill_prompts": dict(prefill)} if prompts else {}),  # export_tvm pops "$"
        **{
            name: {
                "step": nn.spec.Tensor(["batch", 3], "int32"),
                "logits_out": nn.spec.Tensor(["batch", widths.selection], F32),
                "best_out": nn.spec.Tensor(["batch"], "int32"),
                "logprob_out": nn.spec.Tensor(["batch"], F32),
                **state,
                **packed,
            }
            for name in ("decode", "decode_wide")
        },
        "constrained_pick": {
            **constrained,
            "best_out": nn.spec.Tensor(["n"], "int32"),
            "logprob_out": nn.spec.Tensor(["n"], F32),
            **no_params,
        },
        "constrained_mask": {**constrained, **no_params},
        # A step's sampled rows: (temperature, top_p, min_p), (top_k, seed low, seed high, counter).
        "sampled_pick": sampled,
        "sampled_pick_nucleus": dict(sampled),  # export_tvm pops "$"
        "create_kv_pools": {"num_pages": int, "num_slots": int, "pages_per_seq": int, **no_params},
        "assign_pages": {
            "page_table": nn.spec.Tensor(list(table), "int32"),
            "slot": nn.spec.Tensor([1], "int32"),
            "pages": nn.spec.Tensor(["count"], "int32"),
            **no_params,
        },
        "feed_picks": {
            "step": nn.spec.Tensor(["batch", 3], "int32"),
            "best": nn.spec.Tensor(["batch"], "int32"),
            **no_params,
        },
        "create_gdn_pools": {"num_slots": int, **no_params},
        "reset_gdn_slots": {
            "conv_pool": nn.spec.Tensor(list(conv), dtype),
            "rec_pool": nn.spec.Tensor(list(rec), F32),
            "slots": nn.spec.Tensor(["count"], "int32"),
            **no_params,
        },
    }


def mark_decode_for_cuda_graph(mod: IRModule, max_batch: int) -> IRModule:
    """Let TVM's RewriteCUDAGraph capture each decode function whole: one graph per batch size
    up to `max_batch` (storage is planned once, for `max_batch`). Every argument counts as a
    fixed input (`num_input` 0): the runner passes views of the same buffers on every call
    (inputs, outputs, pools), so capturing their addresses is sound."""
    for name in ("decode", "decode_wide"):
        mod[name] = mod[name].with_attrs(
            {
                "num_input": 0,
                "tir_var_upper_bound": {"batch": max_batch},
                "relax.rewrite_cuda_graph.capture_symbolic_vars": ["batch"],
            }
        )
    return mod
