"""A learner unit: one learner's devices, jitted inner step and train state, driven by the pure
learner state machine (diloco.algo.learner). Every runtime runs its learners through this class.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), docs/algorithm.md#learner.

The send path (a send's encode, on the devices or the host, and its frame) is in
diloco/runtime/unit_send.py and the eager outer steps in diloco/runtime/unit_eager.py; both are
called with the unit, whose device state and codec state they read and write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from diloco.algo import device_codecs
from diloco.algo import learner as lsm
from diloco.algo import messages, payloads
from diloco.algo.codecs import Codec
from diloco.algo.eager import Momentum
from diloco.algo.fragments import Fragment, Path, Schedule, assemble, get_path, set_path
from diloco.data import batch_share, train_batch, trained_tokens
from diloco.runtime import world
from diloco.runtime import unit_eager, unit_send
from diloco.runtime.transfer import DeviceValues
from diloco.runtime.unit_send import Ticket
from diloco.train.trainer import Compiled


class StepResult(NamedTuple):
    tokens: int
    loss: float | None  # None unless fetched (fetching syncs the device)
    sends: tuple[lsm.Send, ...]
    frames: tuple[bytes, ...]


class _Deferred(NamedTuple):
    """A step's sends whose frames are finished later (docs/design.md#deferred-encode)."""

    tickets: tuple[Ticket, ...]
    metrics: dict | None  # the step's metrics, when its loss is to be fetched
    frames: tuple[bytes, ...] | None = None  # once encoded

    @property
    def sends(self) -> tuple[lsm.Send, ...]:
        return tuple(t.send for t in self.tickets)


class UnitSpec(NamedTuple):
    """What every learner shares: how to cut batches, fragments, schedule and the up codec."""

    train: object  # Corpus.train: the token stream (int32 [n]), or packed fine-tuning rows (sft.Rows)
    seed: int
    num_learners: int
    batch_size: int
    seq_len: int
    fragments: tuple[Fragment, ...]
    schedule: Schedule
    up_codec: Codec
    up_spec: str
    shard_block: int = 0  # data.shard_block: 0 = contiguous shards
    # Encode block-format contributions on the learner's devices (docs/design.md#encoding-on-the-device);
    # False: on the host, from a copy of the fragment's params (benchmarks compare the two).
    device_encode: bool = True
    down_spec: str = "fp32"  # the broadcasts' delta codec (syncer.Policy.down_spec): warm_up compiles its decoder
    # rows per step of each learner (runtime.learner_batch, diloco/config/learner_batch.py); () or a
    # learner beyond it (one a tape adds): batch_size
    learner_batch: tuple[int, ...] = ()
    # Eager outer steps under an outer momentum a learner can follow (eager.momentum_of): the stand-in
    # adds the move that momentum carries into the next merge (docs/algorithm.md#eager-outer-steps)
    eager_momentum: Momentum | None = None

    def rows_of(self, learner: int) -> int:
        """Learner's batch rows with every slice up: its own step's shape, compiled for it alone."""
        return self.learner_batch[learner] if learner < len(self.learner_batch) else self.batch_size


class LearnerUnit:
    """Owns device state and host anchors; not thread-safe (one driver per unit)."""

    def __init__(self, spec: UnitSpec, learner: int, incarnation: int, compiled: Compiled,
                 anchors: dict[int, tuple[int, dict[Path, np.ndarray]]], step: int = 0,
                 key: bytes | None = None):
        """key: this learner's authentication key (diloco/algo/auth.py); None = frames go unsigned."""
        self.spec, self.learner, self.compiled = spec, learner, compiled
        self._key = key
        # anchors[p] = (version, values) applied; latest[p] = newest received (decoding base)
        self.anchors = dict(anchors)
        self.latest = dict(anchors)
        versions = tuple(anchors[p][0] for p in range(len(spec.fragments)))
        self.ls = lsm.init(learner, incarnation, versions, step)
        params = assemble(spec.fragments, {p: v for p, (_, v) in anchors.items()})
        self.state = compiled.init(jax.device_put(params, compiled.state_sharding.params))
        self.state = self.state.replace(
            step=jax.device_put(np.int32(step), compiled.state_sharding.step))
        self.codec_states: dict[Path, object] = {}
        self.sent_local: dict[int, dict[Path, np.ndarray]] = {}  # fragment -> local values at its send
        self.dropped_frames = 0
        self._deferred: list[_Deferred] = []  # step(defer=True) results awaiting finish()
        # The device encoder of the up codec, if it has one. keep_overlap needs each send's local
        # values on the host (sent_local) anyway, so it encodes there.
        # So do eager outer steps: each send's stand-in is made from its exact pseudo-gradient.
        self.device_codec = (device_codecs.for_spec(spec.up_spec) if spec.device_encode
                             and not spec.schedule.keep and not spec.schedule.eager else None)
        # Eager outer steps (diloco/runtime/unit_eager.py): per fragment the anchor A, per send in
        # flight (by seq) its stand-in u; under spec.eager_momentum, per fragment the syncer's outer
        # momentum rebuilt up to the held version and per send in flight its pseudo-gradient's share g.
        self.eager_anchor = {p: dict(v) for p, (_, v) in anchors.items()} if spec.schedule.eager else {}
        self.stand_ins: dict[int, dict[Path, np.ndarray]] = {}
        self.momenta: dict[int, dict[Path, np.ndarray]] = {}
        self.guesses: dict[int, dict[Path, np.ndarray]] = {}
        self.sends_per_merge: dict[int, float] = {}  # per fragment, as the last answering apply showed
        # Broadcasts are decoded on the devices too, unless they span processes (a learner world):
        # there receive stays host work, as the leader takes broadcasts alone (docs/multihost.md).
        self.device_decode = self.device_codec is not None and all(
            x.sharding.is_fully_addressable for x in jax.tree.leaves(self.state.params))
        # fragment -> (host values, their copy on the devices): the anchor the device encoder reads
        self._placed: dict[int, tuple[Mapping, dict[Path, jax.Array]]] = {}
        self.host_bytes = 0  # bytes contributions copied from the devices to the host

    @property
    def tokens_per_step(self) -> int:
        return self.spec.rows_of(self.learner) * self.spec.seq_len

    def blocking(self) -> lsm.InFlight | None:
        return lsm.blocking(self.ls, self.spec.schedule)

    def give_up(self, fragment: int) -> None:
        self.ls = lsm.give_up(self.ls, fragment)

    def apply_due(self) -> tuple[lsm.Pending, ...]:
        """Apply every received fragment whose apply step has come (before the next inner step).
        Returns those applied by overwriting: their unsent progress is gone (the ledger's
        "overwritten"); a kept apply carries it on into the next send."""
        left = self.ls.in_flight
        self.ls, ready = lsm.to_apply(self.ls, self.spec.schedule)
        if not ready:
            return ()
        if any(t.snapshot is not None and t.send.fragment == q.fragment
               for d in self._deferred for t in d.tickets for q in ready):
            self._settle()  # encode against the anchor the send was made from, before it moves
        if self.spec.schedule.eager:
            return unit_eager.apply(self, ready, left)
        alpha = self.spec.schedule.alpha
        params = self.state.params
        for q in ready:
            version, values = self.latest[q.fragment]
            _, before = self.anchors[q.fragment]
            self.anchors[q.fragment] = (version, values)
            if isinstance(values, DeviceValues):  # nothing host-held of p is needed on the devices now
                self._placed.pop(q.fragment, None)
            if q.kept and not q.answers:  # rebase: Theta' + (local - Theta), the send snapshot too
                params = self._rebase(params, q.fragment, before, values)
                continue
            # The snapshot of the fragment's latest send (the one a merge answers, bar the rare
            # case of two sends in flight); an overwrite voids it, as it voids the counters.
            sent = self.sent_local.pop(q.fragment, None)
            sent = sent if q.kept else None
            olds = {path: get_path(params, path) for path in values}
            if sent is None and alpha == 0.0 and self.device_codec is not None:
                # An overwrite: the params become a copy, made on the devices, of the version's
                # values there (the next step donates the params; the anchor stays).
                glob = self._on_device(q.fragment, values)
                placed = jax.device_put(glob, {path: x.sharding for path, x in olds.items()}, may_alias=False)
                for path, x in placed.items():
                    params = set_path(params, path, x)
                continue
            # One transfer each way per fragment, not one per tensor.
            locals_ = jax.device_get(olds) if sent is not None or alpha != 0.0 else {}
            news = {path: np.asarray(lsm.applied(glob, locals_.get(path), None if sent is None else sent[path],
                                                 alpha), np.float32) for path, glob in values.items()}
            params = self._put(params, olds, news)
        self.state = self.state.replace(params=params)
        return tuple(q for q in ready if not q.kept)

    def _rebase(self, params, p: int, before: dict, after: dict):
        """Move fragment p's params (and its latest send snapshot) by after - before: the unsent
        progress, and what a kept answer will keep, ride on the new version."""
        sent = self.sent_local.get(p)
        olds = {path: get_path(params, path) for path in after}
        locals_ = jax.device_get(olds)
        news = {path: np.asarray(lsm.rebased(np.asarray(locals_[path]), before[path], after[path]), np.float32)
                for path in after}
        if sent is not None:
            for path in after:
                sent[path] = lsm.rebased(sent[path], before[path], after[path])
        return self._put(params, olds, news)

    @staticmethod
    def _put(params, olds: dict, news: dict):
        """params with `news` in place of `olds`, each on its old sharding, in one device_put."""
        placed = jax.device_put(news, {path: x.sharding for path, x in olds.items()})
        for path, x in placed.items():
            params = set_path(params, path, x)
        return params

    def warm_up(self, *smaller: int) -> None:
        """Compile the inner step before a wall clock starts, on a copy of the state (the step
        donates its input), so step times, speed factors and the time ledger measure steps, not XLA.
        `smaller`: batch sizes a failure tape will ask for (each batch shape compiles once)."""
        c, s = self.compiled, self.spec
        for rows in (s.rows_of(self.learner), *smaller):
            state = jax.device_put(self.state, c.state_sharding, may_alias=False)
            batch = train_batch(s.train, seed=s.seed, learner=self.learner, num_learners=s.num_learners,
                                step=0, batch_size=rows, seq_len=s.seq_len, shard_block=s.shard_block)
            jax.block_until_ready(c.train_step(state, self.place(batch)))
        if self.device_codec is None:
            return
        states = dict(self.codec_states)
        for p, frag in enumerate(s.fragments):  # each fragment shape's encoder; its results dropped
            unit_send.start(self, lsm.Send(p, 0, 0, 0, 0, 0), copy=False).work()
            if not self.device_decode:
                continue
            # and the decoders of a broadcast coming back, delta and full copy, on zero payloads
            paths = sorted(frag.paths)
            shapes = [tuple(get_path(self.state.params, path).shape) for path in paths]
            base = self._on_device(p, self.anchors[p][1])
            for spec, anchor in ((s.down_spec, tuple(base[path] for path in paths)), ("fp32", None)):
                decoder = device_codecs.decoder_for(spec)
                if decoder is not None:
                    size = sum(decoder.sizes(shapes))
                    zeros = jax.device_put(np.zeros(size, np.uint8), self._replicated())
                    jax.block_until_ready(decoder.apply(anchor, zeros, shapes))
        self.codec_states = states

    def step(self, fetch_loss: bool = False, rows: int | None = None, defer: bool = False) -> StepResult:
        """One inner step on this learner's shard, then the sends the schedule asks for. `rows`
        shrinks the batch (a learner that lost slices); its tokens, hence its weight, drop with it.
        The tokens are those trained on (of fine-tuning rows, the assistant's): what the ledger
        books and the merge weighs. `defer`: return at once, without frames or loss; `finish`
        hands them out later, framed after the next step is dispatched."""
        batch = self.batch(rows)
        self.state, metrics = self.compiled.train_step(self.state, self.place(batch))
        return self.stepped(batch, metrics, fetch_loss, defer)

    def place(self, batch):
        """The batch on the learner's devices. A batch of this process's rows alone (data=grain in
        a learner's world, docs/data.md#sharding) becomes the global array of every process's rows."""
        share = batch_share(self.spec.train)
        if share == 1:
            return jax.device_put(batch, self.compiled.batch_sharding)
        return world.global_batch(batch, self.compiled.batch_sharding, len(jax.tree.leaves(batch)[0]) * share)

    def batch(self, rows: int | None):
        s = self.spec
        return train_batch(s.train, seed=s.seed, learner=self.learner, num_learners=s.num_learners, step=self.ls.step,
                           batch_size=s.rows_of(self.learner) if rows is None else rows, seq_len=s.seq_len,
                           shard_block=s.shard_block)

    def stepped(self, batch, metrics, fetch_loss: bool, defer: bool) -> StepResult:
        """What follows a step once it is dispatched: the counters, the sends and their frames."""
        tokens = trained_tokens(batch) * batch_share(self.spec.train)  # a world's process: of every process's rows
        self.ls, sends = lsm.after_step(self.ls, self.spec.schedule, tokens)
        tickets = tuple(unit_send.start(self, send, copy=defer) for send in sends)
        if defer:
            self._deferred.append(_Deferred(tickets, metrics if fetch_loss else None))
            return StepResult(tokens, None, sends, ())
        frames = tuple(unit_send.frame(self, t) for t in tickets)
        loss = float(metrics["loss"]) if fetch_loss else None
        return StepResult(tokens, loss, sends, frames)

    def finish(self) -> tuple[tuple[bytes, ...], float | None]:
        """The frames and loss of the oldest deferred step (`step(defer=True)`), framed now,
        while the step dispatched since runs on the devices (docs/design.md#deferred-encode)."""
        self._settle(1)
        d = self._deferred.pop(0)
        return d.frames, None if d.metrics is None else float(d.metrics["loss"])

    def drain(self) -> None:
        """Wait for the frame threads of deferred sends to end (their frames stay to be taken)."""
        for d in self._deferred:
            for t in d.tickets:
                if t.job is not None:
                    t.job.wait()

    @property
    def deferred(self) -> int:
        """Steps whose frames `finish` has still to hand out."""
        return len(self._deferred)

    def _on_device(self, p: int, values: Mapping) -> dict[Path, jax.Array]:
        """Fragment p's `values` on the learner's devices, on its params' shardings: a broadcast
        decoded there already is; host values are put there once (a version's values stay the
        same object until another version replaces them)."""
        if isinstance(values, DeviceValues):
            return values.leaves
        hit = self._placed.get(p)
        if hit is None or hit[0] is not values:
            shardings = {path: get_path(self.state.params, path).sharding for path in values}
            hit = self._placed[p] = (values, jax.device_put(dict(values), shardings))
        return hit[1]

    def _replicated(self):
        """A sharding that puts a whole array on every device of the learner."""
        sharding = jax.tree.leaves(self.state.params)[0].sharding
        return NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else sharding

    def _settle(self, count: int | None = None) -> None:
        """Frame the oldest `count` (all: None) deferred steps not yet framed, in step order, so
        host-encoded error-feedback residuals advance as they would without deferral."""
        for i, d in enumerate(self._deferred[:count]):
            if d.frames is None:
                self._deferred[i] = d._replace(frames=tuple(unit_send.frame(self, t) for t in d.tickets),
                                               tickets=tuple(Ticket(t.send) for t in d.tickets))

    def flush(self) -> StepResult:
        """Final contributions of every fragment with unsent progress (see learner.flush)."""
        self._settle()
        self.ls, sends = lsm.flush(self.ls, self.spec.schedule.eager)
        return StepResult(0, None, sends, tuple(unit_send.frame(self, unit_send.start(self, send, copy=False))
                                                for send in sends))

    def receive(self, frame: bytes) -> tuple[int, int] | None:
        """A broadcast arrived: decode it against the newest version held; (fragment, version) or
        None. A unit that encodes on its devices decodes there too (when the frame's codec has a
        device decoder, and not in a learner world): only the payload crosses, the values stay."""
        try:
            msg = messages.decode(frame)
            h = msg.header
            p = h["fragment"]
            frag = self.spec.fragments[p]
            base_version, base = self.latest[p]
            expected = {path: (get_path(self.state.params, path).shape, np.float32) for path in frag.paths}
            decoder = device_codecs.decoder_for(h["codec"]) if self.device_decode else None
            if decoder is not None:
                layout = payloads.tensor_layout(h, expected)
                raw = decoder.check(h, msg.payload, [shape for _, shape in layout])
                decoder = None if raw is None else decoder
            if decoder is None:
                values = payloads.unpack_fragment(h, msg.payload, None, expected)
        except (messages.MessageError, IndexError, KeyError):
            self.dropped_frames += 1
            return None
        if h["version"] <= base_version:
            return None
        if h["delta_against"] is not None and h["delta_against"] != base_version:
            self.dropped_frames += 1  # cannot decode: wait for a full copy
            return None
        if decoder is not None:
            on_device = None if h["delta_against"] is None else self._on_device(p, base)
            leaves = decoder.apply(None if on_device is None else tuple(on_device[path] for path, _ in layout),
                                   jax.device_put(raw, self._replicated()), [shape for _, shape in layout])
            values = DeviceValues(dict(zip((path for path, _ in layout), leaves)))
        elif h["delta_against"] is not None:
            values = {path: base[path] + values[path] for path in values}
        self.latest[p] = (h["version"], values)
        self.ls = lsm.on_fragment(self.ls, self.spec.schedule, p, h["version"], messages.merged_keys(h))
        return p, h["version"]

    def params_host(self) -> dict:
        return jax.device_get(self.state.params)
