"""The procs syncer's intake from the store: a learner's event read and checked field by field
against the schema of diloco/runtime/events.py, the event numbers its stream lists, and the exit
notices the supervisor (or a successor started apart) writes.

Reference: docs/design.md#damage-in-the-store (what is skipped, and why a run goes on past it).
"""

from __future__ import annotations

import logging
import math
import re

from diloco import store as bs
from diloco.algo import auth
from diloco.runtime import events as ev
from diloco.runtime.procs.child import died, event_key

log = logging.getLogger(__name__)

# The keys of each kind's JSON, as events.to_json writes them; a Died never comes from a learner
# (the syncer books it from an exit notice).
FIELDS = {name: ev.json_fields(kind) for name, kind in ev.KINDS.items() if kind is not ev.Died}

_EVENT_KEY = re.compile(r"^ev/\d{4}/\d{4}/(\d{12})$")


def event_n(key: str) -> int | None:
    """n of an event key (diloco/runtime/procs/child.py event_key); None for a stray key."""
    found = _EVENT_KEY.match(key)
    return None if found is None else int(found[1])


def listed_events(store: bs.BlobStore, m: int, inc: int) -> list[int]:
    """The event numbers the store lists for incarnation inc of learner m (stray keys left out)."""
    return [n for key in store.list(f"ev/{m:04d}/{inc:04d}/") if (n := event_n(key)) is not None]


def number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _rows(x, *checks) -> bool:
    return isinstance(x, list) and all(isinstance(r, list) and len(r) == len(checks)
                                       and all(c(v) for c, v in zip(checks, r)) for r in x)


def parse_event(raw: bytes, m: int, inc: int, fragments: int, max_tokens: int, last_seq: int) -> dict:
    """Event JSON of learner m's incarnation inc, checked field by field against what the host
    books (diloco/runtime/events.py): ValueError, naming what is wrong, for anything else. Its
    sends must follow `last_seq`, the last seq booked of this incarnation, in order."""
    data = bs.loads_object(raw, f"event of learner {m} incarnation {inc}", finite=False)  # a loss may be NaN
    kind = data.get("kind") if isinstance(data, dict) else None
    if not isinstance(kind, str) or kind not in FIELDS or set(data) != FIELDS[kind]:
        raise ValueError(f"not a learner event: {str(data)[:200]}")
    if (data["learner"], data["incarnation"]) != (m, inc) or type(data["learner"]) is not int \
            or type(data["incarnation"]) is not int:
        raise ValueError(f"event of learner {data['learner']!r} incarnation {data['incarnation']!r} "
                         f"under learner {m} incarnation {inc}'s key")
    fragment = lambda p: type(p) is int and 0 <= p < fragments  # noqa: E731
    ok = all(number(data[k]) for k in ("start", "end", "at", "died_at", "down_until") if k in data)
    ok = ok and _rows(data["fetched"], number, fragment, bs.is_count, lambda c: isinstance(c, str) and len(c) <= 64)
    ok = ok and _rows(data.get("stalls", []), number, number) and all(a <= b for a, b in data.get("stalls", []))
    if "sends" in data:
        ok = ok and _rows(data["sends"], fragment, bs.is_count)
        seqs = [last_seq] + [seq for _, seq in data["sends"]] if ok else []
        ok = ok and all(a < b for a, b in zip(seqs, seqs[1:]))
    if kind == "StepDone":
        ok = ok and bs.is_count(data["step"]) and data["start"] <= data["end"]
        ok = ok and bs.is_count(data["tokens"]) and data["tokens"] <= max_tokens and bs.is_count(data["rows"])
        ok = ok and (data["loss"] is None or type(data["loss"]) in (int, float))
    if kind == "Applied":
        ok = ok and isinstance(data["fragments"], list) and all(map(fragment, data["fragments"]))
    if kind == "Rejoined":
        r = data["rejoin"]
        ok = ok and isinstance(r, dict) and set(r) == {"learner", "incarnation", "step", "restored_from", "staleness"}
        ok = ok and (r["learner"], r["incarnation"]) == (m, inc) and bs.is_count(r["step"])
        ok = ok and (r["restored_from"] is None or bs.is_count(r["restored_from"]))
        ok = ok and type(r["staleness"]) is int and -1 <= r["staleness"] < bs.MAX_COUNT
    if not ok:
        raise ValueError(f"malformed {kind} event: {str(data)[:300]}")
    return data


def read_event(store: bs.BlobStore, m: int, inc: int, n: int) -> bytes | None:
    """Event n's bytes, None if absent; one too large to be an event comes back as b"" (not
    JSON), so its journal entry skips it, when it is booked and in any replay."""
    try:
        return store.get(event_key(m, inc, n), bs.MAX_JSON_BYTES)
    except bs.TooLarge:
        return b""


def authentic_event(store: bs.BlobStore, secret, m: int, inc: int, n: int, ignored: dict) -> bytes | None:
    """Event n's bytes if it is there and, with the run `secret` (runtime.auth), its tag verifies;
    else None, so the stream waits for it: one that does not verify is ignored, logged and counted
    in `ignored` once per key, and read again, as the learner writes that event over it."""
    raw = read_event(store, m, inc, n)
    if raw is None or secret is None:
        return raw
    key = event_key(m, inc, n)
    try:
        auth.unseal(secret, m, key, raw)
    except ValueError as e:
        if key not in ignored:
            log.error("learner %d incarnation %d event %d ignored until its learner writes it: %s", m, inc, n, e)
            ignored[key] = str(e)[:200]
        return None
    return raw


def read_notice(store: bs.BlobStore, m: int, inc: int, secret=None, ignored: dict | None = None) -> dict | None:
    """The exit notice of (m, inc), if any, as {at, exitcode}. One that is malformed or (with the
    run `secret`) unauthenticated is ignored, logged and counted in `ignored`: it never buries a
    live learner, and the supervisor writes its real one over it (Supervisor._renotice)."""
    name = died(m, inc)
    notice = bs.read_trusted(store, name, secret, ignored)
    if notice is None:
        return None
    if not (isinstance(notice, dict) and number(notice.get("at")) and type(notice.get("exitcode")) is int):
        if ignored is not None and name not in ignored:
            log.error("learner %d incarnation %d: malformed exit notice ignored: %s", m, inc, str(notice)[:200])
            ignored[name] = f"malformed: {str(notice)[:200]}"
        return None
    return {"at": float(notice["at"]), "exitcode": notice["exitcode"]}


def gathered_ignored(store: bs.BlobStore, secret, own: dict[str, str]) -> tuple[dict[str, str], int]:
    """What every process of the run ignored: the syncer's `own`, and the records the learners and
    the supervisor keep (child.note_ignored), as one map name -> why (an object several processes
    ignored counts once) and the count of those their records had no room to name. A record that
    does not verify is itself ignored, in `own`."""
    seen, more = dict(own), 0
    for name in bs.list_control(store, "ignored/"):
        record = bs.read_trusted(store, name, secret, own, {"ignored": dict, "more": int})
        if record is not None:
            seen.update({k: str(v) for k, v in record["ignored"].items() if isinstance(k, str)})
            more += max(record["more"], 0)
    seen.update({k: v for k, v in own.items() if k not in seen})  # a record ignored just now
    return seen, more


def ignored_summary(ignored: dict[str, str], more: int = 0) -> dict:
    """The summary's count of store objects ignored (docs/design.md#damage-in-the-store), by kind
    (events; every other object: ctl/ objects, reports, acks, the pointer), `more` of them unnamed
    (counted as other objects); {} if none were."""
    if not ignored and not more:
        return {}
    events = sum(k.startswith("ev/") for k in ignored)
    return {"store_objects_ignored": len(ignored) + more, "ignored_events": events,
            "ignored_controls": len(ignored) + more - events}
