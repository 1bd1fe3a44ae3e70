"""``needs_kernel``: tests of the C++ kernels run where they are built (``make setup`` builds
them; ``test_gemm.py::test_the_kernels_build`` fails when they cannot be) and skip only where
``CODEDOJO_KERNELS=0`` turns them off."""

from __future__ import annotations

import pytest

from codedojo.ops import kernel_status

needs_kernel = pytest.mark.skipif(kernel_status() != "ready",
                                  reason=f"CPU kernels: {kernel_status()}")
