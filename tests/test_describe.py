"""The option listing is generated from the config dataclasses and their comments; a mistyped key
gets the close matches, not Hydra's "use +key"."""

import functools

from diloco.config import TrainConfig
from diloco.config.describe import describe, options, unknown_keys

GROUPS = {"model", "data", "inner", "mesh", "fragments", "outer", "codec", "syncer", "runtime", "chaos"}


def test_every_option_is_listed_with_its_default_and_comment():
    keys = [k for k, _, _ in options()]
    assert len(keys) == len(set(keys)) > 100
    text = describe()
    cfg = TrainConfig()
    for key, default, _ in options():
        assert default == functools.reduce(getattr, key.split("."), cfg)  # nested: finetune.lora.rank
        assert f"  {key} = {default!r}" in text
    docs = dict((k, d) for k, _, d in options())
    assert "auto | on | off" in docs["runtime.auth.mode"]
    assert "[runtime.auth] Learner authentication" in text  # a section's heading is its docstring
    assert docs["syncer.clip"].startswith("Robust merge")
    assert docs["algo"].startswith("dp: the data-parallel baseline")


def test_every_option_has_a_meaning_line():
    """A field of schema.py without a comment would be listed by `--describe` with its default alone."""
    lines = describe().splitlines()
    bare = [line.strip() for line, after in zip(lines, lines[1:] + [""])
            if line.startswith("  ") and not line.startswith("   ") and not after.startswith("      ")]
    assert not bare, f"options without a meaning (comment the field in diloco/config/schema.py): {bare}"
    assert all(doc for _, _, doc in options())


def test_every_option_outside_the_data_groups_can_be_overridden():
    """Hydra refuses `key=value` for a key its composed config lacks ("not in struct"), so every
    option must be in configs/train.yaml or its group's file (run.memory_check=false, which a
    refusal tells the user to pass, was missing). data.* differs by data group, each listing its own."""
    from diloco.experiments.spec import _compose

    raw = _compose("train", ["run.out_dir=x"])

    def present(key: str) -> bool:
        node = raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True
    missing = [k for k, _, _ in options() if not k.startswith("data.") and not present(k)]
    assert not missing, f"options Hydra cannot override (add them to configs/): {missing}"


def test_a_mistyped_key_gets_the_close_matches():
    got = unknown_keys(["runtime.stall_limit_stpes=2", "run.steps=20", "model=tiny", "+model.d_modle=64",
                        "runtime.quorum=2", "colour=red", "hydra.run.dir=x"], GROUPS)
    assert got == ["unknown option 'runtime.stall_limit_stpes'; did you mean runtime.stall_limit_steps?",
                   "unknown option 'model.d_modle'; did you mean model.d_model?",
                   "unknown option 'runtime.quorum'; did you mean syncer.quorum?",
                   "unknown option 'colour'; `--describe` lists every option"]


def test_an_old_flat_key_is_renamed_to_its_section_with_a_notice(capsys):
    """runtime.store_url= (before the runtime had sections) is runtime.store.url=, not an unknown key."""
    from diloco.config import legacy

    got = legacy.overrides(["runtime.store_url=s3://b/r", "+runtime.auth=off", "runtime.learners=2", "--debug"])
    assert got == ["runtime.store.url=s3://b/r", "+runtime.auth.mode=off", "runtime.learners=2", "--debug"]
    assert capsys.readouterr().err.splitlines() == [
        "warning: runtime.store_url is deprecated, use runtime.store.url",
        "warning: runtime.auth is deprecated, use runtime.auth.mode"]
    assert unknown_keys(got, GROUPS) == []
