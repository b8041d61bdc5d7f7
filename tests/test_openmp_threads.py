"""The CPU's OpenMP workers and the server's model thread (runtime.release_idle_openmp_threads):
the thread that built the engine lets its idle workers go before the model thread takes over."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mtplx.runtime import _openmp_runtime

pytestmark = pytest.mark.skipif(_openmp_runtime() is None, reason="no OpenMP runtime mapped into this process")


def run(code: str) -> str:
    """``code`` in a fresh interpreter (its own OpenMP state): its standard output."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_calling_threads_idle_openmp_workers_exit_and_come_back_when_needed():
    out = run("""
        import os, time
        import torch
        from mtplx.runtime import release_idle_openmp_threads

        def threads():
            return len(os.listdir("/proc/self/task"))

        torch.set_num_threads(2)
        a = torch.arange(400_000, dtype=torch.float32)
        (a + a).sum()  # a parallel region: this thread's pool now holds a worker
        before = threads()
        released = release_idle_openmp_threads()
        for _ in range(200):  # the worker exits on its own
            if threads() < before:
                break
            time.sleep(0.01)
        after = threads()
        total = float((a + a).sum())  # parallel again: a new pool, the same result
        print(released, before, after, threads(), total == float(2 * a.sum()))
    """)
    released, before, after, again, same = out.split()
    assert released == "True"
    assert int(after) == int(before) - 1  # its one worker (two threads, two CPUs at most in use)
    assert int(again) == int(before)
    assert same == "True"


def test_the_scheduler_releases_the_loading_threads_workers_on_the_cpu(monkeypatch):
    import mtplx.batching.scheduler as scheduler_module
    from mtplx.batching.scheduler import Scheduler
    from mtplx.batching.state import SchedulerSettings
    from tests.test_server_harness import tiny_text_engine

    engine = tiny_text_engine()
    scheduler = Scheduler(engine, SchedulerSettings.resolve("serial"))
    started = []  # per call: whether the model thread existed yet
    monkeypatch.setattr(scheduler_module, "release_idle_openmp_threads",
                        lambda: started.append(scheduler._thread is not None) or True)
    scheduler.start()
    try:
        assert started == [False]  # once, before the model thread started
        assert scheduler.alive
    finally:
        scheduler.stop()
