"""Triton grouped GEMM: one launch for all experts, no host sync on the group sizes.

rows  (forward and dgrad): C[rows of e] = A[rows of e] @ B[e]. The M axis is cut into tiles that
      never straddle two groups; tile t finds its group by a binary search over the cumulative
      tile counts, which are computed on the device. The grid is sized by an upper bound
      (ceil(M / BLOCK_M) + E tiles) so that no count has to be read back; surplus tiles exit.
wgrad: C[e] = A[rows of e]^T @ G[rows of e]; one program per (expert, K tile, N tile) walks the
      rows of its group, so an empty group writes zeros and needs no separate fill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimus.ops.triton._launch import cdiv, dot_settings, interpreting


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, c_ptr, ends_ptr, tile_ends_ptr,
    N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    N_GROUPS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile >= tl.load(tile_ends_ptr + N_GROUPS - 1):
        return
    # first group whose cumulative tile count exceeds this tile
    low = tile * 0
    high = low + (N_GROUPS - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        go_right = tl.load(tile_ends_ptr + middle) <= tile
        low = tl.where(go_right, middle + 1, low)
        high = tl.where(go_right, high, middle)
    group = low
    tiles_before = tl.load(tile_ends_ptr + group - 1, mask=group > 0, other=0)
    group_start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    row_end = tl.load(ends_ptr + group).to(tl.int64)
    row_start = (group_start + (tile - tiles_before) * BLOCK_M).to(tl.int64)

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + group.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    row_ok = offs_m[:, None] < row_end
    col_ok = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok & (offs_k[None, :] < K - k0), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k0) & col_ok, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok & col_ok)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, g_ptr, c_ptr, ends_ptr,
    K, N,
    stride_am, stride_ak, stride_gm, stride_gn, stride_ce, stride_ck, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    group = tl.program_id(0)
    row_start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    row_end = tl.load(ends_ptr + group).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k[:, None] < K
    n_ok = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        # A^T tile [BLOCK_K, BLOCK_M] straight from A's strides: no transposed copy
        a = tl.load(a_ptr + offs_m[None, :] * stride_am + offs_k[:, None] * stride_ak,
                    mask=k_ok & (offs_m[None, :] < row_end), other=0.0)
        g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                    mask=(offs_m[:, None] < row_end) & n_ok, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(a, g, acc, input_precision=PRECISION)
    c_ptrs = c_ptr + group.to(tl.int64) * stride_ce + offs_k[:, None] * stride_ck + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=k_ok & n_ok)


def _pipeline_stages() -> int:
    # 3 stages of 32 KB tiles fit NVIDIA's shared memory; AMD's 64 KB LDS (and Intel's SLM) take 2
    return 3 if torch.version.hip is None and torch.cuda.is_available() else 2


def _rows_blocks(kernel, rows: int, n_groups: int, dtype: torch.dtype) -> dict:
    if interpreting(kernel):
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    # small groups waste most of a 128-row tile
    block_m = 64 if rows < 128 * n_groups else 128
    block_k = 32 if dtype == torch.float32 else 64
    warps = 8 if block_m == 128 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": block_k, "num_warps": warps, "num_stages": _pipeline_stages()}


def _wgrad_blocks(kernel, dtype: torch.dtype) -> dict:
    if interpreting(kernel):
        return {"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_N": 16}
    block_m = 32 if dtype == torch.float32 else 64
    return {"BLOCK_M": block_m, "BLOCK_K": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": _pipeline_stages()}


def grouped_mm_rows(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]. a: [M, K]; b: [E, K, N] (any strides, so b may be
    w.transpose(1, 2) for dgrad); ends: [E] cumulative row counts on a's device."""
    n_rows, inner = a.shape
    n_groups, _, n_cols = b.shape
    out = a.new_empty(n_rows, n_cols)
    if n_rows == 0 or n_cols == 0:
        return out
    if inner == 0:
        return out.zero_()
    kernel = _grouped_rows_kernel
    blocks = _rows_blocks(kernel, n_rows, n_groups, a.dtype)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_ends = torch.cumsum(torch.div(counts + blocks["BLOCK_M"] - 1, blocks["BLOCK_M"], rounding_mode="floor"), 0)
    tile_ends = tile_ends.to(torch.int32)
    grid = (cdiv(n_rows, blocks["BLOCK_M"]) + n_groups, cdiv(n_cols, blocks["BLOCK_N"]))
    kernel[grid](
        a, b, out, ends, tile_ends,
        n_cols, inner,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        N_GROUPS=n_groups, SEARCH_STEPS=max(1, (n_groups - 1).bit_length()),
        **blocks, **dot_settings(kernel, a.dtype),
    )
    return out


def grouped_mm_wgrad(a: torch.Tensor, g: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ g[rows of e]: [E, K, N] with zeros for empty groups."""
    n_rows, inner = a.shape
    n_cols = g.shape[1]
    n_groups = ends.numel()
    out = a.new_empty(n_groups, inner, n_cols)
    if out.numel() == 0:
        return out
    kernel = _grouped_wgrad_kernel
    blocks = _wgrad_blocks(kernel, a.dtype)
    grid = (n_groups, cdiv(inner, blocks["BLOCK_K"]), cdiv(n_cols, blocks["BLOCK_N"]))
    kernel[grid](
        a, g, out, ends,
        inner, n_cols,
        a.stride(0), a.stride(1), g.stride(0), g.stride(1), out.stride(0), out.stride(1), out.stride(2),
        **blocks, **dot_settings(kernel, a.dtype),
    )
    return out
