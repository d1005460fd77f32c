"""Dense or delta, push by push: a delta only where it is the faster way to the members.

A delta trades the trainer's scan (reading the weights and the baseline, at memory speed at
best) for bytes on the wire. Where the bytes are cheap -- every member on the trainer's host,
reading its shared-memory ring -- the scan costs about what it saves, or more, so the push goes
dense and no baseline is kept at all. Where a member is across a link, which way wins depends
on the link's rate, the update's density and the trainer's cores, none of which the trainer
knows in advance; so it measures: the first push is dense (there is no base yet), the next a
delta, and from then on each push takes the way whose last push of that kind took fewer seconds
per payload byte, trying the other way again every ``RETRY`` pushes (the density of an RL update
drifts with the learning rate's schedule).

Where the two were within ``CLEAR`` of each other, the first retry comes after ``FIRST_RETRY``
pushes, then twice as many each time the verdict stands: a way's first timing is its worst (its
buffers are new, the first steps of a run change more), and a close verdict from it should not
stand for ``RETRY`` pushes -- while a clear one (a delta 7x faster over 1 Gbit/s) is not worth a
slow push to check early. A verdict is a push the slower way, or one that reversed the order; a
retried delta that went dense (a worker lacked the base) is none, and is retried next push.

Pure: no clocks, no I/O; the pusher reports what each push cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from weight_sync.config import DeltaMode

RETRY = 16  # pushes the faster way before the slower is timed again
FIRST_RETRY = 2  # ...after a close verdict, doubling while it stands
CLEAR = 2.0  # a verdict is close below this ratio of the two costs


@dataclass(frozen=True)
class Choice:
    """How the next push goes, and why (``PushResult.delta_reason``)."""

    delta: bool
    reason: str
    keep_baseline: bool  # a dense push still brings the baseline up to date (a delta may follow)


class DeltaChoice:
    """The choice for one updater's pushes under ``SyncConfig.delta`` (``mode``)."""

    def __init__(self, mode: DeltaMode) -> None:
        self._mode = mode
        self._cost: dict[bool, float] = {}  # seconds per payload byte of the last push each way
        self._streak = 0  # pushes in a row that went the faster way
        self._retry = FIRST_RETRY  # after how many of those the slower way is timed again
        self._clear = False  # whether the last verdict was clear

    def choose(self, far: bool) -> Choice:
        """``far``: some member receives across a network link (not from the trainer's host)."""
        if not self._mode:
            return Choice(False, "delta off", keep_baseline=False)
        if self._mode == "always":
            return Choice(True, "delta='always'", keep_baseline=True)
        if not far:
            return Choice(
                False,
                "every member reads the trainer's host memory: dense is as fast",
                keep_baseline=False,
            )
        dense, delta = self._cost.get(False), self._cost.get(True)
        if dense is None:
            return Choice(False, "timing a dense push", keep_baseline=True)
        if delta is None:
            return Choice(True, "timing a delta push", keep_baseline=True)
        faster = delta < dense
        if self._streak >= self._retry:
            return Choice(
                not faster,
                f"timing a {'dense' if faster else 'delta'} push again after {self._retry}",
                keep_baseline=True,
            )
        ratio = max(dense, delta) / max(min(dense, delta), 1e-18)
        return Choice(
            faster,
            f"{'delta' if faster else 'dense'} was {ratio:.1f}x faster when last timed",
            keep_baseline=True,
        )

    def record(self, choice: Choice, seconds: float, payload_bytes: int) -> None:
        """What a push that went as ``choice`` cost: its transfer's ``seconds`` for
        ``payload_bytes`` of tensors (a delta push's payload is what it brought up to date,
        not what crossed the wire)."""
        if self._mode is not True or not choice.keep_baseline or payload_bytes <= 0:
            return
        was_faster = min(self._cost, key=self._cost.__getitem__) if self._cost else None
        first = choice.delta not in self._cost  # this way's first timing since ``forget``
        self._cost[choice.delta] = seconds / payload_bytes
        faster = min(self._cost, key=self._cost.__getitem__)
        if was_faster is None:  # the first push timed: nothing to compare yet
            return
        if choice.delta != was_faster or faster != was_faster:  # a verdict: when to time again
            ratio = max(self._cost.values()) / max(min(self._cost.values()), 1e-18)
            if ratio >= CLEAR:
                self._retry = RETRY
            elif first or faster != was_faster or self._clear:
                self._retry = FIRST_RETRY  # a new verdict, or one newly close
            else:
                self._retry = min(2 * self._retry, RETRY)
            self._clear = ratio >= CLEAR
            self._streak = 0
        else:  # counting pushes that went the faster way (one that went dense instead of a
            self._streak += 1  # retried delta, because a worker lacked the base, among them)

    def forget(self) -> None:
        """A new group whose members are reached another way (across a link now, or no longer):
        what was timed no longer holds."""
        self._cost.clear()
        self._streak = 0
        self._retry = FIRST_RETRY
        self._clear = False
