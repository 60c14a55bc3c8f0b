"""The host passes cut into hostpool.CHUNK pieces (diloco/algo/hostpool.py): the same bits whatever
the number of threads (norms, deltas, sums, decoded values, encoded bytes), equal to the kernels
run once over the whole array, and faults reported in tensor order as a serial loop would."""

import math
import os

import numpy as np
import pytest

from diloco.algo import codec_kernels, codec_specs, codecs, hostpool, messages, payloads, roundsum
from diloco.algo import syncer as sync
from syncer_frames import publishes, raw_frame

CHUNK = hostpool.CHUNK
N = 3 * CHUNK + 37  # three whole pieces, a short one, and a tail that is no whole lane


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, monkeypatch):
    monkeypatch.setenv(hostpool.ENV, str(request.param))
    return request.param


def test_thread_count_follows_affinity_and_the_cap(monkeypatch):
    monkeypatch.delenv(hostpool.ENV, raising=False)
    assert hostpool.threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(hostpool.ENV, "1")
    assert hostpool.threads() == 1
    monkeypatch.setenv(hostpool.ENV, "0")
    with pytest.raises(ValueError, match="DILOCO_HOST_THREADS"):
        hostpool.threads()


def test_run_keeps_order_raises_the_first_error_and_nests(threads):
    assert hostpool.run([lambda i=i: i * i for i in range(9)]) == [i * i for i in range(9)]

    def fail(i):
        raise KeyError(i)

    with pytest.raises(KeyError, match="3"):
        hostpool.run([lambda: 0, lambda: 0, lambda: 0, lambda: fail(3), lambda: fail(5)])
    # a pass started inside another's task finishes (the inner pieces are claimed by any thread)
    inner = hostpool.run([lambda k=k: sum(hostpool.each(10 * CHUNK, lambda lo, hi: hi - lo + k)) for k in range(4)])
    assert inner == [10 * CHUNK + 10 * k for k in range(4)]
    assert hostpool.start(lambda: 7)() == 7


def pieces_sum(f, x):
    """The norm's definition: the kernel's sum per CHUNK piece, the pieces' sums added exactly."""
    parts = [f(x[lo:hi]) for lo, hi in hostpool.pieces(x.size)]
    return math.fsum(parts)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(N).astype(np.float32)
    r = a + (rng.standard_normal(N) * 1e-2).astype(np.float32)
    w = (rng.standard_normal(N) * 1e-2).astype(np.float32)
    return a, r, w


def test_deltas_norms_and_sums_do_not_depend_on_the_thread_count(threads):
    a, r, w = arrays()
    d, nw, nd = roundsum.delta(a, r, w.copy())
    # the delta is numpy's two subtractions, element by element
    np.testing.assert_array_equal(d, np.subtract(a, np.subtract(r, w)))
    assert nw == math.sqrt(pieces_sum(codec_kernels.sumsq, w))
    assert nd == math.sqrt(pieces_sum(codec_kernels.sumsq, d))
    assert roundsum.norm(w) == nw
    old = (np.random.default_rng(1).standard_normal(N) * 1e3).astype(np.float32)
    for scaled in (True, False):
        got = d.copy()
        roundsum._axpy(got, old, np.float32(0.37), scaled)
        want = d + old * np.float32(0.37) if scaled else d * np.float32(0.37) + old
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(roundsum.add_into(a, w.copy()), a + w)


def test_the_same_bits_on_one_thread_and_two(monkeypatch):
    a, r, w = arrays(2)
    got = {}
    for t in ("1", "2"):
        monkeypatch.setenv(hostpool.ENV, t)
        d, nw, nd = roundsum.delta(a, r, w.copy())
        s = d.copy()
        roundsum._axpy(s, r, np.float32(1e-3), True)
        got[t] = (d.tobytes(), nw, nd, s.tobytes(), roundsum.norm(s))
    assert got["1"] == got["2"]


def test_a_non_finite_value_in_any_piece_gives_an_inf_norm(threads):
    for at in (5, CHUNK + 1, N - 1):
        a, r, w = arrays(3)
        w[at] = np.nan
        _, nw, nd = roundsum.delta(a, r, w)
        assert nw == nd == math.inf


@pytest.mark.parametrize("name", ["int8", "int4", "fp4", "2bit"])
def test_block_codecs_equal_one_serial_kernel_call(name, threads):
    codec = codecs.CODECS[name]()
    fmt = {"int8": codecs._int_format(8), "int4": codecs._int_format(4), "fp4": codecs._fp4_format(),
           "2bit": codecs._two_bit_format()}[name]
    x = (np.random.default_rng(4).standard_normal(N) * 1e-2).astype(np.float32)
    payload, _ = codec.encode(x, None)
    out = codec.decode(payload, x.shape)
    # the reference: each kernel once over every whole block, on this thread
    block, per = 64, 8 // fmt.bits
    full, nb = N // block, -(-N // block)
    buf = np.frombuffer(payload, np.uint8)
    scales = buf[: 4 * nb].view("<f4")
    want = np.empty(full * block, np.float32)
    assert codec_kernels.decode_blocks(buf[4 * nb: 4 * nb + full * block // per].reshape(full, block // per), scales,
                                       fmt.kind, fmt.bits, fmt.lut, np.float32(np.abs(fmt.lut).max()),
                                       want.reshape(full, block))
    np.testing.assert_array_equal(out[: full * block], want)
    sc, packed = np.empty(full, np.float32), np.empty((full, block // per), np.uint8)
    xs = x[: full * block].reshape(full, block)
    assert codec_kernels.encode_blocks(xs, xs.view(np.uint32), fmt.kind, fmt.bits, np.float32(fmt.levels),
                                       fmt.classes, sc, packed)
    assert payload[: 4 * full] == sc.tobytes()
    assert payload[4 * nb: 4 * nb + packed.size] == packed.tobytes()
    assert int(hostpool.aligned_empty(5).ctypes.data) % 64 == 0 and out.ctypes.data % 64 == 0


def two_tensors(spec="int4+zstd1"):
    rng = np.random.default_rng(5)
    values = {("a",): rng.standard_normal((CHUNK, 2), np.float32), ("b",): rng.standard_normal(N, np.float32)}
    tensors, payload, _ = payloads.pack_fragment(values, codec_specs.codec_from_spec(spec))
    assert len(payload) >= CHUNK  # large enough that the tensors are decoded concurrently
    return values, tensors, payload


def test_unpack_fragment_decodes_concurrently_and_faults_in_tensor_order(threads):
    values, tensors, payload = two_tensors()
    expected = {p: (x.shape, np.float32) for p, x in values.items()}
    header = {"codec": "int4+zstd1", "tensors": tensors}
    codec = codec_specs.codec_from_spec("int4")
    got = payloads.unpack_fragment(header, payload, None, expected)
    for p, x in values.items():
        np.testing.assert_array_equal(got[p], codec.decode(codec.encode(x, None)[0], x.shape))
    cut = tensors[0]["nbytes"]
    bad_b = payload[:cut + 40] + bytes(10) + payload[cut + 50:]  # the second tensor's frame damaged
    with pytest.raises(messages.MessageError, match=r"\('b',\)") as e:
        payloads.unpack_fragment(header, bad_b, None, expected)
    assert e.value.reason == "codec_error"
    bad_both = payload[:40] + bytes(10) + bad_b[50:]  # the first one too: its fault is the one raised
    with pytest.raises(messages.MessageError, match=r"\('a',\)"):
        payloads.unpack_fragment(header, bad_both, None, expected)
    wrong_b = {**expected, ("b",): ((N + 1,), np.float32)}  # a later shape fault waits for the first decode
    with pytest.raises(messages.MessageError, match=r"\('a',\)"):
        payloads.unpack_fragment(header, bad_both, None, wrong_b)
    with pytest.raises(messages.MessageError, match="header shape") as e:
        payloads.unpack_fragment(header, payload, None, wrong_b)
    assert e.value.reason == "wrong_shape"


def test_a_bad_checksum_is_quarantined_as_if_checked_first(threads):
    values, tensors, payload = two_tensors("int4")
    from diloco.algo import quorum
    from diloco.algo.fragments import Fragment
    from diloco.algo.outer import make_outer

    theta = {p: np.zeros(x.shape, np.float32) for p, x in values.items()}
    pol = sync.Policy(quorum.GraceConfig(K=1, gamma=0.0), make_outer("nesterov"), "rda", up_spec="int4")
    st = sync.init(pol, (Fragment(0, tuple(theta), sum(x.size for x in theta.values()), False),), (theta,), {0: 0})
    good = raw_frame(tensors, payload, spec="int4")
    for bad in (good[:-9] + bytes([good[-9] ^ 1]) + good[-8:],  # a flipped payload bit: decodes fine
                good[:-9] + b"\xff" * 9):  # and one that would fail its decode too
        st2, actions = sync.on_contribution(pol, st, bad, 1.0)
        assert actions == (sync.Outcome(None, "quarantined:checksum"),)
        assert st2.fragments == st.fragments and st2.quarantined == {"checksum": 1}
    st2, actions = sync.on_contribution(pol, st, good, 1.0)
    assert len(publishes(actions)) == 1


def test_large_buffers_are_reused_only_when_nothing_reads_them():
    import jax

    n = 3 * CHUNK
    a = hostpool.aligned_empty(n)
    at = a.ctypes.data
    assert at % 64 == 0 and a.dtype == np.float32 and a.shape == (n,)
    view = a.reshape(3, -1)[1:]
    del a
    b = hostpool.aligned_empty(n)
    assert b.ctypes.data != at  # a view of it lives
    del view
    c = hostpool.aligned_empty(n)
    assert c.ctypes.data == at
    c.fill(7.0)
    held = jax.device_put(c)  # read in place by jax
    assert held.unsafe_buffer_pointer() == at
    del c
    d = hostpool.aligned_empty(n)
    assert d.ctypes.data not in (at, b.ctypes.data)
    d.fill(0.0)
    assert (np.asarray(held) == 7.0).all()


def test_dropping_idle_buffers_frees_only_those_nothing_reads():
    """Between runs (a run's memory check) the idle buffers go: a 135M model's held gigabytes. One
    a view or a jax array still reads stays, and its memory is not handed out again."""
    import gc

    import jax

    n = 5 * CHUNK  # a size no other test asks for
    hostpool.drop_idle()
    a, b, c = (hostpool.aligned_empty(n) for _ in range(3))
    view = b[CHUNK:]
    b.fill(3.0)
    held = jax.device_put(c)  # read in place
    del a, b, c
    hostpool.drop_idle()
    assert len(hostpool._BUFFERS[n]) == 2  # a's owner went
    fresh = hostpool.aligned_empty(n)
    assert fresh.ctypes.data not in (held.unsafe_buffer_pointer(), view.ctypes.data - 4 * CHUNK)
    assert (view == 3.0).all()
    del view, held, fresh
    gc.collect()
    assert hostpool.drop_idle() >= 3 * (4 * n + 64) and n not in hostpool._BUFFERS
    assert hostpool.drop_idle() == 0
