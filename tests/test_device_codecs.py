"""The device encoder (diloco/algo/device_codecs.py, docs/design.md#encoding-on-the-device): its
payloads are the host codecs' bytes, its error-feedback residuals their residuals, a learner unit
that encodes on its devices sends the frames a host-encoding one sends, and only the packed
payload crosses from the devices to the host."""

import jax
import numpy as np
import pytest
from conftest import diloco_world
from test_deferred_encode import one_learner_config
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.algo import codec_specs, codecs, device_codecs, messages, payloads
from diloco.algo import syncer as sync
from diloco.config import MeshConfig
from diloco.runtime import build as build_setup

SPECS = ["int4", "int8", "fp4", "2bit", "int4+ef", "2bit+ef", "fp4+ef+zstd1", "int4+zstd1", "int8+ef+zstd3+b32",
         "2bit+ef+b128", "int4+b8"]


def host_payloads(spec, diffs, states):
    codec = codec_specs.codec_from_spec(spec)
    out = []
    for i, d in enumerate(diffs):
        payload, states[i] = codec.encode(d, states.get(i, codec.init(d.shape)))
        out.append(payload)
    return out


@settings(max_examples=25, deadline=None)
@given(spec=st.sampled_from(SPECS), seed=st.integers(0, 2**31 - 1),
       sizes=st.lists(st.integers(0, 700), min_size=1, max_size=4),
       scale=st.sampled_from([1e-20, 1e-6, 1e-2, 1.0, 1e4, 1e30]))
def test_device_payloads_and_residuals_are_the_host_codecs(spec, seed, sizes, scale):
    """Three rounds of a fragment's contributions (so error feedback carries residuals): every
    tensor's bytes and residual are the host codec's, zero tensors and partial blocks included.
    (XLA on the CPU flushes subnormals to zero, so a residual below 2^-126 may be 0 there.)"""
    rng = np.random.default_rng(seed)
    dc = device_codecs.for_spec(spec)
    shapes = [(n,) if i % 2 else (1, n) for i, n in enumerate(sizes)]
    anchor = [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes]
    local = [(a - rng.standard_normal(s) * scale * rng.choice([0.0, 1e-3, 1.0])).astype(np.float32)
             for a, s in zip(anchor, shapes)]
    residuals = tuple(np.zeros(s, np.float32) for s in shapes) if dc.error_feedback else ()
    states = {}
    for _ in range(3):
        raw, residuals = dc.encode(tuple(anchor), tuple(local), residuals)
        got = device_codecs.to_wire(dc, jax.device_get(raw), shapes)
        want = host_payloads(spec, [a - x for a, x in zip(anchor, local)], states)
        assert got == want
        for i in range(len(shapes) if dc.error_feedback else 0):
            np.testing.assert_array_equal(flushed(np.asarray(residuals[i])), flushed(states[i].residual))
        local = [(x + rng.standard_normal(x.shape) * scale * 1e-2).astype(np.float32) for x in local]


def flushed(x):
    return np.where(np.abs(x) < np.float32(2.0**-126), np.float32(0.0), x)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_is_refused_and_leaves_the_residual(bad):
    dc = device_codecs.for_spec("int4+ef")
    x = np.linspace(-1, 1, 200, dtype=np.float32)
    x[137] = bad
    residual = np.full(200, 0.25, np.float32)
    raw, (new,) = dc.encode((x,), (np.zeros(200, np.float32),), (residual,))
    with pytest.raises(codecs.NonFiniteError):
        device_codecs.to_wire(dc, jax.device_get(raw), [(200,)])
    np.testing.assert_array_equal(np.asarray(new), residual)


def test_codecs_without_a_device_encoder_stay_on_the_host():
    assert [device_codecs.for_spec(s) for s in ("fp32", "bf16", "topk", "bf16+zstd1")] == [None] * 4
    assert device_codecs.for_spec("int4+zstd1").zstd_level == 1
    assert device_codecs.for_spec("2bit+ef+b128").block == 128


@pytest.fixture(scope="module", params=[1, 2], ids=["data", "fsdp"])
def setup(request, tmp_path_factory):
    """A learner of two devices, its params replicated (data) or split across them (fsdp)."""
    cfg = one_learner_config(tmp_path_factory.mktemp("devenc"), devices=2, mesh=MeshConfig(fsdp=request.param))
    return diloco_world(cfg)[2]


def test_a_device_encoding_learner_sends_the_host_encoding_learners_frames(setup):
    """Twins fed the same broadcasts by a K = 1 syncer: the same frames, residuals and params,
    step by step, deferred (the wall-clock loop's way) and at once."""
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    host = build_setup.new_unit(setup._replace(spec=setup.spec._replace(device_encode=False)), 0, 0, state)
    dev = build_setup.new_unit(setup, 0, 0, state)
    assert dev.device_codec is not None and host.device_codec is None
    dev.warm_up()
    sent = 0
    for i in range(10):
        for unit in (host, dev):
            unit.apply_due()
        a = host.step()
        b = dev.step(defer=i % 2 == 0)
        frames = dev.finish()[0] if i % 2 == 0 else b.frames
        assert frames == a.frames
        sent += len(frames)
        for frame in a.frames:
            state, actions = sync.on_contribution(setup.policy, state, frame, float(i))
            for action in actions:
                if isinstance(action, sync.Publish):
                    host.receive(action.frames[0])
                    dev.receive(action.frames[0])
    assert sent >= 8 and host.flush().frames == dev.flush().frames
    for path, residual in host.codec_states.items():
        np.testing.assert_array_equal(np.asarray(dev.codec_states[path].residual), residual.residual)
    for x, y in zip(jax.tree.leaves(jax.device_get(host.state.params)), jax.tree.leaves(jax.device_get(dev.state.params))):
        np.testing.assert_array_equal(x, y)


def test_only_the_packed_payload_crosses_to_the_host(setup, monkeypatch):
    """Implicit device-to-host transfers are refused, explicit ones counted: what a learner copies
    to the host for its contributions is exactly their packed payloads (int4: 4.5 bits a value,
    7.1x fewer bytes than the fp32 params the host encoder copies)."""
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    copied = []
    real = jax.device_get

    def counting(x):
        out = real(x)
        copied.append(sum(np.asarray(v).nbytes for v in jax.tree.leaves(out)))
        return out

    for device in (True, False):
        unit = build_setup.new_unit(setup._replace(spec=setup.spec._replace(device_encode=device)), 0, 0, state)
        copied.clear()
        monkeypatch.setattr(jax, "device_get", counting)
        with jax.transfer_guard_device_to_host("disallow"):
            results = [unit.step(defer=True) for _ in range(4)]
            frames = [f for _ in results for f in unit.finish()[0]]
        monkeypatch.setattr(jax, "device_get", real)
        fp32 = sum(4 * f.size for r in results for s in r.sends for f in [setup.fragments[s.fragment]])
        if device:
            payload = sum(t["nbytes"] for f in frames for t in messages.decode(f).header["tensors"])
            raw = sum(sum(unit.device_codec.sizes([tuple(t["shape"]) for t in messages.decode(f).header["tensors"]]))
                      for f in frames)
            assert sum(copied) == unit.host_bytes == raw and payload < raw  # zstd shrinks it further
            assert 7.0 < fp32 / raw < 7.2
        else:
            assert sum(copied) == unit.host_bytes == fp32


def test_a_returned_fragment_crosses_to_the_devices_as_its_int8_payload(setup, monkeypatch):
    """A merged fragment coming back as an int8 delta is put on the devices as its payload (about
    a quarter of the fp32 values), decoded and applied there; nothing is fetched to the host."""
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit = build_setup.new_unit(setup, 0, 0, state)
    unit.warm_up()
    real_put, real_get = jax.device_put, jax.device_get
    put, got = [], []

    def counting_put(x, *a, **k):
        put.append(sum(v.nbytes for v in jax.tree.leaves(x) if isinstance(v, np.ndarray)))
        return real_put(x, *a, **k)

    def counting_get(x):
        got.append(x)
        return real_get(x)

    deltas = 0
    for i in range(8):
        unit.apply_due()
        result = unit.step()
        for frame in result.frames:
            state, actions = sync.on_contribution(setup.policy, state, frame, float(i))
            for action in actions:
                if isinstance(action, sync.Publish):
                    header = messages.decode(action.frames[0]).header
                    put.clear(), got.clear()
                    monkeypatch.setattr(jax, "device_put", counting_put)
                    monkeypatch.setattr(jax, "device_get", counting_get)
                    unit.receive(action.frames[0])
                    monkeypatch.setattr(jax, "device_put", real_put)
                    monkeypatch.setattr(jax, "device_get", real_get)
                    if header["delta_against"] is not None:
                        deltas += 1
                        values = sum(4 * np.prod(t["shape"]) for t in header["tensors"])
                        assert sum(put) == header["payload_len"] < values / 3.5 and got == []
        monkeypatch.setattr(jax, "device_get", counting_get)
        got.clear()
        unit.apply_due()
        monkeypatch.setattr(jax, "device_get", real_get)
        assert got == []  # an overwriting apply copies on the devices
    assert deltas >= 3 and unit.dropped_frames == 0


def test_a_bad_broadcast_is_dropped_on_the_devices_as_on_the_host(setup):
    """A broadcast with a nan or negative block scale, a scale whose largest code overflows, a
    wrong size or a wrong shape is dropped (counted, nothing held changes) by a unit that decodes
    on its devices exactly when a host-decoding unit drops it."""
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    units = [build_setup.new_unit(setup._replace(spec=setup.spec._replace(device_encode=d)), 0, 0, state)
             for d in (True, False)]
    for i in range(6):  # until a merge publishes an int8 delta
        frames = [u.step().frames for u in units][0]
        published = []
        for frame in frames:
            state, actions = sync.on_contribution(setup.policy, state, frame, float(i))
            published += [a.frames[0] for a in actions if isinstance(a, sync.Publish)]
        if published:
            break
    msg = messages.decode(published[0])
    h, payload = msg.header, bytearray(msg.payload)
    assert h["codec"] == "int8" and h["delta_against"] == 0
    t0 = h["tensors"][0]

    def forged(scale=None, tensors=None, cut=0):
        p = bytearray(payload)
        if scale is not None:
            p[0:4] = np.float32(scale).tobytes()
        body = bytes(p[: len(p) - cut])
        return messages.encode({**h, "tensors": tensors or h["tensors"]}, body)

    bad = [forged(scale=np.nan), forged(scale=-1.0), forged(scale=3e38),
           forged(tensors=[{**t0, "nbytes": t0["nbytes"] - 1}] + h["tensors"][1:], cut=1),
           forged(tensors=[{**t0, "shape": [t0["shape"][0] + 1] + t0["shape"][1:]}] + h["tensors"][1:])]
    for frame in bad:
        held = [u.latest[h["fragment"]] for u in units]
        assert [u.receive(frame) for u in units] == [None, None]
        assert [u.latest[h["fragment"]] for u in units] == held
    assert [u.dropped_frames for u in units] == [len(bad)] * 2
    assert [u.receive(published[0]) for u in units] == [(h["fragment"], h["version"])] * 2
    for path in units[1].latest[h["fragment"]][1]:
        np.testing.assert_array_equal(units[0].latest[h["fragment"]][1][path], units[1].latest[h["fragment"]][1][path])


@pytest.mark.parametrize("spec,specs,cuts", [
    ("int4+ef", {(8, 512): ("fsdp", None), (3, 1024): (None, "fsdp"), (6, 4, 64): (None, "fsdp", None)},
     [(1, 4, 1024), (3, 4, 256), (6, 4, 64)]),
    ("2bit+ef+zstd1", {(8, 512): ("fsdp", None), (6, 4, 64): (None, "fsdp", None)}, [(1, 4, 1024), (6, 4, 64)]),
    ("int8+b32", {(3, 1024): (None, "fsdp"), (5, 96): (None, "fsdp")}, [(3, 4, 256), (1, 1, 480)]),
])
def test_each_device_quantises_its_own_shard(spec, specs, cuts):
    """fsdp-split tensors whose shards are whole blocks are cut per shard (no gather in the
    compiled encode; the scales and codes stay split) and still give the host codec's bytes and
    residuals; a tensor whose shards split a block ((5, 96): runs of 24) is gathered first, with
    the same bytes."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "fsdp"))
    dc = device_codecs.for_spec(spec)
    rng = np.random.default_rng(1)
    shapes = list(specs)
    shardings = [NamedSharding(mesh, PartitionSpec(*specs[s])) for s in shapes]
    assert [device_codecs.layout(s, sh, dc.block) for s, sh in zip(shapes, shardings)] == cuts
    anchor = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    local = [(a - rng.standard_normal(s) * 1e-2).astype(np.float32) for a, s in zip(anchor, shapes)]
    put = lambda xs: tuple(jax.device_put(x, sh) for x, sh in zip(xs, shardings))  # noqa: E731
    residuals = put([np.zeros(s, np.float32) for s in shapes]) if dc.error_feedback else ()
    states = {}
    for _ in range(2):
        pieces, residuals = dc.encode(put(anchor), put(local), residuals)
        assert device_codecs.to_wire(dc, jax.device_get(pieces), shapes) == host_payloads(
            spec, [a - x for a, x in zip(anchor, local)], states)
        for i in range(len(shapes) if dc.error_feedback else 0):
            np.testing.assert_array_equal(np.asarray(residuals[i]), states[i].residual)
        for (scales, _), (_, parts, _) in zip(pieces, cuts):
            assert scales.sharding.is_fully_replicated == (parts == 1)
        local = [(x - rng.standard_normal(x.shape) * 1e-2).astype(np.float32) for x in local]
    text = dc.lower(put(anchor), put(local), residuals).compile().as_text()
    assert ("all-gather" in text) == any(parts == 1 for _, parts, _ in cuts)


def test_forged_block_specs_are_taken_or_dropped_as_on_the_host(setup):
    """A broadcast naming a block of 0, one that is no whole number of bytes, one past MAX_BLOCK,
    or an fp32 copy with a block named: the device path drops or takes each exactly as the host
    path does, and never raises."""
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    units = [build_setup.new_unit(setup._replace(spec=setup.spec._replace(device_encode=d)), 0, 0, state)
             for d in (True, False)]
    p = 0
    shapes = {path: units[0].latest[p][1][path].shape for path in setup.fragments[p].paths}
    version = 1
    for spec in ("fp32+b0", "int8+b0", "int4+b3", "int8+b1048576", "int8+b32"):
        values = {path: np.full(shape, 0.01, np.float32) for path, shape in shapes.items()}
        try:
            codec = codec_specs.codec_from_spec(spec)
        except messages.MessageError:
            codec = codec_specs.codec_from_spec(spec.split("+")[0])  # sent under a spec it does not match
        tensors, payload, _ = payloads.pack_fragment(values, codec)
        header = {"kind": "fragment", "learner": 0, "incarnation": 0, "seq": version, "fragment": p,
                  "base_version": version, "version": version, "c_steps": 0, "c_tokens": 0, "codec": spec,
                  "delta_against": None, "tensors": tensors}
        frame = messages.encode(header, payload)
        got = [u.receive(frame) for u in units]
        assert got[0] == got[1], spec
        version += got[0] is not None
    assert units[0].dropped_frames == units[1].dropped_frames >= 3


def test_an_overflowing_error_feedback_round_trip_is_refused_and_keeps_every_residual():
    """absmax = float32 max: 127 x (max / 127) decodes to inf, which the host's error feedback
    refuses; the device encoder refuses it too, and no tensor's residual moves."""
    dc = device_codecs.for_spec("int8+ef")
    big = np.full(64, np.finfo(np.float32).max, np.float32)
    fine = np.linspace(-1, 1, 64, dtype=np.float32)
    with pytest.raises(codecs.NonFiniteError):
        codec_specs.codec_from_spec("int8+ef").encode(big, codecs.ErrorFeedbackState(np.zeros(64, np.float32), ()))
    residuals = (np.full(64, 0.5, np.float32), np.full(64, 0.25, np.float32))
    pieces, new = dc.encode((fine, big), (np.zeros(64, np.float32), np.zeros(64, np.float32)), residuals)
    with pytest.raises(codecs.NonFiniteError):
        device_codecs.to_wire(dc, jax.device_get(pieces), [(64,), (64,)])
    for r, n in zip(residuals, new):
        np.testing.assert_array_equal(np.asarray(n), r)


def merged(setup, unit, steps):
    """Step `unit` `steps` times beside a K = 1 syncer that merges its frames at once; yields
    (the syncer's state, the Publish) for each merge."""
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    for i in range(steps):
        unit.apply_due()
        for frame in unit.step().frames:
            state, actions = sync.on_contribution(setup.policy, state, frame, float(i))
            for action in actions:
                if isinstance(action, sync.Publish):
                    yield state, action


def test_no_host_anchor_stays_on_the_devices_once_versions_live_there(setup):
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit = build_setup.new_unit(setup, 0, 0, state)
    for _, action in merged(setup, unit, 8):
        unit.receive(action.frames[0])
    held = [p for p, (_, v) in unit.anchors.items() if type(v).__name__ == "DeviceValues"]
    assert held and not set(held) & set(unit._placed)


@pytest.mark.parametrize("setup", [1], indirect=True, ids=["data"])  # recompiles everything: once
# 8 s each; without warm_up (the control: arrivals compile) in the slow suite
@pytest.mark.parametrize("warm", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_warm_up_compiles_the_broadcast_decoders_too(setup, warm):
    """After warm_up a learner's first int8 delta and a joiner's first fp32 copy compile nothing:
    each fragment shape's decoders ran on zero payloads before any clock (without warm_up, they
    compile on arrival)."""
    jax.clear_caches()  # nothing compiled by the tests before
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit, joiner = (build_setup.new_unit(setup, 0, 0, state) for _ in range(2))
    assert unit.spec.down_spec == "int8"
    if warm:
        unit.warm_up()
        joiner.warm_up()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else None)
    arrivals = 0
    for state, action in merged(setup, unit, 6):
        compiles.clear()
        unit.receive(action.frames[0])
        joiner.receive(sync.full_frame(state, action.fragment))
        arrivals += 1
        assert (compiles == []) == warm or arrivals > 2, compiles
    assert arrivals >= 3 and unit.dropped_frames == joiner.dropped_frames == 0
