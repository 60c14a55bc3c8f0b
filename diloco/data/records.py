"""Records of a file set, read by index: the sources of data=grain (Parquet, ArrayRecord, JSONL,
plain text), each file checked at start-up so bad input is one error naming the file.

Reference: docs/data.md#formats.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from diloco.data.errors import DataError

FORMATS = ("parquet", "arrayrecord", "jsonl", "text")
SUFFIXES = {".parquet": "parquet", ".array_record": "arrayrecord", ".arrayrecord": "arrayrecord",
            ".jsonl": "jsonl", ".json": "jsonl", ".txt": "text", ".text": "text"}
RECORDS = ("tokens", "text", "json")  # what an ArrayRecord record holds (data.record)


def file_format(path: Path, fmt: str) -> str:
    """data.format, or (auto) the format the file's suffix names."""
    if fmt != "auto":
        return fmt
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None and "array_record" in path.name:  # sharded names: x.array_record-00000-of-00008
        kind = "arrayrecord"
    if kind is None:
        raise DataError(f"{path}: cannot tell its format from the suffix {path.suffix!r} (known: "
                        f"{', '.join(sorted(SUFFIXES))}); set data.format={'|'.join(FORMATS)}")
    return kind


class Lines:
    """The non-blank lines of a JSONL or text file, by index: an index of line starts over the
    file mapped into memory (one pass at start-up, no copy of the text held)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e}); fix its permissions or "
                            "drop it from data.paths") from None
        buf = np.frombuffer(self._map, np.uint8) if size else np.zeros(0, np.uint8)
        ends = np.flatnonzero(buf == 10)
        starts = np.concatenate([[0], ends + 1])
        stops = np.concatenate([ends, [size]])
        # a blank line (only whitespace) is no record; checked on the short lines alone
        keep = np.ones(len(starts), bool)
        for i in np.flatnonzero(stops - starts <= 8):
            keep[i] = bool(bytes(buf[starts[i]:stops[i]]).strip())
        self.starts, self.stops = starts[keep], stops[keep]
        self.numbers = np.flatnonzero(keep) + 1  # 1-based line numbers, for errors

    def __len__(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> str:
        raw = self._map[self.starts[i]:self.stops[i]]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{self.path}: line {self.numbers[i]}: invalid UTF-8 at byte {e.start}") from None

    def __getstate__(self):  # a worker process maps the file again
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class ParquetFile:
    """One Parquet file's rows, by index, of the columns a run reads; the last GROUPS_KEPT row
    groups decoded are kept, as a shuffle block's reads stay among a few (docs/data.md#shuffling)."""

    GROUPS_KEPT = 8

    def __init__(self, path: Path, columns: tuple[str, ...]):
        import pyarrow.parquet as pq

        self.path, self.columns = path, columns
        try:
            self._file = pq.ParquetFile(str(path))
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); rewrite "
                            "it or drop it from data.paths") from None
        names = self._file.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (columns: {names}); set data.text_field "
                            "(or data.chat_field) to one of them")
        sizes = [self._file.metadata.row_group(g).num_rows for g in range(self._file.num_row_groups)]
        self.group_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._groups: dict[int, dict] = {}  # row group -> its columns as lists, oldest first

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def row(self, i: int) -> dict:
        g = int(np.searchsorted(self.group_starts, i, side="right") - 1)
        if g not in self._groups:
            try:
                table = self._file.read_row_group(g, columns=list(self.columns))
            except Exception as e:  # noqa: BLE001
                raise DataError(f"{self.path}: row group {g} cannot be read ({type(e).__name__}: {e}); "
                                "rewrite the file or drop it from data.paths") from None
            if len(self._groups) >= self.GROUPS_KEPT:
                del self._groups[next(iter(self._groups))]
            self._groups[g] = table.to_pydict()
        rows, k = self._groups[g], i - int(self.group_starts[g])
        return {c: rows[c][k] for c in self.columns}

    def __getstate__(self):
        return {"path": self.path, "columns": self.columns}

    def __setstate__(self, state):
        self.__init__(state["path"], state["columns"])


class ArrayRecordFile:
    """One ArrayRecord file's records (bytes), by index, read CHUNK at a time: a lone random read
    decompresses the record's whole group, so its neighbours are kept for the reads that follow
    (a shuffle block's reads stay among a few chunks: docs/data.md#shuffling)."""

    CHUNK, CHUNKS_KEPT = 64, 64

    def __init__(self, path: Path):
        from array_record.python.array_record_module import ArrayRecordReader

        self.path = path
        self._chunks: dict[int, list[bytes]] = {}  # oldest first
        try:
            self._reader = ArrayRecordReader(str(path), "readahead_buffer_size:0")
            self._n = self._reader.num_records()
        except Exception as e:  # noqa: BLE001 - the reader raises RuntimeError / ValueError
            raise DataError(f"{path}: not a readable ArrayRecord file ({type(e).__name__}: {e}); "
                            "rewrite it or drop it from data.paths") from None

    def __len__(self) -> int:
        return self._n

    def record(self, i: int) -> bytes:
        c = i // self.CHUNK
        if c not in self._chunks:
            if len(self._chunks) >= self.CHUNKS_KEPT:
                del self._chunks[next(iter(self._chunks))]
            try:
                self._chunks[c] = self._reader.read(list(range(c * self.CHUNK, min(self._n, (c + 1) * self.CHUNK))))
            except Exception as e:  # noqa: BLE001 - a damaged chunk
                raise DataError(f"{self.path}: records {c * self.CHUNK}.. cannot be read ({type(e).__name__}: "
                                f"{e}); rewrite the file or drop it from data.paths") from None
        return self._chunks[c][i - c * self.CHUNK]

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class FileSet:
    """Every record of the files in order (file by file, row by row): record i is the i-th.
    read(i) gives a str (text), a dict (JSON, Parquet row) or an int32 array (pre-tokenised)."""

    def __init__(self, files: list[Path], fmt: str, columns: tuple[str, ...], record: str):
        self.files, self.record = files, record
        self.kinds = [file_format(f, fmt) for f in files]
        self.readers = []
        for f, kind in zip(files, self.kinds):
            if kind == "parquet":
                self.readers.append(ParquetFile(f, columns))
            elif kind == "arrayrecord":
                self.readers.append(ArrayRecordFile(f))
            else:
                self.readers.append(Lines(f))
        self.starts = np.concatenate([[0], np.cumsum([len(r) for r in self.readers])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, i: int) -> tuple[int, int]:
        """(file index, index inside it) of record i."""
        f = int(np.searchsorted(self.starts, i, side="right") - 1)
        return f, int(i - self.starts[f])

    def read(self, i: int):
        f, k = self.where(i)
        reader, kind = self.readers[f], self.kinds[f]
        if kind == "parquet":
            return reader.row(k)
        if kind == "text":
            return reader.line(k)
        if kind == "jsonl":
            return self._json(reader.line(k), f"{self.files[f]}: line {reader.numbers[k]}")
        raw = reader.record(k)
        if self.record == "tokens":
            if len(raw) % 4:
                raise DataError(f"{self.files[f]}: record {k} has {len(raw)} bytes, not whole int32 token "
                                "ids; set data.record=text or json if the records are not pre-tokenised")
            return np.frombuffer(raw, "<i4")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{self.files[f]}: record {k}: invalid UTF-8 at byte {e.start}; set "
                            "data.record=tokens if the records are int32 token ids") from None
        return text if self.record == "text" else self._json(text, f"{self.files[f]}: record {k}")

    @staticmethod
    def _json(line: str, where: str) -> dict:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise DataError(f"{where} is not valid JSON ({str(e)[:80]})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where} is a JSON {type(obj).__name__}, not an object")
        return obj

    def describe(self, i: int) -> str:
        f, k = self.where(i)
        if self.kinds[f] in ("jsonl", "text"):
            return f"{self.files[f]}: line {self.readers[f].numbers[k]}"
        return f"{self.files[f]}: {'row' if self.kinds[f] == 'parquet' else 'record'} {k}"
