"""How glibc's malloc keeps memory: given back in a worker process, in few arenas in a
frontend process.

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

A frontend process allocates from its event loop's thread and from the tokenizer pool's
threads (the encoder's Rust code uses malloc too). glibc gives each thread that meets a
locked arena an arena of its own, up to eight per core, and each arena keeps its own free
pieces: in a 30-minute soak the frontends' idle RSS rose 12-16% over ~15 minutes before it
levelled off, memory spread over arenas rather than held. With two arenas it rose
5-7%, levelling off after ~5 minutes, at no measured cost in throughput
(docs/reliability.md, "What the frontends kept").
"""

from __future__ import annotations

import contextlib
import ctypes
import os

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

TRIM_THRESHOLD = 32 * 1024 * 1024
MMAP_THRESHOLD = 4 * 1024 * 1024
#: Arenas a frontend process allocates from: the loop's and the tokenizer threads' share.
FRONTEND_ARENAS = 2


def _glibc(call: str, *args: int) -> bool:
    """glibc's *call* with *args*, true when it returned non-zero; False off glibc."""
    with contextlib.suppress(OSError, AttributeError):
        return bool(getattr(ctypes.CDLL("libc.so.6"), call)(*args))
    return False


def keep_freed_heap(trim: int = TRIM_THRESHOLD, mmap: int = MMAP_THRESHOLD) -> bool:
    """Make glibc keep freed heap up to *trim* bytes and map only blocks from *mmap*
    bytes on (process-wide). Returns whether it took effect (False off glibc)."""
    return _glibc("mallopt", _M_MMAP_THRESHOLD, mmap) and _glibc("mallopt", _M_TRIM_THRESHOLD, trim)


def limit_arenas(arenas: int = FRONTEND_ARENAS) -> bool:
    """Make glibc allocate from at most *arenas* arenas (process-wide; a fork inherits
    it), unless ``MALLOC_ARENA_MAX`` is set: the operator's word wins. Call it before
    the threads start. Returns whether it took effect (False off glibc)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    return _glibc("mallopt", _M_ARENA_MAX, arenas)


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the free pages of every arena go back to the kernel,
    not only the top of the heap. Returns whether any did (False off glibc). Called when
    a process goes idle (``headwater.gc_tuning``) and by ``GET /debug/heap?trim``."""
    return _glibc("malloc_trim", 0)
