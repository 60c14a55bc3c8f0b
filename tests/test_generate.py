"""Generation: the KV cache gives what recomputing the whole sequence gives, batched prompts of
different lengths equal each prompt alone, transformers' greedy continuations, sampling rules, and
the on-device decode loop gives exactly what a host loop of one dispatch per token gives."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.hf import load
from diloco.pretrained import shipped_smollm2
from diloco.model import Model, build
from diloco.model.generate import (NO_TOKEN, Sampling, _decode_loop, buckets, generate, init_cache, left_pad,
                                   sample)
from test_model import TINY

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _recompute_greedy(model, prompt, n):
    """The reference without a cache: a full forward over the whole sequence for every token."""
    apply = jax.jit(model.apply)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(apply(model.params, jnp.asarray([seq]))[0, -1])))
    return seq[len(prompt):]


# the architecture variants (5-7 s each) in the slow suite; the families' fixtures run by default
@pytest.mark.parametrize("variant", [{}, pytest.param({"positions": "learned", "norm": "layer", "mlp": "gelu",
                                                       "qkv_bias": True, "o_bias": True, "mlp_bias": True},
                                                      marks=pytest.mark.slow),
                                     pytest.param({"qk_norm": True, "head_dim": 8, "rope_scaling": "llama3",
                                                   "rope_original_max_len": 16}, marks=pytest.mark.slow)])
def test_kv_cache_greedy_equals_recomputing_the_sequence(variant):
    cfg = dataclasses.replace(TINY, **variant)
    model = build(cfg, 256, seed=3)
    # Scaled-up weights make the argmax decisive, so a cache error changes tokens, not ties.
    model = model._replace(params=jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, model.params))
    prompt = [5, 17, 200, 3, 99, 42, 7]
    out = generate(model, cfg, [prompt], 12)
    assert out.tokens[0] == _recompute_greedy(model, prompt, 12)


def test_batched_prompts_of_different_lengths_equal_each_prompt_alone():
    model = build(TINY, 256, seed=4)
    model = model._replace(params=jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, model.params))
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2], [100]]
    together = generate(model, TINY, prompts, 8)
    for prompt, tokens in zip(prompts, together.tokens):
        assert tokens == generate(model, TINY, [prompt], 8).tokens[0]


@pytest.mark.parametrize("name", ["llama3", "gpt2"])
def test_greedy_generation_matches_transformers_generate(name):
    pre = load(FIXTURES / name)
    ref = json.loads((FIXTURES / name / "generate.json").read_text())
    out = generate(pre.model, pre.config, ref["prompt_ids"], len(ref["new_ids"][0]))
    assert out.tokens == ref["new_ids"]


def test_left_padded_prefill_matches_transformers_with_an_attention_mask():
    pre = load(FIXTURES / "llama3")
    ref = np.load(FIXTURES / "llama3" / "padded.npz")
    mask = ref["attention_mask"].astype(bool)
    cache = init_cache(pre.config, *ref["tokens"].shape)
    logits, cache = pre.model.decode(pre.model.params, jnp.asarray(ref["tokens"]), jnp.asarray(mask), cache)
    np.testing.assert_allclose(np.asarray(logits)[mask], ref["logits"][mask], atol=1e-4)
    assert cache["pos_B"].tolist() == mask.sum(1).tolist()


def test_stop_tokens_end_a_row_and_are_not_returned():
    model = build(TINY, 256, seed=5)
    free = generate(model, TINY, [[1, 2, 3]], 10).tokens[0]
    stop = free[4]
    out = generate(model, TINY, [[1, 2, 3], [1, 2, 3]], 10, stop_ids=[stop])
    first = free.index(stop)
    assert out.tokens[0] == free[:first] and out.stopped == [True, True]


def test_left_pad_and_cache_length_checks():
    tokens, mask = left_pad([[1, 2], [3]])
    assert tokens.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[True, True], [False, True]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])
    model = build(TINY, 256, seed=0)
    with pytest.raises(ValueError, match="more than model.max_seq_len=128"):
        generate(model, TINY, [[1] * 100], 29)
    with pytest.raises(ValueError, match="top_p=0 must be in"):
        generate(model, TINY, [[1]], 2, Sampling(temperature=1.0, top_p=0))


def test_sampling_rules():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)

    def freq(s):
        return np.bincount(np.asarray(jax.vmap(lambda k: sample(logits, k, s))(keys))[:, 0], minlength=4) / 2000

    assert int(sample(logits, keys[0], Sampling())[0]) == 0  # greedy
    assert freq(Sampling(temperature=1.0, top_k=1))[0] == 1.0
    top2 = freq(Sampling(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.8) < 0.04
    # top_p=0.7: 0.5 alone is short of 0.7, so {0, 1} is the smallest nucleus.
    nucleus = freq(Sampling(temperature=1.0, top_p=0.7))
    assert nucleus[2:].sum() == 0 and abs(nucleus[0] - 0.5 / 0.8) < 0.04
    assert freq(Sampling(temperature=1.0, top_p=0.4))[0] == 1.0  # the top token always stays
    full = freq(Sampling(temperature=1.0))
    np.testing.assert_allclose(full, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    # A low temperature sharpens towards the argmax.
    assert freq(Sampling(temperature=0.2))[0] > 0.9


def _stepwise(model, cfg, prompts, n, sampling=Sampling(), stop_ids=(), seed=0):
    """The reference: a jitted prefill, then a host loop of one jitted step per token, with token i
    drawn with jax.random.split(key(seed), n)[i] (what generate did before its loop moved onto the
    device). Returns (tokens up to each row's first stop, stopped, decode tokens, raw steps BxT)."""
    tokens_BxP, mask_BxP = left_pad(prompts)
    B = len(prompts)
    cache = init_cache(cfg, B, tokens_BxP.shape[1] + n)
    keys = jax.random.split(jax.random.key(seed), n)
    prefill = jax.jit(lambda p, t, m, c, k: (lambda lc: (sample(lc[0][:, -1], k, sampling), lc[1]))(
        model.decode(p, t, m, c)))
    step = jax.jit(lambda p, t, c, k: (lambda lc: (sample(lc[0][:, 0], k, sampling), lc[1]))(
        model.decode(p, t[:, None], jnp.ones((B, 1), bool), c)))
    next_B, cache = prefill(model.params, tokens_BxP, mask_BxP, cache, keys[0])
    out, decoded = [np.asarray(next_B)], 0
    done_B = np.isin(out[0], list(stop_ids))
    for i in range(1, n):
        if done_B.all():
            break
        decoded += int((~done_B).sum())
        next_B, cache = step(model.params, next_B, cache, keys[i])
        out.append(np.asarray(next_B))
        done_B |= np.isin(out[-1], list(stop_ids))
    steps_BxT = np.stack(out, axis=1)
    rows, stopped = [], []
    for row in steps_BxT.tolist():
        hits = [j for j, t in enumerate(row) if t in stop_ids]
        rows.append(row[:hits[0]] if hits else row)
        stopped.append(bool(hits))
    return rows, stopped, decoded, steps_BxT


def _sharp(model):
    # Scaled-up weights make the argmax decisive, so a cache error changes tokens, not ties.
    return model._replace(params=jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, model.params))


PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [1, 2, 3], [100]]  # left-padded into one batch of unequal rows
VARIANTS = [{}, {"positions": "learned", "norm": "layer", "mlp": "gelu", "qkv_bias": True, "o_bias": True,
                 "mlp_bias": True},
            {"qk_norm": True, "head_dim": 8, "rope_scaling": "llama3", "rope_original_max_len": 16}]


@pytest.mark.parametrize("variant", [0, *(pytest.param(v, marks=pytest.mark.slow) for v in range(1, len(VARIANTS)))])
def test_device_loop_equals_the_per_token_loop_on_tiny_models(variant):
    cfg = dataclasses.replace(TINY, **VARIANTS[variant])
    model = build(cfg, 256, seed=3)
    for m, sampling in ((_sharp(model), Sampling()), (model, Sampling(0.8, 20, 0.9))):
        ref, stopped, decoded, _ = _stepwise(m, cfg, PROMPTS, 12, sampling, seed=1)
        out = generate(m, cfg, PROMPTS, 12, sampling, seed=1)
        assert (out.tokens, out.stopped, out.new_tokens) == (ref, stopped, len(ref) + decoded)
        assert decoded == 3 * 11  # no stop ids: every row runs all 11 steps after the prefill


@pytest.mark.parametrize("name", ["llama3", "gpt2", "qwen3", "mistral"])
def test_device_loop_equals_the_per_token_loop_on_each_family(name):
    pre = load(FIXTURES / name)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    ref, *_ = _stepwise(pre.model, pre.config, prompts, 10)
    assert generate(pre.model, pre.config, prompts, 10).tokens == ref


@pytest.mark.slow
@pytest.mark.skipif(shipped_smollm2() is None, reason="needs `make smollm2`")
def test_device_loop_equals_the_per_token_loop_on_smollm2():
    pre = load(shipped_smollm2())
    tok = pre.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in ("What is the capital of France?", "Name a colour.")]
    assert len(prompts[0]) != len(prompts[1])
    ref, stopped, decoded, _ = _stepwise(pre.model, pre.config, prompts, 16, stop_ids=tok.stop_ids)
    out = generate(pre.model, pre.config, prompts, 16, stop_ids=tok.stop_ids)
    assert (out.tokens, out.stopped, out.new_tokens) == (ref, stopped, len(ref) + decoded)
    assert stopped == [True, False]  # "The capital of France is Paris." then eos; the other runs on


def test_each_row_stops_at_its_own_stop_token_and_the_loop_at_the_last():
    model = build(TINY, 256, seed=5)
    free, _, _, raw_BxT = _stepwise(model, TINY, PROMPTS, 16)
    # Stop tokens chosen so row 0 stops at step 2 and row 1 at step 6 (each one's first occurrence
    # of any of them); row 2 runs to the end unless it meets one too.
    stops = [free[0][2], free[1][6]]
    assert stops[1] not in free[0][:2] and stops[0] not in free[1][:6]
    firsts = [next((j for j, t in enumerate(row) if t in stops), None) for row in free]
    ref, stopped, decoded, _ = _stepwise(model, TINY, PROMPTS, 16, stop_ids=stops)
    out = generate(model, TINY, PROMPTS, 16, stop_ids=stops)
    assert (out.tokens, out.stopped, out.new_tokens) == (ref, stopped, len(ref) + decoded)
    for row, first in zip(range(3), firsts):
        assert out.tokens[row] == free[row][:first] and out.stopped[row] == (first is not None)
    # Analytically: a row that stops at step j is running for steps 1..j, one that never stops for
    # every step the loop takes; the loop runs to the last row's stop.
    steps = 16 if None in firsts else max(firsts) + 1
    assert out.new_tokens == 3 + sum(steps - 1 if f is None else f for f in firsts)

    # On the device, a stopped row's slots hold NO_TOKEN and the loop ends once all rows stopped.
    first_B = jnp.asarray(raw_BxT[:, 0])
    width, slots = buckets(7, 16, TINY.max_seq_len)
    tokens_BxP, mask_BxP = left_pad(PROMPTS, width=width)
    cache = init_cache(TINY, 3, width + slots)
    _, cache = model.decode(model.params, tokens_BxP, mask_BxP, cache)
    keys_T = jax.random.split(jax.random.key(0), slots)
    all_stop = np.asarray(sorted({free[0][2], free[1][6], free[2][4]}), np.int32)
    out_BxT, n, decoded, _ = _decode_loop(model.params, first_B, cache, keys_T, all_stop, np.int32(16),
                                          decode=model.decode, sampling=Sampling(), on_step=None)
    firsts = [next(j for j, t in enumerate(row) if t in all_stop) for row in free]
    assert int(n) == max(firsts) + 1 and int(decoded) == sum(firsts)
    for row, first in enumerate(firsts):
        assert out_BxT[row, :first + 1].tolist() == raw_BxT[row, :first + 1].tolist()
        assert (np.asarray(out_BxT[row, first + 1:]) == NO_TOKEN).all()


class _FixedLogits:
    """A model whose next-token logits are the same whatever the context: draws from it are draws
    from one known distribution, so the loop's sampling can be checked analytically."""

    def __init__(self, logits_V):
        self.logits_V = jnp.asarray(logits_V, jnp.float32)

    def decode(self, params, tokens_BxL, mask_BxL, cache):
        B, L = tokens_BxL.shape
        return jnp.broadcast_to(self.logits_V + 0 * params["w"], (B, L, self.logits_V.shape[0])), cache

    def model(self):
        return Model(apply=None, params={"w": jnp.zeros(())}, decode=self.decode)


def test_sampling_in_the_loop_draws_token_i_with_key_i_and_respects_top_k_and_top_p():
    V, B, n = 256, 8, 24
    logits_V = np.linspace(0.0, 6.0, V)  # token 255 most likely, then 254, ...
    model = _FixedLogits(logits_V).model()
    prompts = [[1]] * B
    for sampling, allowed in ((Sampling(1.0, top_k=3), {253, 254, 255}),
                              (Sampling(1.0), set(range(V))),
                              (Sampling(0.7, top_k=40, top_p=0.5), None)):
        out = generate(model, TINY, prompts, n, sampling, seed=7)
        tokens_BxT = np.asarray(out.tokens)
        keys = jax.random.split(jax.random.key(7), n)
        expect_BxT = np.stack([np.asarray(sample(jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (B, V)),
                                                 keys[i], sampling)) for i in range(n)], axis=1)
        np.testing.assert_array_equal(tokens_BxT, expect_BxT)
        assert generate(model, TINY, prompts, n, sampling, seed=7).tokens == out.tokens  # deterministic
        assert generate(model, TINY, prompts, n, sampling, seed=8).tokens != out.tokens
        assert len(set(tokens_BxT[:, 0])) > 1 and len(set(tokens_BxT[0])) > 1  # fresh draws per row and step
        if allowed is not None:
            assert set(tokens_BxT.ravel()) <= allowed
    assert set(np.asarray(generate(model, TINY, prompts, n, Sampling(1.0, top_k=3), seed=7).tokens).ravel()) \
        == {253, 254, 255}  # 192 draws: each of the three appears


def test_one_and_zero_new_tokens():
    model = _sharp(build(TINY, 256, seed=4))
    ref, *_ = _stepwise(model, TINY, PROMPTS, 1)
    out = generate(model, TINY, PROMPTS, 1)
    assert out.tokens == ref and all(len(t) == 1 for t in out.tokens)
    assert out.new_tokens == 3 and out.run_s > 0 and out.tokens_per_s == 3 / out.run_s
    first = out.tokens[0][0]
    stopped = generate(model, TINY, PROMPTS, 5, stop_ids=[first])
    assert stopped.tokens[0] == [] and stopped.stopped[0] and stopped.new_tokens == \
        1 + sum(len(t) for t in stopped.tokens[1:])  # row 0 stopped at once; the others ran 4 steps
    with pytest.raises(ValueError, match="max_new_tokens=0 must be > 0"):
        generate(model, TINY, PROMPTS, 0)


def test_streaming_sees_every_step_in_order():
    model = _sharp(build(TINY, 256, seed=4))
    seen = []
    out = generate(model, TINY, PROMPTS, 9, on_step=lambda tokens_B: seen.append(tokens_B.tolist()))
    assert np.asarray(seen).T.tolist() == out.tokens
    stop = out.tokens[0][3]
    seen.clear()
    out = generate(model, TINY, [PROMPTS[0]], 9, stop_ids=[stop], on_step=lambda t: seen.append(int(t[0])))
    assert seen == out.tokens[0] + [stop]  # the stream ends with the stop token, as the CLI expects


def test_buckets():
    assert buckets(7, 12, 128) == (32, 32)
    assert buckets(33, 1, 128) == (64, 32)
    assert buckets(100, 28, 128) == (100, 28)  # the bucket would pass max_seq_len: exactly what fits
    assert buckets(90, 20, 128) == (96, 32) and sum(buckets(90, 20, 128)) <= 128
    with pytest.raises(ValueError, match="is 129 positions, more than model.max_seq_len=128"):
        buckets(100, 29, 128)


def test_calls_within_one_bucket_reuse_the_compiled_programs():
    model = build(TINY, 256, seed=6)
    generate(model, TINY, [[1, 2, 3], [4]], 12, stop_ids=[1, 2])
    compiles = []

    def listener(event, duration, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        # Other prompts, lengths, new-token counts, stop ids and seed, all within the same buckets.
        out = generate(model, TINY, [[9] * 20, [4, 4]], 30, stop_ids=[3, 5], seed=9)
        out = generate(model, TINY, [[8], [7] * 31], 2, stop_ids=[6, 7], seed=1)
        assert compiles == [] and len(out.tokens) == 2
        generate(model, TINY, [[8], [7] * 31], 33)  # the next bucket of new tokens: compiled anew
        assert compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_a_call_is_one_dispatch_of_one_program(monkeypatch):
    """The key split, the prefill and the loop are one compiled program, called once a call; its
    outputs are every token (the tokens equal a separate run's)."""
    import diloco.model.generate as gen
    model = _sharp(build(TINY, 256, seed=4))
    ref = generate(model, TINY, PROMPTS, 9, seed=2)
    calls = []
    real = gen._generate

    class Spy:
        @staticmethod
        def lower(*args, **kw):
            compiled = real.lower(*args, **kw).compile()

            class Once:
                def compile(self):
                    return lambda *a: calls.append(1) or compiled(*a)
            return Once()

    monkeypatch.setattr(gen, "_generate", Spy)
    out = generate(model, TINY, PROMPTS, 9, seed=2)
    assert calls == [1] and out.tokens == ref.tokens and out.new_tokens == ref.new_tokens
