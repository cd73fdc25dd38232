"""Thread pinning for the launch thread (runtime/cuda/launch.py), which needs no GPU."""

from __future__ import annotations

import os
import threading

import pytest

from runtime.cuda.launch import pin_to_current_cpu, unpin

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.exists("/proc/thread-self/stat"),
                                reason="thread affinity through /proc is Linux-only")


@linux_only
def test_pin_restricts_only_the_calling_thread_and_unpin_restores_it():
    seen = {}

    def body():
        before = os.sched_getaffinity(0)
        previous = pin_to_current_cpu()
        seen["pinned"] = os.sched_getaffinity(0)
        unpin(previous)
        seen["after"] = os.sched_getaffinity(0)
        seen["before"], seen["previous"] = before, previous

    worker = threading.Thread(target=body)
    main_before = os.sched_getaffinity(0)
    worker.start()
    worker.join()
    assert seen["previous"] == seen["before"]
    assert len(seen["pinned"]) == 1 and seen["pinned"] <= seen["before"]
    assert seen["after"] == seen["before"]
    assert os.sched_getaffinity(0) == main_before  # the main thread was never touched


def test_unpin_of_nothing_is_a_no_op():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    unpin(None)
    assert (os.sched_getaffinity(0) if before is not None else None) == before
