"""What a contribution may claim, checked against what the syncer saw its learner do
(docs/algorithm.md#claims-checked-against-observation).

A contribution's c_steps weighs it in the merge and scales every norm bound and the clip, so a
learner holding a key could otherwise claim the run's whole step count and have a huge update
admitted. The syncer counts the steps each live incarnation reported (its step-time inputs, one per
step, delivered before that step's contributions) and, per fragment, where that count stood when
the learner's last merged contribution of it arrived. An honest learner counts c_steps since it
last applied the fragment, which is after that contribution left it (it blocks tau steps after a
send until the answer comes), so it never claims more than the steps reported since then, plus
the steps it took while that contribution travelled. Everything here is a pure function of the
syncer's inputs, so replay (diloco/algo/replay.py) rebuilds it exactly.
"""

from __future__ import annotations

from typing import NamedTuple

Slot = tuple[int, int, int]  # (learner, incarnation, fragment)


class Claims(NamedTuple):
    steps: dict[int, int] = {}  # learner -> steps its live incarnation reported
    # (learner, incarnation, fragment) -> `steps` when its last merged contribution of the fragment
    # arrived (absent: the incarnation's start, 0)
    marks: dict[Slot, int] = {}
    # the same for the contribution of it admitted and not yet merged (a round holds one per learner)
    open: dict[Slot, int] = {}


def observe_step(c: Claims, learner: int, steps: int = 1) -> Claims:
    """One more step reported by `learner`'s live incarnation; or `steps` more, the steps of events
    lost in the store (docs/design.md#damage-in-the-store), which the learner took all the same and
    counts in its next contribution's c_steps."""
    return c._replace(steps={**c.steps, learner: c.steps.get(learner, 0) + steps})


def excess(c: Claims, learner: int, incarnation: int, fragment: int, c_steps: int, slack: int) -> str:
    """Why claiming `c_steps` is more than the syncer can account for, or "" to admit it. `slack`:
    the steps a learner may take while its contribution travels (tau) and a margin."""
    slot = (learner, incarnation, fragment)
    seen = c.steps.get(learner, 0) - c.marks.get(slot, 0)
    if c_steps <= seen + slack:
        return ""
    return (f"c_steps {c_steps} > {seen} steps learner {learner} incarnation {incarnation} reported since "
            f"its last merged contribution of fragment {fragment} arrived, + slack {slack}")


def admitted(c: Claims, learner: int, incarnation: int, fragment: int) -> Claims:
    """A contribution entered fragment's open round (replacing any earlier one of the learner's)."""
    return c._replace(open={**c.open, (learner, incarnation, fragment): c.steps.get(learner, 0)})


def merged(c: Claims, slots: list[Slot]) -> Claims:
    """The open contributions at `slots` were merged: later claims count from their arrival."""
    marks = {**c.marks, **{s: c.open[s] for s in slots if s in c.open}}
    return c._replace(marks=marks, open={s: n for s, n in c.open.items() if s not in slots})


def on_live(c: Claims, live: dict[int, int], before: dict[int, int]) -> Claims:
    """The live set changed: a learner that left or came back as a new incarnation starts from 0."""
    kept = {m for m, inc in live.items() if before.get(m) == inc}
    return Claims({m: n for m, n in c.steps.items() if m in kept},
                  {s: n for s, n in c.marks.items() if s[0] in kept and live[s[0]] == s[1]},
                  {s: n for s, n in c.open.items() if s[0] in kept and live[s[0]] == s[1]})


def unknown(live: dict[int, int], steps: int) -> Claims:
    """What a restore knows when the checkpoint saved no claims: `steps` (the run's step count) for
    every live learner, so only the header's bounds hold until its next contribution is merged."""
    return Claims({m: steps for m in live})


def to_json(c: Claims) -> dict:
    return {"steps": sorted([m, n] for m, n in c.steps.items()),
            "marks": sorted([*s, n] for s, n in c.marks.items()),
            "open": sorted([*s, n] for s, n in c.open.items())}


def from_json(d: dict) -> Claims:
    return Claims({int(m): int(n) for m, n in d["steps"]},
                  {(int(m), int(i), int(p)): int(n) for m, i, p, n in d["marks"]},
                  {(int(m), int(i), int(p)): int(n) for m, i, p, n in d["open"]})
