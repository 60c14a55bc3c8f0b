"""The blob store over the S3 protocol, against a local S3-compatible server (localbucket, on
127.0.0.1 only, started and stopped by these tests): round-trips, key schemes, atomicity, a bad
endpoint, and outages (the server stopped, or answering 503 SlowDown) that writes and reads ride
out with nothing lost (docs/design.md#object-store-transport)."""

from __future__ import annotations

import re
import socket
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

localbucket = pytest.importorskip("localbucket")

import store_checks  # noqa: E402
from conftest import alongside  # noqa: E402

from diloco import store as bs  # noqa: E402
from diloco.store import network  # noqa: E402

BUCKET = "diloco"


class LocalS3:
    """localbucket serving `root` (one folder per bucket) on 127.0.0.1, in this process.

    `stop()` closes the listening socket and every open connection (a real outage, not a server
    that still answers on kept-alive connections); `start()` serves the same files on the same
    port again. While `slow_down` is set, every request is answered 503 SlowDown.
    """

    def __init__(self, root: Path, port: int = 0):
        self.root, self.port, self.slow_down, self.requests = Path(root), port, False, 0
        (self.root / BUCKET).mkdir(parents=True, exist_ok=True)
        self._server: ThreadingHTTPServer | None = None
        self._conns: set[socket.socket] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "run", **opts) -> str:
        return network.with_options(f"s3://{BUCKET}/{prefix}", endpoint=self.endpoint, **opts)

    def start(self) -> "LocalS3":
        owner = self

        class Handler(localbucket.S3Handler):
            data_root = self.root

            def log_message(self, *args):
                pass

            def _dispatch(self, action):
                owner.requests += 1
                if owner.slow_down:
                    self._send_error(localbucket.S3Error(HTTPStatus.SERVICE_UNAVAILABLE, "SlowDown",
                                                         "Please reduce your request rate."))
                    return
                super()._dispatch(action)

        class Server(ThreadingHTTPServer):
            daemon_threads, block_on_close, allow_reuse_address = True, False, True

            def get_request(self):
                conn, addr = super().get_request()
                owner._conns.add(conn)
                return conn, addr

            def shutdown_request(self, request):
                owner._conns.discard(request)
                super().shutdown_request(request)

        self._server = Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._conns.clear()
        self._server = None


@pytest.fixture
def s3(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    server = LocalS3(tmp_path / "s3").start()
    yield server
    server.stop()


def test_round_trip_put_get_list_delete(s3):
    store = bs.BlobStore(s3.url())
    store_checks.round_trip(store, bs.BlobStore(s3.url("other")))
    # Objects live under <bucket>/run/ on the server, nothing outside it.
    assert sorted(p.name for p in (s3.root / BUCKET / "run").iterdir()) == ["b"]


def test_key_schemes_pointer_acks_gc_and_control_over_s3(s3):
    store_checks.key_schemes(bs.BlobStore(s3.url()))


def test_a_reader_sees_the_old_or_the_new_object_never_a_mix(s3):
    """A PUT is atomic for readers (localbucket writes a temporary file and renames it, as S3's
    PUT replaces the object whole): a pointer rewritten while read is always one of its versions."""
    writer, reader = bs.BlobStore(s3.url()), bs.BlobStore(s3.url())
    versions = [bytes([65 + i]) * (1 << 20) for i in range(4)]
    writer.put("down/latest", versions[0])
    def rewrite(stop):
        i = 0
        while not stop.is_set():
            i += 1
            writer.put("down/latest", versions[i % 4])

    reads = alongside(rewrite, lambda: [reader.get("down/latest") for _ in range(40)])
    assert all(r in versions for r in reads) and len(set(reads)) > 1


def test_bad_urls_and_endpoints_fail_at_start_naming_the_value(s3, tmp_path):
    from dataclasses import replace

    from diloco.config import ConfigError, RuntimeConfig, StoreConfig, TrainConfig, validate

    with pytest.raises(ValueError, match="ftp://x"):
        bs.BlobStore("s3://diloco/run?endpoint=ftp://x")
    with pytest.raises(ValueError, match="'colour'"):
        bs.BlobStore(f"s3://diloco/run?endpoint={s3.endpoint}&colour=red")
    with pytest.raises(ValueError) as info:
        bs.BlobStore("s3://diloco/run?endpoint=http://me:hunter2@127.0.0.1:9")
    assert "hunter2" not in str(info.value) and "127.0.0.1:9" in str(info.value)
    with pytest.raises(ValueError, match="needs a bucket"):
        bs.BlobStore(f"s3:///run?endpoint={s3.endpoint}")
    # No server there: the open's probe retries to the deadline, then names the endpoint.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    # (Bounds at half the 60 s default deadline: what ignoring retry_s, or retrying, would take.)
    t0 = time.monotonic()
    with pytest.raises(bs.StoreUnavailable, match=f"127.0.0.1:{dead}"):
        bs.BlobStore(f"s3://diloco/run?endpoint=http://127.0.0.1:{dead}&retry_s=1")
    assert time.monotonic() - t0 < network.DEFAULT_RETRY_S / 2
    # A bucket the server does not have is no transient failure: refused at once, naming the URL.
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="s3://nosuchbucket/run"):
        bs.BlobStore(f"s3://nosuchbucket/run?endpoint={s3.endpoint}")
    assert time.monotonic() - t0 < network.DEFAULT_RETRY_S / 2

    base = TrainConfig(runtime=RuntimeConfig(kind="procs", learners=1, devices_per_learner=1))
    for store, want in [(dict(url="s3://b/p", endpoint="localhost:9000"), "'localhost:9000'"),
                        (dict(url="s3://b/p", region="US East"), "'US East'"),
                        (dict(url="", endpoint="http://127.0.0.1:9000"), "runtime.store.endpoint is set but "
                                                                         "runtime.store.url='' is not an s3:// URL"),
                        (dict(url="s3://b/p", retry_s=0.0), "runtime.store.retry_s=0.0"),
                        (dict(url="s3://b/p?retry_s=-1"), "'-1'")]:
        with pytest.raises(ConfigError, match=re.escape(want)):
            validate(replace(base, runtime=replace(base.runtime, store=StoreConfig(**store))))
    ok = validate(replace(base, runtime=replace(base.runtime, store=StoreConfig(
        url="s3://b/p", endpoint=s3.endpoint, retry_s=30.0))))
    assert network.run_store_url(ok.runtime, "file:///x") == f"s3://b/p?endpoint={s3.endpoint}&retry_s=30"
    assert network.run_store_url(base.runtime, "file:///x") == "file:///x"


def test_the_s3_spec_reads_the_aws_environment_and_never_holds_a_secret():
    env = {"AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "http://b:2", "AWS_REGION": "eu-west-1",
           "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    spec = network.s3_spec("bkt", "p/", {}, env)
    assert spec["endpoint"] == "http://b:2" and spec["aws_region"] == "eu-west-1"
    assert spec["aws_credentials"] == {"type": "environment"}
    assert "s3cr3t" not in repr(spec) and "AKIDEXAMPLE" not in repr(spec)
    spec = network.s3_spec("bkt", "", {"endpoint": "http://c:3", "region": "r1"}, env)
    assert spec["endpoint"] == "http://c:3" and spec["aws_region"] == "r1"  # the URL's options win
    spec = network.s3_spec("bkt", "", {}, {"AWS_ENDPOINT_URL": "http://a:1"})
    assert spec["endpoint"] == "http://a:1" and spec["aws_region"] == "us-east-1" and "aws_credentials" not in spec
    assert "endpoint" not in network.s3_spec("bkt", "", {}, {})  # AWS itself; the driver finds the region
    with pytest.raises(ValueError, match="AWS_ENDPOINT_URL_S3='nope'"):
        network.s3_spec("bkt", "", {}, {"AWS_ENDPOINT_URL_S3": "nope"})
    retries = network.request_retries(60.0)
    assert 4 <= retries["max_retries"] <= 16 and retries["max_delay"] == "2s"


class _Future:
    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    def result(self, timeout=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self):
        self.cancelled = True


def test_call_repeats_transient_failures_up_to_its_deadline_and_raises_others_at_once():
    now = [0.0]

    def sleep(dt):
        now[0] += dt

    outcomes = [ValueError("UNAVAILABLE: connection refused"), ValueError("ABORTED: All 8 retry attempts failed"),
                "done"]
    got = network.call(lambda: _Future(outcomes.pop(0)), "put x", 60, sleep=sleep, clock=lambda: now[0])
    assert got == "done" and now[0] == pytest.approx(0.3)  # 0.1 s, then 0.2 s
    with pytest.raises(ValueError, match="NOT_FOUND"):
        network.call(lambda: _Future(ValueError("NOT_FOUND: NoSuchBucket")), "list", 60, sleep=sleep,
                      clock=lambda: now[0])
    now[0] = 0.0
    calls = []
    with pytest.raises(bs.StoreUnavailable, match=r"put x: the store kept failing for 10 s \(10 attempts"):
        network.call(lambda: calls.append(1) or _Future(ValueError("UNAVAILABLE: down")), "put x", 10,
                      sleep=sleep, clock=lambda: now[0])
    assert now[0] == pytest.approx(10)  # back-off 0.1, 0.2, ... 2 s, capped by the deadline
    assert not isinstance(bs.StoreUnavailable("x"), ValueError)  # never taken for damage

    # An attempt with no answer is cancelled after attempt_s and made again (a dead connection).
    now[0] = 0.0
    hung = []

    class Hung(_Future):
        def result(self, timeout=None):
            now[0] += timeout
            raise TimeoutError

    def op():
        hung.append(Hung(None) if len(hung) < 2 else _Future("late"))
        return hung[-1]

    assert network.call(op, "get x", 60, sleep=sleep, clock=lambda: now[0]) == "late"
    assert [f.cancelled for f in hung] == [True, True, False] and now[0] == pytest.approx(2 * 15 + 0.3)
    assert network.attempt_s(60) == 15 and network.attempt_s(30) == 10 and network.attempt_s(1.5) == 1.5


def test_writes_and_reads_ride_out_a_stopped_server_and_lose_nothing(s3):
    store_checks.rides_out_an_outage(bs.BlobStore(s3.url(retry_s=30)), s3.stop, s3.start)


def test_throttling_503_slow_down_is_retried_and_loses_nothing(s3):
    store = bs.BlobStore(s3.url(retry_s=30))
    s3.slow_down = True
    before = s3.requests
    threading.Timer(2.0, lambda: setattr(s3, "slow_down", False)).start()
    t0 = time.monotonic()
    written = store_checks.fill(store, 5, "throttled")
    assert time.monotonic() - t0 >= 2 and s3.requests - before > 6  # retried, not failed
    assert {k: store.get(k) for k in written} == written and store.list("seq/") == sorted(written)


def test_a_store_down_past_its_deadline_raises_a_clear_error(s3):
    store_checks.fails_past_its_deadline(bs.BlobStore(s3.url(retry_s=1.5)), s3.stop)


# One short procs run of tests/test_procs.py's tiny model with its traffic over S3, and one where
# the server is down for 3 s mid-run (its helpers imported, so both stay the same run).
from test_procs import STEPS, M, P, variant, world  # noqa: E402,F401  (world: a module fixture)

from diloco.config import StoreConfig  # noqa: E402


def _check_run(rt, summary, cfg):
    store_checks.procs_run_balanced(rt, summary, cfg, STEPS, M, P)


@pytest.mark.slow  # the store's own behaviour over S3 is the fast tests above
def test_a_procs_run_over_s3_balances_its_ledger(world, tmp_path, s3):
    from diloco.runtime import procs

    _, _, evaluate_global, _ = world
    cfg, setup, run_dir = variant(world, tmp_path, store=StoreConfig(f"s3://{BUCKET}/run", s3.endpoint, retry_s=30.0))
    rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)
    _check_run(rt, summary, cfg)
    assert not (run_dir / "store").exists()  # the traffic went to the server
    assert bs.BlobStore(s3.url()).list("rep/") == []  # every report read


@pytest.mark.slow
def test_a_procs_run_rides_out_the_s3_server_down_for_3_s(world, tmp_path, s3):
    from diloco.runtime import procs

    cfg, setup, run_dir = variant(world, tmp_path, store=StoreConfig(f"s3://{BUCKET}/run", s3.endpoint, retry_s=30.0))
    up, outage = s3.root / BUCKET / "run" / "up", {}

    def outage_once_traffic_flows(done):
        while not done.is_set() and not (up.is_dir() and any(up.rglob("*"))):
            time.sleep(0.05)
        if done.is_set():
            return
        s3.stop()
        outage["stopped"] = time.monotonic()
        time.sleep(3)
        s3.start()
        outage["restarted"], outage["run_going"] = time.monotonic(), not done.is_set()

    rt, summary = alongside(outage_once_traffic_flows, lambda: procs.run(cfg, setup, run_dir, None))
    assert outage.get("run_going"), outage  # the server came back while the run was still going
    _check_run(rt, summary, cfg)
    assert sorted(rt.exits) == [(f"learner-{m}", 0, 0) for m in range(M)]  # nobody crashed or restarted


@pytest.mark.slow
def test_a_ray_run_over_s3_balances_its_ledger(world, tmp_path, s3):
    """The same run under runtime=ray, on a Ray instance the runtime starts on 127.0.0.1: its actors
    inherit this process's AWS variables, as a node's environment provides them on a cluster."""
    pytest.importorskip("ray")
    from test_ray import loopback

    from diloco.runtime import procs

    _, _, evaluate_global, _ = world
    cfg, setup, run_dir = variant(world, tmp_path, kind="ray",
                                  store=StoreConfig(f"s3://{BUCKET}/run", s3.endpoint, retry_s=30.0))
    with pytest.MonkeyPatch.context() as mp:
        loopback(mp)
        rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)  # runtime.kind=ray: the Ray launcher
    assert rt.finished["complete"] and rt.finished["steps"] == {str(m): STEPS for m in range(M)}
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    assert not (run_dir / "store").exists()  # the traffic went to the server
    assert bs.BlobStore(s3.url()).list("rep/") == []
