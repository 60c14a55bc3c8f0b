"""Issue 35's options run in the threads, procs and ray runtimes (docs/algorithm.md#recipes): one
home for the run of the tiny model the option tests share, the invariants every such run must keep,
and each option's check of what it changes, read from the run's own records (the syncer's inputs
and decisions, metrics.jsonl). tests/test_ray_options.py and tests/test_runtime_options.py import it."""

import json
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import diloco_world, tiny_cfg
from test_procs import merge_versions

from diloco.algo import messages, outer_auto, replay
from diloco.algo import syncer as sync
from diloco.algo.syncer_state import Outcome, Publish
from diloco.runtime.runlog import read_decisions, read_inputs

STEPS = 16
H_EAGER = 4  # fragments.H of the eager runs, at tau = 2H
EAGER = dict(fragments=dict(H=H_EAGER, tau=2 * H_EAGER, eager=True), syncer=dict(anchor="base"))
# configs/codec/sparseloco.yaml, at chunks of 64 so that the tiny model's tensors hold several
SPARSELOCO = dict(codec=dict(up="sparseloco", down="int8", error_feedback=True, ef_decay=0.95, zstd_level=0,
                             chunk=64, chunk_k=8))


class Run(NamedTuple):
    rt: object  # the finished runtime: threads' Threads, or procs' (and ray's) supervisor
    summary: dict
    dir: Path
    cfg: object
    setup: object


def option_run(tmp_path, kind: str, runtime=None, **groups) -> Run:
    """A `kind` run (threads, procs or ray: ray's driver is procs' supervisor) of the tiny model
    with 2 learners and the option's `groups` (and `runtime` fields): STEPS steps, a final
    evaluation, learner checkpoints every 8 steps; checked to have ended whole, every learner at
    STEPS steps, balanced, nothing quarantined, no version applied twice or skipped, and below the
    initial loss."""
    from diloco.runtime import procs, threads

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tiny_cfg(tmp_path, kind, run=dict(steps=STEPS, eval_every=STEPS, out_dir=str(run_dir)),
                   runtime=dict(learner_checkpoint_every=8, restart_s=0.0, **(runtime or {})), **groups)
    _, _, setup, evaluate_global, initial = diloco_world(cfg)
    if kind == "threads":
        rt, summary = threads.run(cfg, setup, run_dir, evaluate_global)
        assert [u.ls.step for u in rt.units] == [STEPS, STEPS]
    else:
        rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)
        assert sorted(rt.exits) == [("learner-0", 0, 0), ("learner-1", 0, 0)]  # nobody restarted
        assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0 and summary["quarantined"] == 0
    assert summary["eval_loss"] < initial, (summary["eval_loss"], initial)
    for p, vs in merge_versions(run_dir).items():
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    return Run(rt, summary, run_dir, cfg, setup)


def sent(run_dir) -> list[dict]:
    """The headers of every contribution frame the syncer received, in order."""
    return [messages.decode(e.data, verify=False).header for e in read_inputs(run_dir / "syncer_inputs.bin")
            if e.kind == "contribution"]


def outcomes(setup, run_dir) -> tuple[dict, dict]:
    """From the syncer's inputs replayed (the same calls the run's syncer made; its decisions must
    agree): (learner, incarnation, seq) of each merged contribution -> the version that took it in,
    and of every contribution -> its Outcome ("merged", "carried" into a later one, a drop reason)."""
    st, into, what = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0}), {}, {}
    for event in read_inputs(run_dir / "syncer_inputs.bin"):
        st, out = replay.apply(setup.policy, st, event)
        into.update({tuple(key): o.version for o in out if isinstance(o, Publish) for key in o.merged})
        what.update({tuple(o.key): o for o in out if isinstance(o, Outcome) and o.key is not None})
    assert json.loads(json.dumps(list(st.decisions))) == read_decisions(run_dir / "decisions.jsonl")
    return into, what


def check_eager(run: Run, H: int = H_EAGER) -> None:
    """fragments.eager=true at tau = 2H: each send of a fragment leaves before the merge that took
    in the one before it is applied, so its base version is older than that merge's; and the
    learner's counters count from its last send (an apply never resets them), so every send but a
    fragment's first and the final flush carries H steps."""
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


def check_auto_momentum(run: Run) -> None:
    """outer.momentum=auto: every merge records the momentum it stepped with, and that momentum is
    the rule's (docs/algorithm.md#outer-statistics-and-automatic-momentum) over the consecutive
    cosines of the fragment's earlier merges: the warm-up value until `after` are measured, their
    bias-corrected mean clipped to [0, ceiling] from then on; metrics.jsonl and the summary carry
    the same momenta."""
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


def check_sparseloco(run: Run) -> None:
    """codec=sparseloco (SPARSELOCO's) with decayed error feedback: every contribution frame is
    sparseloco's (the header's spec, which the syncer decodes by), none is quarantined, and each is
    merged or carried into a later one of its learner that is."""
    frames = sent(run.dir)
    assert frames and {h["codec"] for h in frames} == {"sparseloco+ef+c64+t8"}
    into, what = outcomes(run.setup, run.dir)
    keys = {(h["learner"], h["incarnation"], h["seq"]) for h in frames}
    assert set(what) == keys and set(into) == {k for k, o in what.items() if o.outcome == "merged"}, (into, what)
    assert all(o.outcome == "merged" or (o.outcome == "carried" and o.into in into) for o in what.values()), what
