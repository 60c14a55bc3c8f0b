"""The model-facing half of task scoring: loglikelihoods of continuations (one forward pass over a
padded batch), greedy generation cut at stop strings (diloco/model/generate.py, one dispatch a
batch), per-document metrics and their 95% intervals (docs/evaluation.md#what-is-scored).
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco.model.generate import BUCKET, generate

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


@functools.partial(jax.jit, static_argnames="apply")
def _target_logprobs(params, tokens_BxL, targets_BxL, apply):
    """log p(target_t | tokens_<=t) and whether the target is the argmax, at every position."""
    logp_BxLxV = jax.nn.log_softmax(apply(params, tokens_BxL).astype(jnp.float32), axis=-1)
    picked_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return picked_BxL, jnp.argmax(logp_BxLxV, axis=-1) == targets_BxL


def loglikelihoods(model, max_seq_len: int, pairs: Sequence[tuple[list[int], list[int]]],
                   batch_size: int) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per
    (context tokens, continuation tokens) pair. Rows are right-padded: a causal model's logits at a
    real position never see the pads after it, so a row scores as it would alone. A context too
    long for the model loses its oldest tokens. With several devices and a batch_size they divide,
    the rows are split across them (the weights replicated)."""
    params, rows_on = _placement(model.params, batch_size)
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        rows = [(list(c) + list(x))[-(max_seq_len + 1):] for c, x in chunk]
        width = min(-(-max(len(r) - 1 for r in rows) // BUCKET) * BUCKET, max_seq_len)
        tokens = np.zeros((batch_size, width), np.int32)  # a fixed batch shape: one compile per width
        targets = np.zeros((batch_size, width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r) - 1], targets[i, :len(r) - 1] = r[:-1], r[1:]
        tokens, targets = jax.device_put(tokens, rows_on), jax.device_put(targets, rows_on)
        logp, greedy = jax.device_get(_target_logprobs(params, tokens, targets, apply=model.apply))
        for i, ((_, cont), r) in enumerate(zip(chunk, rows)):
            span = slice(len(r) - 1 - len(cont), len(r) - 1)
            out.append((float(logp[i, span].sum()), bool(greedy[i, span].all())))
    return out


def _placement(params, batch_size: int):
    """(params, where a batch's rows go): split over every device along the batch when it divides,
    else the default device."""
    devices = jax.devices()
    if len(devices) == 1 or batch_size % len(devices):
        return params, None
    mesh = Mesh(np.asarray(devices), ("batch",))
    return jax.device_put(params, NamedSharding(mesh, P())), NamedSharding(mesh, P("batch"))


def generate_until(model, cfg, tokenizer, prompts: Sequence[list[int]], until: Sequence[str], max_new: int,
                   batch_size: int) -> list[str]:
    """Greedy continuations of each prompt, cut before the first stop string (and at end of text)."""
    max_new = max(1, min(max_new, cfg.max_seq_len // 2))
    keep = cfg.max_seq_len - max_new  # room for the new tokens: a longer prompt loses its oldest tokens
    stops = [t for t in (tokenizer.eos_id,) if t is not None]
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p)[-keep:] for p in prompts[start:start + batch_size]]
        result = generate(model, cfg, chunk, max_new, stop_ids=stops)
        out += [cut(tokenizer.decode(row), until) for row in result.tokens]
    return out


def cut(text: str, until: Sequence[str]) -> str:
    ends = [text.find(u) for u in until if u and u in text]
    return text[:min(ends)] if ends else text


# ---- metrics -------------------------------------------------------------------------------------

def choice_correct(lls: Sequence[float], choices: Sequence[str], gold: int) -> tuple[bool, bool]:
    """(acc, acc_norm) of one document as lm-eval defines them: the answer with the highest summed
    loglikelihood, and with the highest loglikelihood per character of the answer."""
    lls = np.asarray(lls, np.float64)
    lengths = np.asarray([max(len(c), 1) for c in choices], np.float64)
    return int(np.argmax(lls)) == gold, int(np.argmax(lls / lengths)) == gold


def exact_match(prediction: str, targets: Sequence[str]) -> bool:
    return any(prediction.strip() == t.strip() for t in targets)


def _words(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1(prediction: str, targets: Sequence[str]) -> float:
    """Token-overlap F1 between the prediction and its best-matching target (SQuAD's)."""
    best = 0.0
    for t in targets:
        p, g = _words(prediction), _words(t)
        if not p or not g:
            best = max(best, float(p == g))
            continue
        common = sum((Counter(p) & Counter(g)).values())
        if common:
            precision, recall = common / len(p), common / len(g)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (stays inside [0, 1], sensible at 0 or n of n)."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(values: Sequence[float], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile bootstrap interval of the mean (fixed seed: the same scores, the same interval)."""
    values = np.asarray(values, np.float64)
    if len(values) == 0:
        return 0.0, 1.0
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))
