"""Record files under an object-store URL (s3://, gs://): listed and copied once through the
run's store layer (diloco/store) into data.data_dir, then read as local files.

Reference: docs/data.md#formats (a copy, not a streamed read: the sets' files are read by index).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import tempfile
from pathlib import Path

from diloco.data.errors import DataError

REMOTE = ("s3", "gs")


def is_remote(pattern: str) -> bool:
    return pattern.partition("://")[0] in REMOTE


def fetch(pattern: str, data_dir: str | Path) -> list[Path]:
    """The local copies of the objects `pattern` names (scheme://bucket/dir/name, the name may be a
    glob; s3 store options after '?', as runtime.store.url takes them), fetched if not there yet.
    Objects are taken as written once: a local copy is kept whatever the object holds now."""
    from diloco.store import BlobStore, StoreUnavailable

    base, _, query = pattern.partition("?")
    scheme, _, rest = base.partition("://")
    bucket, _, path = rest.partition("/")
    head, _, name = path.rpartition("/")
    if not bucket or not name:
        raise DataError(f"data.paths entry {pattern!r}: want {scheme}://bucket/[dir/]name (a glob in the name)")
    url = f"{scheme}://{bucket}/{head}".rstrip("/") + (f"?{query}" if query else "")
    try:
        store = BlobStore(url)
        keys = [k for k in store.list("") if "/" not in k and fnmatch.fnmatchcase(k, name)] \
            if glob.has_magic(name) else [name]
    except (ValueError, StoreUnavailable) as e:
        raise DataError(f"data.paths entry {pattern!r}: {e}") from None
    if not keys:
        raise DataError(f"data.paths: glob {pattern!r} matches no objects")
    root = Path(data_dir) / "remote" / hashlib.sha256(f"{scheme}://{bucket}/{head}".encode()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for key in sorted(keys):
        local = root / key
        if not local.is_file():
            try:
                data = store.get(key)
            except (ValueError, StoreUnavailable) as e:
                raise DataError(f"data.paths: {scheme}://{bucket}/{head}/{key} cannot be read: {e}") from None
            if data is None:
                raise DataError(f"data.paths: no object {scheme}://{bucket}/{head}/{key}")
            fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.")  # a crash leaves no half-copied file
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, local)
        out.append(local)
    return out
