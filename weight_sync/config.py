"""The one configuration object, validated when it is built.

Every knob lives here so that a bad value fails at construction, in the caller's frame, with a
message that says what to change -- not minutes later inside a collective on another machine.
"""

from __future__ import annotations

import difflib
import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MiB = 1 << 20
_TIMEOUTS = ("push_timeout_s", "collective_timeout_s", "rendezvous_timeout_s", "rpc_timeout_s")
_DEFAULT_RENDEZVOUS_S = 120.0
_DEFAULT_RPC_S = 120.0
HOST_BUCKET_BYTES = 32 * MiB
GPU_BUCKET_BYTES = 256 * MiB
_GPU_SMALLEST_BUCKET = 16 * MiB
_GPU_FREE_SHARE = 32  # a bucket is at most this fraction of the GPU's free memory


def auto_bucket_bytes(device_type: str, free_bytes: int | None = None) -> int:
    """``bucket_bytes='auto'`` for a trainer on a device of ``device_type``.

    On the host 32 MiB: Gloo and the shared-memory rings gain nothing from larger buckets
    (docs/performance). On a GPU a bucket costs a collective launch, or a ring round trip per
    slot, that a device copy of its bytes (a few us per MiB) does not: the colocated push of
    1 GB to 7 workers on one H100 took 0.168 s with 32 MiB buckets and 0.039 s with 256 MiB
    (docs/gpu.md). But a push holds about two buckets per process on the GPU (the trainer's
    staging, each colocated reader's receive buffers) and the trainer's ring one more: seven
    colocated readers hold some seventeen. A thirty-second of the free memory keeps that under
    about half of it; rounded down to a power of two, 16 MiB at the least.
    """
    if device_type != "cuda":
        return HOST_BUCKET_BYTES
    if free_bytes is None:  # not known here (a driver without the GPU): as if plenty
        return GPU_BUCKET_BYTES
    share = max(free_bytes // _GPU_FREE_SHARE, _GPU_SMALLEST_BUCKET)
    return min(GPU_BUCKET_BYTES, 1 << (share.bit_length() - 1))


Backend = Literal["auto", "gloo", "nccl"]
GroupMode = Literal["auto", "world", "standalone", "job"]
SameHost = Literal["shm", "group"]
DeltaMode = bool | Literal["always"]  # see SyncConfig.delta
Staging = Literal["stream", "atomic"]
CastDtype = Literal["float32", "bfloat16", "float16"]


class SyncConfig(BaseModel):
    """How a :class:`~weight_sync.WeightUpdater` moves weights. Frozen: build a new one to change it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket_bytes: int | Literal["auto"] = Field(
        "auto",
        description="Largest packed bucket in bytes. Bigger buckets mean fewer collectives, "
        "smaller ones more overlap of packing with sending; each side holds two at a time. "
        "'auto' picks by where the trainer's tensors live: 32 MiB on the host (Gloo, the "
        "rings: measured best there), and on a GPU 256 MiB, less where the GPU has little "
        "free memory (a thirty-second of it, rounded down to a power of two, 16 MiB at "
        "least): there every bucket costs a launch and a round trip that a device copy of "
        "the bytes does not. A delta push cuts what it sends into about eight buckets (at "
        "least 1 MiB each, at most this), so that relays and workers pass on and patch one "
        "while the next arrives.",
    )
    direct_min_bytes: int | Literal["auto"] | None = Field(
        "auto",
        description="Contiguous tensors at least this large skip the buckets: each is broadcast "
        "from its own storage and, where the worker's target allows, straight into it. None "
        "packs everything. 'auto' picks by where the buffers live: 1 MiB for host buffers "
        "(Gloo, the ring; measured best there: docs/performance), bucket_bytes for GPU "
        "buffers (NCCL), where packing is a cheap device copy and every extra collective costs "
        "its launch and latency: only tensors that would fill a bucket anyway go alone.",
    )
    cast_dtype: CastDtype | None = Field(
        None,
        description="Cast every float64/float32/float16/bfloat16 tensor to this dtype on the "
        "sender, while packing (e.g. fp32 master weights to 'bfloat16': half the bytes on the "
        "wire). Workers receive exactly what tensor.to(dtype) gives (NaN stays NaN; its payload "
        "bits, on which torch's own kernels differ, are not promised). fp8/fp4, integer and "
        "bool tensors are sent as they are. None sends every tensor in its own dtype.",
    )
    alignment: int = Field(
        64,
        description="Byte alignment of every tensor inside a bucket; a power of two >= 16 so "
        "that any dtype can be viewed in place on the receiver.",
    )
    backend: Backend = Field(
        "auto",
        description="Data-plane backend: 'gloo' (CPU buffers), 'nccl' (CUDA buffers) or 'auto' "
        "(NCCL when the weights are on CUDA and every worker has a GPU, else Gloo).",
    )
    same_host: SameHost = Field(
        "shm",
        description="How workers on the trainer's host receive a Gloo push: 'shm', through a "
        "shared-memory ring (one write by the trainer, one read per worker; workers elsewhere "
        "keep the group, in the same push); 'group', through the broadcast group like every "
        "other worker. NCCL pushes always use the group.",
    )
    relay: bool = Field(
        True,
        description="Members on a host other than the trainer's take a Gloo push once per "
        "host: the first of them joins the broadcast group and passes every bucket on to the "
        "others of its host through a shared-memory ring, so the payload crosses the link to "
        "that host once (Gloo's broadcast tree would send it there about log2(members) times). "
        "False: every member joins the group. NCCL pushes relay by themselves.",
    )
    group_mode: GroupMode = Field(
        "auto",
        description="'world': init_process_group + new_group (the process must have no default "
        "group); 'standalone': a group on its own store beside any existing default group; "
        "'auto': 'world' for a Gloo push when no member has a default group, else 'standalone' "
        "(always for NCCL: a standalone group is aborted without blocking the caller); 'job': "
        "new_group over the default group every member already shares (the ranks of one "
        "torchrun/mpirun job: weight_sync.launch.job_sync sets it).",
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="Address the trainer's rendezvous store listens on and workers dial. "
        "Loopback by default; name the node's address for multi-node groups.",
    )
    allow_all_interfaces: bool = Field(
        False,
        description="Must be True to listen on a wildcard address (0.0.0.0 or ::).",
    )
    interface: str | None = Field(
        None,
        description="Network interface (e.g. 'eth1') whose IPv4 address the trainer listens on "
        "instead of master_addr, resolved on the trainer's node when the group forms. For "
        "multi-node groups where the address differs per deployment but the NIC name does not.",
    )
    metrics: bool = Field(
        True,
        description="Export per-push figures through Ray's metrics API (Prometheus); see "
        "weight_sync.actors.metrics.",
    )
    # One number is enough: the timeouts a caller leaves out are derived from the ones it sets
    # (see _derive_timeouts); the defaults below are what 900 s for a push gives.
    rendezvous_timeout_s: float = Field(
        _DEFAULT_RENDEZVOUS_S,
        gt=0,
        description="Bound on forming the group (store connect + mesh setup). Default: "
        "push_timeout_s / 3, at most 120.",
    )
    collective_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound on any single collective (one bucket's broadcast). Default: "
        "push_timeout_s / 3.",
    )
    rpc_timeout_s: float = Field(
        _DEFAULT_RPC_S,
        gt=0,
        description="Bound on every control-plane Ray call that is not a transfer. Default: "
        "push_timeout_s / 3, at most 120.",
    )
    push_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Bound on one whole push, end to end (forming the group and the teardown "
        "after a failure included). Must exceed twice collective_timeout_s, so that after a "
        "frozen worker stalls a broadcast the workers waiting on it still have time to report, "
        "and the frozen one can be named. Default: 3 x collective_timeout_s if that is set, "
        "else 900.",
    )
    staging: Staging = Field(
        "stream",
        description="'stream' writes each bucket into the model as it arrives (memory: two "
        "buckets), the worker reporting no version meanwhile; 'atomic' receives the whole push "
        "into a staging area and applies it only on commit, so a worker keeps its old weights "
        "and version until every worker has the new ones. The staging area is one full copy "
        "of the push in host memory -- pinned host memory on a GPU worker, never the GPU's own "
        "(a serving engine's GPU has no room for a second model), copied to the GPU at commit "
        "on a side stream; a worker that cannot allocate it fails the push before any byte moves.",
    )
    delta: DeltaMode = Field(
        False,
        description="Keep a host copy of the weights as last pushed (the model's size, in the "
        "workers' dtype) and send, per span of 64K elements, only the elements that changed "
        "(indices and values), or the span whole where that is smaller. True: a delta only "
        "where it is faster -- never when every worker is on the trainer's host (the copy is "
        "then not even kept); across a link, whichever way the last push of each kind was "
        "faster, timed again every 16 pushes (sooner while the two are within 2x: a first "
        "timing is the worst) (PushResult.delta and delta_reason say what was "
        "chosen). 'always': a delta whenever the workers can take one. Only workers that hold "
        "exactly that copy, with every tensor writable in place, take deltas: if any does not, "
        "the push goes dense for all. Bit-exact; see weight_sync.delta.",
    )
    checksum: bool = Field(
        False,
        description="Verify a 64-bit checksum of every bucket on every worker before commit; a "
        "mismatch fails the push. Computed where the bytes are (on the GPU for NCCL, read once "
        "per push), the same on any device; costs two passes over the bytes on each side.",
    )
    check_finite: bool = Field(
        False,
        description="Refuse a push whose floating-point tensors hold NaN or Inf (checked on the "
        "trainer before anything is sent). Costs one pass over the weights.",
    )
    max_tensors: int = Field(
        1_000_000, gt=0, description="Most tensors one push may carry (bounds metadata)."
    )
    max_metadata_bytes: int = Field(
        64 * MiB, gt=0, description="Largest serialized plan a worker accepts."
    )

    def sized_for(self, device_type: str, free_bytes: int | None = None) -> SyncConfig:
        """This config with ``bucket_bytes`` settled for a trainer whose tensors live on a
        device of ``device_type`` ("cpu", "cuda") with ``free_bytes`` free (None: unknown);
        an explicit size is kept as given."""
        if self.bucket_bytes != "auto":
            return self
        return self.model_copy(update={"bucket_bytes": auto_bucket_bytes(device_type, free_bytes)})

    @property
    def sized_bucket_bytes(self) -> int:
        """``bucket_bytes`` of a config ``sized_for`` its device (what the push path holds)."""
        assert isinstance(self.bucket_bytes, int), "size the config first: sized_for"
        return self.bucket_bytes

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: object) -> object:
        """An unknown field is refused naming the closest known ones (``bucket_size`` ->
        ``bucket_bytes``) and where every field is described, not only "extra inputs"."""
        if isinstance(data, dict):
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise ValueError("; ".join(_unknown_field(str(key)) for key in unknown))
        return data

    @model_validator(mode="before")
    @classmethod
    def _derive_timeouts(cls, data: object) -> object:
        """Fill in the timeouts left out from the ones given: push_timeout_s=20 alone must not be
        refused for the default collective_timeout_s of 300, nor collective_timeout_s=600 alone
        for the default push_timeout_s of 900. Values given are never changed."""
        if not isinstance(data, dict):
            return data
        given = {key: data[key] for key in _TIMEOUTS if data.get(key) is not None}
        if not given.keys() & {"push_timeout_s", "collective_timeout_s"}:
            return data
        try:
            if "push_timeout_s" in given:
                push = float(given["push_timeout_s"])
            else:
                push = 3 * float(given["collective_timeout_s"])
        except (TypeError, ValueError):
            return data  # the fields' own validation reports it
        if push <= 0:
            return data
        derived = {
            "push_timeout_s": push,
            "collective_timeout_s": push / 3,
            "rendezvous_timeout_s": min(_DEFAULT_RENDEZVOUS_S, push / 3),
            "rpc_timeout_s": min(_DEFAULT_RPC_S, push / 3),
        }
        return {**data, **{key: value for key, value in derived.items() if key not in given}}

    @field_validator("alignment")
    @classmethod
    def _alignment_is_power_of_two(cls, value: int) -> int:
        if value < 16 or value & (value - 1):
            raise ValueError(f"alignment must be a power of two >= 16 (got {value}); try 64")
        return value

    @field_validator("direct_min_bytes")
    @classmethod
    def _direct_positive(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"direct_min_bytes must be >= 1, 'auto' or None (got {value})")
        return value

    @field_validator("master_addr")
    @classmethod
    def _addr_is_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("master_addr must name a host or IP address, e.g. '127.0.0.1'")
        return value.strip()

    @field_validator("interface")
    @classmethod
    def _interface_name(cls, value: str | None) -> str | None:
        if value is not None and not (
            0 < len(value) < 16 and "/" not in value and value.isprintable() and " " not in value
        ):
            raise ValueError(
                f"interface must be a network interface name such as 'eth0', got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> SyncConfig:
        if self.bucket_bytes != "auto" and self.bucket_bytes < self.alignment:
            raise ValueError(
                f"bucket_bytes ({self.bucket_bytes}) must be at least alignment "
                f"({self.alignment}) bytes, or 'auto' (the default: 32 MiB on the host, up to "
                "256 MiB on a GPU)"
            )
        if self.push_timeout_s <= 2 * self.collective_timeout_s:
            raise ValueError(
                f"push_timeout_s ({self.push_timeout_s}) must exceed 2 x collective_timeout_s "
                f"({self.collective_timeout_s}): raise push_timeout_s or lower "
                "collective_timeout_s"
            )
        if _is_wildcard(self.master_addr) and not self.allow_all_interfaces:
            raise ValueError(
                f"master_addr={self.master_addr!r} listens on every interface; name one "
                "address, or pass allow_all_interfaces=True if that is really meant"
            )
        return self


def _unknown_field(key: str) -> str:
    fields = list(SyncConfig.model_fields)
    close = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(name) for name in close)}? " if close else ""
    return (
        f"SyncConfig has no field {key!r}: {hint}its fields are {', '.join(fields)} "
        "(each described in docs/api.md, 'SyncConfig')"
    )


def _is_wildcard(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_unspecified
    except ValueError:
        return False
