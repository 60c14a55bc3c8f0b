"""Files of a run's syncer record: the decision records (JSONL) and the inputs (a framed binary log).

Reference: docs/design.md#replay. The inputs log is what `diloco.algo.replay` needs to
rebuild the syncer exactly; the decision records are what people read.

inputs.bin is a sequence of records `uint32 header length | JSON header | payload`, the header
holding kind, time and, for contributions, the payload length; no pickle.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from diloco import report

from diloco.algo.bounds import loads_json
from diloco.algo.replay import KINDS, Input

_LEN = struct.Struct("<I")


def write_decisions(path: Path, records: Iterable[dict]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_decisions(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class InputLog:
    """Appends syncer inputs to a file as they happen (so a crash keeps everything before it).

    A new log starts empty; `keep=n` reopens an existing one and truncates it to its first n bytes
    (the offset a syncer checkpoint recorded): a restored syncer delivers the later inputs again."""

    def __init__(self, path: Path, keep: int | None = None):
        if keep is None:
            self._file = Path(path).open("wb")
            return
        self._file = Path(path).open("r+b" if Path(path).exists() else "w+b")
        size = self._file.seek(0, 2)
        if size < keep:
            self._file.close()
            raise ValueError(f"{path}: {size} bytes, but the checkpoint recorded {keep} (was it flushed?)")
        self._file.truncate(keep)
        self._file.seek(keep)

    def offset(self) -> int:
        """Bytes written so far, flushed to the OS (a killed process loses none of them)."""
        self._file.flush()
        return self._file.tell()

    def append(self, event: Input) -> None:
        payload = event.data if event.kind == "contribution" else b""
        data = None if event.kind == "contribution" else event.data
        header = json.dumps({"kind": event.kind, "at": event.at, "data": data,
                             "len": len(payload)}).encode()
        self._file.write(_LEN.pack(len(header)) + header + payload)

    def close(self) -> None:
        self._file.close()


def read_inputs(path: Path) -> Iterator[Input]:
    """The inputs of a log, in order, read one record at a time (a log holds every contribution's
    payload, hundreds of MB for a full-model run: docs/design.md#replay); a damaged log is a
    ValueError naming the file and byte."""
    for event, _ in _walk(path, payloads=True):
        yield event


def input_offset(path: Path, n: int) -> int:
    """The byte offset after the log's first n records, read without their payloads (a resume keeps
    that prefix in place: InputLog(path, keep=offset)); a log of fewer records is a ValueError."""
    if n == 0:
        return 0
    for seen, (_, end) in enumerate(_walk(path, payloads=False), 1):
        if seen == n:
            return end
    raise ValueError(f"{path}: fewer than the {n} input records the checkpoint counted")


def _walk(path: Path, payloads: bool) -> Iterator[tuple[Input, int]]:
    """Each record and the byte after it; without `payloads` a contribution's data is b"" and its
    payload is skipped, not read."""
    with Path(path).open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        pos = 0
        while pos < size:
            if pos + _LEN.size > size:
                raise ValueError(f"{path}: truncated record header at byte {pos}")
            (n,) = _LEN.unpack(f.read(_LEN.size))
            try:  # an input header nests 3 deep (the live set's pairs); bounded, so damage cannot recurse
                header = loads_json(f.read(min(n, size - pos - _LEN.size)), 8)
            except ValueError as e:
                raise ValueError(f"{path}: damaged input record at byte {pos}: {e}") from None
            pos = f.tell()
            if not (isinstance(header, dict) and {"kind", "at", "data", "len"} <= set(header)
                    and type(header["len"]) is int and header["len"] >= 0
                    and type(header["at"]) in (int, float)):
                raise ValueError(f"{path}: malformed input record at byte {pos}: {str(header)[:200]}")
            if header["kind"] not in KINDS:
                raise ValueError(f"{path}: unknown input kind {header['kind']!r} at byte {pos}")
            if header["kind"] == "contribution":
                if header["len"] > size - pos:
                    raise ValueError(f"{path}: truncated contribution at byte {pos}")
                data = f.read(header["len"]) if payloads else b""
                pos = f.tell() if payloads else f.seek(pos + header["len"])
            else:
                data = header["data"]
                if header["kind"] in ("step_time", "live", "lost_steps", "finished"):
                    if not isinstance(data, list):
                        raise ValueError(f"{path}: malformed {header['kind']} input at byte {pos}: {str(data)[:200]}")
                    data = tuple(tuple(x) if isinstance(x, list) else x for x in data)
            yield Input(header["kind"], header["at"], data), pos


def learner_rates(cfg, setup, clock: str):
    """The learning rate and throughput of each learner's train records
    (docs/design.md#metrics-series, #model-flops-and-mfu), on runtime.devices_per_learner devices;
    on a virtual `clock` (sim) over the wall seconds between its records, during which every
    learner stepped on the one mesh."""
    from diloco.train import flops, optim

    hw = flops.hardware(cfg.runtime.devices_per_learner, cfg.run.peak_tflops)
    return flops.Rates(setup.flops_per_token, hw, time.perf_counter if clock == "virtual" else None,
                       optim.step_lr(cfg.inner, cfg.run.steps))


@contextlib.contextmanager
def run_outputs(run_dir: Path | None, watch=None, rates=None,
                inputs_seen: int | None = None) -> Iterator[tuple[report.MetricsWriter | None, InputLog | None]]:
    """The metrics writer (with `rates`, train/flops.py Rates, adding throughput to its train records, and
    `watch`, diloco/watch.py, seeing them) and syncer input log of a DiLoCo run (None, None without
    a run dir), closed however the run ends. A resume passes `inputs_seen`, the records its syncer
    checkpoint had taken in: the log keeps those in place and drops the rest (inputs after the
    checkpoint are delivered again), without reading a payload."""
    writer = report.MetricsWriter(run_dir / "metrics.jsonl", watch, rates) if run_dir is not None else None
    inputs = None
    if run_dir is not None:
        path = run_dir / "syncer_inputs.bin"
        inputs = InputLog(path, None if inputs_seen is None else input_offset(path, inputs_seen))
    try:
        yield writer, inputs
    finally:
        for closable in (writer, inputs):
            if closable is not None:
                closable.close()


def close_run(run_dir: Path | None, writer: report.MetricsWriter | None, summary: dict, start: int,
              last_eval: Callable[[], float] | None, decisions: Iterable[dict]) -> dict:
    """The end of a finished sim or threads run: `summary` with the tokens it started from (a
    resumed run's rates are its own, run.py) and the global model's last evaluation, and, with a
    run dir, the decision records and the summary written."""
    summary["tokens_at_start"] = start
    if last_eval is not None:
        summary["eval_loss"] = last_eval()
    if run_dir is not None:
        write_decisions(run_dir / "decisions.jsonl", decisions)
        writer.summary(summary)
    return summary
