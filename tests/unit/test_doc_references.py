"""Commands the docs name outside README.md and docs/*.md (which tests/e2e/test_docs_commands.py runs): the command
table of BENCHMARKS.md names scripts `optimus bench` lists and flags they take, and each recipe's "another device
count" override example is a layout the config accepts. Read statically: nothing is run or timed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from optimus.cli.bench import find_benchmarks
from optimus.config import load_config

REPO = Path(__file__).resolve().parents[2]
BENCH_ROWS = re.findall(r"^\| `([^`]+)` \|", (REPO / "BENCHMARKS.md").read_text().split("\n## ")[0], re.M)
RECIPES = sorted(path for path in (REPO / "configs").glob("mula-*.yaml") if "tiny" not in path.stem)  # Mula recipes


def _source_with_imports(script: Path) -> str:
    """The script's text and that of the benchmarks/ modules it imports (shared argument helpers)."""
    text = script.read_text()
    imported = re.findall(r"^from benchmarks\.(\w+) import", text, re.M)
    return "\n".join([text, *((script.parent / f"{name}.py").read_text() for name in imported)])


def test_the_tables_are_found():
    assert len(BENCH_ROWS) >= 10 and len(RECIPES) == 5


@pytest.mark.parametrize("row", BENCH_ROWS)
def test_benchmarks_table_names_listed_scripts_and_their_flags(row):
    script = re.search(r"benchmarks/(\w+)\.(py|sh)", row)
    assert script, f"BENCHMARKS.md row names no benchmarks/ script: {row}"
    assert script.group(1) in find_benchmarks(REPO / "benchmarks"), f"`optimus bench` does not list {script[0]}"
    source = _source_with_imports(REPO / script.group(0))
    for flag in set(re.findall(r"(?<![\w=-])(--[a-z][a-z0-9-]*)", row)):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{script[0]} takes no {flag} (BENCHMARKS.md: {row})"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_recipe_override_example_is_an_accepted_layout(recipe):
    example = re.search(r"^# Another device count: override the degrees, e\.g\. ((?:--parallel\.\w+=\d+ ?)+)"
                        r"(?:on (?:one )?(\d+)(?:-GPU node| devices))?", recipe.read_text(), re.M)
    assert example, f"{recipe.name} gives no override example"
    overrides = example.group(1).split()
    config = load_config(recipe, overrides)  # validates the layout at the world size its degrees imply
    if example.group(2):
        ranks = int(example.group(2))
        assert config.parallel.layout_ranks == ranks, f"{recipe.name}: {overrides} is not {ranks} ranks"
