"""Split a params pytree into P fragments of whole tensors and schedule their sync (docs/algorithm.md#fragments).

Reference: Streaming DiLoCo (Douillard et al., arXiv 2501.18512), as used by Decoupled DiLoCo
(arXiv 2604.21428).

Params are nested dicts with str keys; a tensor is named by its path, the tuple of keys leading to
it. Every strategy in FRAGMENTERS has the shape `fn(sizes: {path: size}, P) -> list of P path
lists`, so `make_fragments` treats them alike.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

Path = tuple[str, ...]


class Fragment(NamedTuple):
    """One unit of synchronisation: whole tensors, merged and stepped together by the syncer."""

    index: int
    paths: tuple[Path, ...]  # sorted
    size: int  # number of values (not bytes) over all its tensors
    embedding: bool  # all tensors are embedding tensors: merged by averaging, not RDA (section 4)


def leaves_by_path(params: Mapping[str, Any]) -> dict[Path, Any]:
    """Every leaf of a nested dict, keyed by its path, in sorted path order."""
    out: dict[Path, Any] = {}

    def walk(node: Any, prefix: Path) -> None:
        if isinstance(node, Mapping):
            for key in node:
                if not isinstance(key, str):
                    raise TypeError(f"params keys must be str, got {key!r} under {prefix}")
                walk(node[key], prefix + (key,))
        else:
            out[prefix] = node

    walk(params, ())
    return dict(sorted(out.items()))


def tensor_sizes(params: Mapping[str, Any]) -> dict[Path, int]:
    """Number of values of every tensor; works on arrays and on jax.ShapeDtypeStruct alike."""
    return {path: math.prod(np.shape(leaf)) for path, leaf in leaves_by_path(params).items()}


def _too_few(what: str, n: int, P: int) -> ValueError:
    return ValueError(
        f"cannot split {n} {what} into P={P} non-empty fragments; use P <= {n}"
        " (fragments hold whole tensors)"
    )


def balanced(sizes: Mapping[Path, int], P: int) -> list[list[Path]]:
    """Greedy bin packing (LPT): largest tensor first, each into the currently smallest bin.

    Ties are broken deterministically: equal sizes by path, equal bins by fewer tensors then
    lower index, so a zero-size tensor never leaves a bin empty. LPT's makespan is at most
    (4/3 - 1/(3P)) times the optimum (Graham 1969).
    """
    if len(sizes) < P:
        raise _too_few("tensors", len(sizes), P)
    bins: list[list[Path]] = [[] for _ in range(P)]
    heap = [(0, 0, b) for b in range(P)]  # (load, tensor count, bin index)
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        load, count, b = heapq.heappop(heap)
        bins[b].append(path)
        heapq.heappush(heap, (load + sizes[path], count + 1, b))
    return [sorted(b) for b in bins]


# A block index is the first key that is an integer ("3") or a block-like name with one ("block_3",
# "layers_3"); keys such as "w_1" inside a block are not block indices.
_BLOCK_KEY = re.compile(r"^(?:(?:block|blocks|layer|layers)_)?(\d+)$")


def block_index(path: Path) -> int | None:
    """The transformer block a tensor belongs to, parsed from the first integer-like key."""
    for key in path:
        match = _BLOCK_KEY.match(key)
        if match:
            return int(match.group(1))
    return None


def _layer_units(paths: Iterable[Path]) -> list[list[Path]]:
    """Blocks in index order, then every non-block tensor as one more unit, in path order."""
    blocks: dict[int, list[Path]] = {}
    others: list[Path] = []
    for path in sorted(paths):
        i = block_index(path)
        if i is None:
            others.append(path)
        else:
            blocks.setdefault(i, []).append(path)
    return [blocks[i] for i in sorted(blocks)] + [[p] for p in others]


def layer(paths: Iterable[Path], P: int, strided: bool = True) -> list[list[Path]]:
    """Whole transformer blocks per fragment (the Streaming DiLoCo layer split).

    Units are the blocks, then each non-block tensor (final norm, head, ...) as an extra unit.
    Strided: unit u goes to fragment u mod P. Sequential: contiguous runs, unit u to u*P // U.
    """
    units = _layer_units(paths)
    U = len(units)
    if U < P:
        raise _too_few("layer units (blocks plus non-block tensors)", U, P)
    frags: list[list[Path]] = [[] for _ in range(P)]
    for u, unit in enumerate(units):
        frags[u % P if strided else u * P // U].extend(unit)
    return [sorted(f) for f in frags]


def tensor(paths: Iterable[Path], P: int) -> list[list[Path]]:
    """Tensors in path order dealt round robin: tensor i goes to fragment i mod P."""
    ordered = sorted(paths)
    if len(ordered) < P:
        raise _too_few("tensors", len(ordered), P)
    return [ordered[p::P] for p in range(P)]


def layer_strided(sizes: Mapping[Path, int], P: int) -> list[list[Path]]:
    """Block i to fragment i mod P (the Streaming DiLoCo default)."""
    return layer(sizes, P, strided=True)


def layer_sequential(sizes: Mapping[Path, int], P: int) -> list[list[Path]]:
    """Contiguous runs of blocks per fragment."""
    return layer(sizes, P, strided=False)


FRAGMENTERS: dict[str, Callable[[Mapping[Path, int], int], list[list[Path]]]] = {
    "balanced": balanced,
    "layer_strided": layer_strided,
    "layer_sequential": layer_sequential,
    "tensor": tensor,
}


def _capacity(strategy: str, paths: list[Path]) -> int:
    """How many non-empty fragments a strategy can make of these tensors."""
    if strategy.startswith("layer"):
        return len(_layer_units(paths))
    return len(paths)


def _embedding_share(P: int, sizes: dict[Path, int], emb: list[Path], cap_emb: int, cap_rest: int,
                     requested: int | None) -> int:
    """How many of the P fragments hold embeddings: proportional to their share of the values.

    Embeddings get at least one fragment and every other group keeps at least one, so neither
    kind is ever mixed with the other; `requested` overrides the proportional choice.
    """
    lo = max(1, P - cap_rest)
    hi = min(cap_emb, P - 1 if cap_rest else P)
    if cap_emb + cap_rest < P:
        raise ValueError(
            f"the model has {cap_emb + cap_rest} packable units ({cap_emb} embedding, {cap_rest} other),"
            f" fewer than P={P} fragments; use P <= {cap_emb + cap_rest}"
        )
    if lo > hi:
        raise ValueError(
            f"P={P} fragment cannot keep {cap_emb} embedding units apart from {cap_rest} other units"
            " (section 2); use P >= 2, or is_embedding=None to merge all tensors alike"
        )
    if requested is not None:
        if not lo <= requested <= hi:
            raise ValueError(f"embedding_fragments={requested} must lie in [{lo}, {hi}] for P={P}")
        return requested
    total = sum(sizes.values())
    share = sum(sizes[p] for p in emb) / total if total else 0.0
    return min(hi, max(lo, round(P * share)))


def make_fragments(
    params: Mapping[str, Any],
    P: int,
    strategy: str = "balanced",
    is_embedding: Callable[[Path], bool] | None = None,
    embedding_fragments: int | None = None,
) -> tuple[Fragment, ...]:
    """Split params into P non-overlapping fragments of whole tensors.

    Embedding tensors (`is_embedding(path)`) are packed first into fragments of their own, so each
    fragment merges either by weighted averaging or by RDA (section 4). They get a number of
    fragments proportional to their share of the values (at least 1; `embedding_fragments`
    overrides), the strategy then packs each group separately. Non-embedding fragments come first
    (indices 0..), embedding fragments last. With is_embedding=None nothing is flagged.
    """
    if strategy not in FRAGMENTERS:
        raise ValueError(f"unknown fragment strategy {strategy!r}; choose from {sorted(FRAGMENTERS)}")
    if not isinstance(P, int) or P < 1:
        raise ValueError(f"number of fragments P must be a positive integer, got {P!r}")
    sizes = tensor_sizes(params)
    if len(sizes) < P:
        raise ValueError(
            f"the model has {len(sizes)} tensors, fewer than P={P} fragments; use P <= {len(sizes)}"
        )
    flagged = is_embedding or (lambda path: False)
    emb = [p for p in sizes if flagged(p)]
    rest = [p for p in sizes if not flagged(p)]
    fragmenter = FRAGMENTERS[strategy]
    groups: list[tuple[list[Path], bool]] = []
    if emb and rest:
        P_emb = _embedding_share(P, sizes, emb, _capacity(strategy, emb), _capacity(strategy, rest),
                                 embedding_fragments)
        groups += [(g, False) for g in fragmenter({p: sizes[p] for p in rest}, P - P_emb)]
        groups += [(g, True) for g in fragmenter({p: sizes[p] for p in emb}, P_emb)]
    else:
        groups += [(g, bool(emb)) for g in fragmenter(sizes, P)]
    return tuple(
        Fragment(i, tuple(sorted(paths)), sum(sizes[p] for p in paths), is_emb)
        for i, (paths, is_emb) in enumerate(groups)
    )


def get_path(params: Mapping[str, Any], path: Path) -> Any:
    """The tensor at `path` of a nested params dict."""
    node: Any = params
    for key in path:
        node = node[key]
    return node


def extract(params: Mapping[str, Any], fragment: Fragment) -> dict[Path, Any]:
    """The fragment's tensors, keyed by path."""
    return {path: get_path(params, path) for path in fragment.paths}


def set_path(node: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    """New params with the tensor at `path` replaced; only the dicts along the path are copied."""
    head, rest = path[0], path[1:]
    if head not in node:
        raise KeyError(f"params have no key {head!r} (path {path})")
    new = dict(node)
    new[head] = set_path(node[head], rest, value) if rest else value
    return new


def assemble(fragments: Sequence[Fragment], values: Mapping[int, Mapping[Path, Any]]) -> dict[str, Any]:
    """Nested float32 params from every fragment's tensors (values[fragment index][path])."""
    params: dict = {}
    for frag in fragments:
        for path in frag.paths:
            node = params
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = np.asarray(values[frag.index][path], np.float32)
    return params


def insert(params: Mapping[str, Any], fragment: Fragment, values: Mapping[Path, Any]) -> dict[str, Any]:
    """New params with the fragment's tensors replaced by `values`; `params` is left untouched.

    Only the dicts along each replaced path are copied; every other subtree is shared.
    """
    if set(values) != set(fragment.paths):
        missing = sorted(set(fragment.paths) - set(values))
        extra = sorted(set(values) - set(fragment.paths))
        raise ValueError(f"fragment {fragment.index} values: missing {missing}, unexpected {extra}")
    old = extract(params, fragment)
    new: Any = params
    for path in fragment.paths:
        if np.shape(values[path]) != np.shape(old[path]):
            raise ValueError(
                f"fragment {fragment.index} tensor {path}: shape {np.shape(values[path])}"
                f" does not match params shape {np.shape(old[path])}"
            )
        new = set_path(new, path, values[path])
    return new


class Schedule(NamedTuple):
    """When each fragment leaves a learner and how the returning global fragment is applied."""

    H: int  # every fragment is sent once per H local steps
    offsets: tuple[int, ...]  # t_p in 0..H-1: fragment p is sent after step t with t mod H == t_p
    tau: int  # overlap: the merged fragment is applied tau steps after it was sent
    alpha: float  # learner mix: theta <- alpha * theta + (1 - alpha) * Theta (0 = overwrite)
    # Applying the merge that answers a send keeps the progress made since that send (Theta +
    # local - local at send; alpha unused) instead of overwriting it [unsure].
    keep: bool = False
    # A merge that took in none of this learner's sends: "now" applies it before the next step
    # (overwriting the unsent progress of that fragment); "defer" holds it until the learner's own
    # send of the fragment is answered (merges are cumulative), or until it gives up waiting [unsure].
    others: str = "now"
    # Eager outer steps (arXiv 2502.12996, docs/algorithm.md#eager-outer-steps): each send moves the
    # learner at once by its stand-in, `stand_in` times its own pseudo-gradient, and the answering
    # merge later adds the correction (merged change minus stand-in); tau may then reach H and beyond.
    eager: bool = False
    stand_in: float = 0.0


OTHERS = ("now", "defer")


def make_schedule(P: int, H: int, tau: int = 2, alpha: float = 0.0, keep: bool = False,
                  others: str = "now", eager: bool = False, stand_in: float = 0.0) -> Schedule:
    """Offsets spread evenly over 0..H-1 (t_p = p*H // P, so t_p = p when P = H). `eager` allows
    tau >= H: a send's stand-in step keeps the learner's next pseudo-gradient its own."""
    if not isinstance(P, int) or P < 1:
        raise ValueError(f"number of fragments P must be a positive integer, got {P!r}")
    if not isinstance(H, int) or H < 1:
        raise ValueError(f"sync period H must be a positive integer, got {H!r}")
    if P > H:
        raise ValueError(f"P={P} fragments cannot each be sent once per H={H} steps; need P <= H")
    if not isinstance(tau, int) or tau < 0 or (tau >= H and not eager):
        raise ValueError(f"overlap tau={tau!r} must be an integer with 0 <= tau < H={H}"
                         " (tau >= H needs eager outer steps)")
    if eager and (keep or alpha != 0.0):
        raise ValueError(f"eager outer steps keep the progress since a send by their own rule;"
                         f" keep={keep} and alpha={alpha} must be False and 0")
    if not 0.0 <= stand_in < math.inf:
        raise ValueError(f"stand-in scale {stand_in!r} must be a finite number >= 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"learner mix alpha={alpha!r} must lie in [0, 1]")
    if others not in OTHERS:
        raise ValueError(f"others={others!r} not in {'|'.join(OTHERS)}")
    return Schedule(H, tuple(p * H // P for p in range(P)), tau, float(alpha), bool(keep), others,
                    bool(eager), float(stand_in))


def due(schedule: Schedule, step: int) -> tuple[int, ...]:
    """Fragments a learner sends right after local step `step` (steps count from 1)."""
    if step < 1:
        raise ValueError(f"local steps count from 1, got step={step}")
    phase = step % schedule.H
    return tuple(p for p, offset in enumerate(schedule.offsets) if offset == phase)
