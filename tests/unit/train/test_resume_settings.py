"""Which settings of a resumed run count as changed, and where the earlier config.yaml is kept."""

from __future__ import annotations

from optimus.config import build_config, save_config
from optimus.train.resume_settings import changed_settings, keep_earlier_config, keep_earlier_metrics


def test_only_settings_that_change_what_steps_compute_are_listed(tmp_path):
    before = build_config({"train": {"seq_len": 64, "max_steps": 10}, "optim": {"lr": 1e-3}})
    save_config(before, tmp_path / "config.yaml")
    same_meaning = build_config({"train": {"seq_len": 64, "max_steps": 20, "log_every": 5, "ckpt_every": 3},
                                 "optim": {"lr": 1e-3}, "parallel": {"dp_shard": 2}})
    assert changed_settings(tmp_path / "config.yaml", same_meaning) == []
    other = build_config({"train": {"seq_len": 128, "max_steps": 10, "global_batch_size": 16},
                          "optim": {"lr": 1e-4}, "data": {"sources": [{"name": "stdlib"}]}})
    changed = changed_settings(tmp_path / "config.yaml", other)
    assert "train.seq_len: 64 -> 128" in changed and "train.global_batch_size: 8 -> 16" in changed
    assert "optim.lr: 0.001 -> 0.0001" in changed and any(line.startswith("data.sources") for line in changed)


def test_an_unreadable_earlier_config_compares_with_nothing(tmp_path):
    (tmp_path / "config.yaml").write_text("{ not yaml")
    assert changed_settings(tmp_path / "config.yaml", build_config({})) == []
    assert changed_settings(tmp_path / "absent.yaml", build_config({})) == []


def test_earlier_configs_are_kept_under_free_names(tmp_path):
    (tmp_path / "config.yaml").write_text("a: 1\n")
    first = keep_earlier_config(tmp_path, 4)
    (tmp_path / "config.yaml").write_text("a: 2\n")
    second = keep_earlier_config(tmp_path, 4)
    assert first.name == "config-before-step-4.yaml" and second.name == "config-before-step-4.2.yaml"
    assert first.read_text() == "a: 1\n" and second.read_text() == "a: 2\n"


def test_an_earlier_metrics_log_is_moved_aside_under_a_free_name(tmp_path):
    """Moved, not copied (a log may be gigabytes): the run then starts a new metrics.jsonl."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    first = keep_earlier_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
    second = keep_earlier_metrics(tmp_path)
    assert first.name == "metrics-before-step-0.jsonl" and second.name == "metrics-before-step-0.2.jsonl"
    assert first.read_text() == '{"step": 3}\n' and second.read_text() == '{"step": 7}\n'
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_new_seed_or_dtype_is_a_changed_setting(tmp_path):
    """The seed picks the data order and the initial weights, the dtype what every step computes in."""
    save_config(build_config({"train": {"seed": 1, "dtype": "fp32"}}), tmp_path / "config.yaml")
    changed = changed_settings(tmp_path / "config.yaml", build_config({"train": {"seed": 2, "dtype": "bf16"}}))
    assert changed == ["train.dtype: 'fp32' -> 'bf16'", "train.seed: 1 -> 2"]


def test_an_earlier_config_that_is_not_a_mapping_compares_with_nothing(tmp_path):
    """An emptied config.yaml (YAML's null) or a list is readable YAML but no settings: nothing to compare."""
    for text in ("", "- 1\n- 2\n"):
        (tmp_path / "config.yaml").write_text(text)
        assert changed_settings(tmp_path / "config.yaml", build_config({})) == []


def test_a_setting_the_earlier_config_did_not_record_is_listed(tmp_path):
    """A key the earlier file lacks (written before the setting existed, or edited out) is not assumed unchanged:
    it is listed as None before."""
    import yaml

    config = build_config({"optim": {"lr": 1e-3}})
    save_config(config, tmp_path / "config.yaml")
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del raw["optim"]["lr"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    assert changed_settings(tmp_path / "config.yaml", config) == ["optim.lr: None -> 0.001"]


def test_a_third_earlier_config_of_one_step_gets_the_next_free_name(tmp_path):
    """Resumed from the same step three times: each earlier config is kept, none overwritten."""
    kept = []
    for text in ("a: 1\n", "a: 2\n", "a: 3\n"):
        (tmp_path / "config.yaml").write_text(text)
        kept.append(keep_earlier_config(tmp_path, 4))
    assert [p.name for p in kept] == ["config-before-step-4.yaml", "config-before-step-4.2.yaml",
                                      "config-before-step-4.3.yaml"]
    assert [p.read_text() for p in kept] == ["a: 1\n", "a: 2\n", "a: 3\n"]


def test_an_earlier_train_section_that_is_not_a_mapping_reads_as_unset(tmp_path):
    """A damaged `train:` (a scalar where the section was) is compared as if its keys were absent, not a crash."""
    import yaml

    config = build_config({"train": {"seq_len": 64, "global_batch_size": 8, "seed": 1, "dtype": "fp32"}})
    save_config(config, tmp_path / "config.yaml")
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    raw["train"] = "damaged"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    assert changed_settings(tmp_path / "config.yaml", config) == [
        "train.dtype: None -> 'fp32'", "train.global_batch_size: None -> 8", "train.seed: None -> 1",
        "train.seq_len: None -> 64"]
