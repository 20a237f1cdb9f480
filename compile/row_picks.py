"""The artifact's functions over a step's logits rows after the step: a constrained row's
masked pick or in-place mask (structured output), and a sampled row's draw
(schedules/sample_pick.py). Each runs on the logits the step left on the device and writes
its picks into the step's own pick buffers, so launched-ahead steps are fed from them."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..schedules import greedy, sample_pick
from .vocab import VocabWidths

F32 = "float32"


def pick_workspaces(n, chunks: int = greedy.CHUNKS) -> list[Tensor]:
    val, idx = greedy.workspace_shapes(n, chunks)
    return [Tensor.placeholder(val, F32), Tensor.placeholder(idx, "int32")]


class RowPicks(nn.Module):
    widths: VocabWidths

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
            out=[best_out, logprob_out, *pick_workspaces(rows.shape[0])],
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

    def sampled_pick(
        self,
        logits: Tensor,
        rows: Tensor,
        floats: Tensor,
        ints: Tensor,
        best_out: Tensor,
        logprob_out: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Logits row rows[i] drawn with floats[i] (temperature, top_p, min_p) and ints[i]
        (top_k, seed low, seed high, counter): its token and raw logprob into best_out[rows[i]]
        and logprob_out[rows[i]], in place; the other rows' picks are left as they were. No
        row may ask for top_p or min_p without top_k: those take `sampled_pick_nucleus`."""
        return self._sampled(logits, rows, floats, ints, best_out, logprob_out, False)

    def sampled_pick_nucleus(
        self,
        logits: Tensor,
        rows: Tensor,
        floats: Tensor,
        ints: Tensor,
        best_out: Tensor,
        logprob_out: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """`sampled_pick` for any rows, top_p or min_p without top_k included: five more
        kernels find those rows' peaks and nuclei first (schedules/nucleus.py)."""
        return self._sampled(logits, rows, floats, ints, best_out, logprob_out, True)

    def _sampled(self, logits, rows, floats, ints, best_out, logprob_out, nucleus_rows: bool):
        w = self.widths
        func = sample_pick.sample_pick(w.decodable, w.selection, Target.current(), nucleus_rows)
        spaces = [Tensor.placeholder(shape, dt)
                  for shape, dt in sample_pick.workspace_shapes(rows.shape[0])]  # fmt: skip
        best, logprob, *_ = op.tensor_ir_inplace_op(
            func,
            "sample_pick_nucleus" if nucleus_rows else "sample_pick",
            [logits, rows, floats, ints, best_out, logprob_out],
            inplace_indices=[4, 5] + [-1] * len(spaces),
            out=[best_out, logprob_out, *spaces],
        )
        return best, logprob
