"""Compute kernels below the model: ``linear`` routes decode-sized CPU matrix multiplies to a
small C++ kernel (``small_gemm.cpp``) and everything else to ``torch.nn.functional.linear``;
``FusedLayers`` runs a whole decode step (embedding, the dense layers, final norm and head) in
C++ (``decode_step.cpp``); ``greedy`` picks each row's argmax and its log-probability
(``greedy.cpp``)."""

from codedojo.ops.decode import FusedLayers
from codedojo.ops.gemm import kernel_status, linear, load_kernel
from codedojo.ops.greedy import greedy

__all__ = ["FusedLayers", "greedy", "kernel_status", "linear", "load_kernel"]
