"""A random Markov chain source whose entropy rate, the lowest loss any model can reach, is exact.

Reference: Cover & Thomas, "Elements of Information Theory", 2nd ed., Theorem 4.2.4
(entropy rate of a stationary Markov chain: H = sum_i mu_i H(P_i.)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MarkovChain:
    """State s moves to successors[s, k] with probability probs[s, k] (V states, B successors)."""

    successors: np.ndarray  # int64 [V, B]; column 0 is (s + 1) mod V
    probs: np.ndarray  # float64 [V, B]; rows sum to 1

    @property
    def vocab(self) -> int:
        return self.successors.shape[0]


def make_chain(vocab: int, branching: int, seed: int) -> MarkovChain:
    """Random sparse chain. Every state leads to (s + 1) mod V, so all states form one cycle: the
    chain is irreducible and its stationary distribution unique; the other B - 1 successors are
    distinct states drawn at random, and the B probabilities of each row come from Dirichlet(1)."""
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching={branching} must be in [1, vocab={vocab}]")
    rng = np.random.default_rng([seed, 0])
    succ = np.empty((vocab, branching), dtype=np.int64)
    for s in range(vocab):
        nxt = (s + 1) % vocab
        others = rng.choice(vocab - 1, size=branching - 1, replace=False)
        others += others >= nxt  # skip nxt itself: draw from the V - 1 other states
        succ[s] = np.concatenate([[nxt], others])
    probs = rng.dirichlet(np.ones(branching), size=vocab)
    return MarkovChain(succ, probs)


def stationary(chain: MarkovChain, tol: float = 1e-13, max_iters: int = 1_000_000) -> np.ndarray:
    """mu with mu P = mu, by power iteration on the lazy chain (P + I) / 2: same fixed point, but
    aperiodic, so it converges even for a pure cycle (branching 1)."""
    v = chain.vocab
    mu = np.full(v, 1.0 / v)
    for _ in range(max_iters):
        moved = np.bincount(chain.successors.ravel(), (mu[:, None] * chain.probs).ravel(), minlength=v)
        new = 0.5 * (mu + moved)
        if np.abs(new - mu).sum() < tol:
            return new / new.sum()
        mu = new
    raise RuntimeError(f"stationary distribution of a {v}-state chain did not converge "
                       f"in {max_iters} iterations")


def entropy_rate(chain: MarkovChain) -> float:
    """sum_s mu_s H(P_s), in nats per token."""
    p = chain.probs
    row_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
    return float(stationary(chain) @ row_entropy)


def sample(chain: MarkovChain, n: int, seed: int) -> np.ndarray:
    """n states of a stationary run: the first drawn from mu, each next one from its row."""
    rng = np.random.default_rng([seed, 1])
    cum = np.cumsum(chain.probs, axis=1)
    cum[:, -1] = 1.0  # rounding must not leave a gap above the last successor
    u = rng.random(n)
    out = np.empty(n, dtype=np.int64)
    s = int(rng.choice(chain.vocab, p=stationary(chain)))
    # The walk is sequential by nature; plain lists keep the per-step cost near 100 ns.
    succ, cum_rows, uu = chain.successors.tolist(), cum.tolist(), u.tolist()
    for t in range(n):
        out[t] = s
        row = cum_rows[s]
        k = 0
        while row[k] < uu[t]:
            k += 1
        s = succ[s][k]
    return out
