"""Learner authentication and the syncer's own bookkeeping of who may send what (hardening issue
items 6, 7 and 9): forged frames are refused before their header is believed, incarnations come
only from the runtime, a duplicate never books the original's tokens, an unbooked repeat never
crashes the host."""

import logging

import numpy as np
import pytest

from diloco.algo import auth, ledger, messages
from diloco.algo import syncer as sync
from diloco.config import ConfigError
from syncer_frames import THETA0, frame, merges, policy, shifted, start

SECRET = auth.Secret(b"0123456789abcdef0123456789abcdef")


def signed(local, ref, *, key_of=None, secret=SECRET, **kw):
    """A contribution signed with learner `key_of`'s key (default: the learner it claims to be)."""
    plain = messages.decode(frame(local, ref, **kw))
    header = {k: v for k, v in plain.header.items() if k not in ("payload_len", "checksum")}
    learner = kw.get("learner", 0) if key_of is None else key_of
    return messages.encode(header, plain.payload, secret.learner_key(learner))


def theta_bytes(st):
    return {p: x.tobytes() for p, x in sync.theta(st).items()}


# --- the keys and the tag ----------------------------------------------------------------------
def test_the_secret_never_prints_and_keys_differ_per_learner():
    assert "0123" not in repr(SECRET) and "0123" not in str(SECRET)
    assert "0123" not in repr(policy(auth=SECRET))
    keys = {SECRET.learner_key(m) for m in range(64)}
    assert len(keys) == 64
    assert auth.Secret(b"another secret of 32 bytes......").learner_key(0) != SECRET.learner_key(0)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        auth.Secret(b"short")


def test_a_tag_verifies_only_the_frame_it_was_made_for():
    good = messages.decode(signed(shifted(THETA0[0], 1), THETA0[0], learner=1))
    assert auth.verify(SECRET, good.header, good.payload) == ""
    other = auth.Secret(b"fedcba9876543210fedcba9876543210")
    assert "does not verify" in auth.verify(other, good.header, good.payload)
    for field, value in [("seq", 2), ("incarnation", 1), ("learner", 0), ("c_tokens", 9), ("base_version", 1),
                         ("checksum", "0" * 16)]:  # the tag covers the checksum string too
        assert "does not verify" in auth.verify(SECRET, {**good.header, field: value}, good.payload), field
    flipped = bytearray(good.payload)
    flipped[0] ^= 1
    assert "does not verify" in auth.verify(SECRET, good.header, bytes(flipped))
    unsigned = {k: v for k, v in good.header.items() if k != auth.MAC_FIELD}
    assert "no mac" in auth.verify(SECRET, unsigned, good.payload)
    assert "64 hex" in auth.verify(SECRET, {**good.header, "mac": "ab"}, good.payload)


# --- item 9: forged frames ---------------------------------------------------------------------
@pytest.mark.parametrize("forgery", ["unsigned", "other_key", "next_incarnation", "huge_seq", "tampered"])
def test_a_forged_frame_is_refused_unattributed_and_the_real_learner_goes_on(forgery):
    """Before: one forged frame with incarnation + 1 made every later frame of learner 0
    dead_incarnation, one with seq 2**62 made them all duplicate."""
    pol = policy(K=2, auth=SECRET)
    st = start(pol)
    local = shifted(THETA0[0], 1)
    if forgery == "unsigned":
        bad = frame(local, THETA0[0], learner=0, seq=1)
    elif forgery == "other_key":  # learner 1 (holding its own key) poses as learner 0
        bad = signed(local, THETA0[0], learner=0, seq=1, key_of=1)
    elif forgery == "next_incarnation":
        bad = signed(local, THETA0[0], learner=0, inc=1, seq=1, key_of=1)
    elif forgery == "huge_seq":
        bad = signed(local, THETA0[0], learner=0, seq=2**52, key_of=1)
    else:  # a real frame of learner 0 whose seq was raised on the way
        raw = bytearray(signed(local, THETA0[0], learner=0, seq=1))
        i = raw.index(b'"seq":1')
        raw[i:i + 7] = b'"seq":9'
        bad = bytes(raw)
    before = theta_bytes(st)
    st, actions = sync.on_contribution(pol, st, bad, 0.0)
    assert actions == (sync.Outcome(None, "quarantined:unauthenticated"),)
    assert st.live == {0: 0, 1: 0} and st.last_seq == {} and theta_bytes(st) == before
    st, actions = sync.on_contribution(pol, st, signed(local, THETA0[0], learner=0, seq=1), 1.0)
    st, actions = sync.on_contribution(pol, st, signed(shifted(THETA0[0], 3), THETA0[0], learner=1, seq=1), 2.0)
    (rec,) = merges(st)
    assert rec["learners"] == [0, 1] and st.quarantined == {"unauthenticated": 1}


def test_without_auth_a_frame_still_cannot_claim_a_restart():
    pol = policy(K=1)
    st = start(pol)
    st, actions = sync.on_contribution(pol, st, frame(THETA0[0], THETA0[0], learner=0, inc=1, seq=1), 0.0)
    assert actions == (sync.Outcome((0, 1, 1), "quarantined:unknown_incarnation"),)
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0, seq=1), 1.0)
    assert st.merges == 1


# --- items 6 and 7 through the host: the ledger stays balanced and nothing raises --------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from conftest import diloco_world
    from test_conformance import make_cfg

    from diloco.runtime import build as build_setup

    root = tmp_path_factory.mktemp("auth")
    cfg = make_cfg(root, "sim")
    _, _, setup, _, _ = diloco_world(cfg)
    setup = setup._replace(policy=setup.policy._replace(
        grace=setup.policy.grace._replace(K=2, gamma=0.0)))  # a round stays open until both arrive
    st0 = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    unit = build_setup.new_unit(setup, 0, 0, st0)
    sends = [unit.step() for _ in range(2 * cfg.fragments.H)]  # every fragment sent twice
    return cfg, setup, sends


def _host(setup):
    from diloco.runtime.host import SyncerHost
    return SyncerHost(setup, {0: 0, 1: 0})


def _first_send(sends, fragment):
    for result in sends:
        for s, f in zip(result.sends, result.frames):
            if s.fragment == fragment:
                return result, s, f
    raise AssertionError(fragment)


def test_a_duplicate_of_an_in_flight_contribution_leaves_the_original_booked(world):
    """Before: the duplicate was quarantined under the original's key, so the original's tokens
    were booked quarantined:duplicate and its later merge counted as unmatched."""
    from diloco.algo.replay import Input
    from diloco.runtime import events as ev

    cfg, setup, sends = world
    host = _host(setup)
    result, s, f = _first_send(sends, 0)
    host.on_event(ev.StepDone(0, 0, 1, 0.0, 1.0, result.tokens, ((s.fragment, s.seq),), (f,)), 1.0)
    key = (0, 0, s.seq)
    tokens = host.tokens.in_flight[key]
    host.deliver(Input("contribution", 1.5, f))  # the same frame again (a replay, or a copy)
    assert host.tokens.in_flight[key] == tokens and host.tokens.unmatched == 1
    assert host.state.quarantined == {"duplicate": 1}
    assert not any(r.startswith("quarantined:") for r in host.tokens.dropped)
    ledger.check_balance(host.tokens)


def test_an_unbooked_repeat_is_excluded_not_a_crash(world):
    """Before: a second frame of learner 0 that no send booked replaced the first in the open round
    as `carried` into a key the ledger never booked, and ledger.resolve raised inside deliver."""
    from diloco.algo.replay import Input
    from diloco.runtime import events as ev

    cfg, setup, sends = world
    host = _host(setup)
    first, s, f = _first_send(sends, 0)
    host.on_event(ev.StepDone(0, 0, 1, 0.0, 1.0, first.tokens, ((s.fragment, s.seq),), (f,)), 1.0)
    # the same fragment sent again later, delivered without its send ever being booked
    (g,) = [g for r in sends for x, g in zip(r.sends, r.frames) if x.fragment == 0 and x.seq > s.seq][:1]
    for _ in range(messages.decode(g).header["c_steps"]):  # its steps reported, so its claim passes
        host.deliver(Input("step_time", 1.5, (0, 1.0)))
    host.deliver(Input("contribution", 2.0, g))
    assert (0, 0, s.seq) not in host.tokens.in_flight
    assert host.tokens.dropped["excluded"][s.fragment] == first.tokens
    ledger.check_balance(host.tokens)


def test_carrying_never_crosses_incarnations():
    """A restarted learner's first frame replaces its predecessor's in the open round: the old one
    is excluded (its progress is not in the new incarnation's), never carried."""
    pol = policy(K=2)
    st = start(pol)
    st, _ = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 1), THETA0[0], learner=0, seq=1), 0.0)
    st, _ = sync.on_live_change(pol, st, {0: 1, 1: 0}, 1.0)
    st, actions = sync.on_contribution(pol, st, frame(shifted(THETA0[0], 2), THETA0[0], learner=0, inc=1, seq=1), 2.0)
    assert sync.Outcome((0, 0, 1), "excluded") in actions
    assert not any(isinstance(a, sync.Outcome) and a.outcome == "carried" for a in actions)


def test_an_event_the_ledger_cannot_book_is_refused_whole(world, caplog):
    """A repeated StepDone (a replayed or forged event) would book its send twice: it is refused,
    counted and logged, and nothing of it is booked."""
    from diloco.runtime import events as ev

    cfg, setup, sends = world
    host = _host(setup)
    result, s, f = _first_send(sends, 0)
    event = ev.StepDone(0, 0, 1, 0.0, 1.0, result.tokens, ((s.fragment, s.seq),), (f,))
    host.on_event(event, 1.0)  # in flight: its round waits for learner 1
    processed = host.tokens.processed
    with caplog.at_level(logging.WARNING):
        host.on_event(event._replace(start=1.0, end=2.0), 2.0)
        assert host.refused_events == 1 and "still in flight" in caplog.text
        host.on_event(event._replace(sends=((0, 99),)), 2.0)  # the same step time again
        assert host.refused_events == 2 and "overlaps" in caplog.text
        host.on_event(ev.Rejoined(0, 0, 0.0, 0.0, 3.0), 3.0)  # not newer than the live incarnation
        assert host.refused_events == 3 and "already at incarnation 0" in caplog.text
    assert host.tokens.processed == processed
    ledger.check_balance(host.tokens)


# --- the config ---------------------------------------------------------------------------------
def _runtime_cfg(tmp_path, kind="procs", **auth_section):
    """test_conformance's procs config under runtime `kind` with runtime.auth's fields `auth_section`."""
    from dataclasses import replace

    from test_conformance import make_cfg
    cfg = make_cfg(tmp_path, "procs")
    return replace(cfg, runtime=replace(cfg.runtime, kind=kind, auth=replace(cfg.runtime.auth, **auth_section)))


def test_the_secret_comes_from_a_file_or_the_environment_and_errors_never_show_it(tmp_path, monkeypatch):
    from diloco.config import validate
    from diloco.runtime.build import auth_secret

    monkeypatch.delenv("DILOCO_TEST_SECRET", raising=False)
    assert auth_secret(_runtime_cfg(tmp_path, kind="sim")) is None  # auto: off in one process
    assert auth_secret(_runtime_cfg(tmp_path, kind="procs", mode="off")) is None
    made = auth_secret(_runtime_cfg(tmp_path, secret_env="DILOCO_TEST_SECRET"))
    assert made is not None and len(__import__("os").environ["DILOCO_TEST_SECRET"]) == 64
    assert auth_secret(_runtime_cfg(tmp_path, secret_env="DILOCO_TEST_SECRET")) == made  # children agree
    monkeypatch.setenv("DILOCO_TEST_SECRET", "a secret from the environment")
    assert auth_secret(_runtime_cfg(tmp_path, secret_env="DILOCO_TEST_SECRET")) == \
        auth.Secret(b"a secret from the environment")
    path = tmp_path / "secret"
    path.write_text("a secret kept in a file\n")
    assert auth_secret(_runtime_cfg(tmp_path, kind="sim", mode="on", secret_file=str(path))) == \
        auth.Secret(b"a secret kept in a file")
    path.write_text("too short")
    with pytest.raises(ConfigError, match="needs at least 16") as e:
        auth_secret(_runtime_cfg(tmp_path, secret_file=str(path)))
    assert "too short" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        auth_secret(_runtime_cfg(tmp_path, secret_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"runtime\.auth\.mode='maybe'"):
        validate(_runtime_cfg(tmp_path, mode="maybe"))
    with pytest.raises(ConfigError, match=r"runtime\.auth\.secret_env='NOT A NAME'"):
        validate(_runtime_cfg(tmp_path, secret_env="NOT A NAME"))


def test_learner_units_sign_what_they_send_and_the_syncer_admits_it(world):
    from diloco.runtime import build as build_setup

    cfg, setup, _ = world
    setup = setup._replace(policy=setup.policy._replace(auth=SECRET))
    st = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    unit = build_setup.new_unit(setup, 1, 0, st)
    result = unit.step()
    for f in result.frames:
        header = messages.decode(f).header
        assert auth.verify(SECRET, header, messages.decode(f).payload) == ""
        st, actions = sync.on_contribution(setup.policy, st, f, 1.0)
        assert not any(isinstance(a, sync.Outcome) and a.outcome.startswith("quarantined") for a in actions)
    assert st.quarantined == {} and np.all(np.isfinite(np.concatenate([x.ravel() for x in sync.theta(st).values()])))
