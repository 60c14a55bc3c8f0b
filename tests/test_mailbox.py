"""The learner mailbox of the threads runtime: FIFO, never blocks, collapses a backlog into a copy."""

import threading

import numpy as np
import pytest

from diloco.algo import codec_specs, messages, payloads
from diloco.runtime.threads.mailbox import Mailbox


def broadcast(fragment, version, merged=()):
    tensors, payload, _ = payloads.pack_fragment({("w",): np.full(3, version, np.float32)},
                                                 codec_specs.codec_from_spec("fp32"))
    header = {"kind": "fragment", "learner": 0, "incarnation": 0, "seq": version, "fragment": fragment,
              "base_version": version, "version": version, "c_steps": 0, "c_tokens": 0, "codec": "fp32",
              "delta_against": None, "tensors": tensors, "merged": [list(k) for k in merged]}
    return messages.encode(header, payload)


def version_of(frame):
    return messages.decode(frame).header["version"]


def test_fifo_then_closed():
    box = Mailbox(4)
    frames = [broadcast(0, v) for v in (1, 2, 3)]
    for f in frames:
        assert box.put(0, f, catch_up=None) == 0
    assert box.get(0.0) is frames[0] and not box.empty()
    assert box.get(0.0) is frames[1]
    box.close()
    assert box.get(0.0) is frames[2]
    assert box.get(0.0) is None  # closed and empty
    with pytest.raises(RuntimeError):
        box.put(0, frames[0], catch_up=None)


def test_empty_get_times_out_with_false():
    assert Mailbox(1).get(0.01) is False


def test_a_backlog_collapses_into_one_full_copy_listing_every_merged_key():
    box = Mailbox(2)
    calls = []

    def catch_up(p, merged):
        calls.append((p, merged))
        return broadcast(p, 9, merged)

    box.put(0, broadcast(0, 1, [(0, 0, 1)]), catch_up)
    box.put(1, broadcast(1, 1, [(1, 0, 1)]), catch_up)
    extra = box.put(0, broadcast(0, 2, [(2, 0, 5)]), catch_up)  # third frame: over capacity
    assert calls == [(0, ((0, 0, 1), (2, 0, 5)))]
    assert extra == len(broadcast(0, 9, calls[0][1])) and box.collapsed == 2
    got = [box.get(0.0), box.get(0.0)]
    assert [messages.decode(f).header["fragment"] for f in got] == [1, 0]
    assert version_of(got[1]) == 9
    assert messages.merged_keys(messages.decode(got[1]).header) == {(0, 0, 1), (2, 0, 5)}


def test_a_waiting_reader_wakes_on_put_and_on_close():
    box = Mailbox(2)
    got = []
    # timeouts no busy machine reaches: each get returns because of the put or the close
    reader = threading.Thread(target=lambda: got.extend([box.get(600.0), box.get(600.0)]), daemon=True)
    reader.start()
    frame = broadcast(0, 1)
    box.put(0, frame, catch_up=None)
    box.close()
    reader.join(120.0)
    assert not reader.is_alive() and got == [frame, None]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        Mailbox(0)
