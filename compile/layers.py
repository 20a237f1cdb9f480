"""Qwen3.5's blocks in TVM Relax (`relax.frontend.nn`), one module each: the projections,
RMSNorm, the MLP, the gated full-attention layer over our paged KV cache, the Gated DeltaNet
layer, and the decoder layer holding one of the two. compile/model.py stacks them.

Every forward works on a ragged token array: `T` tokens of `B` sequences laid end to end,
`indptr[b]` marking where sequence b starts, `slots[b]` naming its rows in the state pools (GDN
state and the page table) and `positions[t]` giving each token's absolute position.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..schedules import (
    activation,
    attention,
    attention_decode_mma,
    attention_prefill,
    attention_prep,
    gdn_chunked,
    gdn_decode,
    gdn_prep,
    norm,
)
from .config import FULL, ModelConfig

F32 = "float32"


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last axis in float32 (schedules/norm.py: one kernel, casts included);
    `weight` already holds HF's (1 + w), folded at conversion. Without `weight`, x / rms."""
    *lead, dim = x.shape
    rows = functools.reduce(operator.mul, lead)
    weighted = weight is not None
    y = op.tensor_ir_op(
        norm.rms_norm(int(dim), eps, x.dtype, Target.current(), weighted),
        norm.kernel_name(int(dim), eps, x.dtype, weighted),
        [op.reshape(x, (rows, dim))] + ([weight] if weighted else []),
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
    """`weighted=False`: no weight of its own, the norm HF has here being folded into the
    projection that reads it (compile/convert.py `FOLDED_NORMS`)."""

    def __init__(self, dim: int, eps: float, weighted: bool = True):
        self.weight = nn.Parameter((dim,), F32) if weighted else None
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
        return self.down_proj(self.activate(self.gate_up_proj(x)))

    def activate(self, gate_up: Tensor) -> Tensor:
        """silu(gate) · up (schedules/activation.py; decode's is folded into the gate_up GEMV
        by compile/swiglu_fusion.py)."""
        *lead, width = gate_up.shape
        rows = functools.reduce(operator.mul, lead)
        act = op.tensor_ir_op(
            activation.swiglu(self.inter, gate_up.dtype, Target.current()),
            f"{activation.NAME}_{gate_up.dtype}_{self.inter}",
            [op.reshape(gate_up, (rows, width))],
            out=Tensor.placeholder((rows, self.inter), gate_up.dtype),
        )
        return op.reshape(act, (*lead, self.inter))


class KVCache(NamedTuple):
    """The paged K/V cache: pools [full layers, pages, kv heads, page size, head dim] and the
    page table [slots, pages per sequence] of page ids."""

    k_pool: Tensor
    v_pool: Tensor
    page_table: Tensor


class GDNState(NamedTuple):
    """The Gated DeltaNet layers' state pools, [slots, GDN layers, ...] (schedules/gdn.py),
    and the fused decode kernel's tickets (schedules/gdn_decode.py, zero between kernels)."""

    conv_pool: Tensor
    rec_pool: Tensor
    tickets: Tensor


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
        mixed: bool = True,
    ) -> tuple[Tensor, KVCache]:
        """`prefill` picks the tensor-core kernel where there is one (bf16 on CUDA): many query
        tokens share each K/V tile there, while decode's single tokens want split-KV. So a
        `mixed` prefill (decode rows among its sequences) leaves its one-token sequences to
        decode's tensor-core kernel in its ragged form, which runs beside it
        (attention_decode_mma.MIXED_ROWS_SPLIT)."""
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
        cuda_bf16 = target.kind.name == "cuda" and self.dtype == "bfloat16"
        tensor_cores = cuda_bf16 and d % 64 == 0
        split_tc = tensor_cores and nh // nkv <= attention_decode_mma.ROWS
        rows_split = prefill and mixed and split_tc and attention_decode_mma.MIXED_ROWS_SPLIT
        if tensor_cores and prefill:
            kernel = attention_prefill.paged_prefill_mma(nh, nkv, d, target, skip_single=rows_split)
            name = "attn_prefill_mixed" if rows_split else "attn_prefill"
        elif split_tc:
            kernel, name = attention_decode_mma.paged_decode_mma(nh, nkv, d, target), "attn_decode"
        else:
            kernel, name = attention.paged_attention(nh, nkv, d, self.dtype, target), "attn_paged"
        # every kernel reads the output gate from proj and applies it where it stores o
        args = [q, indptr, slots, positions, kv.page_table, k_pool, v_pool, layer, proj]
        out = op.tensor_ir_op(
            kernel,
            name,
            args,
            out=[
                Tensor.placeholder((n_tok, nh, d), self.dtype),
                Tensor.placeholder((attention.SPLIT_BUDGET, nh, d), F32),
                Tensor.placeholder((attention.SPLIT_BUDGET, nh, 2), F32),
            ],
        )
        if rows_split:  # the one-token sequences' rows of o, through the workspaces, in place
            ragged = attention_decode_mma.paged_decode_mma(nh, nkv, d, target, ragged=True)
            out = op.tensor_ir_inplace_op(
                ragged, "attn_decode_ragged", [*args, *out], inplace_indices=[9, 10, 11],
                out=list(out),
            )  # fmt: skip
        o = out[0]
        return self.o_proj(op.reshape(o, (n_tok, nh * d))), KVCache(k_pool, v_pool, kv.page_table)


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
        state: GDNState,
        chunked: bool,
        wide: bool = False,
        mixed: bool = True,
    ) -> tuple[Tensor, GDNState]:
        """`chunked` picks the chunkwise-parallel delta rule (prefill) over the recurrent one
        (decode); both read and update the same state. `wide`: decode_wide's step, whose
        recurrent kernel takes gdn_decode.WIDE_LAYOUT. `mixed=False`: a prefill whose one-token
        sequences (if any) the two passes take too, with no launch of decode's kernel."""
        cfg = self.cfg
        n_tok = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        layer = tirx.IntImm("int32", self.gdn_layer)
        target = Target.current()
        proj = self.in_proj(x)  # [q k v | z | b | a], read in place by the kernels below
        kernel = cfg.linear_conv_kernel_dim
        conv_pool, rec_pool, tickets = state
        conv_and_gates = [self.conv_weight, self.A_log, self.dt_bias]
        two = chunked and gdn_chunked.two_pass(
            hk, hv, dk, dv, target, self.dtype, kernel=kernel,
            skip_single=mixed and gdn_chunked.MIXED_ROWS_RECURRENT,
        )  # fmt: skip
        if chunked and two is None:  # fp32 or the CPU: q, k, v and the gates, then one kernel
            q, k, v, g, beta = op.tensor_ir_op(
                gdn_prep.gdn_input(hk, hv, dk, dv, kernel, self.dtype, target),
                "gdn_input",
                [proj, *conv_and_gates, indptr, slots, conv_pool, layer],
                out=[
                    Tensor.placeholder((n_tok, hk, dk), F32),
                    Tensor.placeholder((n_tok, hk, dk), F32),
                    Tensor.placeholder((n_tok, hv, dv), F32),
                    Tensor.placeholder((n_tok, hv), F32),
                    Tensor.placeholder((n_tok, hv), F32),
                ],
            )
            rec_pool, o = op.tensor_ir_inplace_op(
                gdn_chunked.chunked_gated_delta_rule(hk, hv, dk, dv, target),
                "gdn_delta_rule",
                [q, k, v, g, beta, indptr, slots, rec_pool, layer],
                inplace_indices=[7, -1],
                out=[rec_pool, Tensor.placeholder((n_tok, hv, dv), F32)],
            )
        elif chunked:  # bf16 on CUDA: every chunk's state-free part (from in_proj's rows) at
            # once, then the serial walk over chunks; with `skip_single`, a mixed step's decode
            # rows (one-token sequences) by decode's recurrent kernel instead, whose cost is
            # their state's (gdn_chunked.MIXED_ROWS_RECURRENT)
            beside = two.skip_single and gdn_chunked.MIXED_ROWS_BESIDE_SCAN
            first = two.skip_single and not beside  # the decode rows' kernel, then the passes
            o = Tensor.placeholder((n_tok, hv, dv), self._core_out_dtype())
            if first:  # its o, whose other rows the scan writes in place
                rec_pool, o = self._wide_rule(proj, indptr, slots, conv_pool, rec_pool, layer)
            work = op.tensor_ir_op(
                two.prep,
                two.prep.attrs["global_symbol"],
                [proj, *conv_and_gates, indptr, slots, conv_pool, layer],
                out=[Tensor.placeholder(s, d) for s, d in two.workspace(n_tok, slots.shape[0])],
            )
            rec_pool, o = op.tensor_ir_inplace_op(
                two.scan,
                two.scan.attrs["global_symbol"],
                [*work, indptr, slots, rec_pool, layer, *([o] if first else [])],
                inplace_indices=[8, 10 if first else -1],
                out=[rec_pool, o],
            )
            if beside:  # after the scan, which it runs beside (gdn_decode's ragged form)
                rec_pool, o = self._wide_rule(proj, indptr, slots, conv_pool, rec_pool, layer, o)
        elif not wide:  # one token a sequence: its conv, norms, gates and gated norm in one kernel
            rule = gdn_decode.decode_delta_rule(
                hk, hv, dk, dv, kernel, cfg.rms_norm_eps, self.dtype, target
            )
            conv_pool, rec_pool, tickets, _, o = op.tensor_ir_inplace_op(
                rule,
                rule.attrs["global_symbol"],
                [proj, *conv_and_gates, self.norm_weight, slots, conv_pool, rec_pool, tickets,
                 layer],  # fmt: skip
                inplace_indices=[6, 7, 8, -1, -1],
                out=[
                    conv_pool,
                    rec_pool,
                    tickets,
                    Tensor.placeholder((n_tok, hv, dv), F32),
                    Tensor.placeholder((n_tok, cfg.value_dim), self.dtype),
                ],
            )
            return self.out_proj(o), GDNState(conv_pool, rec_pool, tickets)
        else:  # decode_wide: the same without the gated norm (gdn_decode.decode_delta_rule)
            rec_pool, o = self._wide_rule(proj, None, slots, conv_pool, rec_pool, layer)
        # Gated RMSNorm: HF rounds the core output to the activation dtype before the norm.
        # The conv state moves here, after every kernel that reads it.
        conv_pool, o = op.tensor_ir_inplace_op(
            gdn_prep.gated_norm(hv, dv, cfg.conv_dim, kernel, cfg.rms_norm_eps, self.dtype, target,
                                o.dtype),  # fmt: skip
            "gdn_gated_norm",
            [o, proj, self.norm_weight, indptr, slots, conv_pool, layer],
            inplace_indices=[5, -1],
            out=[conv_pool, Tensor.placeholder((n_tok, cfg.value_dim), self.dtype)],
        )
        return self.out_proj(o), GDNState(conv_pool, rec_pool, tickets)


    def _core_out_dtype(self) -> str:
        """The delta rule's output o's dtype where gated_norm reads it (the fp32 chunked
        kernel's is fp32, as this gives wherever that kernel runs)."""
        cfg = self.cfg
        return gdn_chunked.core_out_dtype(
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, Target.current(), self.dtype,
        )  # fmt: skip

    def _wide_rule(self, proj, indptr, slots, conv_pool, rec_pool, layer, o=None) -> tuple:
        """(recurrent pool, o [n_tok, hv, dv]) from decode_wide's recurrent kernel, without the
        gated norm: one token a sequence, or with `indptr` a prefill's one-token sequences
        only (the ragged form), either before the two passes (which then write o's other rows)
        or, given their `o`, after them, beside the scan, writing its rows in place."""
        cfg = self.cfg
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        o_dtype = self._core_out_dtype()
        rule = gdn_decode.decode_delta_rule(
            hk, hv, dk, dv, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, self.dtype,
            Target.current(), **gdn_decode.WIDE_LAYOUT, gated=False, ragged=indptr is not None,
            beside=o is not None, o_dtype=o_dtype,
        )  # fmt: skip
        seqs = [slots] if indptr is None else [indptr, slots]
        args = [proj, self.conv_weight, self.A_log, self.dt_bias, *seqs, conv_pool, rec_pool, layer]
        fresh = o is None  # else the ragged form writes its rows of the two passes' o
        o = Tensor.placeholder((proj.shape[0], hv, dv), o_dtype) if fresh else o
        return op.tensor_ir_inplace_op(
            rule,
            rule.attrs["global_symbol"],
            args if fresh else [*args, o],
            inplace_indices=[5 + len(seqs), -1 if fresh else len(args)],
            out=[rec_pool, o],
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: str):
        self.kind = cfg.layer_types[index]
        # each feeds one projection, which holds its weight (compile/convert.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weighted=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weighted=False)
        if self.kind == FULL:
            self.self_attn = GatedAttention(cfg, cfg.full_layers.index(index), dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(index), dtype)
        self.mlp = MLP(cfg, dtype)
