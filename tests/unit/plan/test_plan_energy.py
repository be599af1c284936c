"""Energy and carbon as LUMI's table counts them (optimus/plan/energy.py): the published rows themselves, and how
the table prints them beside a plan's. test_plan_model.py holds run_cost's arithmetic and carbon_t on every row."""

from __future__ import annotations

from optimus.plan.energy import PUBLISHED_TRAININGS, energy_table


def test_the_published_rows_are_lumis_table_as_reference_md_quotes_it():
    """Every figure as printed (GPU MWh, PUE, kgCO2e/kWh, tCO2e). OLMo's 0 kgCO2e/kWh (hydro power) makes its
    tonnes 0 whatever its energy, so the carbon arithmetic alone would not notice its 135 MWh changed."""
    assert PUBLISHED_TRAININGS == (
        ("Gopher-280B", "TPUv3", 1066, 1.08, 0.330, 380),
        ("BLOOM-176B", "A100", 433, 1.2, 0.057, 30),
        ("OPT-175B", "A100", 324, 1.1, 0.231, 82),
        ("LLaMA-7B", "A100", 33, 1.1, 0.385, 14),
        ("LLaMA2-7B", "A100", 74, 1.1, 0.385, 31),
        ("OLMo-7B", "MI250X", 135, 1.1, 0.0, 0),
    )


def test_whole_figures_from_a_hundred_up_and_three_significant_digits_below():
    """As the published table prints them: 1,066 MWh and 380 t whole, a small plan's 0.847 t to three digits, and
    a zero as 0 (not 0.00)."""
    rows = [("a", "h", 1234.5, 1.1, 0.385, 99.94), ("b", "h", 0.0123456, 1.1, 0.385, 0.0)]
    lines = energy_table(rows).splitlines()
    assert lines[0].split() == ["training", "hardware", "MWh", "PUE", "kgCO2e/kWh", "tCO2e"]
    assert lines[-2].split() == ["a", "h", "1,234", "1.10", "0.385", "99.9"]
    assert lines[-1].split() == ["b", "h", "0.0123", "1.10", "0.385", "0"]
