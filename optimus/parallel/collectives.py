"""The tensor-in, tensor-out collectives under the name this torch prefers.

torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to reduce_scatter_single /
all_gather_single (same arguments) and warns on every call of the old names, which would print in
every zero1/zero2, EP and TP run; torch before the rename has only the old names, and users on
GPUs bring their own torch.
"""

from __future__ import annotations

import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
