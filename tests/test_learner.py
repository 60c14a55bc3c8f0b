"""The learner state machine: counters, the send schedule, apply tau steps after sending, the stall rule."""

import pytest

from diloco.algo import learner as lsm
from diloco.algo.fragments import make_schedule

TOKENS = 10  # per inner step


def steps(st, schedule, n):
    """n inner steps with nothing applied; all sends, in order."""
    out = []
    for _ in range(n):
        st, sends = lsm.after_step(st, schedule, TOKENS)
        out += sends
    return st, out


def answer(send, learner=0, incarnation=0):
    """The `merged` keys of a broadcast whose merge took in `send`."""
    return frozenset({(learner, incarnation, send.seq)})


def test_init_holds_versions_with_zero_counters():
    st = lsm.init(learner=3, incarnation=2, versions=(5, 7), step=11)
    assert (st.learner, st.incarnation, st.step, st.seq) == (3, 2, 11, 0)
    assert st.c_steps == st.c_tokens == (0, 0)
    assert st.versions == (5, 7)
    assert st.in_flight == st.pending == ()


def test_counters_and_P_equals_H_schedule():
    """P = H = 4: one fragment leaves after every step, each fragment every 4 steps, seq counts sends."""
    sched = make_schedule(4, 4, tau=2)
    st, sends = steps(lsm.init(0, 0, (0, 3, 0, 9)), sched, 8)
    assert st.step == 8
    assert st.c_steps == (8, 8, 8, 8) and st.c_tokens == (80, 80, 80, 80)  # nothing applied: no reset
    # offsets t_p = p: fragment p leaves after step t with t mod 4 == p
    assert [s.fragment for s in sends] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert [s.step for s in sends] == list(range(1, 9))
    assert [s.seq for s in sends] == list(range(1, 9)) and st.seq == 8
    assert [s.c_steps for s in sends] == list(range(1, 9))
    assert [s.c_tokens for s in sends] == [TOKENS * t for t in range(1, 9)]
    assert [s.base_version for s in sends] == [3, 0, 9, 0, 3, 0, 9, 0]  # the version each fragment holds
    for p in range(4):
        assert [s.step for s in sends if s.fragment == p] == [p or 4, (p or 4) + 4]
    assert [(f.fragment, f.sent_at) for f in st.in_flight] == [(s.fragment, s.step) for s in sends]


def test_H_larger_than_P_spreads_offsets():
    """P = 2, H = 6: offsets 0 and 3; nothing is sent at the other four steps."""
    sched = make_schedule(2, 6, tau=1)
    _, sends = steps(lsm.init(0, 0, (0, 0)), sched, 12)
    assert [(s.step, s.fragment) for s in sends] == [(3, 1), (6, 0), (9, 1), (12, 0)]


def test_merge_applied_exactly_tau_steps_after_send_and_resets_only_its_counters():
    sched = make_schedule(4, 4, tau=2)
    st, sends = steps(lsm.init(0, 0, (0, 0, 0, 0)), sched, 1)
    assert [(s.fragment, s.step) for s in sends] == [(1, 1)]
    st = lsm.on_fragment(st, sched, fragment=1, version=1, merged=answer(sends[0]))  # back at once
    assert st.pending == (lsm.Pending(1, 1, apply_at=3, answers=(1,)),)
    for expected_step in (1, 2):  # not before tau = 2 steps have passed
        assert st.step == expected_step
        st, ready = lsm.to_apply(st, sched)
        assert ready == ()
        st, _ = lsm.after_step(st, sched, TOKENS)
    assert st.step == 3
    st, ready = lsm.to_apply(st, sched)
    assert ready == (lsm.Pending(1, 1, 3, (1,)),)
    assert st.c_steps == (3, 0, 3, 3) and st.c_tokens == (30, 0, 30, 30)
    assert st.versions == (0, 1, 0, 0)
    assert st.pending == ()
    assert [f.fragment for f in st.in_flight] == [2, 3]  # answered send gone; later sends still out
    st, sends = steps(st, sched, 4)  # the next send of fragment 1 carries the counters since the apply
    (s1,) = [s for s in sends if s.fragment == 1]
    assert (s1.step, s1.base_version, s1.c_steps, s1.c_tokens) == (5, 1, 2, 20)


def test_late_merge_is_applied_before_the_next_step():
    sched = make_schedule(4, 4, tau=2)
    st, sends = steps(lsm.init(0, 0, (0, 0, 0, 0)), sched, 6)  # fragment 1 left after steps 1 and 5
    first, second = [s for s in sends if s.fragment == 1]
    st = lsm.on_fragment(st, sched, 1, 4, merged=answer(first))
    assert st.pending == (lsm.Pending(1, 4, apply_at=6, answers=(first.seq,)),)
    st, ready = lsm.to_apply(st, sched)
    assert [q.fragment for q in ready] == [1] and st.versions[1] == 4
    assert second.seq in [f.seq for f in st.in_flight]  # the later send still waits for its own merge


def test_merge_nobody_waits_for_is_applied_before_the_next_step():
    """A version another learner's merge produced, with no send of this learner in flight."""
    sched = make_schedule(4, 4, tau=2)
    st, _ = steps(lsm.init(0, 0, (0, 0, 0, 0)), sched, 1)  # only fragment 1 in flight
    st = lsm.on_fragment(st, sched, 3, 2)
    assert st.pending == (lsm.Pending(3, 2, apply_at=1),)
    st, ready = lsm.to_apply(st, sched)
    assert ready == (lsm.Pending(3, 2, 1),)
    assert st.c_steps == (1, 1, 1, 0) and st.versions == (0, 0, 0, 2)
    assert [f.fragment for f in st.in_flight] == [1]


def test_blocking_after_tau_steps_until_the_merge_arrives():
    sched = make_schedule(4, 4, tau=2)
    st, _ = steps(lsm.init(0, 0, (0, 0, 0, 0)), sched, 2)  # fragment 1 sent at step 1, 2 at step 2
    assert lsm.blocking(st, sched) is None  # 1 step since the send: still inside the overlap
    st, _ = steps(st, sched, 1)
    assert lsm.blocking(st, sched) == lsm.InFlight(1, 1, 1, 1, 1 * TOKENS)  # the oldest overdue send
    st = lsm.on_fragment(st, sched, 1, 1, merged=frozenset({(0, 0, 1)}))
    assert lsm.blocking(st, sched) is None  # arrived: pending, not overdue
    st, ready = lsm.to_apply(st, sched)
    assert [q.fragment for q in ready] == [1]
    st, _ = steps(st, sched, 1)
    assert lsm.blocking(st, sched) == lsm.InFlight(2, 2, 2, 2, 2 * TOKENS)


def test_merge_without_this_learners_send_applies_at_once_and_keeps_it_waiting():
    """Another learner's merge of a fragment this learner has in flight: applied before the next
    step, but the send is not answered, so the learner still blocks for its own merge."""
    sched = make_schedule(4, 4, tau=2)
    st, sends = steps(lsm.init(0, 0, (0, 0, 0, 0)), sched, 1)  # fragment 1 sent after step 1
    other = frozenset({(3, 0, 9), (0, 1, sends[0].seq)})  # another learner, and a dead incarnation
    st = lsm.on_fragment(st, sched, 1, 1, merged=other)
    assert st.pending == (lsm.Pending(1, 1, apply_at=1),)
    st, ready = lsm.to_apply(st, sched)
    assert [q.version for q in ready] == [1] and st.versions[1] == 1 and st.c_steps[1] == 0
    assert [f.seq for f in st.in_flight] == [sends[0].seq]
    st, _ = steps(st, sched, 2)
    # the overwrite voided the counters the send left with: a kept overlap has nothing to keep from
    assert lsm.blocking(st, sched) == lsm.InFlight(1, sends[0].seq, 1, -1, -1)
    st = lsm.on_fragment(st, sched, 1, 2, merged=answer(sends[0]))  # its own merge, in the next round
    assert lsm.blocking(st, sched) is None
    st, ready = lsm.to_apply(st, sched)
    assert st.versions[1] == 2 and sends[0].seq not in [f.seq for f in st.in_flight]


def test_deferred_merge_waits_for_the_answer_and_the_answer_replaces_it():
    """others="defer": another learner's merge is held (the learner's unsent progress survives);
    the merge answering its own send, cumulative, is applied tau steps after that send."""
    sched = make_schedule(4, 4, tau=2, others="defer")
    st, sends = steps(lsm.init(0, 0, (0, 0, 0, 0)), sched, 1)  # fragment 1 sent after step 1
    st = lsm.on_fragment(st, sched, 1, 1, merged=frozenset({(3, 0, 9)}))
    assert st.pending == (lsm.Pending(1, 1, apply_at=lsm.DEFERRED),)
    st, ready = lsm.to_apply(st, sched)
    assert ready == () and st.versions[1] == 0 and st.c_steps[1] == 1
    st, _ = steps(st, sched, 1)
    assert lsm.blocking(st, sched) is None  # inside the overlap
    st, _ = steps(st, sched, 1)
    assert lsm.blocking(st, sched).seq == sends[0].seq  # the deferred merge answers nothing
    st = lsm.on_fragment(st, sched, 1, 2, merged=answer(sends[0]))
    st, ready = lsm.to_apply(st, sched)
    assert [(q.version, q.answers) for q in ready] == [(2, (sends[0].seq,))]
    assert st.versions[1] == 2 and 1 not in [f.fragment for f in st.in_flight] and st.c_steps[1] == 0


def test_give_up_applies_a_deferred_merge():
    sched = make_schedule(1, 4, tau=1, others="defer")
    st, sends = steps(lsm.init(0, 0, (0,)), sched, 4)
    st = lsm.on_fragment(st, sched, 0, 3, merged=frozenset({(2, 0, 5)}))
    st, _ = steps(st, sched, 1)
    assert lsm.blocking(st, sched).seq == sends[0].seq
    st = lsm.give_up(st, 0)
    st, ready = lsm.to_apply(st, sched)
    assert [q.version for q in ready] == [3] and st.versions == (3,) and lsm.blocking(st, sched) is None


def test_kept_overlap_leaves_the_counters_of_the_steps_since_the_send():
    """keep=True: the answering apply keeps the tau steps made since the send, and the counters
    (hence the next send's weight and the ledger's pending tokens) keep exactly those steps."""
    sched = make_schedule(1, 4, tau=2, keep=True)
    st, sends = steps(lsm.init(0, 0, (0,)), sched, 4)
    st, _ = steps(st, sched, 2)
    st = lsm.on_fragment(st, sched, 0, 1, merged=answer(sends[0]))
    st, ready = lsm.to_apply(st, sched)
    assert [q.kept for q in ready] == [True]
    assert st.c_steps == (2,) and st.c_tokens == (2 * TOKENS,) and st.in_flight == ()
    st, more = steps(st, sched, 2)
    assert [(s.c_steps, s.c_tokens) for s in more] == [(4, 4 * TOKENS)]
    unanswered = lsm.on_fragment(st, sched, 0, 2, merged=frozenset({(1, 0, 3)}))
    unanswered, ready = lsm.to_apply(unanswered, sched)  # another learner's merge: progress rebased
    assert [q.kept for q in ready] == [True] and unanswered.c_steps == st.c_steps
    assert unanswered.in_flight == st.in_flight and unanswered.versions == (2,)


def test_tau_zero_stalls_right_after_every_send():
    sched = make_schedule(1, 1, tau=0)
    st = lsm.init(0, 0, (0,))
    for version in (1, 2, 3):
        st, sends = lsm.after_step(st, sched, TOKENS)
        assert len(sends) == 1
        assert lsm.blocking(st, sched) == lsm.InFlight(0, sends[0].seq, st.step, 1, TOKENS)
        st = lsm.on_fragment(st, sched, 0, version, merged=answer(sends[0]))
        assert st.pending == (lsm.Pending(0, version, apply_at=st.step, answers=(sends[0].seq,)),)
        st, ready = lsm.to_apply(st, sched)
        assert len(ready) == 1 and lsm.blocking(st, sched) is None
        assert st.c_steps == (0,) and st.c_tokens == (0,)
    assert st.versions == (3,)


def test_give_up_releases_the_stall_and_a_later_arrival_still_applies():
    sched = make_schedule(1, 1, tau=0)
    st, _ = lsm.after_step(lsm.init(0, 0, (0,)), sched, TOKENS)
    assert lsm.blocking(st, sched) is not None
    st = lsm.give_up(st, 0)
    assert lsm.blocking(st, sched) is None and st.in_flight == ()
    st, _ = lsm.after_step(st, sched, TOKENS)  # a second send of fragment 0
    st = lsm.give_up(st, 0)
    st, _ = lsm.after_step(st, sched, TOKENS)
    assert st.c_steps == (3,)
    st = lsm.on_fragment(st, sched, 0, 1)  # the first merge, late: applied before the next step
    st, ready = lsm.to_apply(st, sched)
    assert ready == (lsm.Pending(0, 1, 3),) and st.c_steps == (0,) and st.versions == (0 + 1,)


def test_stale_and_duplicate_versions_are_ignored():
    sched = make_schedule(2, 2, tau=1)
    st, sends = steps(lsm.init(0, 0, (4, 4)), sched, 1)
    for old in (3, 4):  # not newer than the version held
        assert lsm.on_fragment(st, sched, 1, old) == st
    st = lsm.on_fragment(st, sched, 1, 6, merged=answer(sends[0]))
    for old in (5, 6):  # not newer than the version pending
        assert lsm.on_fragment(st, sched, 1, old) == st
    st = lsm.on_fragment(st, sched, 1, 7)  # newer: replaces the pending one, inherits its answer
    assert st.pending == (lsm.Pending(1, 7, apply_at=2, answers=(1,)),)
    st, _ = steps(st, sched, 1)
    st, ready = lsm.to_apply(st, sched)
    assert ready == (lsm.Pending(1, 7, 2, (1,)),) and st.versions == (4, 7)
    assert lsm.on_fragment(st, sched, 1, 7) == st  # a duplicate of the applied version


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_every_send_is_answered_tau_steps_later_with_an_echo_syncer(tau):
    """A syncer that answers each send at once: each apply happens exactly tau steps after the send,
    the learner never blocks, and each send carries the steps since that fragment's last apply."""
    P = H = 4
    sched = make_schedule(P, H, tau=tau)
    st = lsm.init(0, 0, (0,) * P)
    sent, applied = {}, []
    for _ in range(20):
        st, ready = lsm.to_apply(st, sched)
        applied += [(q.fragment, q.version, st.step) for q in ready]
        assert lsm.blocking(st, sched) is None
        st, sends = lsm.after_step(st, sched, TOKENS)
        for s in sends:
            expected = s.step if s.base_version == 0 else s.step - sent[(s.fragment, s.base_version)] - tau
            assert s.c_steps == expected and s.c_tokens == TOKENS * expected
            version = s.base_version + 1
            sent[(s.fragment, version)] = s.step
            st = lsm.on_fragment(st, sched, s.fragment, version, merged=answer(s))
    assert applied and all(step == sent[(p, v)] + tau for p, v, step in applied)


def test_flush_sends_every_fragment_with_unsent_progress_once():
    """At the end of training the fragments not in flight and with progress leave, carrying their
    counters; a fragment in flight does not, and a second flush sends nothing."""
    schedule = make_schedule(2, 8, tau=2)  # offsets 0 and 4
    st = lsm.init(0, 0, (3, 3))
    for _ in range(3):
        st, sent = lsm.after_step(st, schedule, 10)
        assert sent == ()
    _, sends = lsm.flush(st)
    assert [(s.fragment, s.c_steps, s.c_tokens, s.base_version) for s in sends] == [(0, 3, 30, 3), (1, 3, 30, 3)]
    st, sent = lsm.after_step(st, schedule, 10)  # step 4 sends fragment 1
    assert [s.fragment for s in sent] == [1]
    st, sends = lsm.flush(st)
    assert [(s.fragment, s.c_steps, s.seq) for s in sends] == [(0, 4, 2)]
    _, again = lsm.flush(st)
    assert again == ()  # everything is now in flight


def test_apply_and_rebase_rules_by_hand():
    """The numbers a learner's tensor takes on applying a merged fragment (docs/algorithm.md#applying-merged-fragments)."""
    import numpy as np

    from diloco.algo.learner import applied, rebased

    glob, local, sent = np.array([1.0, 2.0]), np.array([3.0, 5.0]), np.array([2.0, 4.0])
    np.testing.assert_array_equal(applied(glob, None, None, 0.0), glob)  # overwrite
    np.testing.assert_array_equal(applied(glob, local, None, 0.25), 0.25 * local + 0.75 * glob)
    np.testing.assert_array_equal(applied(glob, local, sent, 0.0), glob + (local - sent))  # keep_overlap
    np.testing.assert_array_equal(rebased(local, np.array([0.0, 1.0]), np.array([0.5, 0.0])), [3.5, 4.0])
