"""Typed wire metadata: everything that crosses the control plane.

Only plain data travels: dtype names (not torch objects), shapes, byte offsets. Each message is a
frozen pydantic model serialised to JSON, so a worker parses untrusted bytes with bounded size and
strict types instead of unpickling them. A ``SyncPlan`` checks its own geometry on construction:
a receiver that accepts a plan can be sure no segment writes outside its bucket or its tensor,
which matters because Gloo aborts the process (SIGABRT) on a short receive buffer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from functools import cached_property
from typing import Annotated, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from weight_sync.errors import SyncTimeoutError, TransportError, WeightSyncError

MAX_NAME_CHARS = 1024
MAX_DIMS = 32
MAX_SENDERS = 4096  # trainer ranks pushing at once, each over a lane of its own
NO_LANE = ""  # in ``LanePush.firsts``: the layout gives that sender no block
MAX_FIRST_CHARS = 8192  # a lane's one-step request carried in rank 0's call; longer: its store
TRAINER_RANK = 0  # the trainer is rank 0 of every sync group and the source of every broadcast
PLAN_CACHE_SIZE = 8  # plans a member keeps (by digest), most recently accepted last
# What a push's bytes mean, beyond what the metadata's schema says: bumped whenever both ends
# must change together though no field did (say, how a delta's layout is derived from its
# counts), so that a trainer and a worker of different releases refuse each other before any
# collective, instead of sizing receives differently (Gloo aborts a process whose receive is
# smaller than what is sent). 1: delta layouts in eighths (2026-11-24). 2: deltas in sections,
# a header before each (2026-11-25). 3: staged (atomic) deltas in sections too (2026-11-25).
WIRE_VERSION = 3
MAX_DELTA_SECTIONS = 64  # a delta in more sections is refused (each header is a collective)
# Codes of a vote over the group (see Transport.vote), given by the trainer and every member:
# every rank gets back the largest, so one refusal calls the push off everywhere.
VOTE_AGREED, VOTE_REFUSED = 0, 1

# Every dtype a model can hold whose bytes round-trip through a uint8 view.
_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "complex128",
    "complex64",
    "complex32",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)
}
_NAMES_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ``TypeError`` for dtypes that cannot travel as bytes."""
    try:
        return _NAMES_BY_DTYPE[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}") from None


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Hashed(_Wire):
    """A message sent whole once and named by its hash after (a plan, a layout)."""

    @cached_property
    def wire(self) -> str:
        """The message as it travels (JSON); computed once."""
        return self.model_dump_json()

    @cached_property
    def digest(self) -> str:
        """Content hash; lets a sender refer to a message the receiver already holds."""
        return hashlib.sha256(self.wire.encode()).hexdigest()


class TensorMeta(_Wire):
    """One named tensor as the receiver will see it (always contiguous)."""

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    dtype: str
    shape: tuple[int, ...] = Field(max_length=MAX_DIMS)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}")
        return value

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim < 0 for dim in value):
            raise ValueError(f"negative dimension in shape {value}")
        return value

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorMeta:
        """Describe a local tensor (as sent in ``dtype`` if given: a cast on the sender). Its
        dtype and shape are trusted, so only the name is checked here; pydantic's full
        validation is kept for metadata that arrives over the wire (it would cost ~10 us per
        tensor on every push of a model with thousands of tensors)."""
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(
                f"tensor names must be str of 1..{MAX_NAME_CHARS} characters: {name!r:.80}"
            )
        wire = dtype_name(tensor.dtype if dtype is None else dtype)
        return cls.model_construct(name=name, dtype=wire, shape=tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @cached_property
    def nbytes(self) -> int:  # cached: read per segment in the packing loops
        return math.prod(self.shape) * self.itemsize


class Segment(_Wire):
    """A run of bytes of one tensor placed inside one bucket."""

    tensor: int = Field(ge=0, description="index into SyncPlan.tensors")
    tensor_offset: int = Field(ge=0, description="byte offset inside the tensor")
    bucket_offset: int = Field(ge=0, description="byte offset inside the bucket")
    nbytes: int = Field(gt=0)


class BucketMeta(_Wire):
    """One collective. A packed bucket carries segments of several tensors in a staging buffer;
    a direct bucket is one whole tensor broadcast from (and, where possible, into) its own
    storage, with no staging copy on either side."""

    nbytes: int = Field(gt=0)
    segments: tuple[Segment, ...] = Field(min_length=1)
    direct: bool = False


class Tied(_Wire):
    """A name that shares its bytes with one of the plan's tensors (e.g. an LM head tied to the
    embedding): it travels as this entry only, and arrives as the tensor it is tied to."""

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    tensor: int = Field(ge=0, description="index into SyncPlan.tensors")


class SyncPlan(Hashed):
    """Where every byte of every tensor travels. Derived by ``planner.make_plan``."""

    alignment: int = Field(ge=1)
    tensors: tuple[TensorMeta, ...]
    buckets: tuple[BucketMeta, ...]
    tied: tuple[Tied, ...] = ()

    @model_validator(mode="after")
    def _geometry_is_sound(self) -> SyncPlan:
        names = [t.name for t in self.tensors] + [t.name for t in self.tied]
        if len(set(names)) != len(names):
            raise ValueError("plan has duplicate tensor names")
        if any(tie.tensor >= len(self.tensors) for tie in self.tied):
            raise ValueError("a tied name refers to a tensor outside the plan")
        covered = [0] * len(self.tensors)  # bytes of each tensor placed so far, in order
        for b, bucket in enumerate(self.buckets):
            end = 0
            for seg in bucket.segments:
                if seg.tensor >= len(self.tensors):
                    raise ValueError(
                        f"bucket {b}: segment names tensor {seg.tensor}, "
                        f"plan has {len(self.tensors)}"
                    )
                meta = self.tensors[seg.tensor]
                if seg.bucket_offset < end or seg.bucket_offset % self.alignment:
                    raise ValueError(
                        f"bucket {b}: segment at {seg.bucket_offset} overlaps or is misaligned"
                    )
                end = seg.bucket_offset + seg.nbytes
                if end > bucket.nbytes:
                    raise ValueError(f"bucket {b}: segment ends past the bucket")
                if seg.tensor_offset != covered[seg.tensor]:
                    raise ValueError(f"tensor {meta.name!r}: segments out of order")
                if seg.tensor_offset % meta.itemsize or seg.nbytes % meta.itemsize:
                    raise ValueError(f"tensor {meta.name!r}: split inside an element")
                covered[seg.tensor] += seg.nbytes
                if covered[seg.tensor] > meta.nbytes:
                    raise ValueError(f"tensor {meta.name!r}: segments exceed its size")
            if end != bucket.nbytes:
                raise ValueError(f"bucket {b}: declared {bucket.nbytes} bytes, segments fill {end}")
            if bucket.direct and (
                len(bucket.segments) != 1
                or bucket.nbytes != self.tensors[bucket.segments[0].tensor].nbytes
            ):
                raise ValueError(f"bucket {b}: a direct bucket must hold exactly one whole tensor")
        for meta, done in zip(self.tensors, covered, strict=True):
            if done != meta.nbytes:
                raise ValueError(f"tensor {meta.name!r}: {done} of {meta.nbytes} bytes placed")
        return self

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (alignment padding between tensors included)."""
        return sum(bucket.nbytes for bucket in self.buckets)

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of the tensors themselves."""
        return sum(meta.nbytes for meta in self.tensors)

    def metas(self) -> dict[str, TensorMeta]:
        """Every name the plan delivers, tied ones included, with what arrives under it."""
        out = {meta.name: meta for meta in self.tensors}
        for tie in self.tied:
            out[tie.name] = self.tensors[tie.tensor].model_copy(update={"name": tie.name})
        return out

    @property
    def max_packed_bytes(self) -> int:
        """Size of the staging buffers a push needs (direct buckets need none)."""
        return max((b.nbytes for b in self.buckets if not b.direct), default=0)

    @property
    def packed_buckets(self) -> int:
        return sum(not b.direct for b in self.buckets)


# ---- control-plane messages -------------------------------------------------------------------

BASE_PATTERN = r"^[0-9a-f]{16}:[0-9]{1,19}$"  # see weight_sync.delta.lineage
BackendName = Literal["gloo", "nccl"]
ModeName = Literal["world", "standalone", "job"]
StagingName = Literal["stream", "atomic"]
TransportName = Literal["group", "shm", "cuda_ipc", "relay"]


GpuUuid = Annotated[str, Field(min_length=1, max_length=64)]


class RelaySpec(_Wire):
    """The ring a member of the group opens for the other members of its host, and passes every
    broadcast on through (see ``transport.relay``): its id (the ring's socket is named after
    it), how many followers read it, and its slot size."""

    group_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    readers: int = Field(ge=1, le=4096)
    slot_bytes: int = Field(gt=0)


class GroupSpec(_Wire):
    """Everything a member needs to join the dedicated sync group.

    ``transport`` says which part of it: ``"group"``, the torch.distributed broadcast group at
    ``address:port``; ``"shm"``, the trainer's shared-memory ring on this host, or ``"cuda_ipc"``,
    the ring of CUDA buffers on the trainer's own GPU (see ``transport.cuda_ipc``), or
    ``"relay"``, the ring a member of the group opened on this host (``relay`` of that member's
    spec), each reached at the abstract Unix socket named ``address`` (port 0), with
    ``rank``/``world_size`` counted among the ring's readers (its writer is 0). Backend and mode
    are those of the push either way.
    """

    group_id: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    address: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=0, le=65535)
    transport: TransportName = "group"
    world_size: int = Field(ge=1)  # 1: the trainer alone (a one-GPU check of the group's paths)
    rank: int = Field(ge=0)
    backend: BackendName
    mode: ModeName
    rendezvous_timeout_s: float = Field(gt=0)
    collective_timeout_s: float = Field(gt=0)
    # A member of the group passing the push on to the other members of its host.
    relay: RelaySpec | None = None

    @model_validator(mode="after")
    def _rank_in_world(self) -> GroupSpec:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if (self.port == 0) != (self.transport != "group"):
            raise ValueError("a group needs a port (1..65535); a ring has none (0)")
        if self.relay is not None and (self.transport != "group" or self.backend != "gloo"):
            raise ValueError("only a member of a Gloo group relays")
        return self


class MemberInfo(_Wire):
    """What a worker tells the trainer before a group is built."""

    has_default_group: bool
    cuda: bool
    version: int | None
    highest_version: int = 0  # the highest version it was ever sent, committed or not
    hostname: str
    pid: int
    concurrent: bool = False  # declared weight_sync's concurrency groups (see remote_worker)
    # Group ranks this member takes: more than one for an engine whose several workers each
    # receive the broadcast (vLLM with tensor parallelism); it joins as ranks first..first+n-1.
    ranks: int = Field(1, ge=1, le=4096)
    # Members whose key equals the trainer's can map its shared-memory ring (see transport.shm).
    host: str | None = Field(None, max_length=256)
    # The trainer's copy of the weights this member holds bit for bit, if any (see delta.lineage).
    delta_base: str | None = Field(None, pattern=BASE_PATTERN)
    # The UUID of the GPU each of its ranks receives on (``torch.cuda.get_device_properties(i)
    # .uuid``), empty for a CPU member: members sharing a GPU with the trainer or with each other
    # are never put in one NCCL group (NCCL refuses two ranks on one device; see weight_sync.send.routes).
    gpus: tuple[GpuUuid, ...] = Field((), max_length=4096)
    # It takes a whole push in one call -- prepare, receive, commit -- agreeing with the other
    # members by votes over the group (a ``WeightSyncWorker``; see ``Receiver.push``).
    one_call: bool = False


class PrepareRequest(_Wire):
    """The one metadata message of a push: the version and the plan, or the hash of a cached plan."""

    version: int = Field(ge=1)
    wire: int = WIRE_VERSION  # the trainer's; a worker refuses any other
    plan_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    plan: SyncPlan | None = None
    staging: StagingName = "stream"
    checksum: bool = False
    partial: bool = False  # the plan covers part of the model; the rest keeps its version
    # With a baseline kept (SyncConfig.delta): the trainer's base this push is built on, the base
    # it creates, and whether it travels as a delta against the first (planned in buckets of
    # ``delta_bucket_bytes``; see weight_sync.delta).
    built_on: str | None = Field(None, pattern=BASE_PATTERN)
    new_base: str | None = Field(None, pattern=BASE_PATTERN)
    delta: bool = False
    delta_bucket_bytes: int = Field(0, ge=0)
    # A delta travels in up to this many sections of the plan, each its header then its buckets
    # (see weight_sync.delta.layout.sections); 1: one header for the whole push.
    delta_sections: int = Field(1, ge=1, le=MAX_DELTA_SECTIONS)
    # After the last byte every rank votes over the group, and each member commits in its
    # receive call once the vote says all have received: no commit round.
    commit_on_receipt: bool = False

    @model_validator(mode="after")
    def _delta_is_planned(self) -> PrepareRequest:
        if self.delta and (
            self.built_on is None or self.new_base is None or self.delta_bucket_bytes < 16
        ):
            raise ValueError("a delta push names its base, the base it makes and its bucket size")
        if self.delta_sections > 1 and not self.delta:
            raise ValueError("only a delta travels in sections")
        return self


class LaneCheck(_Wire):
    """What a member checks of a push from many senders before any byte moves: its number among
    the senders' pushes, its version, and its layout by digest -- read from rank 0's store by a
    member that lacks it, refused past ``max_metadata_bytes``."""

    push: int = Field(ge=1)
    version: int = Field(ge=1)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    max_metadata_bytes: int = Field(gt=0)


class LanePush(_Wire):
    """Rank 0's one call on a member for a push from many senders (a Ray worker, each worker of
    a vLLM engine): whose lanes to follow (the senders' stores, in sender order) as which member
    (``slot``, from 1), what it checks, how long it may wait for the lanes, and how each lane
    opens (``firsts``, by sender: ``NO_LANE`` where the layout gives that sender no block; None
    where the lane's steps are all in its sender's store; else the lane's push in one step, its
    ``PrepareRequest`` as JSON, carried here rather than posted there)."""

    endpoints: tuple[tuple[str, int], ...] = Field(min_length=1, max_length=MAX_SENDERS)
    slot: int = Field(ge=1)
    check: LaneCheck
    wait_s: float = Field(gt=0)
    firsts: tuple[Annotated[str, Field(max_length=MAX_FIRST_CHARS)] | None, ...] = Field(
        max_length=MAX_SENDERS
    )
    # The member answers rank 0's lane in this call's result (as one sender's members answer
    # their push), not in rank 0's store, where it commits that lane's push here in its one step
    # (``firsts[0]``); asked where that lane is the push's only one (the call then ends as the
    # lane does) of a member that takes pushes in one call (``MemberInfo.one_call``).
    answer: bool = False

    @model_validator(mode="after")
    def _a_first_per_sender(self) -> LanePush:
        if len(self.firsts) != len(self.endpoints):
            raise ValueError(f"{len(self.firsts)} lane openings for {len(self.endpoints)} senders")
        return self

    @classmethod
    def parse(cls, raw: str) -> LanePush:
        """A call as it arrived (JSON), its size bounded before it is parsed; a malformed one
        raises ``ValueError`` saying what is wrong (a plain one: it crosses Ray to the caller)."""
        if len(raw) > _MAX_LANE_PUSH_CHARS:
            raise ValueError(f"a lanes push of {len(raw)} characters is over the bound")
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise ValueError(malformed("lanes push", exc)) from None


def malformed(what: str, exc: ValidationError) -> str:
    """Why metadata that arrived could not be read, in one line: where its first error is."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the whole"
    return f"malformed {what} ({exc.error_count()} errors): {where}: {first['msg']}"


# Every sender's store address and first step, and a little more.
_MAX_LANE_PUSH_CHARS = (300 + MAX_FIRST_CHARS) * MAX_SENDERS


class PrepareReply(_Wire):
    accepted: bool
    need_plan: bool = False
    need_dense: bool = False  # this member cannot take the push as a delta: send it dense
    in_place: bool = False  # it writes every tensor in place: it can take deltas once on the base
    problems: tuple[str, ...] = ()


class ReceiveReport(_Wire):
    version: int
    nbytes: int
    buckets: int
    seconds: float
    checksums: tuple[int, ...] | None = None  # per bucket (checksums.checksum), when asked for


class PushReply(_Wire):
    """A member's answer to a push in one call: its verdict on the push, and what it received
    (``None`` when the push was refused, here or by another member, before any byte moved)."""

    prepared: PrepareReply
    received: ReceiveReport | None = None


Phase = Literal["idle", "prepared", "receiving", "received", "applying"]


class SyncStatus(_Wire):
    """A worker's state, answerable while a push is in flight (see ``remote_worker``)."""

    version: int | None  # committed version; None before the first push and while dirty
    # The last version whose push covered every tensor. Below ``version`` after partial
    # pushes: the tensors they did not cover are as of this version.
    full_version: int | None = None
    dirty: bool  # weights partly updated: a push failed, or a streaming push is under way
    phase: Phase
    pushing: int | None = None  # the version being received, if any
    buckets_done: int = 0
    buckets_total: int = 0
    in_group: bool = False
    last: ReceiveReport | None = None  # the last push this worker received in full
    last_error: str | None = None


# Errors a member may raise that keep their type across such a boundary.
_TYPED = {cls.__name__: cls for cls in (WeightSyncError, TransportError, SyncTimeoutError)}
_MAX_MESSAGE = 2000  # of an error's message in a reply


class WorkerReply(_Wire):
    """One member's answer to one step of a push that crossed a boundary which loses exception
    types (vLLM's ``collective_rpc``, a store): the step's result (JSON) or the error it raised,
    and the member's state after the step (so the trainer knows its version without asking)."""

    value: str | None = None
    error: str | None = None  # the exception's type name
    message: str = ""
    status: SyncStatus

    @classmethod
    def of(
        cls, step: Callable[[], str | None], status: Callable[[], SyncStatus]
    ) -> tuple[WorkerReply, Exception | None]:
        """Run ``step``: its result, or the error it raised (type name and a bounded message),
        with the member's ``status()`` after it; the error is returned too, for a caller that
        raises it again."""
        try:
            value, error = step(), None
        except Exception as exc:
            value, error = None, exc
        reply = cls(
            value=value,
            error=type(error).__name__ if error else None,
            message=str(error)[:_MAX_MESSAGE] if error else "",
            status=status(),
        )
        return reply, error

    def unwrap(self) -> str | None:
        """The result, or the error raised again (as weight_sync's type where it was one: the
        trainer tells a member that lost a collective to someone else from one at fault by it)."""
        if self.error is None:
            return self.value
        kind = _TYPED.get(self.error)
        if kind is not None:
            raise kind(self.message)
        raise WeightSyncError(f"a worker raised {self.error}: {self.message}")
