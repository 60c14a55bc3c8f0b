"""Generation: the KV cache gives what recomputing the whole sequence gives, batched prompts of
different lengths equal each prompt alone, transformers' greedy continuations, and sampling rules."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.config import ModelConfig
from diloco.hf import load
from diloco.model import build
from diloco.model.generate import Sampling, generate, init_cache, left_pad, sample

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY = ModelConfig(name="tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=128)


def _recompute_greedy(model, prompt, n):
    """The reference without a cache: a full forward over the whole sequence for every token."""
    apply = jax.jit(model.apply)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(apply(model.params, jnp.asarray([seq]))[0, -1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("variant", [{}, {"positions": "learned", "norm": "layer", "mlp": "gelu",
                                          "qkv_bias": True, "o_bias": True, "mlp_bias": True},
                                     {"qk_norm": True, "head_dim": 8, "rope_scaling": "llama3",
                                      "rope_original_max_len": 16}])
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
