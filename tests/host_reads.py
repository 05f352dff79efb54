"""Counting what decoding code reads from tensors on the host: on a GPU each such read waits for the device.

Every way Python gets a value out of a tensor (.tolist(), .item(), int(), float(), bool() as in an `if`,
an index, .cpu(), .numpy()) goes through torch's function overrides, so a TorchFunctionMode sees it, on a CPU
as on a GPU. Model passes (KVSession._run) are left out: what happens inside transformers is not ours to count.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch.overrides import TorchFunctionMode

from viasd.passes.session import KVSession

READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})


class HostReads(TorchFunctionMode):
    """Records the name of every host read made while active and not paused."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and name in READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads(monkeypatch):
    """A HostReads mode over the block, paused inside model passes."""
    counter = HostReads()
    original = KVSession._run

    def run(self, *args, **kwargs):
        counter.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(KVSession, "_run", run)
    with counter:
        yield counter
