"""The blob store over the network (`s3://`, `gs://`): store options, the s3 driver's spec, retries.

Reference: docs/design.md#over-s3. Stdlib only; the config checks use its validators
(diloco/config/checks_runtime.py).

Options ride in the store URL's query, `s3://bucket/prefix?endpoint=http://host:9000&region=r&retry_s=60`,
so every process of a run (each reopens the store from its URL) talks to the same server with the
same deadline. Unset, the endpoint comes from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, the region
from `AWS_REGION` or `AWS_DEFAULT_REGION`; credentials are the environment's (`AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY`) or the AWS default chain, and never pass through this module as values.

Failures are retried in two layers. tensorstore retries each HTTP request that fails transiently
(connection refused or reset, 5xx, 429 / 503 SlowDown) with exponential back-off, per its context
resource `s3_request_retries` (set here from the deadline). `call` retries a whole operation
that still fails transiently, with back-off, until the store's deadline (`retry_s`, default 60 s),
and cancels an attempt with no answer after `attempt_s`, so a dead connection or a server that
accepts and never answers cannot hang a reader; then it raises StoreUnavailable. Every operation is safe to repeat: objects are written
whole under keys no other write reuses, pointers by their one writer (docs/design.md#object-store-transport).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, Callable

log = logging.getLogger(__name__)

DEFAULT_RETRY_S = 60.0
ENV_ENDPOINT = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
ENV_REGION = ("AWS_REGION", "AWS_DEFAULT_REGION")
_OPTIONS = {"s3": ("endpoint", "region", "retry_s"), "gs": ("retry_s",)}
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^\[[0-9A-Fa-f:.]+\]$")
_REGION = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
# tensorstore's status codes (the prefix of its errors) for a failure that may pass: an exhausted
# request retry ("ABORTED: All 8 retry attempts failed"), a server down or overloaded, a timeout.
_TRANSIENT = ("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN")


class StoreUnavailable(OSError):
    """The store kept failing transiently past its deadline. An OSError, not a ValueError: the
    readers' damage paths (docs/design.md#damage-in-the-store) take ValueErrors, and an outage is
    not damage, so it is never skipped as a corrupt object."""


def check_endpoint(value: str, where: str = "endpoint") -> str:
    """`value` if it is an http(s)://host[:port] URL without user, path or query; else ValueError naming it."""
    u = urllib.parse.urlsplit(value)
    try:
        port_ok = u.port is None or 0 < u.port < 65536
    except ValueError:
        port_ok = False
    if (u.scheme not in ("http", "https") or not _HOST.match(u.hostname or "") or not port_ok
            or u.username is not None or u.path not in ("", "/") or u.query or u.fragment):
        shown = urllib.parse.urlsplit(value)._replace(netloc=u.netloc.rpartition("@")[2]).geturl()
        raise ValueError(f"{where}={shown!r}: want http://host[:port] or https://host[:port] "
                         "(no user or password, path or query; credentials come from the environment)")
    return value.rstrip("/")


def check_region(value: str, where: str = "region") -> str:
    if not _REGION.match(value):
        raise ValueError(f"{where}={value!r}: want an AWS region name such as us-east-1")
    return value


def check_retry_s(value: Any, where: str = "retry_s") -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{where}={value!r}: want a number of seconds > 0")
    return x


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """(the URL without its query, its store options); ValueError naming the URL for an option its
    scheme does not take or a bad value. Only `s3://` and `gs://` URLs take options."""
    scheme = url.partition("://")[0]
    base, sep, query = url.partition("?")
    if scheme not in _OPTIONS or not sep:
        return url, {}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ValueError(f"blob store URL {redacted(url)!r}: cannot parse its query {query!r}") from None
    opts, keys = dict(pairs), [k for k, _ in pairs]
    for k in keys:
        if k not in _OPTIONS[scheme] or keys.count(k) > 1:
            raise ValueError(f"blob store URL {redacted(url)!r}: option {k!r} is not one of "
                             f"{_OPTIONS[scheme]} for {scheme}://, or is given twice")
    try:
        if "endpoint" in opts:
            opts["endpoint"] = check_endpoint(opts["endpoint"])
        if "region" in opts:
            check_region(opts["region"])
        if "retry_s" in opts:
            check_retry_s(opts["retry_s"])
    except ValueError as e:
        raise ValueError(f"blob store URL {redacted(url)!r}: {e}") from None
    return base, opts


def redacted(url: str) -> str:
    """`url` with any user:password part of an endpoint in its query cut (for error messages)."""
    return re.sub(r"(://)[^/@?&]*@", r"\1", url)


def with_options(url: str, endpoint: str = "", region: str = "", retry_s: float | None = None) -> str:
    """`url` with the given store options set in its query (the runtime config's store fields,
    docs/design.md#object-store-transport); options the URL already names win. Only for s3:// / gs://."""
    base, opts = split_options(url)
    scheme = url.partition("://")[0]
    given = {"endpoint": endpoint, "region": region,
             "retry_s": "" if retry_s in (None, DEFAULT_RETRY_S) else f"{retry_s:g}"}
    extra = {k: v for k, v in given.items() if v and k not in opts}
    if not extra:
        return url
    if scheme not in _OPTIONS or set(extra) - set(_OPTIONS[scheme]):
        raise ValueError(f"blob store URL {redacted(url)!r}: options {sorted(extra)} are for s3:// URLs "
                         "(retry_s: s3:// and gs://)")
    out = base + "?" + urllib.parse.urlencode({**opts, **extra}, safe=":/")
    split_options(out)  # validates the new values
    return out


def endpoint_of(opts: Mapping[str, str], env: Mapping[str, str] = os.environ) -> str:
    """The endpoint a store's options and environment name; "" = AWS's own."""
    if opts.get("endpoint"):
        return opts["endpoint"]
    for name in ENV_ENDPOINT:
        if env.get(name):
            return check_endpoint(env[name], name)
    return ""


def retry_s_of(opts: Mapping[str, str]) -> float:
    return check_retry_s(opts["retry_s"]) if "retry_s" in opts else DEFAULT_RETRY_S


def request_retries(retry_s: float) -> dict:
    """tensorstore's per-request retries, spanning about a quarter of the deadline (at least the
    first few seconds of an outage) so `call`'s whole-operation retries still get their turns."""
    delays, d, n = 0.0, 0.05, 0
    while n < 16 and (n < 4 or delays + d <= retry_s / 4):
        delays, d, n = delays + d, min(d * 2, 2.0), n + 1
    return {"max_retries": n, "initial_delay": "0.05s", "max_delay": "2s"}


def s3_spec(bucket: str, path: str, opts: Mapping[str, str], env: Mapping[str, str] = os.environ) -> dict:
    """The s3 kvstore spec for a bucket and key prefix (tensorstore's kvstore/s3 schema: `endpoint`,
    `aws_region`, `aws_credentials`, context `s3_request_retries`)."""
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path,
                            "context": {"s3_request_retries": request_retries(retry_s_of(opts))}}
    endpoint = endpoint_of(opts, env)
    region = opts.get("region") or next((env[n] for n in ENV_REGION if env.get(n)), "")
    if endpoint:
        spec["endpoint"] = endpoint
        region = region or "us-east-1"  # S3-compatible servers take any region in the signature
    if region:
        spec["aws_region"] = check_region(region, "region (AWS_REGION)")
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        # The default chain would read them too, after complaining about missing ~/.aws files.
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def attempt_s(retry_s: float) -> float:
    """How long one attempt of an operation may take: a quarter of the deadline, at least 10 s
    (a 16 MB put at a few MB/s), at most the deadline. A larger object over a slower link needs a
    larger runtime.store.retry_s."""
    return min(retry_s, max(retry_s / 4, 10.0))


def transient(error: BaseException) -> bool:
    """Whether a tensorstore error may pass if the operation is repeated."""
    return isinstance(error, ValueError) and str(error).split(":", 1)[0].strip() in _TRANSIENT


def call(op: Callable[[], Any], what: str, retry_s: float, *, sleep: Callable[[float], Any] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> Any:
    """`op()` (a tensorstore Future) resolved, repeated with back-off (0.1 s doubling to 2 s) while
    it fails transiently, for at most `retry_s` seconds in all; then StoreUnavailable naming `what`.
    A non-transient error is raised at once, unchanged.

    One attempt waits at most attempt_s(retry_s), then is cancelled and made again: a request
    caught by an outage can sit on a dead connection with no answer and no error (seen with a
    server stopped for 3 s mid-run, tests/test_blobstore_s3.py), and a fresh attempt reconnects."""
    deadline, delay, attempts, per_attempt = clock() + retry_s, 0.1, 0, attempt_s(retry_s)
    while True:
        attempts += 1
        future = op()
        try:
            return future.result(timeout=max(min(deadline - clock(), per_attempt), 0.001))
        except TimeoutError:
            future.cancel()
            last: BaseException = TimeoutError(f"an attempt had no answer within {per_attempt:g} s")
        except ValueError as e:
            if not transient(e):
                raise
            last = e
        left = deadline - clock()
        if attempts == 1 and left > 0:
            log.warning("%s: %s; retrying for up to %g s", what, str(last)[:300], retry_s)
        if left <= 0:
            raise StoreUnavailable(f"{what}: the store kept failing for {retry_s:g} s ({attempts} attempts; "
                                   f"last: {str(last)[:300]})")
        sleep(min(delay, left))
        delay = min(delay * 2, 2.0)


def run_store_url(runtime: Any, default: str) -> str:
    """A run's store URL: `runtime.store.url` with the store's options (endpoint, region, retry_s)
    in its query, or `default` (the run directory's file:// store)."""
    store = runtime.store
    if not store.url:
        return default
    takes = _OPTIONS.get(store.url.partition("://")[0], ())
    return with_options(store.url, store.endpoint, store.region, store.retry_s if "retry_s" in takes else None)
