"""Ledgers on hand-built event sequences: tokens balance per fragment, bytes and time add up."""

import numpy as np
import pytest

from diloco.algo import ledger as L
from diloco.algo import timeline, traffic
from diloco.algo.ledger import LedgerError


def run_tokens():
    """Two learners, two fragments; every number below is worked out in the comments."""
    led = L.token_ledger(2)
    for _ in range(3):
        led = L.process(led, 0, 0, 100)  # L0: pending (300, 300)
    for _ in range(2):
        led = L.process(led, 1, 0, 50)  # L1: pending (100, 100)
    led = L.send(led, 0, 0, fragment=0, seq=0)  # (0,0,0) carries 300 tokens of fragment 0
    led = L.process(led, 0, 0, 100)  # L0: pending (100, 400): steps inside the overlap window
    led = L.merge(led, [(0, 0, 0)])  # merged (300, 0)
    led = L.apply(led, 0, 0, fragment=0)  # the 100 overlap tokens are overwritten for fragment 0
    led = L.send(led, 1, 0, fragment=1, seq=0)  # (1,0,0) carries 100 of fragment 1
    led = L.resolve(led, (1, 0, 0), "stale")
    led = L.send(led, 0, 0, fragment=1, seq=1)  # (0,0,1) carries 400 of fragment 1
    led = L.process(led, 0, 0, 100)  # L0: pending (100, 100), never sent:
    led = L.die(led, 0, 0)  # lost (100, 100); (0,0,1) is still in flight
    return led


def test_token_ledger_balances_through_a_run():
    led = run_tokens()
    assert led.processed == (600, 600)
    assert led.merged == (300, 0)
    assert led.dropped == {"overwritten": (100, 0), "stale": (0, 100)}
    assert led.lost == (100, 100)
    assert L.outstanding(led) == (100, 400)  # L1's unsent (100, 0) + message (0,0,1)'s (0, 400)
    assert L.imbalance(led) == (0, 0) and L.balance(led) == 0
    L.check_balance(led)

    # The dead incarnation's message arrives late and is quarantined; a duplicate adds nothing.
    led = L.resolve(led, (0, 0, 1), "quarantined:dead_incarnation")
    led = L.resolve(led, (0, 0, 0), "merged")
    assert led.unmatched == 1 and led.merged == (300, 0)
    assert led.dropped["quarantined:dead_incarnation"] == (0, 400)
    assert L.outstanding(led) == (100, 0)
    L.check_balance(led)
    totals = L.token_totals(led)
    assert totals["processed"] == 1200
    assert totals["processed"] == sum(v for k, v in totals.items() if k not in ("processed", "unmatched"))


def test_a_restarted_learner_is_a_new_incarnation():
    led = L.die(L.process(L.token_ledger(1), 0, 0, 10), 0, 0)
    with pytest.raises(LedgerError, match="dead"):
        L.process(led, 0, 0, 10)
    led = L.send(L.process(led, 0, 1, 7), 0, 1, 0, seq=0)
    led = L.resolve(led, (0, 1, 0), "lost")  # lost in transit
    assert led.lost == (17,) and L.balance(led) == 0


def test_a_replaced_contribution_carries_its_tokens_into_the_newer_one():
    led = L.token_ledger(2)
    led = L.send(L.process(led, 0, 0, 10), 0, 0, fragment=1, seq=1)  # 10 tokens, superseded
    led = L.send(L.process(led, 0, 0, 10), 0, 0, fragment=1, seq=2)  # 10 more, holds both
    led = L.resolve(led, (0, 0, 1), "carried", into=(0, 0, 2))
    assert led.in_flight == {(0, 0, 2): (1, 20)}
    led = L.merge(led, [(0, 0, 2)])
    assert led.merged == (0, 20) and L.balance(led) == 0
    # carried into a send never booked (a forged or unbooked repeat): excluded, never an error
    led = L.resolve(L.send(L.process(led, 0, 0, 1), 0, 0, fragment=0, seq=3), (0, 0, 3), "carried", into=(0, 0, 9))
    assert led.dropped["excluded"] == (21, 0) and led.in_flight == {} and L.balance(led) == 0  # 20 pending since


def test_check_raises_with_the_numbers():
    led = run_tokens()
    broken = led._replace(merged=(305, 0))
    assert L.imbalance(broken) == (-5, 0) and L.balance(broken) == 5
    with pytest.raises(LedgerError) as e:
        L.check_balance(broken)
    text = str(e.value)
    for part in ["fragment 0", "processed 600", "merged 305", "lost 100", "outstanding 100", "off by -5"]:
        assert part in text
    assert "fragment 1" not in text


def test_token_events_that_cannot_happen_fail_loudly():
    led = L.send(L.process(L.token_ledger(2), 0, 0, 5), 0, 0, 0, seq=0)
    with pytest.raises(LedgerError, match="already in flight"):
        L.send(led, 0, 0, 1, seq=0)
    with pytest.raises(LedgerError, match="outside"):
        L.send(led, 0, 0, 2, seq=1)
    with pytest.raises(LedgerError, match="drop reason"):
        L.resolve(led, (0, 0, 0), "bored")
    assert L.send(led, 0, 0, 1, seq=1).in_flight == {(0, 0, 0): (0, 5), (0, 0, 1): (1, 5)}
    assert led.in_flight == {(0, 0, 0): (0, 5)}  # the old value is untouched


def byte_events():
    led = traffic.byte_ledger()
    for t, n, d, m, p, c in [(0.0, 100, "up", 0, 0, "int4"), (0.5, 300, "up", 1, 1, "int4"),
                             (1.0, 400, "down", 0, 0, "fp32"), (1.0, 400, "down", 1, 0, "fp32"),
                             (2.5, 100, "up", 0, 1, "int4")]:
        led = traffic.add_bytes(led, t, n, d, m, p, c)
    return led


def test_byte_totals_and_rates():
    led = byte_events()
    assert traffic.byte_totals(led) == {(0, "up"): 200, (0, "down"): 400, (1, "up"): 300, (1, "down"): 400}
    assert traffic.byte_totals(led, ("codec",)) == {("int4",): 500, ("fp32",): 800}
    assert traffic.byte_totals(led, ("fragment", "direction"))[(0, "down")] == 800
    np.testing.assert_array_equal(traffic.window_rates(led, 1.0), [400, 800, 100])
    np.testing.assert_array_equal(traffic.window_rates(led, 1.0, direction="up", end=4.0), [400, 0, 100, 0])
    # The busiest second is [0.5, 1.5): 300 + 400 + 400, which no aligned window sees.
    assert traffic.peak_rate(led, 1.0) == 1100.0
    assert traffic.peak_rate(led, 1.0, direction="up") == 400.0
    assert traffic.peak_rate(led, 0.5, learner=0) == 800.0
    assert traffic.mean_rate(led, 0.0, 4.0) == 1300 / 4
    assert traffic.peak_rate(traffic.byte_ledger(), 1.0) == 0.0


def test_byte_log_spans_chunks():
    led = traffic.byte_ledger()
    for i in range(600):  # more than two chunks
        led = traffic.add_bytes(led, i / 8, 1 + i % 2, "up", i % 3, 0, "int4")
    old = led
    led = traffic.add_bytes(led, 80.0, 1000, "down", 0, 0, "fp32")
    assert len(traffic.byte_events(old)) == 600 and len(traffic.byte_events(led)) == 601
    assert traffic.byte_totals(led, ("direction",)) == {("up",): 900, ("down",): 1000}
    assert traffic.peak_rate(led, 1.0, direction="up") == 12.0  # any 8 consecutive events: 4 x 1 + 4 x 2 bytes
    with pytest.raises(LedgerError):
        traffic.add_bytes(led, 0.0, 1, "sideways", 0, 0, "int4")


def time_ledger():
    led = timeline.time_ledger()
    for m, state, a, b in [(0, "compute", 0, 4), (0, "compute", 4, 8), (0, "stall", 8, 9),
                           (0, "compute", 9, 10), (1, "compute", 0, 3), (1, "down", 3, 6),
                           (1, "restarting", 6, 7), (1, "compute", 7, 10)]:
        led = timeline.add_time(led, m, state, a, b)
    return led


def test_goodput_and_uptime():
    led = time_ledger()
    assert len(timeline.intervals(led)) == 7  # L0's two back-to-back compute intervals were coalesced
    assert timeline.seconds(led) == {
        0: {"compute": 9.0, "stall": 1.0, "down": 0.0, "restarting": 0.0, "degraded": 0.0},
        1: {"compute": 6.0, "stall": 0.0, "down": 3.0, "restarting": 1.0, "degraded": 0.0},
    }
    assert timeline.goodput(led) == 15 / 20
    assert timeline.goodput(led, 0) == 0.9 and timeline.goodput(led, 1) == 0.6
    assert timeline.uptime(led, quorum=1) == 1.0  # L0 never went down: zero global downtime at K = 1
    assert timeline.uptime(led, quorum=2) == 0.6  # both up during [0, 3) and [7, 10)
    assert timeline.uptime(led, quorum=2, start=0, end=20) == 0.3
    with pytest.raises(LedgerError, match="overlaps"):
        timeline.add_time(led, 1, "compute", 9.5, 11)


def test_summary_is_plain_numbers():
    s = L.summary(run_tokens(), byte_events(), time_ledger(), start=0.0, end=4.0, window=1.0, quorum=2)
    assert s["tokens_processed"] == 1200 and s["tokens_imbalance"] == 0
    assert s["tokens_dropped:stale"] == 100 and s["tokens_outstanding"] == 500
    assert s["bytes_up"] == 500 and s["bytes_down"] == 800
    assert s["peak_rate_down"] == 800.0 and s["mean_rate_up"] == 125.0
    assert s["goodput"] == 0.75 and s["uptime"] == 0.75  # both up in [0, 3) of [0, 4)
    assert s["learner1_down_s"] == 3.0
    assert all(isinstance(v, (int, float)) for v in s.values())


def test_training_peak_leaves_out_each_learners_final_sync():
    led = traffic.byte_ledger()
    for t in range(6):  # two learners, one 100-byte fragment every step, out of phase by half a step
        led = traffic.add_bytes(led, t, 100, "up", 0, t % 4, "int4")
        led = traffic.add_bytes(led, t + 0.5, 100, "up", 1, t % 4, "int4")
    for p in range(4):  # the final sync: every fragment at once, learner 1 a step later
        led = traffic.add_bytes(led, 6.0, 100, "up", 0, p, "int4")
        led = traffic.add_bytes(led, 7.0, 100, "up", 1, p, "int4")
    assert traffic.peak_rate(led, 1.0, direction="up") == 500.0  # learner 1's last send + learner 0's sync
    assert traffic.peak_rate(led, 1.0, skip_last=True, direction="up") == 200.0
    kept = traffic.without_last_sends(traffic.byte_events(led))
    assert len(kept) == 12 and kept["time"].max() == 5.5
    assert len(traffic.without_last_sends(traffic.byte_events(traffic.byte_ledger()))) == 0
    s = L.summary(run_tokens(), led, time_ledger(), start=0.0, end=8.0, window=1.0)
    assert s["peak_rate_up_training"] == 200.0 and s["peak_rate_up"] == 500.0


def test_records_append_in_constant_time_and_read_like_a_tuple():
    """The syncer's decision records (diloco/algo/eventlog.py Records) across chunk boundaries."""
    from diloco.algo.eventlog import Records

    recs, plain = Records(), ()
    for i in range(700):
        recs, plain = recs.add({"i": i}), plain + ({"i": i},)
    assert len(recs) == 700 and recs == plain and list(recs) == list(plain)
    assert recs[0] == {"i": 0} and recs[-1] == {"i": 699} and recs[256] == {"i": 256}
    assert recs[:-1] == plain[:-1] and recs[10:13] == plain[10:13]
    assert Records(plain) == recs and recs != plain[:-1]
    with pytest.raises(IndexError):
        recs[700]
