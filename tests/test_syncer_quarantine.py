"""What the syncer refuses: every kind of malformed or poisoned contribution is quarantined with its
reason in the ledger and Theta untouched; the payload bound admits every codec; the norm bound."""

import numpy as np
import pytest

from diloco.algo import codec_specs, payloads
from diloco.algo import syncer as sync
from diloco.algo.codecs import make_codec
from diloco.algo.fragments import Fragment
from syncer_frames import B, FP32, THETA0, W, frame, merges, policy, raw_frame, shifted, start


def _payload_with(value):
    """An fp32 payload for fragment 0 whose first value is `value` (encode refuses non-finite)."""
    tensors, payload, _ = payloads.pack_fragment({B: np.zeros(2, np.float32), W: np.zeros((2, 3), np.float32)}, FP32)
    return tensors, np.float32(value).tobytes() + payload[4:]


def _bad_frame(case):
    """(frame, key of the frame or None, reason)."""
    local = shifted(THETA0[0], 0.5)
    key = (1, 0, 1)
    if case in ("nan", "inf"):
        tensors, payload = _payload_with(np.nan if case == "nan" else -np.inf)
        return raw_frame(tensors, payload, learner=1), key, "non_finite"
    if case == "wrong_shape":
        bad = {**local, W: np.zeros((3, 2), np.float32)}
        return frame(bad, {**THETA0[0], W: np.zeros((3, 2), np.float32)}, learner=1), key, "wrong_shape"
    if case == "wrong_dtype":
        tensors, payload, _ = payloads.pack_fragment(local, FP32)
        tensors[0]["dtype"] = "bfloat16"
        return raw_frame(tensors, payload, learner=1), key, "wrong_dtype"
    if case == "checksum":
        good = bytearray(frame(local, THETA0[0], learner=1))
        good[-3] ^= 0x40  # one payload bit
        return bytes(good), None, "checksum"
    if case == "truncated_zstd":
        codec = make_codec("fp32", zstd_level=1)
        tensors, payload, _ = payloads.pack_fragment(local, codec)
        tensors[-1]["nbytes"] -= 5  # header consistent with the cut payload: only zstd can tell
        return raw_frame(tensors, payload[:-5], learner=1, spec="fp32+zstd1"), key, "codec_error"
    if case == "duplicate":  # unattributed: its key is the original's, which is in the open round
        return frame(local, THETA0[0], learner=0, seq=1), None, "duplicate"
    if case == "dead_incarnation":
        return frame(local, THETA0[0], learner=0, inc=0, seq=9), (0, 0, 9), "dead_incarnation"
    if case == "unknown_learner":
        return frame(local, THETA0[0], learner=7), (7, 0, 1), "unknown_learner"
    if case == "future_version":
        return frame(local, THETA0[0], learner=1, base_version=3), key, "future_version"
    raise AssertionError(case)


CASES = ["nan", "inf", "wrong_shape", "wrong_dtype", "checksum", "truncated_zstd", "duplicate",
         "dead_incarnation", "unknown_learner", "future_version"]


@pytest.mark.parametrize("case", CASES)
def test_quarantine_leaves_theta_bit_identical(case):
    pol = policy(K=2)
    st = start(pol)
    good0 = shifted(THETA0[0], 1)
    # learner 0 is already in the open round (incarnation 1 for the dead-incarnation case)
    inc = 1 if case == "dead_incarnation" else 0
    st, _ = sync.on_live_change(pol, st, {0: inc, 1: 0}, 0.0)
    st, _ = sync.on_contribution(pol, st, frame(good0, THETA0[0], learner=0, inc=inc, seq=1), 0.0)
    before = st
    snapshot = {p: x.tobytes() for p, x in sync.theta(st).items()}
    bad, key, reason = _bad_frame(case)
    st, actions = sync.on_contribution(pol, st, bad, 1.0)
    assert actions == (sync.Outcome(key, f"quarantined:{reason}"),)
    assert st.quarantined == {reason: 1}
    rec = st.refusals.latest[-1]
    assert (rec["event"], rec["reason"], rec["key"], rec["at"]) == ("quarantine", reason,
                                                                     None if key is None else list(key), 1.0)
    assert st.decisions == before.decisions and st.refusals.total == before.refusals.total + 1
    assert st.refusals.counts[(reason, None if key is None else key[0])] == 1
    assert {p: x.tobytes() for p, x in sync.theta(st).items()} == snapshot
    assert st.fragments is before.fragments and st.merges == 0
    assert st.last_seq == before.last_seq and st.live == before.live
    # the round still merges exactly the good contributions
    good1 = shifted(THETA0[0], -3)
    st, _ = sync.on_contribution(pol, st, frame(good1, THETA0[0], learner=1, seq=2), 2.0)
    (rec,) = merges(st)
    assert rec["learners"] == [0, 1]
    for p in (W, B):
        np.testing.assert_allclose(st.fragments[0].theta[p], (good0[p] + good1[p]) / 2, rtol=1e-6)


def test_incarnations_come_from_the_runtime_never_from_a_frame():
    """A frame claiming incarnation + 1 is refused and changes nothing (issue: one such frame made
    every later frame of the real learner dead_incarnation); once the runtime reports the restart,
    the new incarnation is admitted and the old one is dead."""
    pol = policy(K=2)
    st = start(pol)
    before = st
    st, actions = sync.on_contribution(pol, st, frame(THETA0[0], THETA0[0], learner=1, inc=2, seq=1), 0.0)
    assert actions == (sync.Outcome((1, 2, 1), "quarantined:unknown_incarnation"),)
    assert st.live == before.live and st.last_seq == {} and st.fragments is before.fragments
    st, actions = sync.on_contribution(pol, st, frame(THETA0[0], THETA0[0], learner=1, inc=0, seq=1), 0.0)
    assert actions == () and st.last_seq == {(1, 0): 1}  # the real learner is unharmed
    st, _ = sync.on_live_change(pol, st, {0: 0, 1: 2}, 1.0)
    st, actions = sync.on_contribution(pol, st, frame(THETA0[0], THETA0[0], learner=1, inc=2, seq=1), 1.0)
    assert st.last_seq[(1, 2)] == 1
    st, actions = sync.on_contribution(pol, st, frame(THETA0[0], THETA0[0], learner=1, inc=0, seq=5), 1.0)
    assert actions == (sync.Outcome((1, 0, 5), "quarantined:dead_incarnation"),)


@pytest.mark.parametrize("spec", ["topk+k1.0", "topk+zstd1+k1.0", "fp32+zstd1"])
def test_the_payload_bound_admits_every_codec_at_its_largest(spec):
    """Top-k at fraction 1 sends 8 bytes per value, twice fp32; zstd adds its frame on top. A legitimate
    contribution of a large fragment must not be refused as too large; a bigger payload is."""
    big = (Fragment(0, (W,), 4096, False),)
    theta0 = ({W: np.zeros((64, 64), np.float32)},)
    pol = policy(K=1)
    st = start(pol, frags=big, theta0=theta0)
    local = {W: np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)}
    kw = codec_specs.parse_spec(spec)
    codec = make_codec(kw.pop("name"), **kw)
    st, actions = sync.on_contribution(pol, st, frame(local, theta0[0], codec=codec, spec=spec), 0.0)
    assert st.quarantined == {} and st.merges == 1
    np.testing.assert_allclose(st.fragments[0].theta[W], local[W], rtol=1e-6, atol=1e-6)
    tensors = [{"path": list(W), "shape": [64, 64], "dtype": "float32", "nbytes": 9 * 4096}]
    st, actions = sync.on_contribution(pol, st, raw_frame(tensors, bytes(9 * 4096), seq=2, base_version=1), 1.0)
    assert actions == (sync.Outcome(None, "quarantined:too_large"),)


def test_a_pseudo_gradient_far_above_the_running_median_is_quarantined():
    """norm_bound x the median of the fragment's last admitted norms: a 100x contribution (a
    diverged or poisoned learner) is counted and never merged; normal ones keep flowing."""
    pol = policy(K=1, norm_bound=10.0, norm_window=8)
    st = start(pol)
    for seq in range(1, 9):  # eight normal contributions set the median (norm of a shift by 1)
        st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], seq=seq,
                                                    base_version=st.fragments[0].version), float(seq))
    theta, version = st.fragments[0].theta, st.fragments[0].version
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 100), THETA0[0], seq=9,
                                                      base_version=version), 9.0)
    assert actions == (sync.Outcome((0, 0, 9), "quarantined:exploding_norm"),)
    assert st.quarantined == {"exploding_norm": 1} and st.fragments[0].theta is theta
    assert st.refusals.latest[-1]["reason"] == "exploding_norm" and "median" in st.refusals.latest[-1]["detail"]
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 3), THETA0[0], seq=10,
                                                      base_version=version), 10.0)
    assert sync.Outcome((0, 0, 10), "merged") in actions  # 3x the median is within the bound
    assert len(st.fragments[0].norms) == 8  # the window; the quarantined norm never entered it
    # per inner step: the same 100x move over 100 steps is an ordinary contribution
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 100), THETA0[0], seq=11, c_steps=100,
                                                      c_tokens=800, base_version=st.fragments[0].version), 11.0)
    assert sync.Outcome((0, 0, 11), "merged") in actions


def test_clip_bounds_a_plausible_outlier_to_a_multiple_of_the_median():
    """syncer.clip: a pseudo-gradient 20x its peers' (not exploding, so admitted) is scaled onto
    clip x the median norm per step before the merge, direction kept; the others are untouched."""
    from diloco.algo import merge as merging

    pol = policy(K=3, clip=2.0)
    st = start(pol, M=3)
    locals_ = [shifted(THETA0[0], s) for s in (1.0, -1.5, 20.0)]
    for m, local in enumerate(locals_):
        st, actions = sync.on_contribution(pol, st, frame(local, THETA0[0], learner=m), float(m))
    (rec,) = merges(st)
    assert rec["clipped"] == [2]
    deltas = [{p: THETA0[0][p] - local[p] for p in local} for local in locals_]
    norms = [merging.global_norm(d) for d in deltas]
    bar = 2.0 * float(np.median(norms))
    deltas[2] = {p: x * np.float32(bar / norms[2]) for p, x in deltas[2].items()}
    for p in (W, B):
        want = THETA0[0][p] - sum(d[p] for d in deltas) / 3
        np.testing.assert_allclose(st.fragments[0].theta[p], want, rtol=1e-5, atol=1e-6)
    # off (the default): the same round merges the outlier whole
    st = start(policy(K=3), M=3)
    for m, local in enumerate(locals_):
        st, _ = sync.on_contribution(policy(K=3), st, frame(local, THETA0[0], learner=m), float(m))
    np.testing.assert_allclose(st.fragments[0].theta[W], sum(x[W] for x in locals_) / 3, rtol=1e-5)
    assert merges(st)[0]["clipped"] == []
