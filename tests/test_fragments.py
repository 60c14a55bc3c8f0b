"""Fragments of whole tensors, their packing strategies and the send schedule (docs/algorithm.md#fragments)."""

import itertools
import random

import jax
import numpy as np
import pytest

from diloco.algo import fragments as fr

V, D, F, L = 32, 8, 24, 4


def toy_params(n_layers=L, untied=False):
    def block():
        return {
            "attn": {"wq": np.ones((D, D)), "wk": np.ones((D, D // 2)), "wv": np.ones((D, D // 2)),
                     "wo": np.ones((D, D))},
            "mlp": {"w1": np.ones((D, F)), "w2": np.ones((F, D)), "w3": np.ones((D, F))},
            "norm1": {"scale": np.ones((D,))},
            "norm2": {"scale": np.ones((D,))},
        }

    params = {"embed": {"embedding": np.ones((V, D))}, "blocks": {str(i): block() for i in range(n_layers)},
              "final_norm": {"scale": np.ones((D,))}}
    if untied:
        params["lm_head"] = {"kernel": np.ones((D, V))}
    return params


def is_embedding(path):
    return path[0] in ("embed", "lm_head")


def assert_partition(frags, params, P):
    paths = list(fr.leaves_by_path(params))
    seen = [p for f in frags for p in f.paths]
    assert len(frags) == P and [f.index for f in frags] == list(range(P))
    assert sorted(seen) == sorted(paths) and len(seen) == len(set(seen))  # each tensor exactly once
    assert all(f.paths for f in frags)
    sizes = fr.tensor_sizes(params)
    assert all(f.size == sum(sizes[p] for p in f.paths) for f in frags)


@pytest.mark.parametrize("strategy", sorted(fr.FRAGMENTERS))
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_every_tensor_in_exactly_one_fragment(strategy, P):
    params = toy_params()
    assert_partition(fr.make_fragments(params, P, strategy), params, P)


@pytest.mark.parametrize("strategy", sorted(fr.FRAGMENTERS))
@pytest.mark.parametrize("untied", [False, True])
def test_embeddings_get_fragments_of_their_own(strategy, untied):
    params = toy_params(untied=untied)
    for P in (2, 4, 5):
        frags = fr.make_fragments(params, P, strategy, is_embedding=is_embedding)
        assert_partition(frags, params, P)
        for f in frags:
            kinds = {is_embedding(p) for p in f.paths}
            assert kinds == {f.embedding}  # never mixed, and the flag says which
        assert frags[-1].embedding and not frags[0].embedding  # embedding fragments come last


def test_embedding_fragment_count_follows_their_share_of_values():
    sizes_params = {"embed": {"e1": np.ones((600,)), "e2": np.ones((600,))},
                    "blocks": {str(i): {"w": np.ones((100,))} for i in range(8)}}
    emb = lambda p: p[0] == "embed"
    frags = fr.make_fragments(sizes_params, 4, is_embedding=emb)  # 1200 of 2000 values -> round(2.4) = 2
    assert [f.embedding for f in frags] == [False, False, True, True]
    frags = fr.make_fragments(sizes_params, 4, is_embedding=emb, embedding_fragments=1)
    assert [f.embedding for f in frags] == [False, False, False, True]
    with pytest.raises(ValueError, match="embedding_fragments=3"):
        fr.make_fragments(sizes_params, 4, is_embedding=emb, embedding_fragments=3)  # only 2 tensors


def test_single_fragment_cannot_separate_embeddings():
    with pytest.raises(ValueError, match="P=1"):
        fr.make_fragments(toy_params(), 1, is_embedding=is_embedding)
    (frag,) = fr.make_fragments(toy_params(), 1)  # plain DiLoCo: one fragment, nothing flagged
    assert not frag.embedding


def test_too_few_tensors_names_both_numbers():
    params = {"a": np.ones(3), "b": {"c": np.ones(2)}}
    for strategy in fr.FRAGMENTERS:
        with pytest.raises(ValueError, match=r"2 tensors.*P=3"):
            fr.make_fragments(params, 3, strategy)
    one_block = {"embed": np.ones(3), "blocks": {"0": {"a": np.ones(2), "b": np.ones(2), "c": np.ones(2)}}}
    with pytest.raises(ValueError, match=r"2 packable units.*P=3"):  # 4 tensors, but 2 layer units
        fr.make_fragments(one_block, 3, "layer_strided", is_embedding=lambda p: p == ("embed",))
    with pytest.raises(ValueError, match=r"2 layer units.*P=3"):
        fr.make_fragments(one_block, 3, "layer_sequential")
    with pytest.raises(ValueError, match="unknown fragment strategy 'nope'"):
        fr.make_fragments(params, 1, "nope")


def brute_force_opt(sizes, P):
    best = float("inf")
    for assign in itertools.product(range(P), repeat=len(sizes)):
        loads = [0] * P
        for s, b in zip(sizes, assign):
            loads[b] += s
        best = min(best, max(loads))
    return best


def test_balanced_packing_within_lpt_bound_of_optimum():
    rng = random.Random(0)
    for _ in range(60):
        n, P = rng.randint(3, 7), rng.choice([2, 3])
        if n < P:
            continue
        sizes = [rng.randint(1, 50) for _ in range(n)]
        bins = fr.balanced({(f"t{i}",): s for i, s in enumerate(sizes)}, P)
        got = max(sum(sizes[int(p[0][1:])] for p in b) for b in bins)
        opt = brute_force_opt(sizes, P)
        assert opt <= got <= (4 / 3 - 1 / (3 * P)) * opt + 1e-9, (sizes, P, got, opt)


def test_balanced_packing_sanity_on_large_instances():
    rng = random.Random(1)
    for _ in range(30):
        P = rng.randint(2, 24)
        sizes = {(f"t{i:03d}",): rng.choice([rng.randint(1, 10), rng.randint(100, 10_000)])
                 for i in range(rng.randint(P, 200))}
        bins = fr.balanced(sizes, P)
        loads = [sum(sizes[p] for p in b) for b in bins]
        total, biggest = sum(sizes.values()), max(sizes.values())
        assert max(loads) >= max(total / P, biggest)  # the lower bound on any packing
        assert max(loads) <= total / P + biggest  # greedy list scheduling never does worse (Graham)
        assert all(bins)


def test_balanced_is_deterministic_and_breaks_ties_by_path():
    sizes = {("b",): 5, ("a",): 5, ("d",): 5, ("c",): 5, ("e",): 1}
    bins = fr.balanced(sizes, 2)
    assert bins == [[("a",), ("c",), ("e",)], [("b",), ("d",)]]
    shuffled = dict(reversed(list(sizes.items())))
    assert fr.balanced(shuffled, 2) == bins
    # zero-size tensors never leave a bin empty
    assert all(fr.balanced({("x",): 0, ("y",): 0, ("z",): 0}, 3))
    params = toy_params()
    assert fr.make_fragments(params, 3) == fr.make_fragments(params, 3)


def test_block_index_parsing():
    assert fr.block_index(("blocks", "3", "attn", "wq")) == 3
    assert fr.block_index(("block_12", "mlp", "w_1")) == 12
    assert fr.block_index(("model", "layers_7", "w")) == 7
    assert fr.block_index(("decoder", "layer_0", "scale")) == 0
    assert fr.block_index(("mlp", "w_1")) is None
    assert fr.block_index(("final_norm", "scale")) is None


def test_layer_strided_and_sequential():
    params = toy_params()
    strided = fr.make_fragments(params, 2, "layer_strided", is_embedding=None)
    blocks_of = lambda f: sorted({fr.block_index(p) for p in f.paths} - {None})
    # units: blocks 0..3, then embed/embedding (4) and final_norm/scale (5); unit u -> u mod P
    assert [blocks_of(f) for f in strided] == [[0, 2], [1, 3]]
    assert ("embed", "embedding") in strided[0].paths and ("final_norm", "scale") in strided[1].paths
    sequential = fr.make_fragments(params, 3, "layer_sequential")
    # 6 units, unit u -> u*3 // 6: blocks 0,1 | blocks 2,3 | embedding and final norm
    assert [blocks_of(f) for f in sequential] == [[0, 1], [2, 3], []]
    with_emb = fr.make_fragments(params, 3, "layer_strided", is_embedding=is_embedding)
    # the embedding is pulled out first; units left: blocks 0..3 and final_norm
    assert [blocks_of(f) for f in with_emb] == [[0, 2], [1, 3], []]
    assert with_emb[0].paths[-1] == ("final_norm", "scale") and with_emb[2].embedding


def test_tensor_strategy_is_round_robin_in_path_order():
    sizes = {("c",): 1, ("a",): 9, ("b",): 4, ("d",): 2, ("e",): 3}
    assert fr.tensor(sizes, 2) == [[("a",), ("c",), ("e",)], [("b",), ("d",)]]


def test_fragments_of_abstract_params():
    params = jax.eval_shape(lambda: jax.tree.map(np.asarray, toy_params()))
    frags = fr.make_fragments(params, 4, is_embedding=is_embedding)
    assert frags == fr.make_fragments(toy_params(), 4, is_embedding=is_embedding)


def test_extract_and_insert_are_pure_and_round_trip():
    params = toy_params()
    frag = fr.make_fragments(params, 4, "layer_strided")[1]  # block 1 and the final norm
    values = fr.extract(params, frag)
    assert list(values) == list(frag.paths)
    new = fr.insert(params, frag, {p: v * 2 for p, v in values.items()})
    for path, leaf in fr.leaves_by_path(params).items():
        assert np.all(leaf == 1)  # the input is untouched
        expected = 2 if path in frag.paths else 1
        assert np.all(fr.leaves_by_path(new)[path] == expected)
    untouched = [k for k in params["blocks"] if all(p[:2] != ("blocks", k) for p in frag.paths)]
    for k in untouched:  # subtrees outside the fragment are shared, not copied
        assert new["blocks"][k] is params["blocks"][k]
    with pytest.raises(ValueError, match="missing"):
        fr.insert(params, frag, dict(list(values.items())[1:]))
    path = frag.paths[0]
    with pytest.raises(ValueError, match="shape"):
        fr.insert(params, frag, {**values, path: np.ones((3, 3, 3))})


def test_schedule_one_fragment_per_step_when_P_equals_H():
    sched = fr.make_schedule(24, 24)
    assert sched.offsets == tuple(range(24)) and sched.tau == 2 and sched.alpha == 0.0
    sent = {p: [] for p in range(24)}
    for step in range(1, 24 * 5 + 1):
        due = fr.due(sched, step)
        assert len(due) == 1
        sent[due[0]].append(step)
    for p, steps in sent.items():
        assert len(steps) == 5 and set(np.diff(steps)) == {24}
    assert fr.due(sched, 1) == (1,) and fr.due(sched, 24) == (0,)


def test_schedule_spreads_offsets_when_P_below_H():
    sched = fr.make_schedule(3, 12, tau=1)
    assert sched.offsets == (0, 4, 8)
    sends = [fr.due(sched, s) for s in range(1, 25)]
    assert sum(len(d) for d in sends) == 6
    for p in range(3):
        steps = [s for s, d in enumerate(sends, 1) if p in d]
        assert np.diff(steps).tolist() == [12]


def test_schedule_errors_name_values():
    with pytest.raises(ValueError, match="P=5.*H=4"):
        fr.make_schedule(5, 4)
    with pytest.raises(ValueError, match="tau=4.*H=4"):
        fr.make_schedule(4, 4, tau=4)
    with pytest.raises(ValueError, match="alpha=1.5"):
        fr.make_schedule(2, 4, alpha=1.5)
    with pytest.raises(ValueError, match="step=0"):
        fr.due(fr.make_schedule(2, 4), 0)
