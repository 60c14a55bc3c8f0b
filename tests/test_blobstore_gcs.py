"""The blob store over Google Cloud Storage's JSON API, against a local GCS server
(gcp-storage-emulator, on 127.0.0.1 only, started and stopped by these tests): round-trips, key
schemes, and a server that goes away for a few seconds, which writes and reads ride out with nothing
lost (docs/design.md#object-store-transport).

tensorstore's gcs driver takes its server from TENSORSTORE_GCS_HTTP_URL (read whenever a store is
opened; there is no endpoint in its spec), so that variable is what these tests set, and what a
spawned process inherits. Credentials: with none to be found the driver sends no token, which the
emulator accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

emulator = pytest.importorskip("gcp_storage_emulator.server")

import store_checks  # noqa: E402

from diloco import store as bs  # noqa: E402
from diloco.runtime.world import free_port  # noqa: E402

BUCKET = "diloco-test"


def _as_gcs_does() -> None:
    """Two answers of the emulator, made GCS's: a listing of a key range (startOffset, endOffset,
    which tensorstore sends for a prefix and lists before a delete_range) holds only the range's
    keys, where the emulator ignores both; and a ranged read that starts at or past an object's
    end is 416, where the emulator answers 206 with a Content-Range tensorstore rightly rejects
    (BlobStore.get's size probe relies on the 416)."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def ls(request, response, storage, *args, **kwargs):
        start = (request.query.get("startOffset") or [""])[0]
        end = (request.query.get("endOffset") or [None])[0]
        send = response.json

        def json(obj):
            items = [o for o in obj.get("items") or [] if o["name"] >= start and (end is None or o["name"] < end)]
            send({**obj, "items": items})

        response.json = json
        objects.ls(request, response, storage, *args, **kwargs)

    served = objects.download

    def download(request, response, storage, *args, **kwargs):
        asked = re.fullmatch(r"\s*bytes=([0-9]+)-[0-9]*", request.get_header("range", None) or "")
        try:
            size = len(storage.get_file(request.params["bucket_name"], request.params["object_id"]))
        except NotFound:
            size = None
        if asked and size is not None and int(asked[1]) >= size:
            response["Content-Range"] = f"bytes */{size}"
            response.status = HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE
            return
        served(request, response, storage, *args, **kwargs)

    fixed = {objects.ls: ls, served: download}
    objects.download = download  # objects.get calls it by name for ?alt=media, tensorstore's read
    for _, handlers in emulator.HANDLERS:
        for method, handler in list(handlers.items()):
            handlers[method] = fixed.get(handler, handler)


class LocalGCS:
    """gcp-storage-emulator keeping its objects under `root`, on a fixed port of 127.0.0.1. `stop()`
    closes the server (a real outage: connections refused); `start()` serves the same objects on the
    same port again."""

    def __init__(self, root: Path):
        self.root, self.port = Path(root), free_port()
        self._server = None
        self._made = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "run", **opts) -> str:
        query = "&".join(f"{k}={v}" for k, v in opts.items())
        return f"gs://{BUCKET}/{prefix}" + (f"?{query}" if query else "")

    def start(self) -> "LocalGCS":
        if not getattr(emulator, "_diloco_as_gcs", False):
            _as_gcs_does()
            emulator._diloco_as_gcs = True
        # The bucket once; a restarted server finds it, and every object, on disk.
        self._server = emulator.create_server("127.0.0.1", self.port, in_memory=False, data_dir=str(self.root),
                                              default_bucket=None if self._made else BUCKET)
        self._server.start()
        self._made = True
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    server = LocalGCS(tmp_path / "gcs").start()
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", server.endpoint)
    yield server
    server.stop()


def test_round_trip_put_get_list_delete_over_gcs(gcs):
    # (the emulator fails an empty upload, which a run never makes)
    store_checks.round_trip(bs.BlobStore(gcs.url()), bs.BlobStore(gcs.url("other")), small=b"x")


def test_key_schemes_pointer_acks_gc_and_control_over_gcs(gcs):
    store_checks.key_schemes(bs.BlobStore(gcs.url()))


def test_writes_and_reads_ride_out_a_stopped_gcs_server_and_lose_nothing(gcs):
    store_checks.rides_out_an_outage(bs.BlobStore(gcs.url(retry_s=30)), gcs.stop, gcs.start)


def test_a_gcs_store_down_past_its_deadline_raises_a_clear_error(gcs):
    store_checks.fails_past_its_deadline(bs.BlobStore(gcs.url(retry_s=1.5)), gcs.stop)


# One short procs run of tests/test_procs.py's tiny model with its traffic over GCS.
from test_procs import STEPS, M, P, variant, world  # noqa: E402,F401  (world: a module fixture)

from diloco.config import StoreConfig  # noqa: E402


@pytest.mark.slow  # the store's own behaviour over GCS is the fast tests above
def test_a_procs_run_over_gcs_balances_its_ledger(world, tmp_path, gcs):
    from diloco.runtime import procs

    _, _, evaluate_global, _ = world
    cfg, setup, run_dir = variant(world, tmp_path, store=StoreConfig(f"gs://{BUCKET}/run", retry_s=30.0))
    rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)
    store_checks.procs_run_balanced(rt, summary, cfg, STEPS, M, P)
    assert not (run_dir / "store").exists()  # the traffic went to the server
    assert bs.BlobStore(gcs.url()).list("rep/") == []  # every report read
