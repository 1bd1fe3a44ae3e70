"""Compute kernels below the model: ``linear`` routes decode-sized CPU matrix multiplies to a
small C++ kernel (``small_gemm.cpp``) and everything else to ``torch.nn.functional.linear``."""

from codedojo.ops.gemm import kernel_status, linear, load_kernel

__all__ = ["kernel_status", "linear", "load_kernel"]
