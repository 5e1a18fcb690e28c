"""Handing torch's CPU threads to the thread that computes: a server's and the training service's worker.

Torch's CPU builds for Linux run their parallel work on GNU OpenMP (libgomp). Each thread that
starts parallel work gets a pool of worker threads of its own, kept for the thread's life. When
libgomp manages more threads than there are CPUs, its idle workers spin only briefly before they
sleep (``do_spin`` takes ``gomp_throttled_spin_count_var``), so every parallel product pays a
wake-up. A program that computes with torch on its main thread (which makes the main thread's
pool) and serves in the same process decodes on a worker thread (which makes another): on this
project's 2-core machine a decode of the bundled model then took 1.7-2.5 times as long as the same
decode on the main thread (a LoRA-sized product 4-7 µs against 65-116; docs/benchmarks.md,
"Serving latency", 12-08). A bare ``grooves serve`` process, whose main thread computes nothing in
parallel before its engine starts, was not slowed.

``release_pool()`` frees the calling thread's pool (OpenMP 5.0's ``omp_pause_resource_all``). The
serving engine and the training service call it on the thread that loaded the model, just before
their worker starts, and on the worker whenever it has nothing queued, so that one pool exists at
a time even with several servers in one process; a trainer calls it while it waits for its
rewards (``grooves.rewards.runner.run_coroutine``), which a judge served in its process computes,
and an async pipeline's sampler thread and trainer each call it while they wait for the other. A
thread that computes in parallel again gets a new pool from libgomp: only speed depends on this,
never a result.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("grooves.policy")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what can be kept


@functools.cache
def _libgomp():
    """The libgomp torch has loaded into this process (None when torch runs on another runtime)."""
    import torch  # noqa: F401  (loads torch's libgomp, if it has one)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)  # already loaded: the same handle
        except OSError:
            continue
        if hasattr(library, "omp_pause_resource_all"):
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            library.omp_pause_resource_all.restype = ctypes.c_int
            return library
    return None


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True when a libgomp did so."""
    library = _libgomp()
    if library is None:
        return False
    done = library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not done:
        log.debug("libgomp declined to free the calling thread's OpenMP threads")
    return done
