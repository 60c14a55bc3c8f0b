"""The blob store: whole-object put/get/list/delete on a tensorstore kvstore, and how a URL opens one.

Reference: docs/design.md#object-store-transport (procs: a tensorstore kvstore, `file://` by default, the same
code for `gs://` / `s3://`) and docs/design.md#messages (frames are validated by the syncer, not the transport).

Every object is written whole under a key no other write reuses (contributions and broadcasts), or
is a small pointer written by one process (`down/latest`, acks, control), so readers never need a
lock. A reader never sees a torn object:

* `file://`: tensorstore's file driver writes the value to `<key>.__lock`, fsyncs it (unless
  `sync=False`), `rename`s it onto `<key>` and fsyncs the directory; reads open the key's file, so
  they see the old inode or the new one, never a partial one (file_key_value_store.cc, header
  comment "The files containing the values of existing keys are never modified; instead, they are
  replaced via `rename`"; observed with strace on 0.1.86: `rename(".../seq.__lock", ".../seq")`).
  A writer killed mid-write leaves only a `.__lock` file, which List skips and Read never opens.
  The driver has an opt-in `file_io_locking: {"mode": "non_atomic"}` that writes in place; this
  module pins mode "os" (the default) in the spec, so a shared context cannot switch it on.
* `gs://` and `s3://`: a PUT of a whole object is atomic for readers in both services (a GET
  returns the old or the new object, never a mix), and both lists are strongly consistent. An
  S3-compatible server at another endpoint, its region and the retry deadline are options in the
  URL's query (diloco/store/network.py); transient failures are retried there, up to the deadline.
* `memory://`: in-process, private to one BlobStore; for tests.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, Callable

import tensorstore as ts

from diloco.store import network
from diloco.store.keys import LATEST, check_key, check_prefix

_SCHEMES = ("file", "memory", "gs", "s3")


class TooLarge(ValueError):
    """An object larger than its reader's bound, left unread (docs/design.md#damage-in-the-store)."""

    def __init__(self, key: str, limit: int):
        super().__init__(f"{key}: larger than {limit} bytes; not read")
        self.key, self.limit = key, limit


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    if not check_prefix(prefix):
        return ts.KvStore.KeyRange()
    # Keys are ASCII from check_key's alphabet, so bumping the last character never overflows.
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _spec(url: str, sync: bool) -> Any:
    """The kvstore spec for a URL or plain path; ValueError naming the URL if it is not one."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"blob store URL must be a non-empty str, got {url!r}")
    base, opts = network.split_options(url)
    scheme, sep, rest = base.partition("://")
    if not sep:  # a plain path: the file driver, made absolute so child processes agree on it
        scheme, rest = "file", os.path.abspath(url)
    elif scheme not in _SCHEMES:
        raise ValueError(f"blob store URL {url!r}: scheme {scheme!r} is not one of {_SCHEMES}")
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError(f"blob store URL {url!r}: file:// needs an absolute path (file:///abs/dir)")
        return {"driver": "file", "path": urllib.parse.unquote(rest).rstrip("/") + "/", "file_io_sync": sync,
                "file_io_locking": {"mode": "os"}}
    if scheme in ("gs", "s3") and not rest.split("/")[0]:
        raise ValueError(f"blob store URL {url!r}: {scheme}:// needs a bucket ({scheme}://bucket/prefix)")
    if scheme == "s3":
        bucket, _, path = rest.partition("/")
        path = urllib.parse.unquote(path).strip("/")
        return network.s3_spec(bucket, path + "/" if path else "", opts)
    return f"{scheme}://{rest.rstrip('/')}/" if rest else url


class BlobStore:
    """Whole-object put/get/list/delete on a tensorstore kvstore.

    `url`: `file:///abs/dir` or a plain path (file driver), `memory://` (tests; private to this
    object), `gs://bucket/prefix` or `s3://bucket/prefix` (tensorstore's gcs / s3 drivers, with
    their usual credentials; `s3://bucket/prefix?endpoint=http://host:port&region=r&retry_s=60`
    for another S3-compatible server, diloco/store/network.py). `sync=False` skips the file
    driver's fsyncs: still atomic for readers, but not durable across a machine crash (a killed
    process loses nothing either way). Pickles as (url, sync), so a spawned process reopens the
    same store (not for memory://).

    On gs:// and s3:// every operation is retried while it fails transiently, for at most the
    URL's `retry_s` (default 60 s), then raises StoreUnavailable (network.call); opening lists
    the store once (the run's pointer, one key at most), so a wrong endpoint or bucket fails here,
    naming the URL.
    """

    def __init__(self, url: str, *, sync: bool = True):
        self.url, self.sync = url, sync
        scheme = url.partition("://")[0] if isinstance(url, str) else ""
        try:
            self._kv = ts.KvStore.open(_spec(url, sync)).result()
            self._retry_s = (network.retry_s_of(network.split_options(url)[1])
                             if scheme in ("gs", "s3") else None)
            if self._retry_s is not None:
                self._call(lambda: self._kv.list(_prefix_range(LATEST)), f"open (list {LATEST})")
        except ValueError as e:
            if network.redacted(url) in str(e):
                raise
            raise ValueError(f"cannot open blob store URL {network.redacted(url)!r}: {e}") from None

    def _call(self, op: Callable[[], Any], what: str) -> Any:
        """`op()` resolved; on a network store, with network.call's retries and deadline."""
        if self._retry_s is None:
            return op().result()
        return network.call(op, f"{network.redacted(self.url)} {what}", self._retry_s)

    def __reduce__(self):
        return _reopen, (self.url, self.sync)

    def __repr__(self) -> str:
        return f"BlobStore({self.url!r})"

    def put(self, key: str, data: bytes) -> None:
        key, data = check_key(key), bytes(data)
        self._call(lambda: self._kv.write(key, data), f"put {key}")

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The object, or None if there is none (never written, or deleted e.g. by gc).

        `max_bytes`: raise TooLarge, having read one byte, if the object is larger. A one-byte
        ranged read at offset max_bytes tells: the kvstore refuses a range past the end
        (OUT_OF_RANGE), so a refusal means the object fits and is then read whole. Keys written
        once never change in between; a pointer rewritten by its one writer between the two reads
        is checked again after the read.
        """
        key = check_key(key)
        if max_bytes is not None:
            try:
                probe = self._call(lambda: self._kv.read(key, byte_range=slice(max_bytes, max_bytes + 1)),
                                   f"get {key}")
            except ValueError as e:
                if "OUT_OF_RANGE" not in str(e):
                    raise
            else:
                if probe.state != "value":
                    return None
                raise TooLarge(key, max_bytes)
        r = self._call(lambda: self._kv.read(key), f"get {key}")
        if r.state != "value":
            return None
        if max_bytes is not None and len(r.value) > max_bytes:
            raise TooLarge(key, max_bytes)
        return bytes(r.value)

    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (a plain string prefix, not only whole path parts), sorted."""
        keys = _prefix_range(prefix)
        return sorted(k.decode() for k in self._call(lambda: self._kv.list(keys), f"list {prefix}"))

    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error (gc and a reader may race)."""
        key = check_key(key)
        self._call(lambda: self._kv.write(key, None), f"delete {key}")

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix; it would delete the whole store")
        keys = _prefix_range(prefix)
        self._call(lambda: self._kv.delete_range(keys), f"delete_prefix {prefix}")


def _reopen(url: str, sync: bool) -> BlobStore:
    return BlobStore(url, sync=sync)
