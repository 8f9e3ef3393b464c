"""The instance lifecycle of §6.3 as a state machine, with a fake clock."""

import pytest

from kvsp_moq.errors import BadRecord, StaleEpoch
from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.protocol.records import InstanceStatus
from pc.lifecycle import InstanceFailed, InstanceRegistry, LifecycleSettings, StateChanged, id_matches

URL = "http://127.0.0.1:9001/"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(epoch=1, state="active", ttl_ms=60_000, **extra) -> InstanceStatus:
    data = {"instance": URL, "epoch": epoch, "state": state, "ttl_ms": ttl_ms, "batch_size": 10,
            "prefill_tokens_per_s": 1000}
    data.update(extra)
    return InstanceStatus.from_json(data)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(clock):
    return InstanceRegistry(LifecycleSettings(sleep_load_threshold=0.2, sleep_after_ms=5000),
                            clock=clock)


def test_lower_epoch_is_discarded(reg):
    assert reg.report(record(epoch=5)).state == "active"
    with pytest.raises(StaleEpoch) as e:
        reg.report(record(epoch=4, queued=9))
    assert e.value.problem == "kvsp-stale-epoch" and e.value.status == 409
    assert reg.get(URL).epoch == 5 and reg.get(URL).queued == 0


def test_restart_with_higher_epoch_fails_the_old_incarnation(reg):
    reg.report(record(epoch=5))
    reply = reg.report(record(epoch=6))
    assert InstanceFailed(URL, 5, "restarted") in reply.events
    assert reg.get(URL).epoch == 6 and reg.is_active(URL)


def test_expiry_marks_failed(reg, clock):
    reg.report(record(ttl_ms=3000))
    clock.now += 2.9
    assert reg.expire() == [] and reg.is_active(URL)
    clock.now += 0.2
    assert not reg.is_active(URL)          # not offered even before the sweep
    assert reg.active() == []
    assert reg.expire() == [InstanceFailed(URL, 1, "expired")]
    assert reg.expire() == []              # once
    assert reg.status_of(URL).state == "failed" and reg.get(URL) is None
    # The same incarnation does not come back; a restart does.
    assert reg.report(record()).state == "failed"
    assert reg.report(record(epoch=2)).state == "active"


def test_refresh_extends_expiry(reg, clock):
    reg.report(record(ttl_ms=1000))
    for _ in range(5):
        clock.now += 0.9
        reg.report(record(ttl_ms=1000))
    assert reg.expire() == [] and reg.is_active(URL)


def test_sleep_refused_until_load_stayed_low_long_enough(reg, clock):
    reg.report(record(running=1))                      # load 0.1 < 0.2: quiet from now
    clock.now += 4.0
    assert reg.report(record(requested_state="sleeping")).state == "active"
    clock.now += 1.5
    reply = reg.report(record(requested_state="sleeping"))
    assert reply.state == "draining"
    assert StateChanged(URL, 1, "active", "draining") in reply.events
    assert not reg.is_active(URL)


def test_busy_period_restarts_the_quiet_clock(reg, clock):
    reg.report(record())
    clock.now += 4.0
    reg.report(record(running=5))                      # load 0.5: busy
    clock.now += 2.0
    assert reg.report(record(requested_state="sleeping")).state == "active"
    clock.now += 5.0
    assert reg.report(record(requested_state="sleeping")).state == "draining"


def test_draining_to_sleeping_to_active_only_on_pc_word(reg, clock):
    reg.report(record())
    reg.set_state(URL, "draining")
    assert reg.report(record(state="draining", running=2)).state == "draining"
    assert reg.report(record(state="sleeping", running=1)).state == "draining"  # still busy
    assert reg.report(record(state="sleeping", running=0)).state == "sleeping"
    # A sleeping instance does not wake up by itself.
    assert reg.report(record(state="active")).state == "sleeping"
    assert not reg.is_active(URL)
    change = reg.set_state(URL, "active")
    assert change == StateChanged(URL, 1, "sleeping", "active", by_pc=True)
    assert reg.report(record()).state == "active" and reg.is_active(URL)


def test_set_state_refusals(reg, clock):
    reg.report(record(ttl_ms=10))
    with pytest.raises(BadRecord):
        reg.set_state(URL, "failed")
    clock.now += 1
    reg.expire()
    with pytest.raises(BadRecord):
        reg.set_state(URL, "active")


def test_directory_get_and_ids(reg):
    assert reg.get(URL) is None
    reg.report(InstanceStatus.from_json({"instance": URL[:-1], "epoch": 1, "state": "active",
                                         "ttl_ms": 100}))
    assert reg.get(URL).instance == URL and reg.get(URL[:-1]) is not None
    assert len(instance_id(URL)) == 32 and instance_id(URL) == instance_id(URL[:-1])
    assert id_matches(instance_id(URL), URL)
    assert id_matches("http%3A%2F%2F127.0.0.1%3A9001%2F", URL)
    assert not id_matches(instance_id("http://other/"), URL)
    assert reg.find_by_id(instance_id(URL)).instance == URL
