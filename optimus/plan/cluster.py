"""Cluster presets: the YAML files next to this module, one per machine, every number with its source.

Peak FLOP/s are not repeated here: a preset names its device and the peak comes from
optimus/train/hardware.py DEVICE_PEAKS_TFLOPS, the table MFU is read against during training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from optimus.config import ConfigError
from optimus.plan.efficiency import Efficiency
from optimus.train.hardware import DEVICE_PEAKS_TFLOPS

PRESETS_DIR = Path(__file__).resolve().parent / "clusters"


@dataclass(frozen=True)
class Cluster:
    """One machine: its devices, links, and what running it costs in energy and carbon."""

    name: str
    device: str
    devices_per_node: int
    memory_gb: float
    hbm_gb_s: float
    intra_node_gb_s: float  # per device, per direction
    intra_node_latency_us: float
    inter_node_gb_s: float  # per node, per direction: shared by the node's devices
    inter_node_latency_us: float
    node_power_kw: float
    pue: float
    grid_kgco2_per_kwh: float
    efficiency: Efficiency = field(default_factory=Efficiency)  # per op class: the preset's `efficiency:` block
    auto_dtype: str = "bf16"  # what train.dtype "auto" resolves to: bf16 on accelerators, measured here
    measured_peak_flops: dict[str, float] | None = None  # {"fp32": .., "bf16": ..}: `here`, probed, not a datasheet
    nics_per_node: int = 1  # network interfaces per node; inter_node_gb_s is their sum
    # whether collectives run beside compute: on accelerators copy engines and NICs move the bytes while the
    # device computes; on a CPU host whose cores all run ranks, gloo's transport needs those same cores
    comm_overlaps_compute: bool = True
    # of a core, per rank, when every rank computes: cores / ranks where ranks outnumber cores (`here`), else 1;
    # a rank that waits then gives its core to the others
    core_share: float = 1.0
    # `here`: timed collectives, {op: {group size: [[bytes, seconds], ...]}} (optimus/plan/calibrate.py); the
    # presets model theirs (optimus/plan/comms.py)
    measured_collectives: dict[str, dict[tuple[int, int, bool], list]] | None = None
    # the devices are host CPUs (`here`): the loss head runs the chunked CPU kernel, not F.cross_entropy
    host_cpu: bool = False
    # `here`: seconds per byte the first write of a freshly allocated block costs beyond a reused one's, for
    # blocks of fresh_block_bytes or more (glibc maps those from the kernel and unmaps them on free, so every
    # step's pages are faulted in again); accelerators' caching allocators reuse their blocks: 0
    fresh_page_s_per_byte: float = 0.0
    fresh_block_bytes: int = 0

    def resolved(self, config):
        """`config` with train.dtype "auto" resolved as the trainer resolves it on this cluster's devices
        (auto_dtype: bf16 on accelerators, what the probe chose here). Every prediction prices the resolved dtype:
        the step-time model once read "auto" as bf16 for FLOPs but as fp32 for its memory-bound bytes."""
        if config.train.dtype != "auto":
            return config
        return config.model_copy(update={"train": config.train.model_copy(update={"dtype": self.auto_dtype})})

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of one device in "bf16" or "fp32": the datasheet's (dense, no sparsity), or measured here."""
        if self.measured_peak_flops is not None:
            return self.measured_peak_flops["fp32" if dtype == "fp32" else "bf16"]
        for fragment, bf16, fp32, _source in DEVICE_PEAKS_TFLOPS:
            if fragment == self.device:
                return (fp32 if dtype == "fp32" else bf16) * 1e12
        raise ConfigError(f"cluster '{self.name}' names device '{self.device}', which has no entry in "
                          f"optimus/train/hardware.py DEVICE_PEAKS_TFLOPS: add its datasheet peaks there")

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes. HBM comes in binary sizes (an "80 GB" H100 holds 80 GiB), and the dry run
        compares against GiB too."""
        return self.memory_gb * 1024**3


def cluster_names() -> list[str]:
    """The presets shipped with the package (plus `here`, this machine, measured: optimus/plan/calibrate.py)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_cluster(name: str) -> Cluster:
    """The preset called `name`; ConfigError (one line) when there is none."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown cluster '{name}': choose one of {', '.join(cluster_names() + ['here'])}")
    raw = yaml.safe_load(path.read_text())
    try:
        raw["efficiency"] = Efficiency.from_dict(raw.get("efficiency"), f"cluster preset {path}")
        return Cluster(**raw)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cluster preset {path} is malformed ({err}): fix its keys") from None
