"""Issue 35's options where the threads and procs runtimes had no run of their own
(docs/algorithm.md#recipes): codec=sparseloco on threads; fragments.eager=true,
outer.momentum=auto and codec=sparseloco as learner and syncer processes. Each is a run of the tiny
model checked by what the option changes, with the checks tests/test_ray_options.py makes of the
same options on Ray (tests/option_checks.py)."""

import pytest
from option_checks import EAGER, SPARSELOCO, check_auto_momentum, check_eager, check_sparseloco, option_run


@pytest.mark.slow  # a threads run of the tiny model: about 20 s here (load 5)
def test_threads_learners_send_sparseloco_frames_that_merge(tmp_path):
    check_sparseloco(option_run(tmp_path, "threads", **SPARSELOCO))


@pytest.mark.slow  # spawns a syncer and two learner processes: about 40 s here
def test_procs_learners_send_sparseloco_frames_that_merge(tmp_path):
    check_sparseloco(option_run(tmp_path, "procs", **SPARSELOCO))


@pytest.mark.slow  # spawns a syncer and two learner processes: about 40 s here
def test_procs_learners_take_eager_outer_steps(tmp_path):
    check_eager(option_run(tmp_path, "procs", **EAGER))


@pytest.mark.slow  # spawns a syncer and two learner processes: about 40 s here
def test_procs_syncer_sets_the_outer_momentum_from_its_statistics(tmp_path):
    check_auto_momentum(option_run(tmp_path, "procs", outer=dict(momentum="auto")))
