"""What the family builders share: the weight dtype choice and how frozen parts are cast."""

from __future__ import annotations

from typing import Any, Literal

WeightsDtype = Literal["fp32", "bf16"]


def cast_to_bf16(weights_dtype: WeightsDtype, *modules: Any) -> None:
    """Casts `modules` to bfloat16 when `weights_dtype` asks for it (halves the files of a
    full-size preset); the VAEs are left out by the callers, as the families publish them fp32."""
    if weights_dtype == "bf16":
        import torch

        for module in modules:
            module.to(torch.bfloat16)
