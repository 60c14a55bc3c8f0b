"""Checkpoint damage (a hardening issue's items): torn saves are removed when a directory reopens."""

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
