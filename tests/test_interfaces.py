"""The runtimes' pieces implement the named interfaces (diloco/runtime/interfaces.py), so a new
runtime can be written against them."""

from diloco import store as bs
from diloco.runtime import interfaces as api
from diloco.runtime.crew import Crew
from diloco.runtime.procs.learner import ProcLearner
from diloco.runtime.threads.runtime import Threads, _ThreadPort


def test_concrete_pieces_satisfy_the_protocols(tmp_path):
    store = bs.BlobStore(f"file://{tmp_path / 'store'}")
    assert isinstance(store, api.BlobStore)
    channel = bs.ControlChannel(store)
    assert isinstance(channel, api.Channel)
    channel.write("start", {"t0": 1.5})
    assert channel.read("start") == {"t0": 1.5} and channel.read("nothing") is None
    assert isinstance(Crew(), api.Lifecycle)
    for port in (ProcLearner, _ThreadPort):  # the two ports of the one wall-clock learner loop
        assert all(callable(getattr(port, name, None))
                   for name in ("clock", "poll", "wait", "emit", "check", "log")), port
    assert callable(getattr(Threads, "clock"))
