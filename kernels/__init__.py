"""ftkit.kernels: CPU and Triton expert kernels."""
