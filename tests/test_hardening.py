"""Hostile frames: whatever a contribution claims, the syncer quarantines it with a reason or admits
it, never crashes, and leaves Theta bit-identical when it refuses (docs/algorithm.md#bounds-on-what-a-frame-can-claim).

Each test is built from the trigger of one defect; the fuzz test at the end mutates valid frames."""

import json
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from diloco import store as bs
from diloco.algo import auth
from diloco.algo import ledger as tl
from diloco.algo import merge as merging
from diloco.algo import codec_specs, messages, payloads
from diloco.algo import syncer as sync
from diloco.algo.codecs import make_codec
from diloco.algo.outer import make_outer
from syncer_frames import B, E, FP32, THETA0, W, frame, merges, policy, publishes, raw_frame, shifted, start


def _bits(st):
    return {p: x.tobytes() for p, x in sync.theta(st).items()}


def _refused(pol, st, frame_, reason, key, now=1.0):
    """Feed one frame that must be quarantined with `reason`; returns the new state."""
    before, bits = st, _bits(st)
    st, actions = sync.on_contribution(pol, st, frame_, now)
    assert actions == (sync.Outcome(key, f"quarantined:{reason}"),)
    assert st.quarantined.get(reason, 0) == before.quarantined.get(reason, 0) + 1
    assert st.refusals.latest[-1]["event"] == "quarantine" and st.refusals.latest[-1]["reason"] == reason
    assert st.decisions == before.decisions  # refusals are counted apart, never in the unbounded records
    assert _bits(st) == bits and st.merges == before.merges
    assert st.fragments is before.fragments  # nothing of any fragment moved, not even its norms
    return st


def _wire(values, codec=FP32):
    """The tensors list and payload of `values` sent as the pseudo-gradient itself."""
    tensors, payload, _ = payloads.pack_fragment(values, codec)
    return tensors, payload


def _framed(header_bytes: bytes, payload: bytes = b"") -> bytes:
    return messages.MAGIC + struct.pack("<I", len(header_bytes)) + header_bytes + payload


def _forged(local, *, learner=0, seq=1, c_steps=1, c_tokens=8, **over):
    """A contribution against THETA0[0] written by hand: encode refuses the headers these tests need."""
    tensors, payload = _wire({p: THETA0[0][p] - local[p] for p in local})
    header = {"kind": "contribution", "learner": learner, "incarnation": 0, "seq": seq, "fragment": 0,
              "base_version": 0, "version": 0, "c_steps": c_steps, "c_tokens": c_tokens, "codec": "fp32",
              "delta_against": None, "tensors": tensors, "payload_len": len(payload),
              "checksum": messages.checksum(payload), **over}
    return _framed(json.dumps(header, separators=(",", ":")).encode(), payload)


# 1. A malformed codec spec is wrong_codec, never a ValueError out of float() / int().

MALFORMED_SPECS = ["topk+k..", "topk+k1e", "int4+k-", "topk+k+", "topk+ke5", "int8+b" + "9" * 5000,
                   "int8+zstd" + "1" * 5000, "topk+k" + "1" * 400, "topk+k1e999", "+k0.5", "int8+b0"]


@pytest.mark.parametrize("spec", MALFORMED_SPECS, ids=lambda s: s[:16])
def test_a_malformed_codec_spec_is_wrong_codec(spec):
    with pytest.raises(messages.MessageError) as e:
        codec_specs.codec_from_spec(spec)
    assert e.value.reason == "wrong_codec"
    pol = policy()
    _refused(pol, start(pol), raw_frame(*_wire(shifted(THETA0[0], 0.5)), spec=spec), "wrong_codec", (0, 0, 1))


# 2. Nesting depth is bounded before json.loads recurses (a 2 kB header 1,000 deep).

def _deep(n=1000):
    return b'{"kind":' + b"[" * n + b"]" * n + b"}"


def test_a_deeply_nested_header_is_bad_header():
    for raw in (_deep(), b'{"a":' * 1000 + b"1" + b"}" * 1000, b"[" * 100_000):
        with pytest.raises(messages.MessageError) as e:
            messages.decode(_framed(raw))
        assert e.value.reason == "bad_header" and "deep" in e.value.detail
    pol = policy()
    _refused(pol, start(pol), _framed(_deep()), "bad_header", None)
    # brackets inside strings are not nesting: a header may carry them in a path
    local = {E: np.array([1.0, 2.0, 3.0, 5.0], np.float32)}
    tensors, payload = _wire(local)
    tensors[0]["path"] = ["[" * 100 + '\\"{' * 50]
    assert messages.decode(raw_frame(tensors, payload, fragment=1)).header["tensors"] == tensors


@pytest.mark.parametrize("read", ["latest", "ack", "control"])
def test_a_deeply_nested_store_object_fails_loudly_naming_the_key(read):
    store = bs.BlobStore("memory://")
    key, call = {"latest": (bs.LATEST, lambda: bs.latest(store)),
                 "ack": (bs.ack_key(0, 0), lambda: bs.read_ack(store, 0, 0)),
                 "control": (bs.ctl_key("start"), lambda: bs.read_control(store, "start"))}[read]
    store.put(key, _deep(5000))
    with pytest.raises(ValueError, match=f"{key}.*deep"):
        call()
    store.put(key, json.dumps({"seq": 3, "fragments": {}, "deep": [[[["ok"]]]]}).encode())
    call()  # an ordinary object still reads


# 3. Every counter a frame claims is an int below 2**53 and within what the policy can verify.

@pytest.mark.parametrize("over", [
    dict(c_steps=1, c_tokens=10**200), dict(c_steps=10**400, c_tokens=10**400), dict(c_steps=2**53, c_tokens=2**53),
    dict(seq=2**53), dict(incarnation=2**60), dict(base_version=2**53, version=2**53), dict(version=2**62),
], ids=lambda d: "+".join(d))
def test_an_unbounded_counter_is_bad_counter(over):
    pol = policy(K=1)
    _refused(pol, start(pol), _forged(shifted(THETA0[0], 0.5), **over), "bad_counter", None)
    with pytest.raises(messages.MessageError, match="bad_counter"):  # refused by decode, before admission
        messages.decode(_forged(shifted(THETA0[0], 0.5), **over))


def test_counters_above_the_policys_bounds_are_bad_counter():
    pol = policy(K=1, max_steps=48, step_tokens=8)
    st = start(pol)
    local = shifted(THETA0[0], 0.5)
    st = _refused(pol, st, frame(local, THETA0[0], c_steps=49, c_tokens=49 * 8), "bad_counter", (0, 0, 1))
    st = _refused(pol, st, frame(local, THETA0[0], c_steps=2, c_tokens=17), "bad_counter", (0, 0, 1))
    st, actions = sync.on_contribution(pol, st, frame(local, THETA0[0], c_steps=48, c_tokens=48 * 8), 2.0)
    assert sync.Outcome((0, 0, 1), "merged") in actions  # the bounds themselves are admitted


def test_a_counter_overflow_in_an_open_round_cannot_crash_its_merge():
    """Unbounded, the frame was admitted into the round and every later merge of the fragment raised."""
    pol = policy(K=2)
    st = start(pol)
    st = _refused(pol, st, _forged(shifted(THETA0[0], 0.5), learner=1, c_tokens=10**200), "bad_counter", None)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0), 2.0)
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 3), THETA0[0], learner=1, seq=2), 3.0)
    assert [r["learners"] for r in merges(st)] == [[0, 1]] and len(publishes(actions)) == 1
    np.testing.assert_allclose(st.fragments[0].theta[W], shifted(THETA0[0], 2)[W], rtol=1e-6)


# 4. Huge finite values: safe norms, a Theta-relative bound, and no non-finite merge is published.

@pytest.mark.parametrize("merge", ["rda", "rda_fragment"])
def test_rda_of_huge_finite_values_is_finite(merge):
    big = {W: np.full((2, 3), 1e30, np.float32), B: np.array([-1e30, 2e30], np.float32)}
    tiny = {W: np.full((2, 3), 1e-30, np.float32), B: np.array([-1e-30, 2e-30], np.float32)}
    for d in (big, tiny):
        out = merging.merge([d], [1.0], merge)  # RDA of one delta is that delta
        for p in d:
            np.testing.assert_allclose(np.asarray(out[p]), d[p], rtol=1e-5)
    out = merging.merge([big, tiny], [1.0, 1.0], merge)
    assert all(np.isfinite(np.asarray(x)).all() for x in out.values())


def test_a_huge_finite_contribution_is_quarantined_before_the_median_is_armed():
    """1e30 passes the non-finite check; RDA's float32 norm used to be inf, the merge NaN, and publishing raised."""
    pol = policy(K=1, merge="rda")
    st = start(pol)
    big = {W: np.full((2, 3), 1e30, np.float32), B: np.full(2, 1e30, np.float32)}
    st = _refused(pol, st, raw_frame(*_wire(big)), "exploding_norm", (0, 0, 1))
    assert "Theta" in st.refusals.latest[-1]["detail"]
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], seq=2), 2.0)
    assert sync.Outcome((0, 0, 2), "merged") in actions


def test_a_merge_that_would_overflow_drops_the_offender_and_merges_the_rest():
    """Each contribution is finite and within the norm bounds (here switched off), but Nesterov's
    step lr (1 + mu) x 3e38 overflows float32: the offender is quarantined, the rest merge."""
    pol = policy(K=2, merge="rda", outer=make_outer("nesterov"), theta_norm_bound=0.0)
    good = frame(shifted(THETA0[0], 1), THETA0[0], learner=0)
    alone = policy(K=1, merge="rda", outer=make_outer("nesterov"))
    want, _ = sync.on_contribution(alone, start(alone), good, 0.0)
    huge = {W: np.full((2, 3), 3e38, np.float32), B: np.full(2, 3e38, np.float32)}
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, good, 0.0)
    bits = _bits(st)
    st, actions = sync.on_contribution(pol, st, raw_frame(*_wire(huge), learner=1), 1.0)
    assert sync.Outcome((1, 0, 1), "quarantined:overflow") in actions
    assert sync.Outcome((0, 0, 1), "merged") in actions and st.quarantined == {"overflow": 1}
    assert _bits(st) != bits and _bits(st) == _bits(want)  # exactly the merge of the good one alone
    (rec,) = merges(st)
    assert rec["learners"] == [0]
    # alone in its round, the offender is dropped and nothing is published
    one = pol._replace(grace=pol.grace._replace(K=1))
    st = start(one)
    bits = _bits(st)
    st, actions = sync.on_contribution(one, st, raw_frame(*_wire(huge), learner=1), 0.0)
    assert actions == (sync.Outcome((1, 0, 1), "quarantined:overflow"),)
    assert _bits(st) == bits and st.merges == 0 and st.fragments[0].version == 0


def test_zero_norms_never_arm_the_median():
    """With zeros in the window, once more than half the recent norms were 0, every nonzero contribution was refused."""
    pol = policy(K=1, norm_bound=10.0, norm_window=8)
    st = start(pol)
    for seq in range(1, 10):  # learners that took steps but whose fragment did not move
        st, _ = sync.on_contribution(pol, st, frame(THETA0[0], THETA0[0], seq=seq,
                                                    base_version=st.fragments[0].version), float(seq))
    assert st.fragments[0].norms == ()
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], seq=10,
                                                      base_version=st.fragments[0].version), 10.0)
    assert sync.Outcome((0, 0, 10), "merged") in actions


# 5. Only the run's codec is decoded, and no block size allocates beyond a hard cap.

def test_a_codec_other_than_the_runs_is_wrong_codec():
    pol = policy(K=1, up_spec="int8")
    st = start(pol)
    local = shifted(THETA0[0], 0.5)
    st = _refused(pol, st, frame(local, THETA0[0]), "wrong_codec", (0, 0, 1))  # fp32 is not this run's
    assert "int8" in st.refusals.latest[-1]["detail"]
    st, actions = sync.on_contribution(pol, st, frame(local, THETA0[0], codec=make_codec("int8"), spec="int8"), 2.0)
    assert sync.Outcome((0, 0, 1), "merged") in actions


def test_a_huge_block_is_refused_before_any_allocation():
    """`int8+b16777216`: a 365-byte frame whose decode used to allocate 64 MiB per tensor."""
    block = 1 << 24
    scale = np.float32(0.01).tobytes()
    tensors = [{"path": list(B), "shape": [2], "dtype": "float32", "nbytes": 6},
               {"path": list(W), "shape": [2, 3], "dtype": "float32", "nbytes": 10}]
    bad = raw_frame(tensors, scale + b"\x01\x02" + scale + bytes(range(6)), spec=f"int8+b{block}")
    assert len(bad) < 400
    pol = policy(K=1)
    st = start(pol)
    tracemalloc.start()
    try:
        st = _refused(pol, st, bad, "wrong_codec", (0, 0, 1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing a 365-byte frame peaked at {peak} bytes"
    with pytest.raises(messages.MessageError, match="wrong_codec"):
        codec_specs.codec_from_spec(f"int4+b{block}")
    with pytest.raises(ValueError, match="block"):
        make_codec("int8", block=block)


# Property: random mutations of valid frames never escape the quarantine path.

_JSON = hs.recursive(
    hs.none() | hs.booleans() | hs.integers() | hs.integers(min_value=2**52, max_value=10**400)
    | hs.integers(max_value=-1) | hs.floats(allow_nan=False, allow_infinity=False) | hs.text(max_size=8),
    lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(hs.text(max_size=6), inner, max_size=4),
    max_leaves=12)
_PART = hs.one_of(hs.just("ef"), hs.integers(0, 30).map(lambda n: f"zstd{n}"),
                  hs.sampled_from([1, 2, 7, 8, 32, 64, 65, 1 << 16, 1 << 17, 1 << 24]).map(lambda n: f"b{n}"),
                  hs.sampled_from(["0.5", "1.0", "0.01", "1e-05", "..", "1e", "-", "2", "nan"]).map("k{}".format),
                  hs.sampled_from([0, 1, 2, 3, 8, 64, 4096, 1 << 16, 1 << 17, 10**12]).map(lambda n: f"c{n}"),
                  hs.sampled_from([0, 1, 2, 32, 65, 10**12]).map(lambda n: f"t{n}"),
                  hs.text("abz019+.-e", max_size=5))
_SPEC = hs.builds(lambda name, parts: "+".join([name, *parts]),
                  hs.sampled_from(["fp32", "bf16", "int8", "int4", "fp4", "2bit", "topk", "sparseloco", "int3", ""]),
                  hs.lists(_PART, max_size=3))
_FIELDS = (*messages.HEADER_FIELDS, "merged", "extra")
_VALID_SPECS = ["fp32", "int8", "int4+zstd1", "topk+k0.5", "2bit+b8", "bf16", "sparseloco+c8+t2",
                "sparseloco+ef+c4+t4"]


@hs.composite
def _frames(draw):
    """A contribution frame as a learner writes it, then maybe mutated: a header field replaced by
    any JSON value, a codec spec from the grammar, payload bits flipped, the frame cut or a byte hit."""
    learner, p, seq = draw(hs.integers(0, 1)), draw(hs.integers(0, 1)), draw(hs.integers(1, 6))
    spec = draw(hs.sampled_from(_VALID_SPECS))
    kw = codec_specs.parse_spec(spec)
    codec = make_codec(kw.pop("name"), **kw)
    scale = draw(hs.sampled_from([0.0, 0.1, 1.0, 1e3, 1e20, 3e38]))
    rng = np.random.default_rng(draw(hs.integers(0, 2**16)))
    diff = {path: np.clip(scale * rng.standard_normal(x.shape), -3e38, 3e38).astype(np.float32)
            for path, x in THETA0[p].items()}
    tensors, payload = _wire(diff, codec)
    c_steps = draw(hs.integers(0, 30))
    payload = bytearray(payload)
    mutation = draw(hs.sampled_from(["none", "field", "spec", "payload", "truncate", "header_bytes"]))
    if mutation == "payload" and payload:
        for _ in range(draw(hs.integers(1, 4))):
            payload[draw(hs.integers(0, len(payload) - 1))] ^= 1 << draw(hs.integers(0, 7))
    header = {"kind": "contribution", "learner": learner, "incarnation": 0, "seq": seq, "fragment": p,
              "base_version": 0, "version": 0, "c_steps": c_steps, "c_tokens": 8 * c_steps, "codec": spec,
              "delta_against": None, "tensors": tensors, "payload_len": len(payload),
              "checksum": messages.checksum(bytes(payload))}
    if mutation == "field":
        header[draw(hs.sampled_from(_FIELDS))] = draw(_JSON)
    elif mutation == "spec":
        header["codec"] = draw(_SPEC)
    out = _framed(json.dumps(header, separators=(",", ":")).encode(), bytes(payload))
    if mutation == "truncate":
        out = out[:draw(hs.integers(0, len(out)))]
    elif mutation == "header_bytes":
        out = bytearray(out)
        out[draw(hs.integers(0, len(out) - 1))] = draw(hs.integers(0, 255))
        out = bytes(out)
    return out


def _policy(i):
    return [lambda: policy(K=1), lambda: policy(K=2, merge="rda", outer=make_outer("nesterov")),
            lambda: policy(K=1, gamma=0.8, merge="rda", norm_bound=10.0, norm_window=4, max_steps=24,
                           step_tokens=8),
            lambda: policy(K=2, merge="rda", outer=make_outer("nesterov"), theta_norm_bound=0.0)][i]()


def _sent(frame_):
    """(key, fragment) a learner would have booked this frame under, or None if it names none."""
    try:
        h = messages.decode(frame_).header
    except messages.MessageError:
        return None
    if h["kind"] != "contribution" or not 0 <= h["fragment"] < len(THETA0):
        return None
    return (h["learner"], h["incarnation"], h["seq"]), h["fragment"]


def _fuzz(pol_index, frames):
    pol = _policy(pol_index)
    st = start(pol)
    led = tl.token_ledger(len(st.fragments))
    for now, frame_ in enumerate(frames):
        sent = _sent(frame_)
        if sent is not None and sent[0] not in led.in_flight:  # book the send, as a runtime does
            (learner, inc, seq), p = sent
            led = tl.send(tl.process(led, learner, inc, 8), learner, inc, p, seq)
        before, bits = st, _bits(st)
        st, actions = sync.on_contribution(pol, st, frame_, float(now))
        outcomes = [a for a in actions if isinstance(a, sync.Outcome)]
        if len(actions) == 1 and outcomes[0].outcome.startswith("quarantined:"):
            assert _bits(st) == bits and st.merges == before.merges
            assert outcomes[0].outcome.split(":", 1)[1] in messages.QUARANTINE_REASONS
            assert sum(st.quarantined.values()) == sum(before.quarantined.values()) + 1
        for a in outcomes:
            if a.key is not None:
                led = tl.resolve(led, a.key, a.outcome, a.into)
        for a in publishes(actions):
            messages.decode(a.frames[0])  # what is published is a well-formed, finite frame
        assert all(np.isfinite(x).all() for x in sync.theta(st).values())
    for p in range(len(st.fragments)):  # close every open grace window
        st, actions = sync.on_deadline(pol, st, p, 1e9)
        for a in actions:
            if isinstance(a, sync.Outcome):
                led = tl.resolve(led, a.key, a.outcome, a.into)
    tl.check_balance(led)
    assert all(np.isfinite(x).all() for x in sync.theta(st).values())


_FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=800, **_FUZZ)
@given(hs.integers(0, 3), hs.lists(_frames(), min_size=1, max_size=6))
def test_fuzzed_frames_are_admitted_or_quarantined_never_raised(pol_index, frames):
    _fuzz(pol_index, frames)


@pytest.mark.slow
@settings(max_examples=5_000, **_FUZZ)
@given(hs.integers(0, 3), hs.lists(_frames(), min_size=1, max_size=10))
def test_fuzzed_frames_long(pol_index, frames):
    _fuzz(pol_index, frames)


# Property: with learners authenticated, a signed frame is admitted only as it was signed.

_SECRET = auth.Secret(b"fuzzing secret, 32 bytes long..")


@hs.composite
def _signed_frames(draw):
    """(frame, untouched): a frame signed by its learner (or by the other one), maybe mutated."""
    learner, p, seq = draw(hs.integers(0, 1)), draw(hs.integers(0, 1)), draw(hs.integers(1, 6))
    rng = np.random.default_rng(draw(hs.integers(0, 2**16)))
    diff = {path: (0.1 * rng.standard_normal(x.shape)).astype(np.float32) for path, x in THETA0[p].items()}
    tensors, payload = _wire(diff)
    header = {"kind": "contribution", "learner": learner, "incarnation": 0, "seq": seq, "fragment": p,
              "base_version": 0, "version": 0, "c_steps": 1, "c_tokens": 8, "codec": "fp32",
              "delta_against": None, "tensors": tensors}
    signer = draw(hs.sampled_from([learner, learner, 1 - learner]))
    good = messages.encode(header, payload, _SECRET.learner_key(signer))
    out = bytearray(good)
    mutation = draw(hs.sampled_from(["none", "byte", "field", "truncate", "strip_mac"]))
    if mutation == "byte":
        out[draw(hs.integers(0, len(out) - 1))] = draw(hs.integers(0, 255))
    elif mutation in ("field", "strip_mac"):
        msg = messages.decode(good)
        h = dict(msg.header)
        if mutation == "field":
            h[draw(hs.sampled_from(["seq", "incarnation", "learner", "c_steps", "base_version"]))] = draw(hs.integers(0, 9))
        else:
            del h["mac"]
        out = bytearray(_framed(json.dumps(h, separators=(",", ":")).encode(), msg.payload))
    elif mutation == "truncate":
        out = out[:draw(hs.integers(0, len(out)))]
    return bytes(out), bytes(out) == good and signer == learner


@settings(max_examples=400, **_FUZZ)
@given(hs.lists(_signed_frames(), min_size=1, max_size=6))
def test_fuzzed_signed_frames_are_admitted_only_as_signed(frames):
    pol = policy(K=2, auth=_SECRET)
    st = start(pol)
    for now, (frame_, untouched) in enumerate(frames):
        before, bits = st, _bits(st)
        st, actions = sync.on_contribution(pol, st, frame_, float(now))
        refused = [a for a in actions if isinstance(a, sync.Outcome) and a.outcome.startswith("quarantined:")]
        if not untouched:
            assert refused and len(actions) == 1, (actions, frame_[:200])
            assert _bits(st) == bits and st.last_seq == before.last_seq
        else:
            assert not [a for a in refused if a.outcome == "quarantined:unauthenticated"]


# Property: a damaged syncer input log (syncer_inputs.bin) reads as inputs or a ValueError naming it.

@settings(max_examples=300, **_FUZZ)
@given(hs.integers(0, 2**16), hs.sampled_from(["none", "byte", "truncate", "deep"]), hs.data())
def test_a_damaged_input_log_reads_or_fails_naming_the_file(seed, damage, data):
    import tempfile
    from pathlib import Path

    from diloco.algo.replay import Input
    from diloco.runtime.runlog import InputLog, read_inputs

    inputs = [Input("live", 0.0, ((0, 0), (1, 0))), Input("step_time", 0.5, (0, 0.5)),
              Input("contribution", 1.0, frame(shifted(THETA0[0], 1), THETA0[0])), Input("deadline", 2.0, 1)]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "syncer_inputs.bin"
        log = InputLog(path)
        for x in inputs:
            log.append(x)
        log.close()
        blob = bytearray(path.read_bytes())
        if damage == "byte":
            blob[data.draw(hs.integers(0, len(blob) - 1))] = data.draw(hs.integers(0, 255))
        elif damage == "truncate":
            blob = blob[:data.draw(hs.integers(0, len(blob)))]
        elif damage == "deep":
            deep = b"[" * 5000 + b"]" * 5000
            blob = bytearray(struct.pack("<I", len(deep)) + deep) + blob
        path.write_bytes(bytes(blob))
        try:
            got = list(read_inputs(path))
        except ValueError as e:
            assert str(path) in str(e)
        else:
            if damage == "none":
                assert [(x.kind, x.at) for x in got] == [(x.kind, x.at) for x in inputs]
