"""Compute kernels below the model: ``linear`` routes decode-sized CPU matrix multiplies to a
small C++ kernel (``small_gemm.cpp``) and everything else to ``torch.nn.functional.linear``;
``FusedLayers`` runs a whole decode step (embedding, the dense layers, final norm and head) in
C++ (``decode_step.cpp``); ``greedy`` picks each row's argmax and its log-probability
(``greedy.cpp``); ``move_to_huge_pages`` puts a model's weights in memory backed by 2 MB pages
(``huge_pages.py``)."""

from codedojo.ops.decode import FusedLayers
from codedojo.ops.gemm import kernel_status, linear, load_kernel
from codedojo.ops.greedy import greedy
from codedojo.ops.huge_pages import huge_page_empty, move_to_huge_pages

__all__ = ["FusedLayers", "greedy", "huge_page_empty", "kernel_status", "linear", "load_kernel",
           "move_to_huge_pages"]
