"""Runtime damage (hardening issue items): torn checkpoint saves, frames too damaged to name themselves."""

import numpy as np

from diloco import checkpoint


def test_a_torn_save_is_removed_when_the_directory_is_opened_again(tmp_path):
    manager = checkpoint.open_manager(tmp_path / "ck", keep=2, async_save=False)
    checkpoint.save(manager, 1, {"w": np.ones(3, np.float32)})
    manager.wait_until_finished()
    manager.close()
    torn = tmp_path / "ck" / "2.orbax-checkpoint-tmp-1234567890"  # what a kill mid-save leaves
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "partial").write_bytes(b"\0" * 16)
    manager = checkpoint.open_manager(tmp_path / "ck", keep=2, async_save=False)
    try:
        manager.wait_until_finished()  # Orbax removes them in the background
        assert not torn.exists()
        assert manager.all_steps() == [1]
        state, _ = checkpoint.restore(manager, 1, {"w": np.zeros(3, np.float32)})
        np.testing.assert_array_equal(state["w"], np.ones(3, np.float32))
    finally:
        manager.close()


def test_a_frame_too_damaged_to_name_itself_resolves_the_send_that_carried_it(tmp_path):
    """A contribution whose frame fails its checksum is quarantined without a key of its own; the
    event that named it says which send it was, so its tokens are dropped, not in flight forever."""
    from conftest import diloco_world

    from diloco.algo import ledger
    from diloco.runtime import events as ev
    from diloco.runtime.host import SyncerHost
    from test_conformance import make_cfg

    cfg = make_cfg(tmp_path, "sim")
    _, _, setup, _, _ = diloco_world(cfg)
    host = SyncerHost(setup, {0: 0, 1: 0})
    tokens = cfg.data.batch_size * cfg.data.seq_len
    host.on_event(ev.StepDone(0, 0, 1, 0.0, 1.0, tokens, ((0, 1),), (b"DLC1 not a frame at all",)), 1.0)
    assert (0, 0, 1) not in host.tokens.in_flight
    assert sum(host.state.quarantined.values()) == 1
    assert any(reason.startswith("quarantined:") for reason in host.tokens.dropped)
    ledger.check_balance(host.tokens)
