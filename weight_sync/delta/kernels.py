"""Fused compare kernels (numba) for deltas: fp32 master weights pushed as bf16, and any 2- or
4-byte tensor pushed in its own dtype (bf16, fp16, fp32 weights).

Comparing in NumPy and torch takes a pass per step -- cast into a scratch, compare into a mask,
count the mask, find its indices (``np.flatnonzero``: ~1 ns an element, branchy), gather the
values, scatter them into the copy -- so a scan of GPT-2 small (124M elements) took ~0.17 s on 2
threads where reading its bytes once takes ~0.05 s. Here each is one pass over the trainer's
bits and the copy:

* ``scan`` counts the changes of a piece per span and writes each change's value and
  position, 64 elements at a time: which of them changed, as the bits of a word (a loop LLVM
  vectorises), then the first four changes written without a branch and one step per change
  after those. fp32 -> bf16: 0.35 ns an element at 4% changed, one thread of our EPYC VM (0.25
  with nothing changed, about the speed of reading the inputs), where ``np.flatnonzero`` alone
  takes ~1 ns, a branch per element 1.0-1.3 ns, and a step per change from the first 0.54: the
  loop's exit, after as good as random a number of changes, was mispredicted about once a block.
  In the tensor's own dtype, with the copy's update (``emit``), one thread of the VM of
  2026-11-27: fp32 1.3 ns an element at 10% changed against NumPy's 3.0, bf16 0.8 against 2.3;
* ``emit`` writes the blobs the scan keeps, and brings the copy up to date there;
  ``extract`` finds a blob it did not keep again, the same way, straight into the blob.

What a change is depends only on the widths of the two inputs, chosen when each kernel is
compiled (``_narrow``, ``_magnitude``): words of one width are compared bit for bit, as
``codec.differ`` does (NaN payloads and -0.0 included); fp32 bits against a bf16 copy are
rounded first, with torch's own fp32 -> bf16 (round to nearest even on the bits:
``c10::detail::round_to_nearest_even``, and the AVX2/AVX-512 ``cvtfp32_bf16``, which compute
the same for everything but NaN). So 4-byte words against a 2-byte copy mean bf16, never fp16:
the caller (``baseline.fusable``) sends nothing else this way. NaN is where torch disagrees with
itself -- its vectorised cast (contiguous tensors) writes 0xFFFF, its scalar one (0-dim or
strided) 0x7FC0 -- so the rounding kernels never decide a NaN: they return -1 on meeting one,
and the caller compares that piece the torch way. Inf, -0.0, subnormals and ties round as torch
rounds them (tested bit for bit, and checked again each time the kernels load:
``weight_sync.delta.kernel_loader``).

Importing this module compiles the kernels (``cache=True``: later processes load them from
numba's cache); ``Baseline`` does it on a thread of its own, and uses them once they are ready.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import int64, njit, types, uint16, uint32, uint64
from numba.core.typing.templates import Signature
from numba.extending import intrinsic, overload

_OPTIONS = {"nogil": True, "boundscheck": False, "error_model": "numpy", "cache": True}
_ABS = uint32(0x7FFFFFFF)
_INF = uint32(0x7F800000)
_EAGER = 4  # changes of a 64-element block written without a branch (at 4% changed: 2.6)


@intrinsic
def _lowest_bit(typingctx: object, word: types.Integer) -> tuple[Signature, Callable[..., object]]:
    """The index of the lowest set bit of a uint64, 64 where none is set (LLVM's ``cttz``,
    defined at zero: one ``tzcnt``)."""
    signature = types.uint64(types.uint64)

    def codegen(
        context: object, builder: ir.IRBuilder, sig: Signature, args: list[ir.Value]
    ) -> ir.Value:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return signature, codegen


@intrinsic
def _popcount(typingctx: object, word: types.Integer) -> tuple[Signature, Callable[..., object]]:
    """How many bits of a uint64 are set (``ctpop``: one instruction)."""
    signature = types.uint64(types.uint64)

    def codegen(
        context: object, builder: ir.IRBuilder, sig: Signature, args: list[ir.Value]
    ) -> ir.Value:
        return builder.ctpop(args[0])

    return signature, codegen


def _narrow(bits: int, held: int) -> int:
    """The trainer's word ``bits`` as the workers hold it, beside ``held`` (a word of the copy):
    itself where both have one width; fp32 bits rounded to bf16 (not a NaN: round to nearest,
    ties to even, as torch) where the copy is narrower. Only ever called jitted."""
    raise NotImplementedError("jitted only")


@overload(_narrow, jit_options=_OPTIONS)
def _narrow_typed(bits: types.Integer, held: types.Integer) -> Callable[[int, int], int]:
    # (numba takes the function returned for these types: its parameters must read as these.)
    def same(bits: types.Integer, held: types.Integer) -> int:
        return bits

    def rounded(bits: types.Integer, held: types.Integer) -> int:
        # Left as uint32 rather than made a uint16 (as a helper returning one would): so, the
        # scan runs at 0.68 ns an element against 0.77-1.0.
        return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16)

    return same if bits.bitwidth == held.bitwidth else rounded


def _magnitude(bits: int, held: int) -> int:
    """What tells a NaN among the trainer's words: fp32 bits without their sign where they are
    rounded (above inf's, a NaN), and 0 where words are compared as they are (bit for bit:
    nothing to leave undecided). Only ever called jitted."""
    raise NotImplementedError("jitted only")


@overload(_magnitude, jit_options=_OPTIONS)
def _magnitude_typed(bits: types.Integer, held: types.Integer) -> Callable[[int, int], int]:
    def none(bits: types.Integer, held: types.Integer) -> int:
        return uint32(0)

    def unsigned(bits: types.Integer, held: types.Integer) -> int:
        return bits & _ABS

    return none if bits.bitwidth == held.bitwidth else unsigned


@njit(**_OPTIONS)
def _changed_bits(x: np.ndarray, base: np.ndarray) -> tuple[int, int]:
    """Which of 64 elements changed, as the bits of a uint64 (a loop from 0 over views: LLVM
    vectorises it), and -1 if one is a NaN to leave undecided (else 0)."""
    changed = uint64(0)
    widest = uint32(0)  # the largest magnitude's bits: above inf's, a NaN
    for j in range(64):
        bits = x[j]
        widest = max(widest, _magnitude(bits, base[j]))
        changed |= uint64(_narrow(bits, base[j]) != base[j]) << uint64(j)
    return changed, -1 if widest > _INF else 0


@njit(**_OPTIONS)
def _find(
    x: np.ndarray, base: np.ndarray, values: np.ndarray, rows: np.ndarray, offset: int
) -> int:
    """The changes of ``x`` against ``base``, in order: their values as the copy holds them into
    ``values``, their positions plus ``offset`` into ``rows``, as far as those hold. Returns how
    many changed, or -1 on meeting a NaN to leave undecided. 64 elements at a time: the first
    ``_EAGER`` changes of a block without a branch, then one step per change."""
    found = 0
    room = values.size
    size = x.size
    whole = size - size % 64
    for block in range(0, size, 64):
        if block < whole:
            changed, nan = _changed_bits(x[block : block + 64], base[block : block + 64])
            if nan:
                return -1
            if changed and found + _EAGER <= room:
                # Written whether or not there are that many (slots past the last change are
                # overwritten by the next ones): no branch on how many changed.
                eager = min(int64(_popcount(changed)), _EAGER)
                for k in range(_EAGER):
                    at = block + int64(_lowest_bit(changed) & uint64(63))
                    values[found + k] = _narrow(x[at], base[at])
                    rows[found + k] = offset + at
                    changed &= changed - uint64(1)
                found += eager
        else:  # the last, short one: element by element
            changed = uint64(0)
            for j in range(size - block):
                bits = x[block + j]
                if _magnitude(bits, base[block + j]) > _INF:
                    return -1
                changed |= uint64(_narrow(bits, base[block + j]) != base[block + j]) << uint64(j)
        while changed:
            at = block + int64(_lowest_bit(changed))
            changed &= changed - uint64(1)
            if found < room:
                values[found] = _narrow(x[at], base[at])
                rows[found] = offset + at
            found += 1
    return found


# (the trainer's words, the copy's words): fp32 bits -> bf16, and each width as it is.
_WIDTHS = [("uint32", "uint16"), ("uint32", "uint32"), ("uint16", "uint16")]


@njit(
    [
        f"int64({x}[::1], {w}[::1], {w}[::1], int32[::1], int64[::1], int64, int64)"
        for x, w in _WIDTHS
    ],
    **_OPTIONS,
)
def scan(
    x: np.ndarray,
    base: np.ndarray,
    values: np.ndarray,
    rows: np.ndarray,
    counts: np.ndarray,
    span: int,
    offset: int,
) -> int:
    """The changes of ``x`` (the trainer's bits) against ``base`` (the copy's): how many in each
    ``span`` elements into ``counts``; in order, their values as the copy holds them into
    ``values`` and their positions plus ``offset`` into ``rows`` (as long as ``x``: room for
    every change). ``base`` is left as it is. Returns how many changed, or -1 on meeting a NaN
    to leave undecided (the rest then undefined)."""
    found = 0
    for s in range(counts.size):
        lo = s * span
        hi = min(lo + span, x.size)
        changed = _find(x[lo:hi], base[lo:hi], values[found:], rows[found:], offset + lo)
        if changed < 0:
            return -1
        counts[s] = changed
        found += changed
    return found


@njit(
    [f"int64({x}[::1], {w}[::1], uint16[::1], {w}[::1], int32[::1])" for x, w in _WIDTHS],
    **_OPTIONS,
)
def extract(
    x: np.ndarray, base: np.ndarray, index: np.ndarray, values: np.ndarray, rows: np.ndarray
) -> int:
    """A sparse blob of ``x`` (the trainer's bits, from a span boundary) against ``base`` (the
    copy's): each change's position modulo 2**16 into ``index``, its value into ``values``, its
    position into ``rows`` -- as far as they hold (all three the same length). Where exactly
    that many changed, ``base`` is brought up to date. Returns how many changed (the caller
    knows how many to expect), or -1 on meeting a NaN to leave undecided (``base`` untouched)."""
    found = _find(x, base, values, rows, 0)
    if found == index.size:
        for j in range(found):
            index[j] = uint16(rows[j] & 0xFFFF)
            base[rows[j]] = values[j]
    return found


@njit(
    [f"void(int32[::1], {w}[::1], {w}[::1], uint16[::1], {w}[::1])" for w in ("uint16", "uint32")],
    **_OPTIONS,
)
def emit(
    rows: np.ndarray, values: np.ndarray, base: np.ndarray, index: np.ndarray, blob: np.ndarray
) -> None:
    """A sparse blob from changes ``scan`` found (``rows`` from a span boundary of ``base``):
    positions modulo 2**16 into ``index``, values into ``blob``; and ``base`` brought up to
    date -- one loop where NumPy takes three (fancy indexing alone ~5 ns a change)."""
    for j in range(rows.size):
        index[j] = uint16(rows[j] & 0xFFFF)
        blob[j] = values[j]
        base[rows[j]] = values[j]
