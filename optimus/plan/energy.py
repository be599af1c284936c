"""Energy and carbon of a training run, counted as LUMI's table of published trainings counts them.

LUMI's table (REFERENCE.md, "LUMI (CSC)") gives, per training: the accelerators' energy in MWh, the data centre's
PUE, the grid's carbon intensity in kgCO2e/kWh, and tCO2e = MWh x PUE x kgCO2e/kWh / 1000 (every row of it
checks: Gopher 1,066 x 1.08 x 0.330 = 380 t). A planned run is counted the same way, with the node's power
(accelerators, host and network of one node: the preset's node_power_kw) in place of the accelerators' alone.
"""

from __future__ import annotations

from optimus.plan.cluster import Cluster

# (training, hardware, MWh, PUE, kgCO2e/kWh, tCO2e): REFERENCE.md, "LUMI (CSC)", energy of published trainings
PUBLISHED_TRAININGS = (
    ("Gopher-280B", "TPUv3", 1066, 1.08, 0.330, 380),
    ("BLOOM-176B", "A100", 433, 1.2, 0.057, 30),
    ("OPT-175B", "A100", 324, 1.1, 0.231, 82),
    ("LLaMA-7B", "A100", 33, 1.1, 0.385, 14),
    ("LLaMA2-7B", "A100", 74, 1.1, 0.385, 31),
    ("OLMo-7B", "MI250X", 135, 1.1, 0.0, 0),  # LUMI: hydro power
)


def carbon_t(energy_mwh: float, pue: float, kgco2_per_kwh: float) -> float:
    """tCO2e of `energy_mwh` of IT energy: times the PUE (the facility's overhead), times the grid's intensity.
    (MWh x kgCO2e/kWh = tCO2e, the 1000s cancel.)"""
    return energy_mwh * pue * kgco2_per_kwh


def run_cost(cluster: Cluster, devices: int, tokens_per_s: float, tokens: float) -> dict[str, float]:
    """Days to train `tokens`; IT energy (nodes x node power x time) in MWh, as LUMI's table counts it; the PUE,
    the grid's intensity, the facility energy (x PUE) and tCO2e at the cluster preset's defaults."""
    seconds = tokens / tokens_per_s
    energy_mwh = devices / cluster.devices_per_node * cluster.node_power_kw * seconds / 3600 / 1000
    return {"days": seconds / 86400, "energy_mwh": energy_mwh, "pue": cluster.pue,
            "facility_mwh": energy_mwh * cluster.pue, "kgco2_per_kwh": cluster.grid_kgco2_per_kwh,
            "co2_t": carbon_t(energy_mwh, cluster.pue, cluster.grid_kgco2_per_kwh)}


def energy_table(rows: list[tuple[str, str, float, float, float, float]]) -> str:
    """LUMI's table layout: the published trainings, then `rows` (same columns) for the planned run(s)."""
    lines = [f"{'training':<34} {'hardware':<16} {'MWh':>9} {'PUE':>5} {'kgCO2e/kWh':>10} {'tCO2e':>8}"]
    for name, hardware, mwh, pue, intensity, co2 in (*PUBLISHED_TRAININGS, *rows):
        lines.append(f"{name:<34.34} {hardware:<16.16} {_figure(mwh):>9} {pue:>5.2f} {intensity:>10.3f} {_figure(co2):>8}")
    return "\n".join(lines)


def _figure(x: float) -> str:
    """Whole numbers from 100 up (as the published table), three significant digits below."""
    return f"{x:,.0f}" if abs(x) >= 100 or x == 0 else f"{x:.3g}"
