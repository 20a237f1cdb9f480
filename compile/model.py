"""Qwen3.5's language model in TVM Relax (`relax.frontend.nn`): the blocks of compile/layers.py
stacked under the embedding, the final norm and the logits head, with the functions the
artifact exports (prefill, decode, decode_wide, the constrained pick and mask, the pools;
their argument shapes are compile/exports.py's).

The full-attention layers keep K/V in our own paged cache (schedules/kv_cache.py): two page
pools and a page table, all plain tensors, so a decode step can be one CUDA graph.
"""

from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..schedules import (
    embedding,
    gdn,
    gdn_decode,
    greedy,
    kv_cache,
    logits,
)
from ..schedules.pick_triples import pick_chunks
from .config import FULL, ModelConfig
from .layers import DecoderLayer, GDNState, KVCache, RMSNorm
from .row_picks import F32, RowPicks, pick_workspaces
from .vocab import VocabWidths


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

    def forward(self, hidden: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Logits [rows, selection], into `out` when given (decode's fixed output buffer), and
        the triples of their greedy pick's first half (schedules/logits.py)."""
        weight = self._tied[0].weight if hasattr(self, "_tied") else self.weight
        rows, chunks = hidden.shape[0], pick_chunks(self._widths.selection)
        if out is not None:
            return op.tensor_ir_inplace_op(
                self._kernel, "logits", [hidden, weight, out], inplace_indices=[2, -1, -1],
                out=[out, *pick_workspaces(rows, chunks)],
            )  # fmt: skip
        return op.tensor_ir_op(
            self._kernel,
            "logits",
            [hidden, weight],
            out=[
                Tensor.placeholder((rows, self._widths.selection), F32),
                *pick_workspaces(rows, chunks),
            ],
        )


class Qwen35LM(RowPicks, nn.Module):
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
        gdn_tickets: Tensor,
    ) -> tuple[Tensor, ...]:
        """Any number of tokens of any number of sequences: logits [len(logit_positions),
        selection] at the given token positions, and each row's greedy pick, so a greedy
        request's first token costs the host 8 bytes rather than a 1 MB row and a softmax. The
        pools come back only because they are updated in place."""
        return self._prefill(
            input_ids, indptr, slots, positions, logit_positions, k_pool, v_pool, page_table,
            conv_pool, rec_pool, gdn_tickets, mixed=True,
        )  # fmt: skip

    def prefill_prompts(
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
        gdn_tickets: Tensor,
    ) -> tuple[Tensor, ...]:
        """`prefill` for steps of prompt chunks only: the chunked GDN's two passes take any
        one-token sequence themselves, so decode's GDN kernel, there for a mixed step's decode
        rows, is not launched (exported where it differs: `prompts_prefill_differs`)."""
        return self._prefill(
            input_ids, indptr, slots, positions, logit_positions, k_pool, v_pool, page_table,
            conv_pool, rec_pool, gdn_tickets, mixed=False,
        )  # fmt: skip

    def _prefill(
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
        gdn_tickets: Tensor,
        mixed: bool,
    ) -> tuple[Tensor, ...]:
        kv = KVCache(k_pool, v_pool, page_table)
        x, kv, gdn_state = self._stack(
            self.embed_tokens(input_ids), indptr, slots, positions, kv,
            GDNState(conv_pool, rec_pool, gdn_tickets), chunked=True, mixed=mixed,
        )  # fmt: skip
        hidden = self.norm(op.take(x, logit_positions, axis=0))
        logits_rows, *triples = self.lm_head(hidden)
        rows = logits_rows.shape[0]
        best, best_logprob = op.tensor_ir_op(
            greedy.greedy_pick(self.widths.decodable, self.widths.selection, Target.current()),
            "greedy_pick",
            triples,
            out=[Tensor.placeholder((rows,), "int32"), Tensor.placeholder((rows,), F32)],
        )
        return logits_rows, best, best_logprob, kv.k_pool, kv.v_pool, *gdn_state

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
        gdn_tickets: Tensor,
    ) -> tuple[Tensor, ...]:
        """One token for each of `batch` sequences: logits [batch, selection] and each row's
        greedy pick, written into the given output buffers. Compiled apart from prefill so its
        projections get GEMV schedules; every argument is a buffer the runner keeps at a fixed
        address, so the whole step is one CUDA graph per batch size. `step` [batch, 3] holds
        each row's token id, slot and position: one host-to-device copy a step."""
        return self._decode(
            step, logits_out, best_out, logprob_out, k_pool, v_pool, page_table,
            GDNState(conv_pool, rec_pool, gdn_tickets), wide=False,
        )  # fmt: skip

    def decode_wide(
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
        gdn_tickets: Tensor,
    ) -> tuple[Tensor, ...]:
        """The same step for 8-64 sequences, compiled apart: its projections get tensor-core
        tiles instead of GEMV schedules (see compile/pipeline.py), and its GDN core blocks of
        32 state rows (gdn_decode.WIDE_LAYOUT)."""
        return self._decode(
            step, logits_out, best_out, logprob_out, k_pool, v_pool, page_table,
            GDNState(conv_pool, rec_pool, gdn_tickets), wide=True,
        )  # fmt: skip

    def _decode(
        self,
        step: Tensor,
        logits_out: Tensor,
        best_out: Tensor,
        logprob_out: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        page_table: Tensor,
        gdn_state: GDNState,
        wide: bool,
    ) -> tuple[Tensor, ...]:
        batch, hidden = step.shape[0], self.cfg.hidden_size
        x, indptr, slots, positions = op.tensor_ir_op(
            embedding.decode_inputs(hidden, self.dtype, Target.current()),
            "decode_inputs",
            [step, self.embed_tokens.weight],
            out=[
                Tensor.placeholder((batch, hidden), self.dtype),
                Tensor.placeholder((batch + 1,), "int32"),
                Tensor.placeholder((batch,), "int32"),
                Tensor.placeholder((batch,), "int32"),
            ],
        )
        kv = KVCache(k_pool, v_pool, page_table)
        x, kv, gdn_state = self._stack(
            x, indptr, slots, positions, kv, gdn_state, chunked=False, wide=wide
        )
        logits_out, *triples = self.lm_head(self.norm(x), out=logits_out)
        best, best_logprob = op.tensor_ir_inplace_op(
            greedy.greedy_pick(self.widths.decodable, self.widths.selection, Target.current()),
            "greedy_pick",
            [*triples, best_out, logprob_out],
            inplace_indices=[2, 3],
            out=[best_out, logprob_out],
        )
        return logits_out, best, best_logprob, kv.k_pool, kv.v_pool, *gdn_state

    def _stack(
        self,
        x: Tensor,
        indptr: Tensor,
        slots: Tensor,
        positions: Tensor,
        kv: KVCache,
        gdn_state: GDNState,
        chunked: bool,
        wide: bool = False,
        mixed: bool = True,
    ) -> tuple[Tensor, KVCache, GDNState]:
        """The decoder layers over embeddings x: hidden states [tokens, hidden] before the norm;
        `wide` (decode_wide's step) and `mixed` as in GatedDeltaNet.forward (and
        GatedAttention.forward)."""
        for layer in self.layers:
            h = layer.input_layernorm(x)
            if layer.kind == FULL:
                h, kv = layer.self_attn(h, indptr, slots, positions, kv, chunked, mixed)
            else:
                h, gdn_state = layer.linear_attn(h, indptr, slots, gdn_state, chunked, wide, mixed)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, kv, gdn_state

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

    def feed_picks(self, step: Tensor, best: Tensor) -> Tensor:
        """The next decode step's `step` from this one's, in place: each row's pick becomes its
        token, one position on (schedules/greedy.feed_picks)."""
        return op.tensor_ir_inplace_op(
            greedy.feed_picks(Target.current()),
            "picks_to_inputs",
            [step, best],
            inplace_indices=[0],
            out=Tensor.placeholder(step.shape, "int32"),
        )

    def create_gdn_pools(self, num_slots: tirx.Var) -> tuple[Tensor, Tensor, Tensor]:
        """Zeroed conv and recurrent pools and decode's tickets (layers.GDNState)."""
        conv, rec, tickets = gdn_pool_shapes(self.cfg, num_slots)
        return op.zeros(conv, self.dtype), op.zeros(rec, F32), op.zeros(tickets, "int32")

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


def gdn_pool_shapes(cfg: ModelConfig, num_slots) -> tuple[tuple, tuple, tuple]:
    """layers.GDNState's shapes: conv pool, recurrent pool, tickets."""
    n_gdn = len(cfg.linear_layers)
    conv = (num_slots, n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    rec = (
        num_slots,
        n_gdn,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.linear_key_head_dim,
    )
    tickets = gdn_decode.tickets_shape(
        cfg.linear_num_key_heads, cfg.linear_num_value_heads, num_slots
    )
    return conv, rec, tickets


def kv_pool_shapes(cfg: ModelConfig, num_pages, num_slots, pages_per_seq) -> tuple[tuple, tuple]:
    pool = (
        len(cfg.full_layers),
        num_pages,
        cfg.num_key_value_heads,
        kv_cache.PAGE_SIZE,
        cfg.head_dim,
    )
    return pool, (num_slots, pages_per_seq)
