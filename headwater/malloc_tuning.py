"""How glibc's malloc gives memory back in a worker process.

A worker on the TCP request plane allocates and frees a few large buffers per request:
a read of up to 1 MiB (:func:`headwater.wire.codec.read_size`), the decoder's buffer, a
prompt's simulated KV (~640 KB in ``kv_data`` pieces for 40k tokens), the 160 KB token
array. glibc serves blocks above its mmap threshold with fresh mappings and trims the top
of its heap once more than twice that threshold is free there, so the same megabytes were
returned to the kernel after every request and faulted in again on the next: a decode
worker took 28-49 minor page faults per 40k-token request, and page faults are dear in a
virtual machine. With a fixed mmap threshold of 4 MiB and a trim threshold of 32 MiB it
took none after its first requests, at ~10% less CPU per request
(docs/performance.md, "The TCP layout"). The price: up to 32 MiB freed at the top of the
heap stay with the process until it is trimmed.
"""

from __future__ import annotations

import contextlib
import ctypes

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 32 * 1024 * 1024
MMAP_THRESHOLD = 4 * 1024 * 1024


def keep_freed_heap(trim: int = TRIM_THRESHOLD, mmap: int = MMAP_THRESHOLD) -> bool:
    """Make glibc keep freed heap up to *trim* bytes and map only blocks from *mmap*
    bytes on (process-wide). Returns whether it took effect (False off glibc)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim)
        )
    return False
