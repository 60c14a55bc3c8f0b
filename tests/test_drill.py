"""The chaos drill's pure parts: its kill schedule, the versions check, merged tokens rebuilt from a
syncer's inputs as the token ledger books them, and the comparison at equal merged tokens."""

from types import SimpleNamespace

import numpy as np
import pytest

from diloco.algo import messages, payloads
from diloco.algo.codecs import make_codec
from diloco.algo.fragments import make_fragments
from diloco.algo.replay import Input
from diloco.config import CodecConfig, OuterConfig, TrainConfig
from diloco.experiments import drill, drill_report
from diloco.runtime.build import policy


def test_kill_gaps_are_fixed_or_seeded_exponential():
    rng = np.random.default_rng(0)
    assert drill.next_gap(rng, 20.0, "fixed") == 20.0
    a = [drill.next_gap(np.random.default_rng(1), 20.0, "poisson") for _ in range(2)]
    assert a[0] == a[1]  # same seed, same schedule
    gaps = [drill.next_gap(rng, 20.0, "poisson") for _ in range(4000)]
    assert abs(np.mean(gaps) / 20.0 - 1) < 0.06
    with pytest.raises(ValueError, match="schedule"):
        drill.next_gap(rng, 20.0, "weibull")


def test_versions_must_run_one_to_n_per_fragment():
    tape = [{"event": "merge", "fragment": p, "version": v} for p, v in [(0, 1), (1, 1), (0, 2), (1, 2)]]
    assert drill.merge_versions(tape) == {0: [1, 2], 1: [1, 2]}
    assert drill.versions_consecutive(drill.merge_versions(tape))
    assert not drill.versions_consecutive({0: [1, 3]})  # skipped
    assert not drill.versions_consecutive({0: [1, 1, 2]})  # made twice


def test_send_tokens_count_since_the_previous_send_or_apply():
    tokens = drill.SendTokens()
    h = dict(learner=0, incarnation=0, fragment=1)
    assert tokens({**h, "base_version": 0, "c_tokens": 100}) == 100
    assert tokens({**h, "base_version": 0, "c_tokens": 250}) == 150  # no apply between: 100 already sent
    assert tokens({**h, "base_version": 2, "c_tokens": 80}) == 80  # applied version 2: counters reset
    assert tokens({**h, "incarnation": 1, "base_version": 2, "c_tokens": 50}) == 50  # a new incarnation
    assert tokens({**h, "fragment": 0, "base_version": 0, "c_tokens": 250}) == 250  # per fragment


def _frame(theta, learner, seq, base, c_tokens, value):
    diff = {path: np.full_like(x, value) for path, x in theta.items()}  # anchor - local
    tensors, payload, _ = payloads.pack_fragment(diff, make_codec("fp32"))
    return messages.encode({"kind": "contribution", "learner": learner, "incarnation": 0, "seq": seq,
                            "fragment": 0, "base_version": base, "version": base, "c_steps": c_tokens // 10,
                            "c_tokens": c_tokens, "codec": "fp32", "delta_against": None,
                            "tensors": tensors}, payload)


def test_merged_tokens_replay_books_each_token_once():
    """One learner, one fragment: each contribution merges at once (everyone live has sent). The
    second was sent before the first merge was applied (same base), so its c_tokens repeat the
    first's 100: the ledger, and the rebuild, count 100 then 150."""
    params = {"w": np.zeros((2, 3), np.float32)}
    fragments = make_fragments(params, 1)
    theta0 = ({("w",): params["w"]},)
    # The frames are fp32: the run's up codec must say so, or the syncer refuses them (wrong_codec).
    cfg = TrainConfig(outer=OuterConfig(name="sgd", lr=1.0, momentum=0.0), codec=CodecConfig(up="fp32", zstd_level=0))
    # Unchecked claims: these hand-built frames claim c_tokens / 10 steps, more than the steps reported.
    setup = SimpleNamespace(policy=policy(cfg)._replace(claim_slack=None), fragments=fragments, theta0=theta0)
    inputs = [Input("contribution", 1.0, _frame(theta0[0], 0, 1, 0, 100, 0.01)),
              Input("contribution", 2.0, _frame(theta0[0], 0, 2, 0, 250, 0.03))]
    steps = [Input("step_time", 0.5, (0, 0.5))] * 3
    curve = drill.replay_curve(setup, 1, steps[:2] + inputs[:1] + steps[2:] + inputs[1:], tokens_per_step=10)
    assert curve.merged == [0, 100, 250] and curve.processed == [0, 20, 30] and curve.loss == {}
    evaluated = drill.replay_curve(setup, 1, inputs, 10, evaluate=lambda theta: float(theta[("w",)].sum()), at={0, 2})
    # Outer lr 1: Theta = the local weights, -0.01 then -0.03 (both against version 0) in 6 values.
    assert evaluated.loss == {0: 0.0, 2: pytest.approx(-0.18)}


def test_compare_interpolates_both_curves_at_the_shorter_ones_tokens():
    free = [(0.0, 4.0), (100.0, 2.0), (200.0, 1.0)]
    chaos = [(0.0, 4.0), (150.0, 2.0)]
    got = drill.compare(free, chaos)
    assert got["tokens"] == 150.0 and got["eval_loss_free"] == pytest.approx(1.5)
    assert got["eval_loss"] == pytest.approx(2.0) and got["relative"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="outside"):
        drill.loss_at(free, 250.0)
    assert drill.bracket([0, 10, 10, 30], 20) == {2, 3} and drill.bracket([0, 10, 30], 30) == {2}


def test_recovery_times_come_from_the_tape_on_the_syncer_clock():
    tape = [
        {"event": "arrival", "at": 1.0, "key": [1, 0, 3]},
        {"event": "merge", "at": 1.2, "learners": [1]},
        {"event": "merge", "at": 6.0, "learners": [0]},
        {"event": "arrival", "at": 7.0, "key": [1, 1, 1]},  # learner 1's next incarnation
        {"event": "merge", "at": 7.5, "learners": [0]},  # its round closed without it
        {"event": "merge", "at": 9.0, "learners": [0, 1]},
    ]
    kills = [{"t": 2.0, "target": "learner-1", "incarnation": 0}, {"t": 5.0, "target": "syncer", "incarnation": 0},
             {"t": 8.0, "target": "learner-0", "incarnation": 0}]
    got = [k["recovered_s"] for k in drill.recovery(tape, kills)]
    assert got == [7.0, 1.0, None]  # 9.0 - 2.0; 6.0 - 5.0; learner 0's successor never sent


def test_partial_merges_are_the_merges_that_left_a_learner_out():
    tape = [{"event": "arrival", "at": 1.0, "fragment": 0, "admitted": [0]},
            {"event": "merge", "at": 1.5, "fragment": 0, "admitted": [0, 1, 2]},
            {"event": "merge", "at": 2.25, "fragment": 1, "admitted": [2]},
            {"event": "merge", "at": 3.0, "fragment": 1, "admitted": [0, 1]}]
    got = drill.partial_merges(tape, learners=3)
    assert got == [{"at": 2.25, "fragment": 1, "admitted": [2]}, {"at": 3.0, "fragment": 1, "admitted": [0, 1]}]
    assert drill.partial_merges(tape, learners=1) == []


def _observed(eval_loss: float, partial: int) -> dict:
    return {"wall_s": 1.0, "summary": {"merges": 10, "eval_loss": eval_loss}, "token_ledger_imbalance": 0,
            "versions_consecutive": True, "merged_tokens_rebuilt": 5, "merged_tokens_ledger": 5,
            "final_eval_rebuilt": eval_loss, "learner_restarts": {"0": 1}, "syncer_restarts": 1,
            "rejoins": [[0, 1, 4]], "partial_merges": [{"at": 1.0, "fragment": 0, "admitted": [1]}] * partial}


def test_the_report_judges_the_chaos_run_against_each_failure_free_run():
    cmp = lambda free, other: {"tokens": 100.0, "eval_loss_free": free, "eval_loss": other, "relative": other / free - 1}
    result = {"free": _observed(2.2, 2), "free2": _observed(2.4, 0), "chaos": _observed(2.4, 3)}
    result["chaos"]["kills"] = [{"t": 1.0, "target": "learner-0", "incarnation": 0, "published_versions": 1,
                                 "recovered_s": 2.0}, {"t": 2.0, "target": "syncer", "incarnation": 0,
                                                       "published_versions": 2, "recovered_s": None}]
    result["compare"] = {a: cmp(2.2, 2.4) for a in ("merged", "processed", "final")}
    result["noise"] = {a: cmp(2.2, 2.4) for a in ("merged", "processed")}
    result["compare_free2"] = {a: cmp(2.4, 2.41) for a in ("merged", "processed")}
    result["checks"] = drill_report.checks(result, ["free", "free2", "chaos"])
    assert not result["checks"]["within_3pct"] and result["checks"]["within_3pct_of_free2"]
    assert result["checks"]["learner_kills"] == 1 and result["checks"]["syncer_kills"] == 1
    rows = dict(drill_report.rows(result))
    assert rows["merges of fewer than M learners (free / chaos)"] == "2 / 3"
    assert rows["merges of fewer than M learners (free2)"] == 0
    assert rows["chaos vs free2, equal merged tokens"] == "2.4000 / 2.4100 (+0.42%)"
    assert rows["equal merged tokens: within 3% of free2"] == "yes"
    assert "learner-0 incarnation 0 (1 versions), recovered in 2.0 s" in drill_report.markdown(result, "cmd")
