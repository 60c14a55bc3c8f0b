"""Issue 35's five options on the ray runtime (docs/algorithm.md#recipes): each a run of the tiny model
with 2 learner actors and the syncer actor on one local Ray cluster the module starts once, checked
by what the option changes, read from the run's own records: Muon's state in the learners'
checkpoints, eager sends leaving before the merge of the one before is applied, the momentum
outer.momentum=auto set at each merge, each learner's tokens at its own batch, and sparseloco
frames merged. The ray driver runs procs' supervisor and its actors procs' learner and syncer
bodies, so these are the procs runs of the same options with Ray's launcher in between."""

import json
import warnings
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402
from conftest import diloco_world, tiny_cfg  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from test_procs import merge_versions  # noqa: E402
from test_ray import loopback  # noqa: E402

from diloco.algo import messages, outer_auto, replay  # noqa: E402
from diloco.algo import syncer as sync  # noqa: E402
from diloco.algo.syncer_state import Outcome, Publish  # noqa: E402
from diloco.config import RayConfig  # noqa: E402
from diloco.runtime import procs  # noqa: E402
from diloco.runtime.runlog import read_decisions, read_inputs  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One head node with logical CPUs for the syncer's actor and two learners' bundles, and one
    XLA compilation cache for every actor's process (a Ray worker gets JAX_* from the driver)."""
    with pytest.MonkeyPatch.context() as mp:
        loopback(mp)
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla_cache")))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        with warnings.catch_warnings():  # JAX's fork warning, as in tests/test_ray.py
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
        yield c
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


class Run(NamedTuple):
    rt: object  # the driver's supervisor, finished
    summary: dict
    dir: Path
    cfg: object
    setup: object


def ray_run(cluster, tmp_path, runtime=None, **groups) -> Run:
    """A ray run of the tiny model with the option's `groups` (and `runtime` fields): STEPS steps,
    a final evaluation, learner checkpoints every 8 steps; checked to have ended whole, balanced
    and below the initial loss, with every actor of the run gone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tiny_cfg(tmp_path, "ray", run=dict(steps=STEPS, eval_every=STEPS, out_dir=str(run_dir)),
                   runtime=dict(ray=RayConfig(address=cluster.address), learner_checkpoint_every=8, restart_s=0.0,
                                **(runtime or {})), **groups)
    _, _, setup, evaluate_global, initial = diloco_world(cfg)
    rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)
    assert sorted(rt.exits) == [("learner-0", 0, 0), ("learner-1", 0, 0)]  # nobody restarted
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0 and summary["quarantined"] == 0
    assert summary["eval_loss"] < initial, (summary["eval_loss"], initial)
    for p, vs in merge_versions(run_dir).items():  # no version applied twice or skipped
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(rt.launcher.prefix)]
    return Run(rt, summary, run_dir, cfg, setup)


def sent(run_dir) -> list[dict]:
    """The headers of every contribution frame the syncer received, in order."""
    return [messages.decode(e.data, verify=False).header for e in read_inputs(run_dir / "syncer_inputs.bin")
            if e.kind == "contribution"]


def outcomes(setup, run_dir) -> tuple[dict, dict]:
    """From the syncer's inputs replayed (the same calls the syncer actor made; its decisions must
    agree): (learner, incarnation, seq) of each merged contribution -> the version that took it in,
    and of every contribution -> its Outcome ("merged", "carried" into a later one, a drop reason)."""
    st, into, what = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0}), {}, {}
    for event in read_inputs(run_dir / "syncer_inputs.bin"):
        st, out = replay.apply(setup.policy, st, event)
        into.update({tuple(key): o.version for o in out if isinstance(o, Publish) for key in o.merged})
        what.update({tuple(o.key): o for o in out if isinstance(o, Outcome) and o.key is not None})
    assert json.loads(json.dumps(list(st.decisions))) == read_decisions(run_dir / "decisions.jsonl")
    return into, what


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_step_their_own_batches(cluster, tmp_path):
    """runtime.learner_batch=[8, 16]: each learner actor steps its own rows, every send claims its
    own tokens per step, and the ledger books each learner's steps at its own batch."""
    rows = (8, 16)
    run = ray_run(cluster, tmp_path, runtime=dict(learner_batch=rows))
    frames = sent(run.dir)
    assert {h["learner"] for h in frames} == {0, 1}
    for h in frames:
        assert h["c_tokens"] == h["c_steps"] * rows[h["learner"]] * run.cfg.data.seq_len, h
    P = run.cfg.fragments.count
    assert run.rt.finished["tokens"]["processed"] == P * STEPS * sum(rows) * run.cfg.data.seq_len
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    for m, b in enumerate(rows):  # the tokens each learner's train records book
        booked = [r for r in records if r["kind"] == "train" and r["learner"] == m]
        assert booked and all(r["tokens"] == r["step"] * b * run.cfg.data.seq_len for r in booked), (m, booked)


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_train_with_muon_and_checkpoint_its_state(cluster, tmp_path):
    """inner=muon: the learner actors step with Muon on the hidden matrices and AdamW on the rest,
    and their checkpoints (what a restarted actor rejoins from) hold both branches: Muon's one
    moment for every hidden matrix with its Newton-Schulz coefficients, Adam's two moments for the
    embedding and the norms (the paths of the saved arrays, from the checkpoint's integrity record)."""
    run = ray_run(cluster, tmp_path, inner=dict(optimizer="muon", lr=1e-2))
    for m in range(2):
        newest = max((run.dir / "learners" / f"learner-{m}").glob("[0-9]*"), key=lambda d: int(d.name))
        paths = json.loads((newest / "integrity" / "metadata").read_text())["arrays"]  # every array saved
        params = {p.removeprefix("params/") for p in paths if p.startswith("params/")}
        kernels = {p for p in params if p.endswith("/kernel")}
        assert kernels and "embed/embedding" in params

        def moments(branch: str, moment: str) -> set[str]:
            head = f"opt_state/1/inner_states/{branch}/inner_state/0/{moment}/"
            return {p.removeprefix(head) for p in paths if p.startswith(head)}

        assert moments("muon", "mu") == kernels and "opt_state/1/inner_states/muon/inner_state/0/ns_coeffs" in paths
        assert moments("adam", "mu") == moments("adam", "nu") == params - kernels, sorted(paths)


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_take_eager_outer_steps(cluster, tmp_path):
    """fragments.eager=true at tau = 2H (which only an eager schedule accepts, in every learner actor):
    each send of a fragment leaves before the merge that took in the one before it is applied, so its
    base version is older than that merge's; and the learner's counters count from its last send
    (an apply never resets them), so every send but a fragment's first and the final flush carries
    H steps."""
    H = 4
    run = ray_run(cluster, tmp_path, fragments=dict(H=H, tau=2 * H, eager=True), syncer=dict(anchor="base"))
    frames = sent(run.dir)
    into, _ = outcomes(run.setup, run.dir)
    by_sender = defaultdict(list)
    for h in frames:
        by_sender[h["learner"], h["fragment"]].append(h)
    overlapped = 0
    for (m, p), hs in sorted(by_sender.items()):
        hs.sort(key=lambda h: h["seq"])
        assert len(hs) >= 3 and all(h["c_steps"] == H for h in hs[1:-1]), (m, p, [h["c_steps"] for h in hs])
        for a, b in zip(hs, hs[1:]):
            v = into.get((m, a["incarnation"], a["seq"]))
            if v is not None:
                assert b["base_version"] < v, (m, p, a["seq"], v, b["base_version"])
                overlapped += 1
    assert overlapped >= 4, overlapped


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_syncer_sets_the_outer_momentum_from_its_statistics(cluster, tmp_path):
    """outer.momentum=auto: every merge the syncer actor made records the momentum it stepped with,
    and that momentum is the rule's (docs/algorithm.md#outer-statistics-and-automatic-momentum) over
    the consecutive cosines of the fragment's earlier merges: the warm-up value until `after` are
    measured, their bias-corrected mean clipped to [0, ceiling] from then on."""
    run = ray_run(cluster, tmp_path, outer=dict(momentum="auto"))
    rule = run.setup.policy.auto
    assert rule == outer_auto.Rule()
    merges = [r for r in read_decisions(run.dir / "decisions.jsonl") if r["event"] == "merge"]
    stats, ruled = defaultdict(outer_auto.Stats), 0
    for r in merges:
        st = stats[r["fragment"]]
        assert r["momentum"] == pytest.approx(outer_auto.momentum(rule, st), abs=1e-6), r
        ruled += st.seen >= rule.after
        if r["update_cos"] is not None:  # outer_auto.observe's EMA, from the cosine the record kept
            mean = rule.beta * st.mean + (1 - rule.beta) * r["update_cos"]
            stats[r["fragment"]] = st._replace(seen=st.seen + 1, mean=mean)
    assert ruled >= 2, ruled  # the rule took over from the warm-up in this run
    logged = [r["momentum"] for r in map(json.loads, (run.dir / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "merge"]
    assert logged == [r["momentum"] for r in merges]
    assert run.summary["outer_momentum_mean"] == pytest.approx(sum(logged) / len(logged))


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_send_sparseloco_frames_that_merge(cluster, tmp_path):
    """codec=sparseloco with decayed error feedback: every contribution frame is sparseloco's (the
    header's spec, which the syncer actor decodes by), none is quarantined, and each is merged or
    carried into a later one of its learner that is."""
    # configs/codec/sparseloco.yaml, at chunks of 64 so that the tiny model's tensors hold several
    codec = dict(up="sparseloco", down="int8", error_feedback=True, ef_decay=0.95, zstd_level=0, chunk=64, chunk_k=8)
    run = ray_run(cluster, tmp_path, codec=codec)
    frames = sent(run.dir)
    assert frames and {h["codec"] for h in frames} == {"sparseloco+ef+c64+t8"}
    into, what = outcomes(run.setup, run.dir)
    keys = {(h["learner"], h["incarnation"], h["seq"]) for h in frames}
    assert set(what) == keys and set(into) == {k for k, o in what.items() if o.outcome == "merged"}, (into, what)
    assert all(o.outcome == "merged" or (o.outcome == "carried" and o.into in into) for o in what.values()), what
