"""The procs syncer's logs across a kill: a journal line cut by the kill is not an entry, and the
input log reopened at a checkpoint's offset continues exactly there."""

import pytest

from diloco.algo.replay import Input
from diloco.runtime.procs.recovery import Journal, read_journal
from diloco.runtime.runlog import InputLog, read_inputs


def test_a_torn_journal_line_is_dropped_and_appending_continues_after_the_whole_ones(tmp_path):
    path = tmp_path / "journal.jsonl"
    j = Journal(path)
    j.append({"do": "event", "m": 0, "inc": 0, "n": 0, "t": 0.5})
    mark = j.offset()  # where a checkpoint taken here would resume
    j.append({"do": "deadline", "fragment": 1, "t": 0.75})
    j.close()
    with path.open("ab") as f:
        f.write(b'{"do":"bury","m":1')  # the kill cut this write: the entry never ran

    entries, end = read_journal(path, mark)
    assert entries == [{"do": "deadline", "fragment": 1, "t": 0.75}]
    j = Journal(path, keep=end)
    j.append({"do": "bury", "m": 1, "inc": 0, "at": 2.0, "t": 2.5})
    j.close()
    assert [e["do"] for e in read_journal(path, 0)[0]] == ["event", "deadline", "bury"]
    assert read_journal(tmp_path / "none.jsonl", 0) == ([], 0)  # a syncer killed before its first entry


def test_input_log_reopened_at_an_offset_drops_what_follows_and_appends(tmp_path):
    path = tmp_path / "inputs.bin"
    log = InputLog(path)
    log.append(Input("step_time", 1.0, (0, 0.25)))
    mark = log.offset()
    log.append(Input("contribution", 2.0, b"\x01\x02"))  # after the checkpoint: delivered again
    log.close()
    log = InputLog(path, keep=mark)
    log.append(Input("deadline", 3.0, 1))
    log.close()
    assert list(read_inputs(path)) == [Input("step_time", 1.0, (0, 0.25)), Input("deadline", 3.0, 1)]
    with pytest.raises(ValueError, match="checkpoint recorded"):  # the log lost flushed bytes
        InputLog(path, keep=10_000)
