"""The target's LM head: its output matrix and the forms its logits are multiplied in."""

from __future__ import annotations

import torch

from dspark.errors import DSparkError
from dspark.products import Float16Weight, Int8Weight, PackedWeight, RescoredHead, float16_available, linear


class LMHead:
    """Hidden states to float32 logits. `model_form` is the matrix in the model's precision, as a decoder step
    multiplies it: plain, packed (oneDNN), int8, or a compiled target's rescored 4-bit head; FBGEMM's float16 copy
    (`use_float16`) is multiplied instead while it is on, and switching it off returns to whatever `model_form` is
    then. Soft-capped where the model caps its logits (Gemma 2). A row's logits never depend on the rows beside it."""

    def __init__(self, weight: torch.Tensor, min_rows: int = 1, softcap: float | None = None):
        self.weight = weight  # the model's parameter: training, export and the drafter read it
        self.min_rows = min_rows  # the decoder's (products.MIN_ROWS_FLOAT32 where float32 is batch-invariant)
        self.softcap = softcap
        self.model_form: torch.Tensor | PackedWeight | Int8Weight | RescoredHead = weight
        self.float16: Float16Weight | None = None

    @property
    def form(self):
        """The form logits are multiplied by now."""
        return self.model_form if self.float16 is None else self.float16

    @property
    def form_name(self) -> str:
        """ "float16" while FBGEMM's float16 copy runs, else "model"."""
        return "model" if self.float16 is None else "float16"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.float16 is not None:
            hidden = hidden.float()  # its float32 sums, not rounded back to the activations' precision
        logits = linear(hidden, self.form, None, self.min_rows).float()
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap

    def use_packed(self, packed: bool) -> None:
        self.model_form = PackedWeight(self.weight.data) if packed else self.weight

    def use_int8(self) -> None:
        self.model_form = Int8Weight(self.weight.data)

    def use_rescored(self) -> None:
        """4-bit scores for every token, the best 64 scored again exactly (products.RescoredHead). One row reads the
        head in ~1.4 instead of ~3 ms (49,152 x 576, 2 threads); from ~8 rows on it costs more than the bfloat16
        head, so only a compiled target, which never batches, takes it."""
        self.model_form = RescoredHead(self.weight.data)

    def float16_possible(self) -> bool:
        """A bfloat16 head on a CPU with FBGEMM, multiplied in the model's precision (not int8, not rescored)."""
        return (
            self.weight.device.type == "cpu"
            and float16_available()
            and self.weight.dtype == torch.bfloat16
            and not isinstance(self.model_form, (Int8Weight, RescoredHead))
        )

    def use_float16(self, on: bool) -> None:
        """FBGEMM's float16 weights with float32 sums and float32 logits (products.Float16Weight), or back to
        `model_form`. The weights convert exactly (but for entries below 2^-14). Where bfloat16 is emulated it reads
        the head several times faster at a verify's rows (autotune.choose_head_form measures it); a row's logits
        still do not depend on the rows beside it."""
        if on and self.float16 is None:
            if not self.float16_possible():
                raise DSparkError("a float16 LM head needs a bfloat16 head on a CPU with FBGEMM, not compiled")
            self.float16 = Float16Weight(self.weight.data)
        elif not on:
            self.float16 = None
