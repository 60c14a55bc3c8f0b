"""The summary every runtime prints at the end of a Decoupled DiLoCo run, from its ledgers and tape."""

from __future__ import annotations

import numpy as np

from diloco.algo import drift, ledger, timeline, traffic
from diloco.algo import syncer as sync

# Keys measured in real seconds on this host, or of this process's share of a resumed run
# (tokens_at_start: trained before it began): a replayed or resumed run reproduces every other one.
REAL_TIME_KEYS = ("syncer_busy_s", "syncer_busy_share", "syncer_pace_share", "syncer_round_s",
                  "wall_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "tokens_at_start")


def replayable(summary: dict) -> dict:
    """The summary without REAL_TIME_KEYS: what two runs from the same seeds agree on."""
    return {k: v for k, v in summary.items() if k not in REAL_TIME_KEYS}


def merge_record(st: sync.SyncerState, decision: dict, merges: int, tokens: ledger.TokenLedger,
                 sent: tuple[int, int], time: timeline.TimeLedger, stalls: int) -> dict:
    """The metrics record of one merge (`decision`, the syncer's merge record, the `merges`-th of
    the run; `sent`: bytes up and down so far, traffic.sent): the syncer-side series the summary
    reports at the end, so far (docs/design.md#metrics-series). Counters are the run's from its
    start, a resumed run's included (the ledgers are)."""
    record = {"kind": "merge", "time": decision["at"], "fragment": decision["fragment"],
              "version": decision["version"], "merges": merges, "tokens": int(tokens.processed[0]),
              "quorum": len(decision["learners"]), "bytes_up": sent[0], "bytes_down": sent[1], "stalls": stalls,
              "quarantined": sum(st.quarantined.values()), "goodput": timeline.goodput(time)}
    if decision["grace"] is not None:
        record["grace_s"] = decision["grace"]
    # the fragment's outer statistics (docs/algorithm.md#outer-statistics-and-automatic-momentum):
    # its merged pseudo-gradient's norm, cosine with the previous one, the learners' agreement, and
    # the momentum outer.momentum=auto set; each only where measured
    for key, name in OUTER_STATS:
        if decision.get(name) is not None:
            record[key] = decision[name]
    return record


# merge_record's outer statistics: (its key, the syncer's merge record's)
OUTER_STATS = (("delta_norm", "delta_norm"), ("update_cos", "update_cos"), ("agreement", "cosine"),
               ("momentum", "momentum"))


def _mean(xs: list) -> float | None:
    return float(np.mean(xs)) if xs else None


def outer_summary(merges: list[dict]) -> dict:
    """The summary's means of the merges' outer statistics (each over the merges that measured it)."""
    got = lambda name: [r[name] for r in merges if r.get(name) is not None]
    return {"delta_norm_mean": _mean(got("delta_norm")), "update_cos_mean": _mean(got("update_cos")),
            "update_cos_rounds": len(got("update_cos")), "outer_momentum_mean": _mean(got("momentum"))}


def run_summary(st: sync.SyncerState, tokens: ledger.TokenLedger, bytes_: traffic.ByteLedger,
                time: timeline.TimeLedger, *, clock: str, end: float, window: float, stalls: int,
                busy_s: float = 0.0, pace_share: float | None = None, round_s: float | None = None,
                injected: dict | None = None, events_lost: list[dict] = ()) -> dict:
    """Plain numbers; raises if the token ledger does not balance. `clock` names the clock the
    run's times are on: "virtual" (sim) or "wall" (threads); clock_s is the run's length on it.
    busy_s: real seconds the syncer spent on its inputs, a share of the run only on a wall clock
    (sim merges in zero virtual time); pace_share, round_s: the start-up check's prediction and its
    largest fragment's round (docs/design.md#does-the-syncer-keep-up), None when it did not run.
    injected: what a chaos tape did by the end (tapes.injected: slice failures, learner outages),
    beside the deaths and rejoins they caused (docs/design.md#the-summary). events_lost: the gaps in
    learners' event streams (SyncerHost.lost_events), each with its evidence; only when there were any."""
    ledger.check_balance(tokens)
    merges = [r for r in st.decisions if r["event"] == "merge"]
    quorum_sizes = [len(r["learners"]) for r in merges]
    graces = [r["grace"] for r in merges if r["grace"] is not None]
    cosines = [r["cosine"] for r in merges if r.get("cosine") is not None]  # rounds of 2+ learners
    sums = ledger.summary(tokens, bytes_, time, start=0.0, end=max(end, 1e-9), window=window)
    lost = {} if not events_lost else {
        "events_lost": sum(g["events"][1] - g["events"][0] + 1 for g in events_lost),
        "tokens_lost_in_gaps": sum(g["tokens"] for g in events_lost),
        "lost_events": [{k: v for k, v in g.items() if k != "final_step"} for g in events_lost]}
    return {
        **(injected or {}), **lost,
        "clock": clock,
        "clock_s": end,
        "merges": st.merges,
        "tokens_processed": int(tokens.processed[0]),
        "tokens_merged_share": sum(tokens.merged) / max(sum(tokens.processed), 1),
        "bytes_up": int(sums["bytes_up"]),
        "bytes_down": int(sums["bytes_down"]),
        "peak_rate_up": sums["peak_rate_up"],
        "peak_rate_up_training": sums["peak_rate_up_training"],  # without the final sync
        "goodput": sums["goodput"],
        "uptime": sums["uptime"],
        "quorum_mean": float(np.mean(quorum_sizes)) if quorum_sizes else 0.0,
        "quorum_min": min(quorum_sizes, default=0),
        "grace_mean_s": float(np.mean(graces)) if graces else 0.0,
        "grace_max_s": max(graces, default=0.0),
        "stalls": stalls,
        # the drift monitor's agreement of learners (algo/drift.py): the mean round cosine
        "pseudograd_cos_mean": float(np.mean(cosines)) if cosines else None,
        "pseudograd_cos_rounds": len(cosines),
        **outer_summary(merges),
        # incarnations that ended before the run did: chip failures, kills, and a resumed run's stop
        "learner_deaths": len(tokens.dead),
        "quarantined": sum(st.quarantined.values()),
        "token_ledger_imbalance": ledger.balance(tokens),
        "syncer_busy_s": busy_s,
        "syncer_busy_share": busy_s / end if clock == "wall" and end > 0 else None,
        "syncer_pace_share": pace_share,
        "syncer_round_s": round_s,
    }
