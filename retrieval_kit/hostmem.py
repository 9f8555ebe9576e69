"""--keep-freed-memory: glibc's malloc keeps freed memory for reuse instead of handing it back.

A CPU training step allocates and frees the same large buffers every step: activations, the dense
gradient of the word embeddings (30522 x 384 floats, 47 MB, once per chunk), attention scores.
glibc serves blocks above its mmap threshold (128 KiB, rising to at most 32 MiB) with a fresh mmap
and unmaps them on free, so every step touches hundreds of MB of new pages, each a page fault that
the kernel zero-fills (measured on MiniLM at 32 x (1+1) x 256 tokens: about 100,000 faults and 0.7 s
of system time per step). With mmap off and the trim threshold high, freed blocks stay in the heap
and the next step reuses them: about 20,000 faults per step. The numbers the step computes do not
change (the allocator decides where memory lives, never what is in it).

The cost: memory freed by the process is not returned to the OS until it exits, so the resident
size stays at its high-water mark (which is what a peak-RSS measure reports anyway).
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's malloc.h


def keep_freed_memory(top_pad_mb=64):
    """mallopt: no mmap for large blocks, no trimming of the heap's top, `top_pad_mb` extra on each
    heap growth. Returns True where it took effect (glibc), False elsewhere (musl, macOS: a no-op).
    Applies to this process and to the processes it forks afterwards (DataLoader workers)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 31 - 1), (M_TOP_PAD, top_pad_mb << 20)))
