"""Host memory of a CPU training process: glibc's allocator and the page faults it costs.

PyTorch's CPU tensors come from the C library's allocator (``posix_memalign`` in
``c10::alloc_cpu``, pytorch/pytorch ``c10/core/impl/alloc_cpu.cpp``). With glibc's
defaults (``man 3 mallopt``), a block above the *mmap threshold* (128 KiB at first, raised
at run time up to 32 MiB as large blocks are freed) is mapped fresh from the kernel and
unmapped when freed, and free memory at the top of the heap beyond the *trim threshold* is
handed back. A training step allocates and frees the same activations every step, so the
kernel maps, zeroes and faults those pages in again and again. Measured on the course's
``cnn`` (batch 32, 2 gloo processes on 2 cores): 760 to 4 600 minor page faults per step
and rank, about 2 us each, 4 to 10 ms of a 40 ms step. How many depends on each process's
history of allocations (the thresholds move), so the ranks of one job differ, and the
slowest rank sets the pace of every DDP step.

:func:`keep_freed_memory` fixes both thresholds (``mallopt``), so that freed blocks stay in
the process for the next step: no fault for the activations once the heap has settled
(a few steps), about 40 per step in the trainer, the same weights bit for bit.
PyTorch's performance tuning guide makes the same point with another cure ("Switch Memory
allocator": ``LD_PRELOAD`` jemalloc or tcmalloc, which reuse freed memory; pytorch/tutorials
``recipes_source/recipes/tuning_guide.py``). :func:`minor_faults` counts the faults
(``getrusage``), so that a run shows what it paid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

try:
    import resource
except ImportError:  # Windows
    resource = None

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap and are reused; glibc's own moving threshold
#: stops at 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit), so that a larger activation
#: (a CPU resnet18 at batch 128 has 32 MiB ones) would be mapped afresh every step.
MMAP_THRESHOLD = 256 << 20
#: Free memory the heap keeps at its top before it gives any back to the kernel.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse instead of returning them to the kernel.

    Fixes the mmap threshold at 256 MiB and the trim threshold at 1 GiB (setting either
    turns off glibc's moving thresholds). Numerics do not change: only where the bytes of a
    tensor live. The process's resident memory stays at its peak instead of falling
    between steps.

    Returns:
        True when both settings took effect; False where the C library has no ``mallopt``
        (macOS, musl, Windows), which changes nothing.

    Example:
        >>> keep_freed_memory() in (True, False)
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``; 0 where it is unknown).

    Example:
        >>> a = minor_faults(); b = minor_faults()
        >>> 0 <= a <= b
        True
    """
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt
