"""What an SGLang engine can load, and the check of a push against it before any byte moves.

SGLang offers no way to ask a running engine which names and shapes its ``load_weights``
takes, and its models skip a name they do not know without a word (``Qwen2Model.load_weights``
keeps only names in its ``params_dict``): a misnamed tensor would be dropped while the engine
claims the new version, and a misshapen one fails half-way through a push, after earlier
buckets loaded. So the check runs on the trainer, against the checkpoint the engine was started
from: its ``*.safetensors`` headers (the names, dtypes and shapes of every tensor the engine
loaded at start, read as JSON -- no tensor data, no pickle) and its ``config.json`` (whether
the LM head is tied to the embedding, in which case SGLang skips ``lm_head.weight``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_MAX_HEADER = 100 << 20  # a safetensors header is JSON: a few KB per hundred tensors
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Checkpoint:
    """The tensors an engine loads, by name: ``(dtype name, shape)``; ``tied``: whether it
    ties its LM head to the embedding (so a pushed ``lm_head.weight`` is not sent)."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    tied: bool

    def to_json(self) -> str:
        return json.dumps(
            {"tensors": {n: [d, list(s)] for n, (d, s) in self.tensors.items()}, "tied": self.tied}
        )

    @classmethod
    def from_json(cls, text: str) -> Checkpoint:
        data = json.loads(text)
        tensors = {
            str(n): (str(d), tuple(int(x) for x in s)) for n, (d, s) in data["tensors"].items()
        }
        return cls(tensors, bool(data["tied"]))


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """The checkpoint in ``directory`` (a Hugging Face model folder of ``*.safetensors``).
    ``FileNotFoundError`` when there is none to read, ``ValueError`` for a malformed one."""
    folder = Path(directory)
    index = folder / "model.safetensors.index.json"
    if index.exists():  # the files the checkpoint is made of, not whatever else lies there
        shards = set(json.loads(index.read_text())["weight_map"].values())
        files = sorted(folder / shard for shard in shards)
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {folder}: the check of a push needs the checkpoint the engine "
            "was started from (pass checkpoint= a folder holding it)"
        )
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        tensors.update(_header(file))
    config = folder / "config.json"
    tied = False
    if config.exists():
        settings = json.loads(config.read_text())
        text = settings.get("text_config") or {}  # a vision-language model's language half
        tied = bool(settings.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return Checkpoint(tensors, tied and TIED_HEAD not in tensors)


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > _MAX_HEADER:
            raise ValueError(f"{file}: a safetensors header of {length} bytes is not believable")
        header = json.loads(handle.read(length))
    return {
        name: (_DTYPES.get(entry["dtype"], entry["dtype"]), tuple(entry["shape"]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def check_push(
    checkpoint: Checkpoint, pushed: Sequence[tuple[str, tuple[int, ...], str]]
) -> tuple[list[int], list[str]]:
    """The indices of ``pushed`` (``(name, shape, wire dtype name)``) to send -- all but a tied
    LM head -- and what the engine cannot load: every name it does not hold, every shape unlike
    its own, and a dtype other than its own where it holds a quantized or integer tensor (its
    loader would copy the values in, not quantize them)."""
    keep, problems = [], []
    for index, (name, shape, dtype) in enumerate(pushed):
        if checkpoint.tied and name == TIED_HEAD:
            continue  # SGLang ties it to the embedding, which the push carries
        held = checkpoint.tensors.get(name)
        if held is None:
            problems.append(
                f"{name}: no such tensor in the engine's checkpoint (map the "
                "trainer's names with rename= or transform=)"
            )
        elif tuple(shape) != held[1]:
            problems.append(f"{name}: pushed {list(shape)}, the engine holds {list(held[1])}")
        elif held[0] != dtype and held[0] not in _FLOATS:
            problems.append(
                f"{name}: pushed {dtype}, the engine holds {held[0]} (quantized "
                "or integer): push it in the engine's own dtype"
            )
        else:
            keep.append(index)
    return keep, problems


_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
