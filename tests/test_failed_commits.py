"""A checkpoint save that fails, to start or in Orbax's asynchronous commit, is logged and retried
at the next save and never fails the run by itself; only when none has committed for
run.checkpoint_fail_s seconds does the run fail, with a message naming the option
(docs/design.md#checkpoint-integrity). Errors are injected into the manager's save and commit."""

import logging

import numpy as np
import pytest

from diloco import checkpoint
from diloco.config import ConfigError, TrainConfig, to_dict
from diloco.config import load as load_config
from diloco.runtime.syncer_ckpt import SyncerCheckpoints
from syncer_frames import FRAGS, policy, start


def _failing_commits(manager, fail: list[int]) -> None:
    """The manager's wait for its async commits raises for the next fail[0] of them: a commit that
    failed in the background thread (what Orbax reports from its next wait_until_finished)."""
    real = manager._wait_for_checkpointers

    def commit():
        real()
        if fail[0] > 0:
            fail[0] -= 1
            raise OSError(5, "Input/output error (injected into the async commit)")
    manager._wait_for_checkpointers = commit


def test_a_failed_async_commit_is_logged_retried_and_never_fails_the_run(tmp_path, caplog):
    pol = policy(K=1)
    st = start(pol)
    ckpts = SyncerCheckpoints(tmp_path / "syncer", every=1, fail_s=3600.0)
    fail = [1]
    _failing_commits(ckpts.manager, fail)
    with caplog.at_level(logging.ERROR):
        assert ckpts.save(st, 1)  # starts; its commit fails in the background
        assert ckpts.save(st, 2)  # the failure surfaces here, logged, and this save (the retry) starts
        assert "Input/output error (injected" in caplog.text and "the next save retries" in caplog.text
        ckpts.saves.settle()
        fail[0] = 1
        assert ckpts.save(st, 3)
        ckpts.close()  # the last commit failed too: logged at the close, which does not raise
    assert ckpts.saves.failures == 2
    again = SyncerCheckpoints(tmp_path / "syncer", every=1)
    assert 2 in again.manager.all_steps()  # the retry committed
    assert again.latest(pol, FRAGS) is not None
    again.close()


def test_no_checkpoint_for_checkpoint_fail_s_fails_the_run_with_a_clear_message(tmp_path, caplog):
    now = [0.0]
    manager = checkpoint.open_manager(tmp_path / "c", 2)
    saves = checkpoint.Saves(manager, "learner 0 checkpoint", fail_s=60.0, clock=lambda: now[0])
    state = {"x": np.arange(4, dtype=np.float32)}
    assert saves.save(1, state)
    now[0] = 30.0
    assert saves.save(2, state)  # step 1 committed at t = 30
    saves.settle()  # step 2's commit too, before the injection (its finalize thread may not have run yet)
    fail = [1]
    _failing_commits(manager, fail)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    now[0] = 40.0
    assert saves.save(3, state)  # starts; its commit fails
    manager.save = full_disk
    now[0] = 80.0
    assert not saves.save(4, state)  # 50 s without a commit: both failures logged, the run goes on
    assert saves.failures == 2 and "No space left on device" in caplog.text
    now[0] = 95.0
    with pytest.raises(checkpoint.CheckpointsFailing, match=r"for 65 s \(run.checkpoint_fail_s=60; 3 saves "
                                                            r"failed, the last with OSError"):
        saves.save(5, state)
    saves.close()


def test_checkpoint_fail_s_is_validated():
    raw = to_dict(TrainConfig())
    with pytest.raises(ConfigError, match=r"run.checkpoint_fail_s=-1.0 must be a finite number of seconds >= 0"):
        load_config({**raw, "run": {**raw["run"], "checkpoint_fail_s": -1.0}})
