"""Cluster presets: the YAML files next to this module, one per machine, every number with its source.

Peak FLOP/s are not repeated here: a preset names its device and the peak comes from
optimus/train/hardware.py DEVICE_PEAKS_TFLOPS, the table MFU is read against during training.

A user's own machine is a file of the same keys (`optimus plan --cluster my-cluster.yaml`): `base: h100` starts from
a preset and changes only what the file gives, and `peak_tflops: {bf16: .., fp32: ..}` prices a device the table
lacks. Every value is checked as it is read, so a typo or a unit slip is one line naming the key, not a plan built
on a negative bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from optimus.config import ConfigError, YamlFileError, read_yaml
from optimus.plan.efficiency import Efficiency, is_finite_number
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
    # {"fp32": .., "bf16": ..} FLOP/s in place of the device table's: `here`'s probes, or a cluster file's peak_tflops
    measured_peak_flops: dict[str, float] | None = None
    nics_per_node: int = 1  # network interfaces per node; inter_node_gb_s is their sum
    # whether collectives run beside compute: on accelerators copy engines and NICs move the bytes while the
    # device computes; on a CPU host whose cores all run ranks, gloo's transport needs those same cores
    comm_overlaps_compute: bool = True
    # of a core, per rank, when every rank computes: cores / ranks where ranks outnumber cores (`here`), else 1;
    # a rank that waits then gives its core to the others
    core_share: float = 1.0
    # `here`: timed collectives, {op: {group size: [[bytes, seconds], ...]}}
    # (optimus/plan/calibrate_collectives.py); the presets model theirs (optimus/plan/comms.py)
    measured_collectives: dict[str, dict[tuple[int, int, bool], list]] | None = None
    # `here`: what a timed collective costs beyond its table's back-to-back call when a step reaches it after compute
    # (the ranks arrive apart, the more the longer they computed: optimus/plan/calibrate_collectives.py), as
    # ((seconds of compute before it, seconds a call), ...); and the seconds a call in effect, which step_time sets
    # from the layout's compute between its collectives (comms.py adds it to every timed call). Modelled links: none
    collective_sync: tuple[tuple[float, float], ...] = ()
    collective_sync_s: float = 0.0
    # the devices are host CPUs (`here`): the loss head runs the chunked CPU kernel, not F.cross_entropy
    host_cpu: bool = False
    # `here`: seconds per byte the first write of a freshly allocated block costs beyond a reused one's, for
    # blocks of fresh_block_bytes or more (glibc maps those from the kernel and unmaps them on free, so every
    # step's pages are faulted in again); accelerators' caching allocators reuse their blocks: 0
    fresh_page_s_per_byte: float = 0.0
    fresh_block_bytes: int = 0
    # `here`: the bandwidth (bytes/s per rank; 0: as hbm_gb_s) of the memory-bound work bound by the rank's own
    # cores, not by the socket the ranks share: the eager elementwise operators (memory_bound) and the fused
    # clipping and AdamW update (optimizer). On the 2-core EPYC (2026-11-29) the tiny MoE's update over 52 M
    # parameters took 31-33 ms on one rank alone and on each of two at once in three runs of five (49 ms in the
    # other two), its softmax, SiLU and division as long on each of two ranks as on one and twice as long on each
    # of four (their cores' share), where a large copy's rate per rank fell to the socket's over the ranks
    core_bandwidth_gb_s: float = 0.0

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
        peaks = datasheet_peaks(self.device)
        if peaks is None:
            raise ConfigError(unknown_device(f"cluster '{self.name}'", self.device))
        return (peaks[1] if dtype == "fp32" else peaks[0]) * 1e12

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes. HBM comes in binary sizes (an "80 GB" H100 holds 80 GiB), and the dry run
        compares against GiB too."""
        return self.memory_gb * 1024**3

    @property
    def memory_label(self) -> str:
        """The device memory as the CLI prints it: two decimals at most (a measured host reads 23.54 GiB)."""
        return f"{round(self.memory_gb, 2):g} GiB"


def cluster_names() -> list[str]:
    """The presets shipped with the package (plus `here`, this machine, measured: optimus/plan/here.py)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


# what a cluster file gives: every key of a preset, checked as it is read
_POSITIVE = ("memory_gb", "hbm_gb_s", "intra_node_gb_s", "inter_node_gb_s", "node_power_kw")
_AT_LEAST_ZERO = ("intra_node_latency_us", "inter_node_latency_us", "grid_kgco2_per_kwh")
_WHOLE = ("devices_per_node", "nics_per_node")
_REQUIRED = ("name", "device", "devices_per_node", *_POSITIVE, *_AT_LEAST_ZERO, "pue")
_FILE_KEYS = (*_REQUIRED, "nics_per_node", "efficiency", "peak_tflops", "base")


def is_cluster_file(name: str) -> bool:
    """Whether `--cluster` names a file (a path or a .yaml name) rather than a preset (a preset's name wins)."""
    if name in cluster_names() or name == "here":
        return False
    return name.endswith((".yaml", ".yml")) or "/" in name or Path(name).is_file()


def load_cluster(name: str) -> Cluster:
    """The preset called `name`, or the cluster file at that path; ConfigError (one line) when there is none or it is
    malformed."""
    if is_cluster_file(name):
        path = Path(name)
        if path.is_dir():
            raise ConfigError(f"cluster file '{name}' is a directory: pass the path of a YAML file with a preset's "
                              f"keys (optimus/plan/clusters/), or a preset ({', '.join(cluster_names())})")
        if not path.is_file():
            raise ConfigError(f"cluster file '{name}' not found: pass a preset ({', '.join(cluster_names())}) or the "
                              f"path of a YAML file with a preset's keys (optimus/plan/clusters/)")
    else:
        path = PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ConfigError(f"unknown cluster '{name}': choose one of {', '.join(cluster_names() + ['here'])}, "
                              f"or pass the path of your own cluster's YAML file")
    raw = _read_mapping(path)
    if "base" in raw:
        base = raw.pop("base")
        if not isinstance(base, str) or base not in cluster_names():
            raise ConfigError(f"cluster file {path}: base {base!r} is not a preset: choose one of "
                              f"{', '.join(cluster_names())}")
        inherited = _read_mapping(PRESETS_DIR / f"{base}.yaml")
        changed = raw.pop("efficiency", None) or {}
        if not isinstance(changed, dict):
            raise ConfigError(f"cluster file {path}: efficiency must be a mapping of op class to fraction of peak "
                              f"(got {changed!r})")
        efficiency = {**(inherited.get("efficiency") or {}), **changed}
        raw = {**inherited, **raw, "efficiency": efficiency}
    return _cluster_from(raw, path)


def _read_mapping(path: Path) -> dict:
    try:
        raw = read_yaml(path)
    except YamlFileError as err:
        raise ConfigError(f"cluster file {path} {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"cluster file {path} must hold a mapping of a preset's keys (name, device, ...)")
    return raw


def _cluster_from(raw: dict, path: Path) -> Cluster:
    """A Cluster from a file's mapping, every key and value checked."""
    where = f"cluster file {path}" if path.parent != PRESETS_DIR else f"cluster preset {path}"
    unknown = sorted(set(raw) - set(_FILE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}': a cluster takes {', '.join(_FILE_KEYS)}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}: add {'it' if len(missing) == 1 else 'them'} "
                          f"(optimus/plan/clusters/h100.yaml says what each is), or start from a preset with `base: NAME`")
    values = dict(raw)
    for key in ("name", "device"):
        if not isinstance(values[key], str) or not values[key]:
            raise ConfigError(f"{where}: {key} must be a name (got {values[key]!r})")
    for key in (*_POSITIVE, *_AT_LEAST_ZERO, "pue", *_WHOLE):
        if key not in values:
            continue
        value = values[key]
        number = is_finite_number(value)
        if key in _WHOLE:
            ok, what = number and value == int(value) and value >= 1, "a whole number, at least 1"
        elif key == "pue":
            ok, what = number and value >= 1, "at least 1 (facility energy over IT energy)"
        elif key in _POSITIVE:
            ok, what = number and value > 0, "a positive number"
        else:
            ok, what = number and value >= 0, "a number, 0 or more"
        if not ok:
            raise ConfigError(f"{where}: {key} must be {what} (got {value!r})")
        values[key] = int(value) if key in _WHOLE else float(value)
    peaks = values.pop("peak_tflops", None)
    if peaks is not None:
        values["measured_peak_flops"] = _peaks(peaks, where)
    try:
        values["efficiency"] = Efficiency.from_dict(values.get("efficiency"), where)
    except (TypeError, ValueError) as err:
        message = str(err) if where in str(err) else f"{where}: efficiency: {err}"
        raise ConfigError(message) from None
    # a device neither in the table nor given peak_tflops fails here, naming the file (not a `base:` preset's name)
    if "measured_peak_flops" not in values and datasheet_peaks(values["device"]) is None:
        raise ConfigError(unknown_device(where, values["device"]))
    return Cluster(**values)


def datasheet_peaks(device: str) -> tuple[float, float] | None:
    """(bf16, fp32) datasheet TFLOP/s of `device` (optimus/train/hardware.py DEVICE_PEAKS_TFLOPS), or None."""
    return next(((bf16, fp32) for fragment, bf16, fp32, _source in DEVICE_PEAKS_TFLOPS if fragment == device), None)


def unknown_device(who: str, device: str) -> str:
    """The one line for a device without datasheet peaks; `who` names the cluster or its file."""
    return (f"{who} names device '{device}', which has no entry in optimus/train/hardware.py DEVICE_PEAKS_TFLOPS: "
            "give its datasheet peaks as peak_tflops: {bf16: .., fp32: ..} in the cluster file")


def _peaks(raw, where: str) -> dict[str, float]:
    """peak_tflops {bf16: .., fp32: ..} (datasheet TFLOP/s of one device) as FLOP/s."""
    good = isinstance(raw, dict) and set(raw) == {"bf16", "fp32"} and all(
        is_finite_number(v) and v > 0 for v in raw.values())
    if not good:
        raise ConfigError(f"{where}: peak_tflops must be {{bf16: TFLOPS, fp32: TFLOPS}}, both positive (got {raw!r})")
    return {dtype: float(value) * 1e12 for dtype, value in raw.items()}
