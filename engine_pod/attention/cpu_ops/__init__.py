"""C++ attention kernels for CPU engines, compiled on first use (build.py)."""
