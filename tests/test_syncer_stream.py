"""The streaming round accumulator (diloco/algo/roundsum.py): each admitted contribution is folded
into its round's running sums, and the merge is one compiled pass whatever the contributor count.

The merged Theta is compared with `reference_round`, the merge as it was before the accumulator
(every contribution's full fp32 local kept, deltas taken at the merge, merge.merge of the list,
then the outer step), for the same frames: within TOL of the step's size (float32 rounding of a
different summation order; measured differences are ~1e-7 of the step)."""

import numpy as np
import pytest

from diloco.algo import close as closing
from diloco.algo import merge as merging
from diloco.algo import codec_specs, outer, payloads, quorum, roundsum
from diloco.algo import syncer as sync
from diloco.algo.syncer_state import ref_of
from diloco.algo.fragments import Fragment
from diloco.algo.outer import make_outer
from diloco.runtime import syncer_ckpt
from syncer_frames import merges, publishes, raw_frame

TOL = 1e-5  # of max |Theta' - Theta|
UP = "int4"
PATHS = (("l", "a"), ("l", "b"), ("l", "c"))


def _theta(rng):
    shapes = {PATHS[0]: (64, 48), PATHS[1]: (48,), PATHS[2]: (300,)}
    return {p: rng.standard_normal(s, np.float32) * 0.1 for p, s in shapes.items()}


def _policy(K, method="rda", **kw):
    return sync.Policy(quorum.GraceConfig(K=K, gamma=0.0), make_outer("nesterov"), method, method,
                       down_codec=codec_specs.codec_from_spec("int8"), down_spec="int8", up_spec=UP, **kw)


def _start(pol, M, rng, embedding=False):
    theta = _theta(rng)
    frag = Fragment(0, PATHS, sum(x.size for x in theta.values()), embedding)
    return sync.init(pol, (frag,), (theta,), {m: 0 for m in range(M)})


def _frame(st, rng, m, seq, base, c_steps=4, scale=1e-2):
    """(frame, local): a contribution of learner m against version `base`, int4 on the wire, and
    the local values the syncer reconstructs from it (ref[base] - decoded payload)."""
    ref = ref_of(st.fragments[0], base)
    diff = {p: rng.standard_normal(x.shape, np.float32) * np.float32(scale) for p, x in ref.items()}
    codec = codec_specs.codec_from_spec(UP)
    tensors, payload, _ = payloads.pack_fragment(diff, codec)
    wire = payloads.unpack_fragment({"codec": UP, "tensors": tensors}, payload, codec,
                                    {p: (x.shape, np.float32) for p, x in ref.items()})
    local = {p: ref[p] - wire[p] for p in ref}
    fr = raw_frame(tensors, payload, learner=m, seq=seq, base_version=base, c_steps=c_steps,
                   c_tokens=c_steps * (8 + 3 * m), spec=UP)
    return fr, local


def reference_round(pol, fs, items, n_live, norms):
    """Theta after merging `items` [(local, base, c_steps, c_tokens)] into fragment state `fs`,
    the way the syncer merged before the streaming accumulator (its _merge and _step, verbatim in
    substance): deltas at the merge, clip, merge.merge of the list, live scale, outer step."""
    method = pol.embedding_merge if fs.spec.embedding else pol.merge
    deltas = []
    for local, base, _, _ in items:
        anchor = fs.theta
        if pol.anchor == "base" and ref_of(fs, base) is not None:
            anchor = ref_of(fs, base)
        deltas.append({p: np.asarray(merging.pseudo_gradient(anchor[p], local[p])) for p in local})
    recent = [n for n in norms if n > 0]
    if pol.clip > 0 and recent:
        bar = pol.clip * float(np.median(recent))
        for i, (_, _, c_steps, _) in enumerate(items):
            allowed, n = bar * max(c_steps, 1), merging.global_norm(deltas[i])
            if n > allowed:
                deltas[i] = {p: x * np.float32(allowed / n) for p, x in deltas[i].items()}
    weights = [merging.token_weight(c_tokens, c_steps) for _, _, c_steps, c_tokens in items]
    delta = merging.merge(deltas, weights, method)
    if pol.scale == "live" and len(items) < n_live:
        delta = {p: x * np.float32(len(items) / n_live) for p, x in delta.items()}
    theta, _ = outer.outer_step(pol.outer, fs.theta, fs.outer_state, delta)
    return {p: np.asarray(x) for p, x in theta.items()}


def _close_enough(got, want, before):
    step = max(float(np.max(np.abs(want[p] - before[p]))) for p in want)
    err = max(float(np.max(np.abs(got[p] - want[p]))) for p in want)
    assert err <= TOL * step, f"merged Theta off by {err:.3g}, {err / step:.3g} of the step {step:.3g}"
    return err / step


CASES = [dict(method=m, anchor=a) for m in ("average", "rda", "rda_fragment") for a in ("current", "base")]
CASES += [dict(method="rda", clip=2.0), dict(method="average", clip=2.0), dict(method="rda", scale="live"),
          dict(method="average", scale="live")]


@pytest.mark.parametrize("M", [1, 3, 6])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_streamed_merge_matches_the_reference_merge(case, M):
    rng = np.random.default_rng(M)
    kw = {k: v for k, v in case.items() if k != "method"}
    live = M + 1 if case.get("scale") == "live" else M  # one live learner never sends: scaled by M / (M + 1)
    pol = _policy(M, case["method"], **kw)
    st = _start(pol, live, rng)
    seq = 0
    for rnd in range(3):  # round 2 mixes stale bases (version 0 and 1) with current ones
        fs = st.fragments[0]
        items = []
        for m in range(M):
            seq += 1
            base = fs.version if (m + rnd) % 2 or rnd < 2 else max(0, fs.version - 1)
            # learner M - 1 of the clip case sends 30x its peers' move: admitted, then clipped
            big = 30.0 if case.get("clip") and m == M - 1 and M > 1 else 1.0
            fr, local = _frame(st, rng, m, seq, base, scale=1e-2 * big)
            st, actions = sync.on_contribution(pol, st, fr, float(seq))
            items.append((local, base, 4, 4 * (8 + 3 * m)))
        assert len(publishes(actions)) == 1
        want = reference_round(pol, fs, items, live, st.fragments[0].norms)
        _close_enough(st.fragments[0].theta, want, fs.theta)
    if case.get("clip") and M > 1:
        assert M - 1 in merges(st)[-1]["clipped"]


def test_the_open_round_keeps_sums_and_payloads_not_fp32_copies():
    rng = np.random.default_rng(0)
    pol = _policy(4)
    st = _start(pol, 4, rng)
    for m in range(3):
        st, _ = sync.on_contribution(pol, st, _frame(st, rng, m, m + 1, 0)[0], 0.0)
    fs = st.fragments[0]
    assert all(isinstance(c.local, roundsum.Local) for c in fs.contributions)
    assert fs.sums.keys == tuple(c.key for c in fs.contributions)
    assert len(fs.sums.sums) == len(PATHS)  # one fp32 array per tensor for the round, whatever M
    kept = sum(len(c.local.payload) for c in fs.contributions)
    assert kept < 0.2 * 3 * 4 * sum(x.size for x in fs.theta.values())  # int4 payloads, not fp32 locals
    # a Local reads back exactly the local values the syncer reconstructed
    c = fs.contributions[0]
    for p in PATHS:
        np.testing.assert_array_equal(c.local[p], c.local.ref[p] - c.local.wire(p))


def test_repeat_removes_the_older_contribution_exactly():
    """A repeat replaces the learner's earlier contribution: the sums are rebuilt from the kept
    payloads, so the merge is bit-identical to the round without the older one."""
    rng = np.random.default_rng(1)
    pol = _policy(3)
    st0 = _start(pol, 3, rng)
    f0a, _ = _frame(st0, rng, 0, 1, 0)
    f1, _ = _frame(st0, rng, 1, 1, 0)
    f0b, _ = _frame(st0, rng, 0, 2, 0)
    f2, _ = _frame(st0, rng, 2, 1, 0)
    st = st0
    for fr in (f0a, f1, f0b):
        st, actions = sync.on_contribution(pol, st, fr, 0.0)
    assert sync.Outcome((0, 0, 1), "carried", (0, 0, 2)) in actions
    st, _ = sync.on_contribution(pol, st, f2, 0.0)
    alone = st0
    for fr in (f1, f0b, f2):
        alone, _ = sync.on_contribution(pol, alone, fr, 0.0)
    for p in PATHS:
        np.testing.assert_array_equal(st.fragments[0].theta[p], alone.fragments[0].theta[p])


def test_a_checkpoint_of_an_open_round_resumes_bit_identical():
    """syncer_ckpt saves the open round's contributions (their Local decodes to the local values)
    but not the sums; the restored syncer rebuilds them and merges exactly as the uninterrupted one."""
    rng = np.random.default_rng(2)
    pol = _policy(3)
    st = _start(pol, 3, rng)
    frames = [_frame(st, rng, m, 1, 0)[0] for m in range(3)]
    for fr in frames[:2]:
        st, _ = sync.on_contribution(pol, st, fr, 0.0)
    arrays, meta = syncer_ckpt.to_checkpoint(st)
    restored = syncer_ckpt.from_checkpoint(arrays, meta, pol, tuple(fs.spec for fs in st.fragments))
    assert restored.fragments[0].sums is None and len(restored.fragments[0].contributions) == 2
    st, _ = sync.on_contribution(pol, st, frames[2], 0.0)
    restored, _ = sync.on_contribution(pol, restored, frames[2], 0.0)
    for p in PATHS:
        np.testing.assert_array_equal(st.fragments[0].theta[p], restored.fragments[0].theta[p])


def test_one_compiled_close_per_fragment_shape_whatever_the_contributor_count():
    """init compiles the close; rounds of 1 to 5 contributors reuse it (no compile in a round)."""
    rng = np.random.default_rng(3)
    grace = quorum.GraceConfig(K=1, gamma=0.8, cap_steps=10.0, tau=2)
    pol = _policy(1)._replace(grace=grace)
    st = _start(pol, 5, rng)
    compiled = closing._close_leaves._cache_size()
    for m in range(5):
        st = sync.observe_step_time(st, m, 1.0)
    seq = 0
    for n in (1, 2, 5, 3):
        version, t0 = st.fragments[0].version, 10.0 * (seq + 1)
        for m in range(n):
            seq += 1
            st, actions = sync.on_contribution(pol, st, _frame(st, rng, m, seq, version)[0], t0 + 0.01 * m)
        if st.fragments[0].version == version:
            st, actions = sync.on_deadline(pol, st, 0, t0 + 100.0)
        assert st.fragments[0].version == version + 1 and merges(st)[-1]["learners"] == list(range(n))
    assert closing._close_leaves._cache_size() == compiled


def test_fragments_of_equal_shapes_share_one_compiled_close_and_merge_as_they_did_alone():
    """Four fragments, two shapes apart from their paths: init compiles two closes, not four, and
    each fragment's round merges bit for bit as a syncer holding only that fragment merges it."""
    rng = np.random.default_rng(5)
    pol = _policy(1)
    shapes = [((8, 6), (6,)), ((8, 6), (6,)), ((5, 5), (5,)), ((8, 6), (6,))]
    frags, thetas = [], []
    for i, (a, b) in enumerate(shapes):
        paths = ((f"block_{i}", "w"), (f"block_{i}", "b"))
        thetas.append({paths[0]: rng.standard_normal(a, np.float32), paths[1]: rng.standard_normal(b, np.float32)})
        frags.append(Fragment(i, paths, sum(x.size for x in thetas[-1].values()), False))
    before = closing._close_leaves._cache_size()
    st = sync.init(pol, tuple(frags), tuple(thetas), {0: 0})
    assert closing._close_leaves._cache_size() - before == 2
    for i in range(len(frags)):
        alone = sync.init(pol, (frags[i]._replace(index=0),), (thetas[i],), {0: 0})
        diff = {p: rng.standard_normal(x.shape, np.float32) * np.float32(1e-2) for p, x in thetas[i].items()}
        tensors, payload, _ = payloads.pack_fragment(diff, codec_specs.codec_from_spec(UP))
        st, _ = sync.on_contribution(pol, st, raw_frame(tensors, payload, seq=1 + i, fragment=i, spec=UP), 1.0)
        alone, _ = sync.on_contribution(pol, alone, raw_frame(tensors, payload, spec=UP), 1.0)
        for path in thetas[i]:
            np.testing.assert_array_equal(st.fragments[i].theta[path], alone.fragments[0].theta[path])
        assert st.fragments[i].version == alone.fragments[0].version == 1


def test_an_overflowing_contribution_is_dropped_and_the_rest_merge_from_a_rebuild():
    """Nesterov's step of a 1e38 delta overflows: the largest is dropped, the sums are rebuilt from
    the others' payloads, and Theta is exactly the merge of those alone."""
    rng = np.random.default_rng(4)
    pol = _policy(3, theta_norm_bound=0.0)
    st0 = _start(pol, 3, rng)
    good = [_frame(st0, rng, m, 1, 0)[0] for m in range(2)]
    codec = codec_specs.codec_from_spec(UP)
    tensors, payload, _ = payloads.pack_fragment(
        {p: np.full(x.shape, 1e38, np.float32) for p, x in st0.fragments[0].theta.items()}, codec)
    huge = raw_frame(tensors, payload, learner=2, spec=UP)
    st = st0
    for fr in (good[0], huge, good[1]):
        st, actions = sync.on_contribution(pol, st, fr, 0.0)
    assert sync.Outcome((2, 0, 1), "quarantined:overflow") in actions
    pair = pol._replace(grace=pol.grace._replace(K=2))
    alone = sync.init(pair, tuple(fs.spec for fs in st0.fragments), (st0.fragments[0].theta,), {0: 0, 1: 0})
    for fr in good:
        alone, _ = sync.on_contribution(pair, alone, fr, 0.0)
    for p in PATHS:
        np.testing.assert_array_equal(st.fragments[0].theta[p], alone.fragments[0].theta[p])
    assert all(np.isfinite(x).all() for x in st.fragments[0].theta.values())


def test_host_norms_are_finite_for_huge_and_tiny_values():
    for v in (1e30, 3e38, 1e-30, 1e-44):
        x = np.full(1000, v, np.float32)
        want = float(np.float32(v)) * np.sqrt(1000.0)
        np.testing.assert_allclose(roundsum.norm(x), want, rtol=1e-6)
    assert roundsum.norm(np.zeros(10, np.float32)) == 0.0
