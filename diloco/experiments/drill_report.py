"""The chaos drill's report: acceptance checks, recovery times after each kill, and the table.

Recovery is read from the chaos run's decision records, on the syncer's clock: for a learner, from
the kill to the first merge that took in work of its next incarnation (restart, rejoin, a few
steps, the contribution's round); for the syncer, from the kill to the first merge its successor
made (restart, restoring the checkpoint, re-executing the journal, the next round)."""

from __future__ import annotations

import statistics

from diloco import report

TARGET = 0.03  # the acceptance bound on the relative eval-loss difference


def recovery(tape: list[dict], kills: list[dict]) -> list[dict]:
    """Each kill with `recovered_s` (None if nothing recovered before the run ended)."""
    merges = [r for r in tape if r["event"] == "merge"]
    out = []
    for k in kills:
        if k["target"] == "syncer":
            after = [r["at"] for r in merges if r["at"] > k["t"]]
        else:
            m, inc = int(k["target"].split("-")[1]), k["incarnation"] + 1
            first = min((r["at"] for r in tape if r["event"] == "arrival" and r["key"][:2] == [m, inc]),
                        default=None)
            after = [] if first is None else [r["at"] for r in merges if r["at"] >= first and m in r["learners"]]
        out.append({**k, "recovered_s": round(after[0] - k["t"], 2) if after else None})
    return out


def _recovery_row(kills: list[dict], learner: bool) -> str:
    times = [k["recovered_s"] for k in kills
             if k.get("recovered_s") is not None and k["target"].startswith("learner") == learner]
    if not times:
        return "-"
    return f"median {statistics.median(times):.1f} s, max {max(times):.1f} s ({len(times)})"


def checks(result: dict, names: list[str]) -> dict:
    c, kills = result["chaos"], result["chaos"]["kills"]
    learner_kills = sum(k["target"].startswith("learner") for k in kills)
    return {
        "ledger_balanced": all(result[n]["token_ledger_imbalance"] == 0 for n in names),
        "versions_consecutive": all(result[n]["versions_consecutive"] for n in names),
        "merged_tokens_rebuilt_match_ledger": all(
            abs(result[n]["merged_tokens_rebuilt"] - result[n]["merged_tokens_ledger"]) <= 1 for n in names),
        "final_eval_rebuilt_matches_run": all(
            abs(result[n]["final_eval_rebuilt"] - result[n]["summary"]["eval_loss"]) < 1e-4 for n in names),
        "learner_kills": learner_kills,
        "learner_restarts": sum(c["learner_restarts"].values()),
        "syncer_kills": len(kills) - learner_kills,
        "syncer_restarts": c["syncer_restarts"],
        "within_3pct": abs(result["compare"]["merged"]["relative"]) <= TARGET,
        "not_worse_by_3pct": result["compare"]["merged"]["relative"] <= TARGET,
        **({"within_3pct_of_free2": abs(result["compare_free2"]["merged"]["relative"]) <= TARGET}
           if "compare_free2" in result else {}),
    }


def _pair(x: dict) -> str:
    """One comparison: the reference's loss / the other's (relative difference)."""
    return f"{x['eval_loss_free']:.4f} / {x['eval_loss']:.4f} ({100 * x['relative']:+.2f}%)"


def rows(result: dict) -> list[tuple[str, object]]:
    f, c, cmp = result["free"], result["chaos"], result["compare"]
    k = {n: ("yes" if v else "NO") if isinstance(v, bool) else v for n, v in result["checks"].items()}
    out = [
        ("wall s (free / chaos)", f"{f['wall_s']} / {c['wall_s']}"),
        ("learner kills / restarts", f"{k['learner_kills']} / {k['learner_restarts']}"),
        ("syncer kills / restarts", f"{k['syncer_kills']} / {k['syncer_restarts']}"),
        ("rejoins", len(c["rejoins"])),
        ("ledger balanced", k["ledger_balanced"]),
        ("versions 1..n per fragment", k["versions_consecutive"]),
        ("merged tokens rebuilt = ledger", k["merged_tokens_rebuilt_match_ledger"]),
        ("final eval rebuilt = run's", k["final_eval_rebuilt_matches_run"]),
        ("merges (free / chaos)", f"{f['summary']['merges']} / {c['summary']['merges']}"),
        ("merges of fewer than M learners (free / chaos)",
         f"{len(f.get('partial_merges', []))} / {len(c.get('partial_merges', []))}"),
    ]
    for axis, label in (("merged", "merged tokens"), ("processed", "processed tokens"), ("final", "final")):
        x = cmp[axis]
        at = "" if axis == "final" else f" at {int(x['tokens']):,}"
        out.append((f"eval loss, equal {label}{at}", _pair(x)))
    for axis, x in result.get("noise", {}).items():
        out.append((f"noise: free2 vs free, {axis}", f"{100 * x['relative']:+.2f}%"))
    if "compare_free2" in result:
        out.append(("merges of fewer than M learners (free2)", len(result["free2"].get("partial_merges", []))))
        for axis, x in result["compare_free2"].items():
            out.append((f"chaos vs free2, equal {axis} tokens", _pair(x)))
    out.append(("equal merged tokens: within 3% / not worse by 3%", f"{k['within_3pct']} / {k['not_worse_by_3pct']}"))
    if "within_3pct_of_free2" in k:
        out.append(("equal merged tokens: within 3% of free2", k["within_3pct_of_free2"]))
    out.append(("learner kill -> first merge of its successor", _recovery_row(c["kills"], True)))
    out.append(("syncer kill -> first merge of its successor", _recovery_row(c["kills"], False)))
    return out


def markdown(result: dict, command: str) -> str:
    lines = ["# Chaos drill (procs runtime)", "", f"`{command}`", "", "| | free / chaos |", "|---|---|"]
    lines += [f"| {k} | {report._fmt(v)} |" for k, v in rows(result)]
    lines += ["", "Kills (seconds after the run's start, target, incarnation, versions published then):", ""]
    lines += [f"- {k['t']} s: {k['target']} incarnation {k['incarnation']} ({k['published_versions']} versions)"
              + ("" if k.get("recovered_s") is None else f", recovered in {k['recovered_s']} s")
              for k in result["chaos"]["kills"]]
    return "\n".join(lines) + "\n"
