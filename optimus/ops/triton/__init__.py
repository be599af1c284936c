"""Triton kernels for the expert path: grouped GEMM (forward, dgrad, wgrad), token gather and
combine, fused SwiGLU. Optional: nothing here is imported until an op picks a Triton backend, so
the package works without triton installed. On CPU tensors they run only under Triton's
interpreter (TRITON_INTERPRET=1 set before triton is imported), which is how the tests run them.
"""
