"""`optimus plan`'s own flags (optimus/cli/plan.py): each refused value is one line and exit 2 before the search,
and what the command prints of a restricted search."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.cli import main
from tests.helpers.runs import one_error_line

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
PLAN = ["plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100", "--devices", "8"]


@pytest.fixture
def no_search(monkeypatch):
    def search(*args, **kwargs):
        raise AssertionError("the search ran before the flags were checked")

    monkeypatch.setattr("optimus.plan.search.plan", search)


@pytest.mark.parametrize("flags, message", [
    (["--top", "0"], "--top must be at least 1 (got 0)"),
    (["--tokens", "0"], "--tokens must be a positive number of tokens (got 0)"),
    (["--tokens=-1e9"], "--tokens must be a positive number of tokens (got -1e+09)"),
    (["--tokens", "inf"], "--tokens must be a positive number of tokens (got inf)"),
    (["--moe-imbalance", "inf"], "a number of at least 1 (got inf)"),
])
def test_a_flag_the_plan_cannot_use_is_refused_in_one_line_before_the_search(flags, message, no_search, capsys):
    """A table of no rows, or days and carbon for no tokens, is no plan: said before minutes of searching."""
    assert main([*PLAN, *flags]) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("text, tokens", [("100e9", 100e9), ("100B", 100e9), ("2.5t", 2.5e12), ("500M", 5e8),
                                          ("64k", 64e3), ("5G", 5e9), (" 4T ", 4e12)])
def test_a_token_budget_is_read_as_people_write_it(text, tokens):
    """`--tokens 100B` as the papers say it, `100e9` as Python reads it: the same budget."""
    from optimus.cli.plan import token_count

    assert token_count(text) == pytest.approx(tokens)


def test_a_restrictions_values_are_listed_in_numeric_order():
    """`--only dp_shard=16,2,4` is said back as 2, 4, 16 (not as text sorts them: 16, 2, 4); names alphabetically."""
    from optimus.cli.plan import sorted_values

    assert sorted_values(frozenset({"16", "2", "4"})) == "2, 4, 16"
    assert sorted_values(frozenset({"zero1", "fsdp"})) == "fsdp, zero1"
