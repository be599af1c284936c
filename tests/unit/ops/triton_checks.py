"""Triton kernels against the references, run by test_triton_interpret.py in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before triton is imported, so not in pytest's own
process). `python triton_checks.py` prints {check name: "ok" or the failure} as JSON."""

from __future__ import annotations

import json
import traceback

import torch

from optimus.ops import permute_tokens, permute_tokens_reference
from tests.helpers.ops import assert_close, check_op_against_reference, moe_inputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grouped_mm_check(counts, dtype):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    inputs = {
        "x": torch.randn(int(counts.sum()), 20, generator=gen).to(dtype).requires_grad_(),
        "w": (torch.randn(len(counts), 20, 36, generator=gen) * 0.2).to(dtype).requires_grad_(),
        "counts": counts,
    }
    check_op_against_reference("grouped_mm", "triton", inputs, dtype, "grouped_mm")


def permute_check(top_k, routing, dtype):
    inputs = moe_inputs(13, 40, 4, 6, top_k, routing, dtype)
    rows, order, counts = permute_tokens(inputs["x"], inputs["expert_ids"], 6, impl="triton")
    ref_rows, ref_order, ref_counts = permute_tokens_reference(inputs["x"], inputs["expert_ids"], 6)
    assert torch.equal(rows, ref_rows) and torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    grad = torch.randn(rows.shape).to(dtype)
    assert_close(torch.autograd.grad(rows, inputs["x"], grad)[0], torch.autograd.grad(ref_rows, inputs["x"], grad)[0], dtype, "dx")
    unpermute_inputs = {"rows": ref_rows.detach().requires_grad_(), "order": order, "weights": inputs["weights"]}
    check_op_against_reference("unpermute_tokens", "triton", unpermute_inputs, dtype, "unpermute")


def swiglu_check(dtype):
    inputs = {"gate_up": (torch.randn(5, 3, 70) * 3).to(dtype).requires_grad_()}
    check_op_against_reference("swiglu", "triton", inputs, dtype, "swiglu")


def experts_check(shape, routing, dtype):
    inputs = moe_inputs(*shape, routing=routing, dtype=dtype)
    check_op_against_reference("moe_experts", "triton", inputs, dtype, routing)


def expert_mlp_check(dtype):
    gen = torch.Generator().manual_seed(2)
    inputs = {
        "rows": torch.randn(20, 18, generator=gen).to(dtype).requires_grad_(),
        "w_gate_up": (torch.randn(3, 18, 24, generator=gen) * 0.3).to(dtype).requires_grad_(),
        "w_down": (torch.randn(3, 12, 18, generator=gen) * 0.3).to(dtype).requires_grad_(),
        "counts": torch.tensor([9, 0, 11]),
    }
    check_op_against_reference("expert_mlp", "triton", inputs, dtype, "expert_mlp")


CHECKS = {}
for _name, _dtype in DTYPES.items():
    CHECKS[f"grouped_mm_uneven_{_name}"] = lambda d=_dtype: grouped_mm_check([5, 0, 17, 1, 0, 9], d)
    CHECKS[f"grouped_mm_one_group_{_name}"] = lambda d=_dtype: grouped_mm_check([0, 0, 33], d)
    CHECKS[f"permute_top2_{_name}"] = lambda d=_dtype: permute_check(2, "skewed", d)
    CHECKS[f"swiglu_{_name}"] = lambda d=_dtype: swiglu_check(d)
    CHECKS[f"experts_top2_uniform_{_name}"] = lambda d=_dtype: experts_check((11, 24, 20, 4, 2), "uniform", d)
    CHECKS[f"expert_mlp_{_name}"] = lambda d=_dtype: expert_mlp_check(d)
CHECKS["permute_top1_one_expert_fp32"] = lambda: permute_check(1, "one_expert", torch.float32)
CHECKS["experts_top1_one_expert_fp32"] = lambda: experts_check((17, 16, 8, 5, 1), "one_expert", torch.float32)
CHECKS["experts_top8_skewed_fp32"] = lambda: experts_check((5, 16, 8, 12, 8), "skewed", torch.float32)
CHECKS["experts_empty_experts_bf16"] = lambda: experts_check((9, 16, 8, 6, 2), "empty_experts", torch.bfloat16)


def run_all() -> dict[str, str]:
    """Run every check; a failure is reported by name with its traceback's last lines."""
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported, none stops the rest
            results[name] = "".join(traceback.format_exc().splitlines(keepends=True)[-6:])
    return results


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(json.dumps(run_all()))
