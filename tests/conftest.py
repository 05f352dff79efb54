import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tiny-model tests run faster on one torch thread (thread start-up dominates their matrices);
    tests on real models keep every core."""
    if request.node.get_closest_marker("real"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
