"""Issue 35's five options on the ray runtime (docs/algorithm.md#recipes): each a run of the tiny model
with 2 learner actors and the syncer actor on one local Ray cluster the module starts once, checked
by what the option changes, read from the run's own records: Muon's state in the learners'
checkpoints, eager sends leaving before the merge of the one before is applied, the momentum
outer.momentum=auto set at each merge, each learner's tokens at its own batch, and sparseloco
frames merged. The ray driver runs procs' supervisor and its actors procs' learner and syncer
bodies, so these are the procs runs of the same options with Ray's launcher in between."""

import json
import warnings

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402
from option_checks import (EAGER, SPARSELOCO, STEPS, Run, check_auto_momentum, check_eager,  # noqa: E402
                           check_sparseloco, option_run, sent)
from ray.cluster_utils import Cluster  # noqa: E402
from test_ray import loopback  # noqa: E402

from diloco.config import RayConfig  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One head node with logical CPUs for the syncer's actor and two learners' bundles, and one
    XLA compilation cache for every actor's process (a Ray worker gets JAX_* from the driver)."""
    with pytest.MonkeyPatch.context() as mp:
        loopback(mp)
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla_cache")))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        with warnings.catch_warnings():  # JAX's fork warning, as in tests/test_ray.py
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
        yield c
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def ray_run(cluster, tmp_path, runtime=None, **groups) -> Run:
    """option_checks.option_run on the ray runtime, on the module's cluster: its checks, and every
    actor of the run gone once it has ended."""
    ray_cfg = RayConfig(address=cluster.address)
    run = option_run(tmp_path, "ray", runtime=dict(ray=ray_cfg, **(runtime or {})), **groups)
    actors = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in actors if a["name"].startswith(run.rt.launcher.prefix)], actors
    return run


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_step_their_own_batches(cluster, tmp_path):
    """runtime.learner_batch=[8, 16]: each learner actor steps its own rows, every send claims its
    own tokens per step, and the ledger books each learner's steps at its own batch."""
    rows = (8, 16)
    run = ray_run(cluster, tmp_path, runtime=dict(learner_batch=rows))
    frames = sent(run.dir)
    assert {h["learner"] for h in frames} == {0, 1}
    for h in frames:
        assert h["c_tokens"] == h["c_steps"] * rows[h["learner"]] * run.cfg.data.seq_len, h
    P = run.cfg.fragments.count
    assert run.rt.finished["tokens"]["processed"] == P * STEPS * sum(rows) * run.cfg.data.seq_len
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    for m, b in enumerate(rows):  # the tokens each learner's train records book
        booked = [r for r in records if r["kind"] == "train" and r["learner"] == m]
        assert booked and all(r["tokens"] == r["step"] * b * run.cfg.data.seq_len for r in booked), (m, booked)


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_train_with_muon_and_checkpoint_its_state(cluster, tmp_path):
    """inner=muon: the learner actors step with Muon on the hidden matrices and AdamW on the rest,
    and their checkpoints (what a restarted actor rejoins from) hold both branches: Muon's one
    moment for every hidden matrix with its Newton-Schulz coefficients, Adam's two moments for the
    embedding and the norms (the paths of the saved arrays, from the checkpoint's integrity record)."""
    run = ray_run(cluster, tmp_path, inner=dict(optimizer="muon", lr=1e-2))
    for m in range(2):
        newest = max((run.dir / "learners" / f"learner-{m}").glob("[0-9]*"), key=lambda d: int(d.name))
        paths = json.loads((newest / "integrity" / "metadata").read_text())["arrays"]  # every array saved
        params = {p.removeprefix("params/") for p in paths if p.startswith("params/")}
        kernels = {p for p in params if p.endswith("/kernel")}
        assert kernels and "embed/embedding" in params

        def moments(branch: str, moment: str) -> set[str]:
            head = f"opt_state/1/inner_states/{branch}/inner_state/0/{moment}/"
            return {p.removeprefix(head) for p in paths if p.startswith(head)}

        assert moments("muon", "mu") == kernels and "opt_state/1/inner_states/muon/inner_state/0/ns_coeffs" in paths
        assert moments("adam", "mu") == moments("adam", "nu") == params - kernels, sorted(paths)


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_take_eager_outer_steps(cluster, tmp_path):
    """fragments.eager=true at tau = 2H, in every learner actor (which only an eager schedule
    accepts): sends overlap the merge of the one before and carry H steps (option_checks.check_eager)."""
    check_eager(ray_run(cluster, tmp_path, **EAGER))


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_syncer_sets_the_outer_momentum_from_its_statistics(cluster, tmp_path):
    """outer.momentum=auto: every merge the syncer actor made stepped with the rule's momentum over
    the fragment's earlier cosines (option_checks.check_auto_momentum)."""
    check_auto_momentum(ray_run(cluster, tmp_path, outer=dict(momentum="auto")))


@pytest.mark.slow  # a ray run: 16 to 40 s here (at load 9)
def test_ray_learners_send_sparseloco_frames_that_merge(cluster, tmp_path):
    """codec=sparseloco with decayed error feedback: every frame the learner actors sent is
    sparseloco's, and merged or carried into a merged one (option_checks.check_sparseloco)."""
    check_sparseloco(ray_run(cluster, tmp_path, **SPARSELOCO))
