"""Benchmark workloads: pure descriptions of state dicts, built on demand in each process."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MiB = 1 << 20
Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    specs: tuple[Spec, ...]
    bucket_bytes: int | None = None  # None: the SyncConfig default
    repeats: int | None = None  # timed pushes, where the workload fixes them (a distribution)

    @property
    def nbytes(self) -> int:
        return self.nbytes_as(None)

    def nbytes_as(self, cast: torch.dtype | None) -> int:
        """Bytes of the state dict as pushed with ``SyncConfig.cast_dtype`` ``cast``: floating
        tensors in that dtype, the rest as they are."""
        return sum(
            math.prod(shape)
            * (cast.itemsize if cast is not None and dtype.is_floating_point else dtype.itemsize)
            for _, dtype, shape in self.specs
        )

    def build(self, fill: float, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Tensors of the right names, dtypes and shapes. Values do not affect transfer speed;
        ``torch.full`` keeps building a GB of them cheap on a small machine."""
        return {
            name: torch.full(shape, fill, dtype=dtype, device=device)
            for name, dtype, shape in self.specs
        }


def gpt2_small() -> Workload:
    """GPT-2 small's state dict: 148 fp32 tensors, ~498 MB."""
    d, f = 768, 3072
    specs: list[Spec] = [("wte", torch.float32, (50257, d)), ("wpe", torch.float32, (1024, d))]
    for i in range(12):
        for name, shape in [
            ("ln_1_weight", (d,)),
            ("ln_1_bias", (d,)),
            ("attn_c_attn_weight", (d, 3 * d)),
            ("attn_c_attn_bias", (3 * d,)),
            ("attn_c_proj_weight", (d, d)),
            ("attn_c_proj_bias", (d,)),
            ("ln_2_weight", (d,)),
            ("ln_2_bias", (d,)),
            ("mlp_c_fc_weight", (d, f)),
            ("mlp_c_fc_bias", (f,)),
            ("mlp_c_proj_weight", (f, d)),
            ("mlp_c_proj_bias", (d,)),
        ]:
            specs.append((f"h{i}_{name}", torch.float32, shape))
    specs += [("ln_f_weight", torch.float32, (d,)), ("ln_f_bias", torch.float32, (d,))]
    return Workload("W1", "GPT-2 small, fp32 (148 tensors)", tuple(specs))


def small_tensors(count: int = 4000, nbytes: int = 4096) -> Workload:
    specs = tuple((f"t{i}", torch.float32, (nbytes // 4,)) for i in range(count))
    return Workload("W2", f"{count} tensors of {nbytes // 1024} KB", specs)


def few_small(count: int = 64, nbytes: int = 16384) -> Workload:
    """A push dominated by fixed costs (an adapter, a small policy): its latency distribution."""
    specs = tuple((f"a{i}", torch.float32, (nbytes // 4,)) for i in range(count))
    return Workload("W5", f"{count} tensors of {nbytes // 1024} KB", specs, repeats=100)


def one_big(nbytes: int = 1 << 30) -> Workload:
    return Workload(
        "W3",
        f"one {nbytes >> 20} MiB tensor, 64 MiB buckets",
        (("weight", torch.float32, (nbytes // 4,)),),
        bucket_bytes=64 * MiB,
    )


def mixed() -> Workload:
    """A small Llama-shaped model: bf16 matrices, fp32 norms and rotary table, int64 buffers."""
    vocab, d, ff, layers = 32000, 1024, 2816, 8
    specs: list[Spec] = [("embed_tokens", torch.bfloat16, (vocab, d))]
    for i in range(layers):
        for name, shape in [
            ("q_proj", (d, d)),
            ("k_proj", (d, d)),
            ("v_proj", (d, d)),
            ("o_proj", (d, d)),
            ("gate_proj", (ff, d)),
            ("up_proj", (ff, d)),
            ("down_proj", (d, ff)),
        ]:
            specs.append((f"layers{i}_{name}", torch.bfloat16, shape))
        specs += [
            (f"layers{i}_input_norm", torch.float32, (d,)),
            (f"layers{i}_post_norm", torch.float32, (d,)),
            (f"layers{i}_rotary_inv_freq", torch.float32, (64,)),
        ]
    specs += [
        ("norm", torch.float32, (d,)),
        ("lm_head", torch.bfloat16, (vocab, d)),
        ("position_ids", torch.int64, (1, 4096)),
        ("token_counts", torch.int64, (vocab,)),
    ]
    return Workload("W4", "mixed bf16 / fp32 / int64 (Llama-shaped)", tuple(specs))


def synthetic(total_bytes: int, tensor_bytes: int = 8 * MiB) -> Workload:
    """``total_bytes`` of fp32 in tensors of ``tensor_bytes`` (for the scaling curves)."""
    count = max(1, total_bytes // tensor_bytes)
    size = min(total_bytes, tensor_bytes) // 4
    specs = tuple((f"p{i}", torch.float32, (size,)) for i in range(count))
    return Workload(f"S{total_bytes >> 20}M", f"{total_bytes >> 20} MB synthetic", specs)


WORKLOADS = {"W1": gpt2_small, "W2": small_tensors, "W3": one_big, "W4": mixed, "W5": few_small}
