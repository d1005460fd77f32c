"""Deterministic state dicts that exercise every path: every dtype, 0-dim, empty, non-contiguous
views (transposed, sliced, expanded) and tensors larger than a small bucket. Values are random
bytes, so float tensors carry NaNs and infinities with arbitrary payloads: only a bit-exact
transfer reproduces them."""

from __future__ import annotations

import math
import warnings

import torch

from weight_sync.wire.metadata import DTYPES

# complex32 is in the zoo on purpose; torch warns that it is experimental whenever one is made.
warnings.filterwarnings("ignore", "ComplexHalf support is experimental")


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(
        0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen
    )
    return raw.view(dtype).view(shape)


def zoo(seed: int, big: int = 3000) -> dict[str, torch.Tensor]:
    """Names are valid nn.Module buffer names (no dots)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dtype in DTYPES.items():
        out[f"{name}_matrix"] = random_tensor((7, 13), dtype, gen)
    out["float32_scalar"] = random_tensor((), torch.float32, gen)
    out["int64_scalar"] = random_tensor((), torch.int64, gen)
    out["bool_scalar"] = random_tensor((), torch.bool, gen)
    out["float32_empty"] = torch.empty(0, 5)
    out["bfloat16_empty"] = torch.empty(3, 0, dtype=torch.bfloat16)
    out["float32_transposed"] = random_tensor((24, 40), torch.float32, gen).t()
    out["float16_sliced"] = random_tensor((40, 40), torch.float16, gen)[::3, 5:30]
    out["float32_expanded"] = random_tensor((1, 17), torch.float32, gen).expand(9, 17)
    out["float32_big"] = random_tensor((big,), torch.float32, gen)
    out["bfloat16_big_transposed"] = random_tensor((big // 20, 41), torch.bfloat16, gen).t()
    out["uint8_odd"] = random_tensor((big + 3,), torch.uint8, gen)
    return out


def contiguous_copy(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.contiguous().clone() for name, tensor in state_dict.items()}


class BufferModel(torch.nn.Module):
    """A module whose state dict is exactly ``tensors`` (as buffers), so the default
    ``load_weights`` can land every dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in contiguous_copy(tensors).items():
            self.register_buffer(name, tensor)
