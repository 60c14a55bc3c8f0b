"""Refused frames are bounded (docs/design.md#damage-in-the-store): however many a sender makes,
the syncer state and its checkpoint meta keep exact counts per reason and learner and only the
latest eventlog.RING records; run.log_refusals writes every one to the run's metrics."""

import json

from diloco.algo import eventlog
from diloco.algo import syncer as sync
from diloco.runtime.syncer_ckpt import from_checkpoint, to_checkpoint
from syncer_frames import FRAGS, THETA0, frame, policy, shifted, start


def _refuse_many(pol, st, n: int, t0: float = 0.0):
    """n refusals: junk (unattributed, bad_magic) and learner 7's frames (unknown_learner), in turn."""
    local = shifted(THETA0[0], 0.5)
    for i in range(n):
        bad = b"junk" * (i % 5 + 1) if i % 2 else frame(local, THETA0[0], learner=7, seq=i + 1)
        st, _ = sync.on_contribution(pol, st, bad, t0 + i)
    return st


def _meta_bytes(st) -> int:
    return len(json.dumps(to_checkpoint(st)[1]).encode())


def test_many_refusals_keep_state_and_checkpoint_meta_bounded():
    pol = policy(K=2)
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0, seq=1), 0.0)
    admitted = len(st.decisions)
    few = _refuse_many(pol, st, 2 * eventlog.RING)
    many = _refuse_many(pol, few, 4000, t0=1e4)
    # counts exact, per reason and per learner (None: the frame named no one)
    n = 2 * eventlog.RING + 4000
    assert many.refusals.total == n and sum(many.quarantined.values()) == n
    assert many.refusals.counts == {("bad_magic", None): n // 2, ("unknown_learner", 7): n // 2}
    assert many.quarantined == {"bad_magic": n // 2, "unknown_learner": n // 2}
    # the records: admissions kept, refusals only the latest RING, newest last
    assert len(many.decisions) == admitted and len(many.refusals.latest) == eventlog.RING
    assert [r["at"] for r in many.refusals.latest] == [1e4 + i for i in range(4000 - eventlog.RING, 4000)]
    assert many.refusals.latest[-1]["reason"] == "bad_magic" and many.refusals.latest[-2]["key"] == [7, 0, 3999]
    # the checkpoint meta stays the size it had after 128 refusals (only the digits of counts and
    # times grow); kept, the 4,000 more records would add about 400 kB
    assert _meta_bytes(many) - _meta_bytes(few) < 1000, (_meta_bytes(few), _meta_bytes(many))
    arrays, meta = to_checkpoint(many)
    back = from_checkpoint(arrays, json.loads(json.dumps(meta)), pol, FRAGS)
    assert back.refusals.counts == many.refusals.counts and back.refusals.total == n
    assert list(back.refusals.latest) == json.loads(json.dumps(list(many.refusals.latest)))


def test_newest_gives_the_refusals_after_those_seen():
    r = eventlog.Refusals()
    for i in range(eventlog.RING + 10):
        r = eventlog.refuse(r, {"at": i}, "bad_magic", None)
    assert [x["at"] for x in eventlog.newest(r, r.total - 3)] == [r.total - 3, r.total - 2, r.total - 1]
    assert eventlog.newest(r, r.total) == ()
    assert len(eventlog.newest(r, 0)) == eventlog.RING  # more than the ring holds: the latest RING


def _host(pol, log_refusals):
    from diloco.runtime.build import Setup
    from diloco.runtime.host import SyncerHost

    written = []
    host = SyncerHost(Setup(FRAGS, pol, None, (), THETA0), {0: 0, 1: 0}, on_merge=written.append,
                      log_refusals=log_refusals)
    return host, written


def test_log_refusals_writes_every_refusal_to_the_runs_metrics():
    from diloco.algo.replay import Input

    pol = policy(K=2)
    host, written = _host(pol, log_refusals=True)
    n = eventlog.RING + 5
    for i in range(n):
        host.deliver(Input("contribution", float(i), b"junk"))
    assert [r["kind"] for r in written] == ["refusal"] * n  # more than the state keeps
    assert [r["time"] for r in written] == [float(i) for i in range(n)] and written[0]["reason"] == "bad_magic"
    quiet, none = _host(pol, log_refusals=False)
    quiet.deliver(Input("contribution", 0.0, b"junk"))
    assert none == [] and quiet.state.refusals.total == 1
