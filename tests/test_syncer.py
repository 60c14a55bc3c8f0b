"""The syncer state machine driven by hand-built frames: sign, exact averaging, token weights, RDA vs
averaging, quorum and grace, and broadcasts as quantized deltas against references."""

import math

import numpy as np
import pytest

from diloco.algo import codec_specs, messages, payloads, quorum
from diloco.algo import syncer as sync
from diloco.algo.codecs import make_codec
from diloco.algo.outer import make_outer

from syncer_frames import B, E, THETA0, W, frame, merges, policy, publishes, shifted, start


def test_sign_learner_moved_by_minus_d_gives_merged_delta_plus_d():
    """delta = Theta - local: a learner at Theta - d contributes +d, and outer SGD moves Theta along -d."""
    d = {W: np.full((2, 3), 0.25, np.float32), B: np.array([0.5, -1.0], np.float32)}
    local = {p: THETA0[0][p] - d[p] for p in d}
    pol = policy(outer=make_outer("sgd", lr=0.5, momentum=0.0))
    st, actions = sync.on_contribution(pol, start(pol), frame(local, THETA0[0]), now=1.0)
    (rec,) = merges(st)
    assert rec["delta_norm"] == pytest.approx(math.sqrt(6 * 0.25**2 + 0.5**2 + 1.0), rel=1e-6)
    for p in d:  # Theta - lr * (+d): half-way towards the learner
        np.testing.assert_allclose(st.fragments[0].theta[p], THETA0[0][p] - 0.5 * d[p], rtol=1e-6, atol=1e-7)
    assert [a.outcome for a in actions if isinstance(a, sync.Outcome)] == ["merged"]


def test_average_outer_gives_the_plain_mean_of_learners_every_round():
    """outer = average (SGD lr 1, no momentum), K = M, equal token weights, fp32 both ways:
    Theta after each round is the plain mean of the learners' params, within float32 rounding."""
    M = 3
    pol = policy(K=M, merge="rda")  # fragment 1 is an embedding fragment: averaged whatever `merge` says
    st = start(pol, M=M)
    rng = np.random.default_rng(0)
    for rnd in range(3):
        ref = st.fragments[1].refs[-1][1]
        assert ref is st.fragments[1].theta  # fp32 down: the reference is Theta itself
        locals_ = [{E: ref[E] + rng.normal(0, 0.1, 4).astype(np.float32)} for _ in range(M)]
        for m in range(M):
            before = st.fragments[1].theta[E].copy()
            st, actions = sync.on_contribution(pol, st, frame(locals_[m], ref, learner=m, seq=rnd + 1,
                                                               fragment=1, base_version=rnd), now=rnd + m / 10)
            if m < M - 1:  # below quorum: nothing moves
                assert publishes(actions) == []
                np.testing.assert_array_equal(st.fragments[1].theta[E], before)
        (pub,) = publishes(actions)
        assert pub.version == rnd + 1 and sorted(pub.frames) == list(range(M)) and pub.full == (0, 1, 2)
        want = np.mean(np.stack([x[E] for x in locals_]).astype(np.float64), axis=0)
        np.testing.assert_allclose(st.fragments[1].theta[E], want, rtol=1e-6, atol=1e-7)
        msg = messages.decode(pub.frames[0])  # every learner is sent exactly Theta
        np.testing.assert_array_equal(np.frombuffer(msg.payload, "<f4"), st.fragments[1].theta[E])
    assert [r["method"] for r in merges(st)] == ["average"] * 3
    assert [r["learners"] for r in merges(st)] == [[0, 1, 2]] * 3
    np.testing.assert_array_equal(st.fragments[0].theta[W], THETA0[0][W])  # the other fragment untouched


def test_token_weights_are_tokens_squared_over_steps():
    """w = c_tokens^2 / c_steps: learner 0 (2 tokens in 1 step, w 4), learner 1 (4 in 2, w 8)."""
    pol = policy(K=2)
    st = start(pol)
    l0, l1 = shifted(THETA0[1], 1.0), shifted(THETA0[1], -2.0)
    st, _ = sync.on_contribution(pol, st, frame(l0, THETA0[1], learner=0, fragment=1, c_steps=1, c_tokens=2), 0.0)
    st, _ = sync.on_contribution(pol, st, frame(l1, THETA0[1], learner=1, fragment=1, c_steps=2, c_tokens=4), 0.0)
    (rec,) = merges(st)
    assert rec["weights"] == [4.0, 8.0]
    # atol: the merge is float32 and the exact answer here is 0 (a few ulps of the delta, not of 0)
    np.testing.assert_allclose(st.fragments[1].theta[E], (4 * l0[E] + 8 * l1[E]) / 12, rtol=1e-6, atol=1e-6)


def test_rda_for_ordinary_fragments_average_for_embeddings():
    """Two learners with orthogonal deltas of norm r: RDA keeps norm r, averaging gives r / sqrt(2)."""
    r = 0.5
    pol = policy(K=2, merge="rda")
    st = start(pol)
    for f, p in ((0, B), (1, E)):
        n = THETA0[f][p].size
        for m in range(2):
            d = {q: np.zeros_like(v) for q, v in THETA0[f].items()}
            d[p] = np.eye(n, dtype=np.float32)[m] * r
            local = {q: THETA0[f][q] - d[q] for q in d}
            st, _ = sync.on_contribution(pol, st, frame(local, THETA0[f], learner=m, seq=f + 1, fragment=f),
                                         now=1.0)
    rda, avg = merges(st)
    assert (rda["fragment"], rda["method"]) == (0, "rda")
    assert (avg["fragment"], avg["method"]) == (1, "average")
    assert rda["delta_norm"] == pytest.approx(r, rel=1e-6)
    assert avg["delta_norm"] == pytest.approx(r / math.sqrt(2), rel=1e-6)
    np.testing.assert_allclose(st.fragments[0].theta[B] - THETA0[0][B], -r / math.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(st.fragments[1].theta[E] - THETA0[1][E], [-r / 2, -r / 2, 0, 0], atol=1e-7)
    np.testing.assert_array_equal(st.fragments[0].theta[W], THETA0[0][W])  # zero delta: unit(0) = 0


# --- quorum and grace --------------------------------------------------------------------------


def test_K1_without_grace_merges_at_the_first_arrival():
    pol = policy(K=1, gamma=0.0, tau=2)
    st = sync.observe_step_time(sync.observe_step_time(start(pol), 0, 1.0), 1, 1.0)
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=1), 5.0)
    assert len(publishes(actions)) == 1 and not any(isinstance(a, sync.SetDeadline) for a in actions)
    (rec,) = merges(st)
    assert rec["learners"] == [1] and rec["reason"] == quorum.NO_GRACE and rec["grace"] == 0.0
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 2), st.fragments[0].theta, learner=0,
                                                      base_version=1), 5.5)
    assert [r["learners"] for r in merges(st)] == [[1], [0]] and st.fragments[0].version == 2


def test_K_equals_M_waits_for_every_learner():
    pol = policy(K=3, gamma=0.0)
    st = start(pol, M=3)
    locals_ = [shifted(THETA0[0], m + 1) for m in range(3)]
    for m in range(3):
        st, actions = sync.on_contribution(pol, st, frame(locals_[m], THETA0[0], learner=m), float(m))
        last = st.decisions[-1] if m < 2 else [r for r in st.decisions if r["event"] == "arrival"][-1]
        assert last["admitted"] == list(range(m + 1))
        if m < 2:
            assert publishes(actions) == [] and last["reason"] == quorum.BELOW_QUORUM
            assert st.fragments[0].version == 0
    (rec,) = merges(st)
    assert rec["learners"] == [0, 1, 2] and rec["reason"] == quorum.ALL_LIVE_IN and rec["at"] == 2.0
    for p in (W, B):
        np.testing.assert_allclose(st.fragments[0].theta[p], np.mean([x[p] for x in locals_], 0), rtol=1e-6)


def test_a_finished_learner_is_waited_for_only_in_rounds_it_is_already_in():
    """K = 3 of 3. Learner 0 is in fragment 0's round when it finishes: that round still waits for
    the other two. Fragment 1's round, which it is not in, merges once 1 and 2 are in, and so does
    fragment 0's later round. A finished input of another incarnation, or a repeat, changes nothing;
    a rejoin as a new incarnation makes it a trainer again."""
    pol = policy(K=3)
    st = start(pol, M=3)
    ones = {p: shifted(THETA0[p], 1) for p in (0, 1)}
    st, _ = sync.on_contribution(pol, st, frame(ones[0], THETA0[0], learner=0), 1.0)
    st, actions = sync.on_finished(pol, st, 0, 1, 2.0)  # not the live incarnation: ignored
    assert st.finished == () and actions == ()
    st, actions = sync.on_finished(pol, st, 0, 0, 2.0)
    assert st.finished == (0,) and publishes(actions) == []
    assert sync.on_finished(pol, st, 0, 0, 2.5)[0] is st  # a repeat
    for m in (1, 2):
        st, _ = sync.on_contribution(pol, st, frame(ones[1], THETA0[1], learner=m, fragment=1), 3.0 + m)
    assert [r["learners"] for r in merges(st)] == [[1, 2]]  # fragment 1: K clamped to the two training
    st, _ = sync.on_contribution(pol, st, frame(ones[0], THETA0[0], learner=1, seq=2), 6.0)
    assert len(merges(st)) == 1  # fragment 0 still waits for learner 2: learner 0 is in it
    st, _ = sync.on_contribution(pol, st, frame(ones[0], THETA0[0], learner=2, seq=2), 7.0)
    assert [r["learners"] for r in merges(st)] == [[1, 2], [0, 1, 2]]
    st, _ = sync.on_live_change(pol, st, {0: 1, 1: 0, 2: 0}, 8.0)  # learner 0 back, training again
    assert st.finished == ()


def test_a_learner_that_finishes_completes_the_rounds_waiting_for_it():
    """K = 2 of 2: learner 0's contribution waits for learner 1, which finishes without sending
    one: the round merges then, K clamped to the one learner it waits for. A round opened after
    that merges at its first arrival."""
    pol = policy(K=2)
    st = start(pol)
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0), 1.0)
    assert publishes(actions) == []
    st, actions = sync.on_finished(pol, st, 1, 0, 2.0)
    assert [r["learners"] for r in merges(st)] == [[0]] and len(publishes(actions)) == 1
    assert merges(st)[0]["reason"] == quorum.ALL_LIVE_IN and merges(st)[0]["at"] == 2.0
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[1], 1), THETA0[1], learner=0, seq=2,
                                                      fragment=1), 3.0)
    assert [r["learners"] for r in merges(st)] == [[0], [0]]


def test_a_finished_learner_keeps_no_old_references():
    """K = 2: learner 0 contributes once (base 0) and finishes; learner 1 then merges alone 6 times
    with int8 broadcasts (references differ from Theta). Learner 0 will send nothing more, so only
    learner 1's last base and the newest reference are kept, not every one since learner 0's base 0
    (up to Policy.history)."""
    pol = policy(K=2, down_codec=make_codec("int8"), down_spec="int8")
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0), 0.0)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 2), THETA0[0], learner=1), 0.5)
    st, _ = sync.on_finished(pol, st, 0, 0, 1.0)
    for k in range(1, 7):
        ref = st.fragments[0].refs[-1][1]
        st, _ = sync.on_contribution(pol, st, frame(shifted(ref, 1), ref, learner=1, seq=k + 1, base_version=k),
                                     1.0 + k)
    assert st.fragments[0].version == 7 and [v for v, _ in st.fragments[0].refs] == [6, 7]


def grace_setup(M):
    """K = 1, tau = 2, gamma 0.8, cap 1 step, step time 1 s: grace = min(0.8 * 2, 1) = 1 s."""
    pol = policy(K=1, gamma=0.8, tau=2, cap=1.0)
    st = start(pol, M=M)
    for m in range(M):
        st = sync.observe_step_time(st, m, 1.0)
    return pol, st, [shifted(THETA0[0], m + 1) for m in range(M)]


def test_grace_window_admits_arrivals_until_the_deadline_then_the_next_round():
    pol, st, loc = grace_setup(3)
    st, actions = sync.on_contribution(pol, st, frame(loc[0], THETA0[0], learner=0), 10.0)
    assert actions == (sync.SetDeadline(0, 11.0),)
    st, actions = sync.on_contribution(pol, st, frame(loc[1], THETA0[0], learner=1), 11.0)  # at the deadline: in
    assert actions == ()
    st, actions = sync.on_deadline(pol, st, 0, 10.5)  # a timer firing early changes nothing
    assert actions == () and st.fragments[0].version == 0
    st, actions = sync.on_deadline(pol, st, 0, 11.0)
    (rec,) = merges(st)
    assert rec["learners"] == [0, 1] and rec["reason"] == quorum.DEADLINE_PASSED
    assert rec["grace"] == pytest.approx(1.0) and rec["missing"] == [2]
    for p in (W, B):
        np.testing.assert_allclose(st.fragments[0].theta[p], (loc[0][p] + loc[1][p]) / 2, rtol=1e-6)
    theta1 = st.fragments[0].theta
    st, actions = sync.on_contribution(pol, st, frame(loc[2], THETA0[0], learner=2), 11.5)  # next round
    assert actions == (sync.SetDeadline(0, 12.5),)
    assert st.fragments[0].theta is theta1
    assert sync.on_deadline(pol, st, 0, 11.0)[1] == ()  # the first round's timer again: stale
    st, _ = sync.on_deadline(pol, st, 0, 12.5)
    assert [r["learners"] for r in merges(st)] == [[0, 1], [2]]
    assert merges(st)[1]["staleness"] == [1]  # based on version 0, merged into version 1


def test_arrival_after_the_deadline_fires_the_merge_and_opens_the_next_round():
    """Without the timer (a wall-clock runtime may deliver it late), a late arrival merges the round
    it missed and waits in the next one."""
    pol, st, loc = grace_setup(2)
    st, _ = sync.on_contribution(pol, st, frame(loc[0], THETA0[0], learner=0), 10.0)
    st, actions = sync.on_contribution(pol, st, frame(loc[1], THETA0[0], learner=1), 11.25)
    (pub,) = publishes(actions)
    assert pub.version == 1
    assert [a for a in actions if isinstance(a, sync.SetDeadline)] == [sync.SetDeadline(0, 12.25)]
    assert [a for a in actions if isinstance(a, sync.Outcome)] == [sync.Outcome((0, 0, 1), "merged")]
    rec = merges(st)[0]
    assert rec["learners"] == [0] and rec["late"] == [1]
    for p in (W, B):
        np.testing.assert_allclose(st.fragments[0].theta[p], loc[0][p], rtol=1e-6)
    st, actions = sync.on_deadline(pol, st, 0, 12.25)
    assert [r["learners"] for r in merges(st)] == [[0], [1]]
    assert [a for a in actions if isinstance(a, sync.Outcome)] == [sync.Outcome((1, 0, 1), "merged")]


def test_a_newer_contribution_of_the_same_learner_replaces_the_older_in_the_round():
    pol = policy(K=2)
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 5), THETA0[0], learner=0, seq=1), 0.0)
    new = shifted(THETA0[0], 1)
    st, actions = sync.on_contribution(pol, st, frame(new, THETA0[0], learner=0, seq=2), 0.5)
    # same base: the newer one holds the older one's progress, so its tokens are carried into it
    assert actions == (sync.Outcome((0, 0, 1), "carried", (0, 0, 2)),)
    other = shifted(THETA0[0], -1)
    st, actions = sync.on_contribution(pol, st, frame(other, THETA0[0], learner=1), 1.0)
    assert [a.key for a in actions if isinstance(a, sync.Outcome)] == [(0, 0, 2), (1, 0, 1)]
    (publish,) = [a for a in actions if isinstance(a, sync.Publish)]
    assert publish.merged == ((0, 0, 2), (1, 0, 1))
    for f in publish.frames.values():  # every broadcast names the contributions it answers
        assert messages.merged_keys(messages.decode(f).header) == {(0, 0, 2), (1, 0, 1)}
    for p in (W, B):
        np.testing.assert_allclose(st.fragments[0].theta[p], (new[p] + other[p]) / 2, rtol=1e-6)


def test_max_staleness_drops_old_bases():
    pol = policy(K=1, max_staleness=0)
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0), 0.0)
    theta = st.fragments[0].theta
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 2), THETA0[0], learner=1), 1.0)
    assert actions == (sync.Outcome((1, 0, 1), "stale"),)
    assert st.fragments[0].theta is theta and st.quarantined == {"stale": 1}

# --- publish ------------------------------------------------------------------------------------


def decode_like_a_learner(frame_bytes, held):
    """What a LearnerUnit reconstructs from a broadcast, given the values of the version it holds."""
    msg = messages.decode(frame_bytes)
    h = msg.header
    values = payloads.unpack_fragment(h, msg.payload, None, {p: (v.shape, np.float32) for p, v in held.items()})
    if h["delta_against"] is not None:
        values = {p: held[p] + values[p] for p in values}
    return h, values


def test_broadcast_is_a_quantized_delta_against_the_reference_learners_hold():
    """int8 down: learners holding the previous version get a delta; what they rebuild is the syncer's
    reference bit for bit, and the rounding error is carried into the next delta, not accumulated."""
    block = 64
    down = make_codec("int8", block=block)
    pol = policy(K=1, down_codec=down, down_spec=codec_specs.codec_spec("int8", block=block))
    st = start(pol)
    held = {m: dict(THETA0[0]) for m in range(2)}
    rng = np.random.default_rng(1)
    for version in (1, 2, 3):
        local = {p: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for p, v in THETA0[0].items()}
        ref = st.fragments[0].refs[-1][1]
        st, actions = sync.on_contribution(pol, st, frame(local, ref, base_version=version - 1, seq=version),
                                           float(version))
        (pub,) = publishes(actions)
        assert pub.full == ()  # everybody holds the previous version
        new_ref_version, new_ref = st.fragments[0].refs[-1]
        assert new_ref_version == version
        for m in range(2):
            h, values = decode_like_a_learner(pub.frames[m], held[m])
            assert (h["version"], h["delta_against"], h["codec"]) == (version, version - 1, "int8")
            assert all(values[p].tobytes() == new_ref[p].tobytes() for p in values)
            held[m] = values
        theta = st.fragments[0].theta
        for p in theta:  # int8 rounding: half a step of the block's scale (plus float32 rounding)
            bound = np.abs(theta[p] - ref[p]).max() / 127 / 2 + 1e-6
            assert np.abs(theta[p] - new_ref[p]).max() <= bound
    # a learner joining now holds nothing: it is sent a full fp32 copy of the reference
    st, _ = sync.on_live_change(pol, st, {0: 0, 1: 0, 2: 0}, 4.0)
    st, actions = sync.on_contribution(pol, st, frame(THETA0[0], st.fragments[0].refs[-1][1], base_version=3,
                                                      seq=4), 5.0)
    (pub,) = publishes(actions)
    assert pub.full == (2,)
    h, values = decode_like_a_learner(pub.frames[2], held[0])
    assert h["delta_against"] is None and h["codec"] == "fp32"
    assert all(values[p].tobytes() == st.fragments[0].refs[-1][1][p].tobytes() for p in values)


def test_contribution_is_decoded_against_the_reference_of_its_base_version():
    """With a lossy broadcast the learner's anchor is the reference, not Theta: decoding against the
    reference recovers the learner's params exactly (fp32 up)."""
    pol = policy(K=1, down_codec=make_codec("int8"), down_spec="int8")
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 0.3), THETA0[0]), 0.0)
    ref = st.fragments[0].refs[-1][1]
    assert any(not np.array_equal(ref[p], st.fragments[0].theta[p]) for p in ref)
    local = shifted(ref, 0.01)
    st, _ = sync.on_contribution(pol, st, frame(local, ref, base_version=1, seq=2), 1.0)
    for p in local:  # outer average, one learner: Theta becomes the learner's params
        np.testing.assert_allclose(st.fragments[0].theta[p], local[p], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("anchor", ["current", "base"])
def test_a_stale_contribution_is_anchored_at_current_theta_or_at_its_base(anchor):
    """Learner 0 merges at version 1; learner 1 then sends d from version 0. anchor=current takes
    Theta_1 - local (pulling Theta back towards version 0); anchor=base adds learner 1's d alone."""
    sgd = make_outer("sgd", lr=1.0, momentum=0.0)
    pol = policy(K=1, outer=sgd, anchor=anchor)
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 0.5), THETA0[0]), 0.0)
    theta1 = st.fragments[0].theta
    local = shifted(THETA0[0], -0.25)  # learner 1 moved by -0.25 x (1, 2, ...) from version 0
    st, _ = sync.on_contribution(pol, st, frame(local, THETA0[0], learner=1), 1.0)
    want = local if anchor == "current" else {p: theta1[p] + (local[p] - THETA0[0][p]) for p in local}
    (_, second) = merges(st)
    assert second["staleness"] == [1]
    for p in local:
        np.testing.assert_allclose(st.fragments[0].theta[p], want[p], rtol=1e-6, atol=1e-6)


def test_scale_live_counts_absent_learners_as_zero_deltas():
    """scale=live, M = 4, one learner in the merge: Theta moves a quarter of the way (outer SGD lr 1)."""
    pol = policy(K=1, outer=make_outer("sgd", lr=1.0, momentum=0.0), scale="live")
    st = start(pol, M=4)
    local = shifted(THETA0[0], 0.5)
    st, _ = sync.on_contribution(pol, st, frame(local, THETA0[0]), 0.0)
    for p in local:
        np.testing.assert_allclose(st.fragments[0].theta[p], THETA0[0][p] + 0.25 * (local[p] - THETA0[0][p]),
                                   rtol=1e-6, atol=1e-6)
