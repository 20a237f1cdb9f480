"""Qwen3.5's language model in TVM Relax (`relax.frontend.nn`), one module per block.

Every forward works on a ragged token array: `T` tokens of `B` sequences laid end to end,
`indptr[b]` marking where sequence b starts, `slots[b]` naming its rows in the state pools (GDN
state and the page table) and `positions[t]` giving each token's absolute position. The
full-attention layers keep K/V in our own paged cache (schedules/kv_cache.py): two page pools
and a page table, all plain tensors, so a decode step can be one CUDA graph.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import numpy as np
from tvm import IRModule, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..schedules import (
    attention,
    attention_prefill,
    attention_prep,
    gdn,
    gdn_chunked,
    gdn_prep,
    greedy,
    kv_cache,
    logits,
    norm,
)
from .config import FULL, ModelConfig
from .vocab import VocabWidths

F32 = "float32"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis in float32 (schedules/norm.py: one kernel, casts included);
    `weight` already holds HF's (1 + w), folded at conversion."""
    *lead, dim = x.shape
    rows = functools.reduce(operator.mul, lead)
    y = op.tensor_ir_op(
        norm.rms_norm(int(dim), eps, x.dtype, Target.current()),
        norm.kernel_name(int(dim), eps, x.dtype),
        [op.reshape(x, (rows, dim)), weight],
        out=Tensor.placeholder((rows, dim), x.dtype),
    )
    return op.reshape(y, x.shape)


class Linear(nn.Linear):
    """No bias; accumulates in fp32 (as cuBLAS does for bf16) and rounds the output back to the
    activation dtype. Accumulating a bf16 GEMM in bf16 costs whole nats of logprob."""

    def __init__(self, in_features: int, out_features: int, dtype: str):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, out_dtype=F32)
        self.act_dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).astype(self.act_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nn.Parameter((dim,), F32)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig, dtype: str):
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, dtype)
        self.down_proj = Linear(self.inter, cfg.hidden_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class KVCache(NamedTuple):
    """The paged K/V cache: pools [full layers, pages, kv heads, page size, head dim] and the
    page table [slots, pages per sequence] of page ids."""

    k_pool: Tensor
    v_pool: Tensor
    page_table: Tensor


class GatedAttention(nn.Module):
    """Full attention: q carries a per-head output gate; q/k RMSNorm; partial RoPE; GQA."""

    def __init__(self, cfg: ModelConfig, kv_layer: int, dtype: str):
        self.cfg = cfg
        self.kv_layer = kv_layer
        self.dtype = dtype
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (2 * nh + 2 * nkv) * d, dtype)
        self.o_proj = Linear(nh * d, cfg.hidden_size, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.inv_freq = attention_prep.inv_freq(cfg.rotary_dim, cfg.rope_theta)

    def forward(
        self,
        x: Tensor,
        indptr: Tensor,
        slots: Tensor,
        positions: Tensor,
        kv: KVCache,
        prefill: bool,
    ) -> tuple[Tensor, KVCache]:
        """`prefill` picks the tensor-core kernel where there is one (bf16 on CUDA): many query
        tokens share each K/V tile there, while decode's single tokens want split-KV."""
        cfg = self.cfg
        n_tok = x.shape[0]
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # [q_0 gate_0 q_1 gate_1 ... | k | v], read in place by both kernels below
        proj = self.qkv_proj(x)
        layer = tirx.IntImm("int32", self.kv_layer)
        target = Target.current()
        # q/k RMSNorm and RoPE, q out, K/V into their pages: one kernel
        k_pool, v_pool, q = op.tensor_ir_inplace_op(
            attention_prep.attention_input(
                nh, nkv, d, cfg.rotary_dim, cfg.rms_norm_eps, self.dtype, target
            ),
            attention_prep.INPUT_NAME,
            [
                proj,
                self.q_norm.weight,
                self.k_norm.weight,
                nn.Tensor.from_const(self.inv_freq),
                indptr,
                slots,
                positions,
                kv.page_table,
                kv.k_pool,
                kv.v_pool,
                layer,
            ],
            inplace_indices=[8, 9, -1],
            out=[kv.k_pool, kv.v_pool, Tensor.placeholder((n_tok, nh, d), self.dtype)],
        )
        tensor_cores = prefill and target.kind.name == "cuda" and self.dtype == "bfloat16"
        if tensor_cores and d % 64 == 0:
            kernel, name = attention_prefill.paged_prefill_mma(nh, nkv, d, target), "attn_prefill"
        else:
            kernel, name = attention.paged_attention(nh, nkv, d, self.dtype, target), "attn_paged"
        o, _, _ = op.tensor_ir_op(
            kernel,
            name,
            [q, indptr, slots, positions, kv.page_table, k_pool, v_pool, layer],
            out=[
                Tensor.placeholder((n_tok, nh, d), self.dtype),
                Tensor.placeholder((attention.SPLIT_BUDGET, nh, d), F32),
                Tensor.placeholder((attention.SPLIT_BUDGET, nh, 2), F32),
            ],
        )
        o = op.tensor_ir_op(
            attention_prep.output_gate(nh, d, self.dtype, target),
            attention_prep.GATE_NAME,
            [o, proj],
            out=Tensor.placeholder((n_tok, nh * d), self.dtype),
        )
        return self.o_proj(o), KVCache(k_pool, v_pool, kv.page_table)


class GatedDeltaNet(nn.Module):
    """Linear attention: fused input projection, causal conv1d with state, the gated delta
    rule with an fp32 recurrent state, gated RMSNorm, output projection."""

    def __init__(self, cfg: ModelConfig, gdn_layer: int, dtype: str):
        self.cfg = cfg
        self.gdn_layer = gdn_layer
        self.dtype = dtype
        hv = cfg.linear_num_value_heads
        self.in_proj = Linear(cfg.hidden_size, cfg.conv_dim + cfg.value_dim + 2 * hv, dtype)
        self.conv_weight = nn.Parameter((cfg.conv_dim, cfg.linear_conv_kernel_dim), dtype)
        self.A_log = nn.Parameter((hv,), F32)
        self.dt_bias = nn.Parameter((hv,), F32)
        self.norm_weight = nn.Parameter((cfg.linear_value_head_dim,), F32)
        self.out_proj = Linear(cfg.value_dim, cfg.hidden_size, dtype)

    def forward(
        self,
        x: Tensor,
        indptr: Tensor,
        slots: Tensor,
        conv_pool: Tensor,
        rec_pool: Tensor,
        chunked: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`chunked` picks the chunkwise-parallel delta rule (prefill) over the recurrent one
        (decode); both read and update the same state."""
        cfg = self.cfg
        n_tok = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        layer = tirx.IntImm("int32", self.gdn_layer)
        target = Target.current()
        proj = self.in_proj(x)  # [q k v | z | b | a], read in place by both kernels below
        conv_pool, q, k, v, g, beta = op.tensor_ir_inplace_op(
            gdn_prep.gdn_input(hk, hv, dk, dv, cfg.linear_conv_kernel_dim, self.dtype, target),
            "gdn_input",
            [proj, self.conv_weight, self.A_log, self.dt_bias, indptr, slots, conv_pool, layer],
            inplace_indices=[6, -1, -1, -1, -1, -1],
            out=[
                conv_pool,
                Tensor.placeholder((n_tok, hk, dk), F32),
                Tensor.placeholder((n_tok, hk, dk), F32),
                Tensor.placeholder((n_tok, hv, dv), F32),
                Tensor.placeholder((n_tok, hv), F32),
                Tensor.placeholder((n_tok, hv), F32),
            ],
        )
        if chunked:  # bf16 on CUDA: the tensor-core kernel (bf16 operands, fp32 state)
            rule = gdn_chunked.chunked_gated_delta_rule(
                hk, hv, dk, dv, target, act_dtype=self.dtype
            )
        else:
            rule = gdn.gated_delta_rule(hk, hv, dk, dv, target)
        rec_pool, o = op.tensor_ir_inplace_op(
            rule,
            "gdn_delta_rule",
            [q, k, v, g, beta, indptr, slots, rec_pool, layer],
            inplace_indices=[7, -1],
            out=[rec_pool, Tensor.placeholder((n_tok, hv, dv), F32)],
        )
        # Gated RMSNorm: HF rounds the core output to the activation dtype before the norm.
        o = op.tensor_ir_op(
            gdn_prep.gated_norm(hv, dv, cfg.conv_dim, cfg.rms_norm_eps, self.dtype, target),
            "gdn_gated_norm",
            [o, proj, self.norm_weight],
            out=Tensor.placeholder((n_tok, cfg.value_dim), self.dtype),
        )
        out = self.out_proj(o)
        return out, conv_pool, rec_pool


def _pick_workspaces(n) -> list[Tensor]:
    val, idx = greedy.workspace_shapes(n)
    return [Tensor.placeholder(val, F32), Tensor.placeholder(idx, "int32")]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: str):
        self.kind = cfg.layer_types[index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == FULL:
            self.self_attn = GatedAttention(cfg, cfg.full_layers.index(index), dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(index), dtype)
        self.mlp = MLP(cfg, dtype)


class LogitsHead(nn.Module):
    """The only producer of logits, and the only reader of the output projection weight.

    Untied checkpoints give it its own weight; tied ones lend it the embedding table, held
    outside nn's parameter discovery so the table is exported (and stored) once."""

    def __init__(
        self,
        cfg: ModelConfig,
        widths: VocabWidths,
        dtype: str,
        embed: nn.Embedding,
        mask_pad: bool = True,
    ):
        self._kernel = logits.logits_projection(
            cfg.hidden_size,
            widths.rows,
            widths.decodable,
            widths.selection,
            dtype,
            Target.current(),
            mask_pad,
        )
        self._widths = widths
        if cfg.tie_word_embeddings:
            self._tied = (embed,)
        else:
            self.weight = nn.Parameter((widths.rows, cfg.hidden_size), dtype)

    def forward(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """Logits [rows, selection], into `out` when given (decode's fixed output buffer)."""
        weight = self._tied[0].weight if hasattr(self, "_tied") else self.weight
        if out is not None:
            return op.tensor_ir_inplace_op(
                self._kernel, "logits", [hidden, weight, out], inplace_indices=[2], out=out
            )
        return op.tensor_ir_op(
            self._kernel,
            "logits",
            [hidden, weight],
            out=Tensor.placeholder((hidden.shape[0], self._widths.selection), F32),
        )


class Qwen35LM(nn.Module):
    """Embedding, the decoder stack, the final norm and the logits head."""

    def __init__(self, cfg: ModelConfig, widths: VocabWidths, dtype: str, mask_pad: bool = True):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(widths.rows, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LogitsHead(cfg, widths, dtype, self.embed_tokens, mask_pad)
        self.widths = widths

    def prefill(
        self,
        input_ids: Tensor,
        indptr: Tensor,
        slots: Tensor,
        positions: Tensor,
        logit_positions: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        page_table: Tensor,
        conv_pool: Tensor,
        rec_pool: Tensor,
    ) -> tuple[Tensor, ...]:
        """Any number of tokens of any number of sequences: logits [len(logit_positions),
        selection] at the given token positions. The pools come back only because they are
        updated in place."""
        kv = KVCache(k_pool, v_pool, page_table)
        x, kv, conv_pool, rec_pool = self._stack(
            input_ids, indptr, slots, positions, kv, conv_pool, rec_pool, chunked=True
        )
        hidden = self.norm(op.take(x, logit_positions, axis=0))
        return self.lm_head(hidden), kv.k_pool, kv.v_pool, conv_pool, rec_pool

    def decode(
        self,
        step: Tensor,
        logits_out: Tensor,
        best_out: Tensor,
        logprob_out: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        page_table: Tensor,
        conv_pool: Tensor,
        rec_pool: Tensor,
    ) -> tuple[Tensor, ...]:
        """One token for each of `batch` sequences: logits [batch, selection] and each row's
        greedy pick, written into the given output buffers. Compiled apart from prefill so its
        projections get GEMV schedules; every argument is a buffer the runner keeps at a fixed
        address, so the whole step is one CUDA graph per batch size. `step` [batch, 3] holds
        each row's token id, slot and position: one host-to-device copy a step."""
        batch = step.shape[0]
        input_ids, slots, positions = (
            op.reshape(c, (batch,)) for c in op.split(step, 3, axis=1)
        )
        indptr = op.arange(0, batch + 1, dtype="int32")
        kv = KVCache(k_pool, v_pool, page_table)
        x, kv, conv_pool, rec_pool = self._stack(
            input_ids, indptr, slots, positions, kv, conv_pool, rec_pool, chunked=False
        )
        logits_out = self.lm_head(self.norm(x), out=logits_out)
        best, best_logprob, _, _ = op.tensor_ir_inplace_op(
            greedy.greedy_pick(self.widths.decodable, self.widths.selection, Target.current()),
            "greedy_pick",
            [logits_out, best_out, logprob_out],
            inplace_indices=[1, 2, -1, -1],
            out=[best_out, logprob_out, *_pick_workspaces(batch)],
        )
        return logits_out, best, best_logprob, kv.k_pool, kv.v_pool, conv_pool, rec_pool

    # The same graph for 8-64 sequences, compiled apart so its projections get tensor-core
    # tiles instead of GEMV schedules (see compile/pipeline.py).
    decode_wide = decode

    def constrained_pick(
        self, logits: Tensor, rows: Tensor, bitmask: Tensor, best_out: Tensor, logprob_out: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The greedy pick of logits rows `rows` under their token bitmasks (xgrammar's
        layout, decodable columns only), and its logprob in the masked distribution. Runs
        after a decode or prefill on the logits it left on the device."""
        w = self.widths
        best, logprob, _, _ = op.tensor_ir_inplace_op(
            greedy.greedy_pick(w.decodable, w.selection, Target.current(), masked=True),
            "masked_greedy_pick",
            [logits, rows, bitmask, best_out, logprob_out],
            inplace_indices=[3, 4, -1, -1],
            out=[best_out, logprob_out, *_pick_workspaces(rows.shape[0])],
        )
        return best, logprob

    def constrained_mask(self, logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
        """-inf, in place, over the decodable columns each row's bitmask forbids: constrained
        rows the host samples are masked before they are copied."""
        w = self.widths
        return op.tensor_ir_inplace_op(
            greedy.apply_token_bitmask(w.decodable, w.selection, Target.current()),
            "apply_token_bitmask",
            [logits, rows, bitmask],
            inplace_indices=[0],
            out=Tensor.placeholder(logits.shape, F32),
        )

    def _stack(
        self,
        input_ids: Tensor,
        indptr: Tensor,
        slots: Tensor,
        positions: Tensor,
        kv: KVCache,
        conv_pool: Tensor,
        rec_pool: Tensor,
        chunked: bool,
    ) -> tuple[Tensor, KVCache, Tensor, Tensor]:
        """Embedding and the decoder layers: hidden states [tokens, hidden] before the norm."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer.input_layernorm(x)
            if layer.kind == FULL:
                h, kv = layer.self_attn(h, indptr, slots, positions, kv, prefill=chunked)
            else:
                h, conv_pool, rec_pool = layer.linear_attn(
                    h, indptr, slots, conv_pool, rec_pool, chunked
                )
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, kv, conv_pool, rec_pool

    def create_kv_pools(
        self, num_pages: tirx.Var, num_slots: tirx.Var, pages_per_seq: tirx.Var
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Zeroed K and V page pools and page table (zeros keep never-written rows finite:
        masked keys still meet a zero weight in P.V)."""
        pool, table = kv_pool_shapes(self.cfg, num_pages, num_slots, pages_per_seq)
        return op.zeros(pool, self.dtype), op.zeros(pool, self.dtype), op.zeros(table, "int32")

    def assign_pages(self, page_table: Tensor, slot: Tensor, pages: Tensor) -> Tensor:
        """Give the sequence in `slot` its pages: row `slot` of the table starts with `pages`."""
        return op.tensor_ir_inplace_op(
            kv_cache.assign_pages(Target.current()),
            "attn_assign_pages",
            [page_table, slot, pages],
            inplace_indices=[0],
            out=Tensor.placeholder(page_table.shape, "int32"),
        )

    def create_gdn_pools(self, num_slots: tirx.Var) -> tuple[Tensor, Tensor]:
        return (
            op.zeros(gdn_pool_shapes(self.cfg, num_slots)[0], self.dtype),
            op.zeros(gdn_pool_shapes(self.cfg, num_slots)[1], F32),
        )

    def reset_gdn_slots(
        self, conv_pool: Tensor, rec_pool: Tensor, slots: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Zero the GDN state of `slots`, so a reused slot starts like a fresh one."""
        out = []
        for kind, pool in (("conv", conv_pool), ("rec", rec_pool)):
            n_slots, *per_slot = pool.shape
            numel = int(np.prod([int(s) for s in per_slot]))
            flat = op.reshape(pool, (n_slots, numel))
            out.append(
                op.tensor_ir_inplace_op(
                    gdn.reset_slots(numel, pool.dtype, f"gdn_reset_{kind}_slots", Target.current()),
                    f"gdn_reset_{kind}_slots",
                    [flat, slots],
                    inplace_indices=[0],
                    out=Tensor.placeholder((n_slots, numel), pool.dtype),
                )
            )
        return out[0], out[1]


def gdn_pool_shapes(cfg: ModelConfig, num_slots) -> tuple[tuple, tuple]:
    n_gdn = len(cfg.linear_layers)
    conv = (num_slots, n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    rec = (
        num_slots,
        n_gdn,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.linear_key_head_dim,
    )
    return conv, rec


def kv_pool_shapes(cfg: ModelConfig, num_pages, num_slots, pages_per_seq) -> tuple[tuple, tuple]:
    pool = (
        len(cfg.full_layers),
        num_pages,
        cfg.num_key_value_heads,
        kv_cache.PAGE_SIZE,
        cfg.head_dim,
    )
    return pool, (num_slots, pages_per_seq)


def export_spec(cfg: ModelConfig, widths: VocabWidths, dtype: str) -> dict:
    """The functions the artifact exports, with their argument shapes."""
    conv, rec = gdn_pool_shapes(cfg, "n_slots")
    pool, table = kv_pool_shapes(cfg, "n_pages", "n_slots", "pages_per_seq")
    state = {
        "k_pool": nn.spec.Tensor(list(pool), dtype),
        "v_pool": nn.spec.Tensor(list(pool), dtype),
        "page_table": nn.spec.Tensor(list(table), "int32"),
        "conv_pool": nn.spec.Tensor(list(conv), dtype),
        "rec_pool": nn.spec.Tensor(list(rec), F32),
    }
    packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
    no_params = {"$": {"param_mode": "none", "effect_mode": "none"}}
    # A step's logits, the rows among them that are constrained, and one bitmask row each.
    constrained = {
        "logits": nn.spec.Tensor(["batch", widths.selection], F32),
        "rows": nn.spec.Tensor(["n"], "int32"),
        "bitmask": nn.spec.Tensor(["n", greedy.mask_words(widths.decodable)], "int32"),
    }
    return {
        "prefill": {
            "input_ids": nn.spec.Tensor(["n_tok"], "int32"),
            "indptr": nn.spec.Tensor(["n_ptr"], "int32"),
            "slots": nn.spec.Tensor(["n_seq"], "int32"),
            "positions": nn.spec.Tensor(["n_tok"], "int32"),
            "logit_positions": nn.spec.Tensor(["n_out"], "int32"),
            **state,
            **packed,
        },
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
        "create_kv_pools": {"num_pages": int, "num_slots": int, "pages_per_seq": int, **no_params},
        "assign_pages": {
            "page_table": nn.spec.Tensor(list(table), "int32"),
            "slot": nn.spec.Tensor([1], "int32"),
            "pages": nn.spec.Tensor(["count"], "int32"),
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
