"""Triton kernels of the triton attention backend.

Triton decides at decoration time, i.e. when a kernel module is first
imported, whether its kernels compile for the GPU or run in the numpy
interpreter (``TRITON_INTERPRET=1``). So this package's ``__init__`` imports
no kernel module: ``support`` and ``plan`` are plain Python and can be
imported anywhere; ``cache_write``, ``paged_attention`` and ``reduce_splits``
only once the backend has been chosen.
"""
