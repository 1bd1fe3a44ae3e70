"""Compute kernels below the model: ``linear`` routes decode-sized CPU matrix multiplies to a
small C++ kernel (``small_gemm.cpp``) and everything else to ``torch.nn.functional.linear``;
``decode_layers`` runs a whole decode step through the dense layers in C++ (``decode_step.cpp``)."""

from codedojo.ops.decode import decode_layers
from codedojo.ops.gemm import kernel_status, linear, load_kernel

__all__ = ["decode_layers", "kernel_status", "linear", "load_kernel"]
