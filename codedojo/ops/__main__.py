"""``python -m codedojo.ops``: build the CPU kernels now (``make setup`` runs it)."""

from codedojo.ops import kernel_status, load_kernel

load_kernel(verbose=False)
print(f"CPU kernels: {kernel_status()}")
