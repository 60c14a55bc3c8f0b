"""Claims checked against observation (docs/algorithm.md#claims-checked-against-observation): an
insider holding one learner's key, with the run's defaults (configs/train.yaml as `make train`
composes it), against a syncer driven the way a runtime drives it: every learner reports each step,
and sends its fragment every H steps, staggered, claiming the H - tau steps since it applied the
previous merge (keep_overlap off). Benign pseudo-gradients have a fixed norm per step in a random
direction each time; the insider sends a multiple of the one it would have sent."""

import numpy as np
import pytest
from conftest import tiny_cfg
from syncer_frames import frame

from diloco.algo import claims, replay
from diloco.algo import syncer as sync
from diloco.algo.fragments import Fragment
from diloco.config import load
from diloco.experiments.spec import _compose
from diloco.runtime import build, syncer_ckpt

W = ("layer", "w")
FRAGS = (Fragment(0, (W,), 1024, False),)
PER_STEP = 0.002  # a benign pseudo-gradient's norm per inner step; ||Theta_0|| is about 18.5
INSIDER = 3


class World:
    """The run's syncer with M learners stepping in lockstep, one step a second."""

    def __init__(self, cfg):
        self.cfg, self.pol, self.wire = cfg, build.policy(cfg), build.run_codecs(cfg)
        self.H, self.tau, self.M = cfg.fragments.H, cfg.fragments.tau, cfg.runtime.learners
        theta0 = {W: np.random.default_rng(0).normal(0.0, 0.58, (32, 32)).astype(np.float32)}
        self.st = sync.init(self.pol, FRAGS, (theta0,), {m: 0 for m in range(self.M)})
        self.rng, self.t, self.seq, self.deadlines = np.random.default_rng(1), 0, [0] * self.M, []
        self.step_tokens = cfg.data.batch_size * cfg.data.seq_len

    def apply(self, kind, at, data):
        self.st, actions = replay.apply(self.pol, self.st, replay.Input(kind, at, data))
        self.deadlines += [a.at for a in actions if isinstance(a, sync.SetDeadline)]
        return actions

    def due(self, m: int) -> bool:
        return self.t >= self.H and (self.t - self.H * m // self.M) % self.H == 0

    def benign(self) -> np.ndarray:
        d = self.rng.standard_normal((32, 32)).astype(np.float32)
        return d * np.float32(PER_STEP * (self.H - self.tau) / np.linalg.norm(d))

    def send(self, m: int, delta: np.ndarray, c_steps: int) -> tuple:
        """Learner m's contribution of `delta` claiming c_steps; the syncer's outcomes for it."""
        fs = self.st.fragments[0]
        ref = fs.refs[-1][1]
        self.seq[m] += 1
        raw = frame({W: ref[W] - delta}, ref, learner=m, seq=self.seq[m], base_version=fs.version,
                    c_steps=c_steps, c_tokens=c_steps * self.step_tokens, codec=self.wire.up, spec=self.wire.up_spec)
        return self.apply("contribution", float(self.t), raw) + self.settle()

    def settle(self) -> tuple:
        """Fire every grace deadline that falls before the next step."""
        out = ()
        while self.deadlines and min(self.deadlines) <= self.t + 1:
            at = min(self.deadlines)
            self.deadlines.remove(at)
            out += self.apply("deadline", at, 0)
        return out

    def step(self, insider=None) -> tuple:
        """One step of every learner; the due ones send. insider(world) -> (delta, c_steps) or None:
        what learner INSIDER sends instead of its benign contribution."""
        self.t += 1
        for m in range(self.M):
            self.apply("step_time", float(self.t), (m, 1.0))
        out = ()
        for m in range(self.M):
            if self.due(m):
                got = insider(self) if insider is not None and m == INSIDER else None
                out += self.send(m, *(got or (self.benign(), self.H - self.tau)))
        return out + self.settle()

    def theta(self) -> np.ndarray:
        return self.st.fragments[0].theta[W]

    def until_due(self, m: int) -> None:
        """Step until learner m sends next (its send not yet made)."""
        while True:
            self.t += 1
            for k in range(self.M):
                self.apply("step_time", float(self.t), (k, 1.0))
            if self.due(m):
                for k in range(m):  # those before it in the step send first
                    if self.due(k):
                        self.send(k, self.benign(), self.H - self.tau)
                return
            for k in range(self.M):
                if self.due(k):
                    self.send(k, self.benign(), self.H - self.tau)
            self.settle()


@pytest.fixture(scope="module")
def defaults():
    return load(_compose("train", ["run.out_dir=runs/test"]))


def warm(cfg, steps=120) -> World:
    w = World(cfg)
    for _ in range(steps):
        w.step()
    w.until_due(INSIDER)
    return w


def outcomes(actions) -> list[str]:
    return [a.outcome for a in actions if isinstance(a, sync.Outcome) and a.key and a.key[0] == INSIDER]


def move(w: World, delta, c_steps) -> tuple[list[str], float]:
    """From w's state (left as it was): what becomes of the insider's frame and how far it moves Theta."""
    st, t, seq, deadlines, rng = w.st, w.t, list(w.seq), list(w.deadlines), w.rng.bit_generator.state
    before = w.theta().copy()
    got = outcomes(w.send(INSIDER, delta, c_steps))
    moved = float(np.linalg.norm(w.theta() - before))
    w.st, w.t, w.seq, w.deadlines = st, t, seq, deadlines
    w.rng.bit_generator.state = rng
    np.testing.assert_array_equal(w.theta(), before)  # the state is a value: trying it changed nothing
    return got, moved


def test_defaults_check_claims_and_clip(defaults):
    pol = build.policy(defaults)
    assert pol.claim_slack is not None and pol.clip > 0 and pol.max_steps == defaults.run.steps


def test_insider_claiming_the_run_steps_is_quarantined_bad_counter(defaults):
    """Issue 32's frame: c_steps = run.steps (honest frames claim H - tau) with 1000x a benign
    update. Every bound scales with the claim, so only the check against the steps reported stops it."""
    w = warm(defaults)
    benign = w.benign()
    got, moved = move(w, 1000 * benign, defaults.run.steps)
    assert got == ["quarantined:bad_counter"] and moved == 0.0
    assert w.st.quarantined == {}  # `move` left the state as it was
    assert move(w, benign, defaults.fragments.H - defaults.fragments.tau)[0] == ["merged"]
    st, _ = sync.on_contribution(w.pol, w.st, frame({W: w.theta() - benign}, w.st.fragments[0].refs[-1][1],
                                                     learner=INSIDER, seq=w.seq[INSIDER] + 1,
                                                     base_version=w.st.fragments[0].version,
                                                     c_steps=defaults.run.steps, c_tokens=defaults.run.steps,
                                                     codec=w.wire.up, spec=w.wire.up_spec), float(w.t))
    assert st.quarantined == {"bad_counter": 1} and st.refusals.counts == {("bad_counter", INSIDER): 1}
    assert "reported since its last merged contribution" in st.refusals.latest[-1]["detail"]


def test_steps_whose_events_were_lost_count_for_the_learners_next_claim(defaults):
    """A procs learner's step events lost in the store (booked lost when its next event closes the
    gap) still counted in its next contribution's c_steps: that honest frame was refused
    bad_counter. The gap's steps now reach the claims as a lost_steps input (SyncerHost.gap_closed)."""
    w = warm(defaults)
    lost = defaults.fragments.H - defaults.fragments.tau  # every step since its last merged contribution
    steps = dict(w.st.claims.steps)
    steps[INSIDER] -= lost  # their events never reached the syncer
    w.st = w.st._replace(claims=w.st.claims._replace(steps=steps))
    assert move(w, w.benign(), lost)[0] == ["quarantined:bad_counter"]
    w.apply("lost_steps", float(w.t), (INSIDER, lost))
    assert move(w, w.benign(), lost)[0] == ["merged"]


def test_one_admitted_insider_frame_moves_theta_at_most_3x_a_benign_one(defaults):
    """Any claimed count, any scale: an admitted frame moves the fragment at most 3x as far as a
    benign contribution from the same state (the claim is checked, and the clip bounds the rest)."""
    w = warm(defaults)
    H, tau = defaults.fragments.H, defaults.fragments.tau
    benign = w.benign()
    _, benign_move = move(w, benign, H - tau)
    assert benign_move > 0
    admitted = []
    for c_steps in (1, H - tau, H, H + tau + defaults.syncer.claim_slack, 2 * H, defaults.run.steps):
        for scale in (1, 3, 30, 1000, 1e6):
            got, moved = move(w, np.float32(scale) * benign, c_steps)
            if got == ["merged"]:
                admitted.append((c_steps, scale))
                assert moved <= 3 * benign_move, (c_steps, scale, moved / benign_move)
            else:
                assert moved == 0.0 and got and got[0].startswith("quarantined:"), (c_steps, scale, got)
    assert (H + tau + defaults.syncer.claim_slack, 30) in admitted  # clipped, not refused
    assert all(c <= H + tau + defaults.syncer.claim_slack for c, _ in admitted)


@pytest.mark.parametrize("attack", ["run_steps", "strongest_admitted"])
def test_thirty_insider_rounds_leave_the_fragment_norm_within_1_5x(defaults, attack):
    """Every time it is due, the insider sends issue 32's frame (1000x its benign update claiming
    run.steps: refused) or the strongest frame it can get admitted (70x, under norm_bound's 100x
    the median per step, claiming H + tau + claim_slack: clipped). After thirty of its rounds the
    fragment's norm is within 1.5x of where it started."""
    H, tau, slack = defaults.fragments.H, defaults.fragments.tau, defaults.syncer.claim_slack
    scale, claim = (1000, defaults.run.steps) if attack == "run_steps" else (70, H + tau + slack)
    w = warm(defaults, steps=48)
    start = float(np.linalg.norm(w.theta()))
    got = []
    for _ in range(30 * H):
        got += outcomes(w.step(lambda w: (np.float32(scale) * w.benign(), claim)))
    end = float(np.linalg.norm(w.theta()))
    # refused until the steps since its last merged contribution add up to run.steps, then clipped
    assert len(got) >= 30 and got.count("quarantined:bad_counter" if attack == "run_steps" else "merged") >= 25
    assert start / 1.5 <= end <= 1.5 * start, (start, end)


def test_claims_survive_a_checkpoint_and_replay_bit_identically(defaults, tmp_path):
    """The claims are state: saved and restored with the syncer, and rebuilt by replaying its inputs."""
    w = World(defaults)
    st0, inputs = w.st, []
    apply = w.apply

    def recording(kind, at, data):
        inputs.append(replay.Input(kind, at, data))
        return apply(kind, at, data)

    w.apply = recording
    for _ in range(60):
        w.step()
    assert w.st.claims.steps == {m: 60 for m in range(w.M)} and w.st.claims.marks
    arrays, meta = syncer_ckpt.to_checkpoint(w.st)
    back = syncer_ckpt.from_checkpoint(arrays, meta, w.pol, FRAGS)
    assert back.claims == w.st.claims
    again = replay.replay(w.pol, st0, inputs)
    assert again.claims == w.st.claims
    np.testing.assert_array_equal(again.fragments[0].theta[W], w.theta())
    meta.pop("claims")  # a checkpoint from before claims were checked: the header's bounds only
    assert syncer_ckpt.from_checkpoint(arrays, meta, w.pol, FRAGS).claims == claims.unknown(w.st.live, 300)


def test_a_new_incarnation_claims_from_its_own_start():
    c = claims.Claims()
    for _ in range(30):
        c = claims.observe_step(claims.observe_step(c, 0), 1)
    c = claims.merged(claims.admitted(c, 0, 0, 0), [(0, 0, 0)])  # fragment 0 merged at step 30
    assert claims.excess(c, 0, 0, 0, 1, 0) and claims.excess(c, 0, 0, 0, 1, 1) == ""
    c = claims.observe_step(claims.observe_step(c, 0), 0)
    assert claims.excess(c, 0, 0, 0, 2, 0) == "" and claims.excess(c, 0, 0, 0, 3, 0)
    assert claims.excess(c, 0, 0, 1, 32, 0) == "" and claims.excess(c, 0, 0, 1, 33, 0)  # never merged: all 32
    c = claims.on_live(c, {0: 0, 1: 1}, {0: 0, 1: 0})  # learner 1 restarted as incarnation 1
    assert c.steps == {0: 32} and claims.excess(c, 1, 1, 0, 1, 0)
    assert claims.excess(claims.observe_step(c, 1), 1, 1, 0, 1, 0) == ""


@pytest.mark.parametrize("fragments", [pytest.param(dict(keep_overlap=True), marks=pytest.mark.slow),
                                       dict(others="defer", keep_overlap=True)])
def test_honest_sim_runs_claim_no_more_than_they_reported(tmp_path, fragments):
    """Learners of unequal speeds with jitter, keep_overlap (c_steps then spans unanswered sends):
    no honest contribution is refused with claim_slack 0 (tau covers steps taken in transit)."""
    from conftest import diloco_world

    from diloco.runtime import sim

    cfg = tiny_cfg(tmp_path, fragments=dict(count=2, H=4, tau=1, **fragments), syncer=dict(quorum=1, claim_slack=0),
                   run=dict(steps=40, log_every=5, eval_every=40, eval_batches=1),
                   runtime=dict(learners=3, speeds=(1.0, 1.7, 1.0), jitter=0.3, learner_checkpoint_every=0))
    _, _, setup, evaluate, _ = diloco_world(cfg)
    rt, _ = sim.run(cfg, setup, None, evaluate)
    assert rt.syncer.merges > 30 and rt.syncer.quarantined == {}
