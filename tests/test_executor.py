"""The pass executor (passes/executor.py): callables handed in from any thread run on its own, results and errors
go back to the caller, and a worker thread can keep OpenMP to itself."""

from __future__ import annotations

import threading

import pytest
import torch

from viasd.passes.executor import PassExecutor, confine_openmp


def test_jobs_from_other_threads_run_on_the_executors_thread_and_errors_go_back():
    executor = PassExecutor()
    here = threading.get_ident()
    seen: dict[str, object] = {}

    def ask() -> None:
        seen["ran on"] = executor.run(threading.get_ident)
        try:
            executor.run(lambda: 1 / 0)
        except ZeroDivisionError as error:
            seen["error"] = error
        seen["after the error"] = executor.run(lambda: "still serving")

    worker = threading.Thread(target=ask)
    worker.start()
    executor.serve(until=lambda: not worker.is_alive(), poll=0.01)
    worker.join()
    assert seen["ran on"] == here and isinstance(seen["error"], ZeroDivisionError)
    assert seen["after the error"] == "still serving" and executor.jobs_run == 3
    assert executor.run(lambda: 7) == 7  # on its own thread: at once, without serving


def test_serve_refuses_another_thread():
    executor = PassExecutor()
    failure: list[BaseException] = []

    def serve_elsewhere() -> None:
        try:
            executor.serve(until=lambda: True)
        except RuntimeError as error:
            failure.append(error)

    thread = threading.Thread(target=serve_elsewhere)
    thread.start()
    thread.join()
    assert failure and "thread that made" in str(failure[0])


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch runs without OpenMP here")
def test_a_confined_thread_uses_one_openmp_thread_and_the_others_keep_theirs():
    before = torch.get_num_threads()
    counts: list[int] = []

    def work() -> None:
        counts.append(int(confine_openmp()))
        counts.append(torch.get_num_threads())
        torch.ones(1 << 18).add_(1)  # a parallel-sized op: runs, on one thread

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert counts == [1, 1] and torch.get_num_threads() == before
