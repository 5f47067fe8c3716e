"""The one clock of timelines (shardwise.dist.clock) on a fake device whose queue runs behind the host, so the
GPU branch -- CUDA events read once after the step -- is exercised on a CPU:

* a kernel launched in a millisecond that runs two seconds measures two seconds on the event clock (the host
  clock measures the launch);
* the event clock's seconds are on the host's scale (where the device reached each stamp) and cost one wait,
  however many stamps;
* a pipeline rank's timeline (Recorder), its bubble, and the context-parallel attention seconds read the device's
  time through it.
"""

from __future__ import annotations

import pytest

from shardwise.dist.clock import EventClock, HostClock, clock_for
from shardwise.parallel.pipeline.timeline import Recorder, bubble_fraction


class FakeDevice:
    """A device with one queue: work launched by the host runs after the work before it. Device time 0 is host
    time ``origin``; every launch costs the host ``launch_s``."""

    def __init__(self, origin: float = 100.0, launch_s: float = 1e-3):
        self.host_now, self.origin, self.launch_s = origin, origin, launch_s
        self.queue_end = 0.0  # device time at which the queued work is done
        self.waits = 0

    def launch(self, seconds: float) -> None:
        self.host_now += self.launch_s
        self.queue_end = max(self.queue_end, self.host_now - self.origin) + seconds

    def host(self) -> float:
        return self.host_now

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """``torch.cuda.Event``'s interface: stamped with the device time the queue reaches it."""

    def __init__(self, device: FakeDevice):
        self.device, self.time = device, None

    def record(self) -> None:
        d = self.device
        self.time = max(d.queue_end, d.host_now - d.origin)

    def synchronize(self) -> None:
        d = self.device
        d.waits += 1
        d.host_now = max(d.host_now, d.origin + self.time)

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1000.0  # milliseconds, as CUDA's


def test_the_event_clock_times_the_work_and_the_host_clock_the_launch():
    dev = FakeDevice(launch_s=0.0)
    events = EventClock(event=dev.event, host=dev.host)
    host = HostClock()
    start, t0 = events.stamp(), host.stamp()
    dev.launch(2.0)
    end, t1 = events.stamp(), host.stamp()
    assert events.elapsed(start, end) == pytest.approx(2.0)
    assert host.elapsed(t0, t1) < 0.5  # the host returned long before the device finished


def test_event_seconds_are_host_times_where_the_device_reached_them_with_one_wait():
    dev = FakeDevice(origin=100.0)
    clock = EventClock(event=dev.event, host=dev.host)
    stamps = []
    for seconds in (0.5, 1.5, 0.25):
        stamps.append(clock.stamp())
        dev.launch(seconds)
    stamps.append(clock.stamp())
    assert dev.waits == 0, "stamping waits for nothing"
    got = clock.seconds(stamps)
    assert dev.waits == 1, "read once after the step"
    expected = [100.0 + s.time for s in stamps]  # device time t is host time origin + t
    assert got == pytest.approx(expected)
    assert [b - a for a, b in zip(got, got[1:], strict=False)] == pytest.approx([0.5 + 1e-3, 1.5, 0.25], abs=1e-9)
    assert clock.seconds([]) == [] and dev.waits == 1


def test_a_pipeline_timeline_and_its_bubble_on_the_device_clock():
    """Two ranks on one fake device each (sharing a host clock origin): rank 0 computes F (1 s) then B (2 s);
    rank 1 waits 1 s (device idle), then F (1 s) and B (2 s). Launches take a millisecond, so only the device clock
    sees where the time goes: busy 6 s of 2 x 4 s."""
    timelines = []
    for rank, idle in ((0, 0.0), (1, 1.0)):
        dev = FakeDevice(origin=10.0, launch_s=0.0)
        rec = Recorder(rank, EventClock(event=dev.event, host=dev.host))
        rec.start = rec.now()
        if idle:
            dev.host_now += idle  # the host waits for a message: nothing queued
        for kind, seconds in (("F", 1.0), ("B", 2.0)):
            with rec.record(kind, rank, 0):
                dev.launch(seconds)
        dev.host_now = max(dev.host_now, 10.0 + 4.0)
        rec.end = rec.now()
        timelines.append(rec.timeline())
    assert [e.kind for e in timelines[1].events] == ["F", "B"]
    assert [(e.start, e.end) for e in timelines[1].events] == [pytest.approx((11.0, 12.0)), pytest.approx((12.0, 14.0))]
    assert [t.busy() for t in timelines] == pytest.approx([3.0, 3.0])
    assert bubble_fraction(timelines) == pytest.approx(1 - 6.0 / 8.0)


def test_context_attention_seconds_come_from_the_device_clock():
    from shardwise.parallel.context.core import ContextAttention
    from shardwise.parallel.context.layout import SequenceLayout

    dev = FakeDevice()
    core = ContextAttention("ring", SequenceLayout(2, 0), None, [0, 1])
    core._clock = EventClock(event=dev.event, host=dev.host)
    for seconds in (0.75, 1.25):
        with core.timed(None):
            dev.launch(seconds)
    assert dev.waits == 0
    assert core.pop_seconds() == pytest.approx(2.0 + 1e-3)
    assert dev.waits == 1 and core.pop_seconds() == 0.0


def test_durations_read_after_the_step_wait_for_nothing_new():
    """The attention seconds are read one step late: the one wait is for the step's own last stamp (done by then),
    not for a new event behind the next step's queued work."""
    dev = FakeDevice()
    clock = EventClock(event=dev.event, host=dev.host)
    pairs = []
    for seconds in (0.5, 1.5):
        start = clock.stamp()
        dev.launch(seconds)
        pairs.append((start, clock.stamp()))
    dev.launch(30.0)  # the next step's work, queued behind
    assert clock.durations(pairs) == pytest.approx([0.5 + 1e-3, 1.5])
    assert dev.waits == 1 and dev.host_now == pytest.approx(dev.origin + 2.0 + 1e-3)  # not behind the 30 s
    assert HostClock().durations([(1.0, 1.25), (2.0, 4.0)]) == [0.25, 2.0]


def test_each_device_gets_its_clock():
    assert isinstance(clock_for("cpu"), HostClock) and isinstance(clock_for(None), HostClock)
    assert isinstance(clock_for("cuda:1"), EventClock)
