import pytest

from optimus.config import ConfigError, build_config, load_config, parse_overrides, save_config


def test_preset_fills_model_and_explicit_fields_win():
    config = build_config({"model": {"preset": "mula-7b-a1b", "n_layers": 2}})
    assert config.model.d_model == 2048 and config.model.n_experts == 64
    assert config.model.n_layers == 2


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["--train.max_steps=10", "--optim.betas", "[0.9, 0.99]", "--model.qk_norm=false"]) == {
        "train": {"max_steps": 10},
        "optim": {"betas": [0.9, 0.99]},
        "model": {"qk_norm": False},
    }


def test_override_beats_file_and_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: mula-tiny-moe\ntrain:\n  max_steps: 5\n")
    config = load_config(path, ["--train.max_steps=7", "--model.top_k=2"])
    assert config.train.max_steps == 7 and config.model.top_k == 2 and config.model.n_experts == 16


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"train": {"max_step": 3}}, "unknown config key 'train.max_step'"),
        ({"modle": {}}, "unknown config key 'modle'"),
        ({"model": {"preset": "gpt-5"}}, "unknown model.preset 'gpt-5'"),
        ({"train": {"seq_len": -1}}, "bad value for 'train.seq_len'"),
        ({"train": {"micro_batch_size": 3, "global_batch_size": 8}}, "not divisible by train.micro_batch_size (3)"),
        ({"parallel": {"pp": 2}, "train": {"micro_batch_size": 8}}, "needs at least pp (2) micro-batches"),
        ({"parallel": {"dp_shard": 3}}, "not divisible by the 3 data-parallel ranks"),
        ({"model": {"n_experts": 2, "top_k": 4}}, "top_k"),
        ({"data": {"sources": [{"weight": 1.0}]}}, "exactly one of"),
        ({"optim": {"betas": [0.9, 1.5]}}, "beta"),
    ],
)
def test_bad_configs_give_one_line(raw, needle):
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a directory"):  # (`optimus train configs` said "not found")
        load_config(tmp_path)
    twice = tmp_path / "twice.yaml"  # PyYAML kept the last without a word: an edit's duplicate silently won or lost
    twice.write_text("model:\n  preset: mula-tiny-moe\ntrain:\n  seed: 1\nmodel: {preset: mula-tiny-dense}\n")
    with pytest.raises(ConfigError, match=r"gives the key 'model' twice \(the second at line 5\): keep one of them"):
        load_config(twice)
    twice.write_text("model: {preset: mula-tiny-moe, preset: mula-tiny-dense}\n")
    with pytest.raises(ConfigError, match="'preset' twice"):
        load_config(twice)
    merged = tmp_path / "merged.yaml"  # a key a merge (`<<: *anchor`) brings may be set again: YAML's override
    merged.write_text("x-train: &t {seed: 1, max_steps: 2}\ntrain:\n  <<: *t\n  seed: 3\n")
    from optimus.config import read_yaml
    assert read_yaml(merged)["train"] == {"seed": 3, "max_steps": 2}
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(None, ["train.max_steps=3"])


def test_a_config_file_that_is_not_utf8_text_is_one_line(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model:\n  preset: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 17\)") as err:
        load_config(binary)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [["--model.preset.x=1"], ["--model.preset=[mula-tiny-dense]"]])
def test_a_preset_that_is_not_a_name_is_one_line(overrides):
    with pytest.raises(ConfigError, match="unknown model.preset .*: choose one of"):
        load_config(None, overrides)


def test_saved_config_round_trips(tmp_path):
    config = build_config({"model": {"preset": "mula-tiny-dense"}, "train": {"max_steps": 3}})
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_precision_defaults_to_auto_in_the_code_and_in_every_shipped_config():
    from pathlib import Path

    from optimus.config import TrainConfig, load_config

    assert TrainConfig().dtype == "auto"
    for path in sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml")):
        assert load_config(path).train.dtype == "auto", path.name


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model": {"moe_impl": "fast"}},
         "bad value for 'model.moe_impl' ('fast'): 'fast' is now called 'auto' (as every op's impl): "
         "write model.moe_impl: auto"),
        ({"train": {"activation_checkpointing": "ops"}},
         "bad value for 'train.activation_checkpointing' ('ops'): 'ops' is now called 'selective_ops': "
         "write train.activation_checkpointing: selective_ops"),
    ],
)
def test_renamed_values_are_refused_in_one_line_naming_the_new_name(raw, message):
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert str(err.value) == message


def test_sections_live_beside_what_they_configure_and_are_re_exported():
    import optimus.config as tree
    from optimus.data.config import DataConfig
    from optimus.optim.config import OptimConfig
    from optimus.parallel.config import ParallelConfig, ParallelDegrees
    from optimus.parallel.mesh import ParallelDims
    from optimus.train.config import TrainConfig

    assert (tree.TrainConfig, tree.OptimConfig, tree.ParallelConfig, tree.DataConfig) == (
        TrainConfig, OptimConfig, ParallelConfig, DataConfig)
    # one list of layout degrees: the config's and the mesh's are the same fields
    assert set(ParallelDegrees.model_fields) == {"dp_replicate", "dp_shard", "tp", "pp", "ep"}
    assert set(ParallelDims.model_fields) == set(ParallelDegrees.model_fields) | {"world_size"}
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=4, ep=2))
    assert (dims.world_size, dims.dp, dims.dp_shard_mod_ep, dims.expert_dp) == (8, 8, 2, 4)
