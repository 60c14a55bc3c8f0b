"""Config conversion and validation: unknown keys, wrong types and inconsistent values are named."""

import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from diloco.config import ConfigError, MeshConfig, TrainConfig, from_dict, load, to_dict, validate
from diloco.config.checks import mesh_errors

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_are_valid_and_round_trip():
    cfg = validate(TrainConfig())
    assert load(to_dict(cfg)) == cfg


def test_unknown_key_is_named():
    raw = to_dict(TrainConfig())
    raw["model"]["d_modle"] = 64
    with pytest.raises(ConfigError, match=r"model\.d_modle"):
        load(raw)


def test_unknown_top_level_section_is_named():
    with pytest.raises(ConfigError, match="optimiser"):
        load({"optimiser": {}})


@pytest.mark.parametrize("section,key,value,expected", [
    ("model", "n_layers", "four", "model.n_layers must be an integer"),
    ("run", "resume", "yes", "run.resume must be true or false"),
    ("inner", "lr", None, "inner.lr must be a number"),
    ("data", "paths", 3, "data.paths must be a list"),
])
def test_wrong_types_are_named(section, key, value, expected):
    raw = to_dict(TrainConfig())
    raw[section][key] = value
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load(raw)


@pytest.mark.parametrize("overrides,expected", [
    ({"model": {"d_model": 100, "n_heads": 6}}, "model.d_model=100 is not divisible by model.n_heads=6"),
    ({"model": {"n_heads": 4, "n_kv_heads": 3}}, "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    ({"model": {"d_model": 12, "n_heads": 4, "n_kv_heads": 4}}, "head dim model.d_model/model.n_heads=3"),
    ({"data": {"seq_len": 512}}, "data.seq_len=512 exceeds model.max_seq_len=256"),
    ({"data": {"source": "wiki"}}, "data.source='wiki'"),
    ({"data": {"source": "files"}}, "data.source=files needs data.paths"),
    ({"data": {"shard_block": 100}}, "data.shard_block=100 must be 0 (contiguous shards) or > data.seq_len=128"),
    ({"inner": {"warmup_steps": 900}}, "inner.warmup_steps=900 must be in [0, run.steps=300]"),
    ({"run": {"steps": 0}}, "run.steps=0 must be > 0"),
])
def test_cross_field_errors_name_the_values(overrides, expected):
    raw = to_dict(TrainConfig())
    for section, values in overrides.items():
        raw[section].update(values)
    with pytest.raises(ConfigError) as err:
        load(raw)
    assert expected in str(err.value)


def test_all_errors_are_reported_together():
    raw = to_dict(TrainConfig())
    raw["run"]["steps"] = -1
    raw["data"]["batch_size"] = 0
    with pytest.raises(ConfigError) as err:
        load(raw)
    assert "run.steps=-1" in str(err.value) and "data.batch_size=0" in str(err.value)


def test_mesh_errors_name_batch_and_devices():
    assert mesh_errors(MeshConfig(), batch_size=32, n_visible=8) == []
    (msg,) = mesh_errors(MeshConfig(), batch_size=30, n_visible=8)
    assert msg == "data.batch_size=30 is not divisible by mesh.data*mesh.fsdp=8"
    (msg,) = mesh_errors(MeshConfig(devices=16), batch_size=32, n_visible=8)
    assert "mesh.devices=16" in msg and "8 devices" in msg
    msgs = mesh_errors(MeshConfig(data=3, fsdp=2), batch_size=32, n_visible=8)
    assert "mesh.data=3 x mesh.fsdp=2 != 8 devices (mesh.devices=0)" in msgs


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _all_compositions():
    groups = ["model", "data", "inner", "mesh", "fragments", "outer", "codec", "syncer", "runtime", "chaos", "finetune",
              "preset"]
    for group in groups:
        for option in _group_options(group):
            yield f"{group}={option}"


@pytest.mark.parametrize("override", list(_all_compositions()))
def test_every_config_file_composes_and_validates(override):
    """Every group file composes with the rest of train.yaml into a valid TrainConfig that holds
    every composed value, the file's own ones included (but those train.yaml sets over it)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        raw = compose(config_name="train", overrides=[override, "run.out_dir=runs/test"])
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(raw, resolve=True)
    if override.startswith("model="):  # big models may need a longer context than the default data
        data["data"]["seq_len"] = min(data["data"]["seq_len"], data["model"]["max_seq_len"])
    loaded = to_dict(load(data))
    assert {s: {k: loaded[s][k] for k in v} if isinstance(v, dict) else loaded[s] for s, v in data.items()} == data
    group, option = override.split("=")
    own = OmegaConf.to_container(OmegaConf.load(CONFIGS / group / f"{option}.yaml"))
    own.pop("defaults", None)
    # train.yaml's own values come after the groups (its _self_), a finetune's and a preset's after
    # train.yaml: those two are global, setting several sections.
    late = group in ("finetune", "preset")
    after = {} if late else OmegaConf.to_container(OmegaConf.load(CONFIGS / "train.yaml")).get(group) or {}
    for section, values in (own if late else {group: own}).items():
        for key, value in values.items():
            if key not in after and (section, key) != ("data", "seq_len"):
                assert loaded[section][key] == value, (section, key, loaded[section][key], value)


def test_finetune_presets_set_the_fine_tuning_outer_step_and_the_command_line_wins():
    """finetune=full and lora set outer lr 1 / momentum 0 over train.yaml's pretraining 0.8
    (docs/design.md#fine-tuning); finetune=none keeps train.yaml's; a command-line value wins."""
    def outer(*overrides):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = load(OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True))
        return cfg.outer.lr, cfg.outer.momentum, cfg.finetune.lora.rank

    from omegaconf import OmegaConf
    assert outer() == outer("finetune=none") == (0.8, 0.0, 0)
    assert outer("finetune=full") == (1.0, 0.0, 0) and outer("finetune=lora") == (1.0, 0.0, 8)
    assert outer("finetune=lora", "outer.lr=0.6", "outer.momentum=0.5") == (0.6, 0.5, 8)
    assert outer("outer=nesterov", "finetune=full")[:2] == (1.0, 0.0)  # over the outer group too


GROUP_TYPES = {"model": "ModelConfig", "data": "DataConfig", "inner": "InnerConfig", "mesh": "MeshConfig",
               "fragments": "FragmentsConfig", "outer": "OuterConfig", "codec": "CodecConfig",
               "syncer": "SyncerConfig", "runtime": "RuntimeConfig", "chaos": "ChaosConfig"}


@pytest.mark.parametrize("group", sorted(GROUP_TYPES))
def test_every_group_file_lists_every_field(group):
    """Hydra only accepts command-line overrides of keys present in the composed YAML, so a field
    missing from a group file could not be set with `group.field=value`."""
    import dataclasses

    import yaml

    import diloco.config as config

    fields = {f.name for f in dataclasses.fields(getattr(config, GROUP_TYPES[group]))}
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text()))
        need = fields
        if group == "data":  # a source's file may leave out the other sources' settings
            need = {"source", "seq_len", "batch_size", "val_fraction", "data_dir"}
        assert need <= keys <= fields, f"{path.name}: missing {sorted(need - keys)}, unknown {sorted(keys - fields)}"
        raw = yaml.safe_load(path.read_text())
        for name, tp in typing.get_type_hints(getattr(config, GROUP_TYPES[group])).items():
            if dataclasses.is_dataclass(tp):  # and each of its sections' (runtime.store)
                inner = {f.name for f in dataclasses.fields(tp)}
                assert set(raw[name]) == inner, f"{path.name}: {name} has {sorted(raw[name])}, not {sorted(inner)}"


def test_an_old_flat_runtime_key_is_read_into_its_section_with_a_notice(capsys):
    """A saved run's config.yaml from before the runtime had sections still loads (a resume reads it)."""
    raw = {"runtime": {"kind": "procs", "store_url": "s3://b/run", "store_retry_s": 5, "auth": "off",
                       "processes_per_learner": 1, "ray_address": "auto", "learner_resources": {"CPU": 2}}}
    cfg = from_dict(TrainConfig, raw)
    r = cfg.runtime
    assert (r.store.url, r.store.retry_s, r.auth.mode, r.ray.address, r.ray.learner_resources) == \
        ("s3://b/run", 5.0, "off", "auto", {"CPU": 2.0})
    err = capsys.readouterr().err.splitlines()
    assert "warning: runtime.store_url is deprecated, use runtime.store.url" in err
    assert "warning: runtime.auth is deprecated, use runtime.auth.mode" in err
    assert len(err) == 6  # one line per old key, once
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg and capsys.readouterr().err == ""  # the new keys: no notice


def test_an_unknown_key_of_a_runtime_section_is_refused_by_its_dotted_name():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) runtime\.store\.bucket; runtime\.store accepts: "
                                          r"endpoint, region, retry_s, url"):
        from_dict(TrainConfig, {"runtime": {"store": {"bucket": "b"}}})
    with pytest.raises(ConfigError, match=r"runtime\.world\.heartbeat_s=0\.5 must be >= 1"):
        load({"runtime": {"kind": "procs", "world": {"heartbeat_s": 0.5}}})
