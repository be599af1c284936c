"""The one ordered entry point that turns a single-device model into its parallel form.

Order (as torchtitan): pipeline split -> tensor parallel -> expert parallel -> activation
checkpointing -> torch.compile -> FSDP. Each step is a function taking the model and the mesh.
"""

from __future__ import annotations

from torch import nn

from optimus.config import Config
from optimus.parallel.mesh import ParallelDims, ParallelMesh


def parallelize_model(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh | None, config: Config) -> nn.Module:
    """Apply the configured parallelisms, in order, to `model` (on the meta device or materialised)."""
    if mesh is None or not dims.is_parallel:
        return model
    raise NotImplementedError("parallel layouts are being implemented (issue 3)")
