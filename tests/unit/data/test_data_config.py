"""The `data:` section's own checks: each source listed once."""

from __future__ import annotations

import pytest
import yaml

from optimus.cli import main
from optimus.config import ConfigError, build_config

TWICE = "is listed twice in data.sources: list it once (give it the summed weight if you meant to weight it up)"


@pytest.mark.parametrize("first, second, shown", [
    ({"name": "sotu"}, {"name": "sotu", "weight": 2.0}, "name 'sotu'"),
    ({"path": "tokens/web"}, {"path": "tokens/web/"}, "path 'tokens/web/'"),
    ({"glob": "olmo/*.npy", "dtype": "uint32"}, {"glob": "olmo/*.npy"}, "glob 'olmo/*.npy'"),
])
def test_a_source_listed_twice_is_refused(first, second, shown):
    with pytest.raises(ConfigError) as refused:
        build_config({"data": {"sources": [first, {"name": "stdlib"}, second]}})
    assert str(refused.value) == f"data source {shown} {TWICE}"


def test_a_packaged_corpus_and_a_folder_of_the_same_name_are_two_sources():
    config = build_config({"data": {"sources": [{"name": "sotu"}, {"path": "sotu"}]}})
    assert len(config.data.sources) == 2


def test_train_refuses_a_source_listed_twice_at_config_load(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump({"data": {"sources": [{"name": "sotu"}, {"name": "sotu"}]},
                                    "run": {"dir": str(tmp_path / "run")}}))
    assert main(["train", str(path), "--dry-run"]) == 2
    assert capsys.readouterr() == ("", f"optimus train: error: data source name 'sotu' {TWICE}\n")
    assert not (tmp_path / "run").exists()


def test_a_source_without_a_location_and_a_heldout_fraction_of_zero_are_refused():
    from optimus.data.config import DataConfig, DataSource

    with pytest.raises(ValueError, match="exactly one"):
        DataSource(weight=2.0)
    with pytest.raises(ValueError, match="heldout_fraction"):
        DataConfig(heldout_fraction=0.0)
    assert DataConfig(heldout_fraction=0.5).heldout_fraction == 0.5
