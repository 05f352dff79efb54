"""Training a draft head under faults: two runs for the same target, and SIGTERM. Tiny random models only."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tiny import tiny_chat_tokenizer, tiny_model
from viasd.errors import ViasdError
from viasd.heads.file import load_head
from viasd.stopping import StopRequest
from viasd.training.command import checkpoint_path
from viasd.training.conversations import Written
from viasd.training.dataset import DataFolder
from viasd.training.prompts import Opener
from viasd.training.train import Checkpoint, TrainSettings, train
from viasd.training.writing import write_data


def conversation(writer: int, number: int) -> Written:
    """A small finished conversation that says which writer wrote it, and its number there."""
    return Written(number, [writer, number, 3], 1, [0, 1], torch.full((2, 4), float(writer)))


def write_shards(path: Path, writer: int, count: int, start: multiprocessing.synchronize.Barrier) -> None:
    folder = DataFolder(path, {"test": 1})
    start.wait(timeout=60)
    for number in range(count):
        folder.save([conversation(writer, number)])


def test_two_writer_processes_both_keep_all_their_shards(tmp_path):
    """Shards were named by count and landed by rename: two writers at once wrote over each other's."""
    context = multiprocessing.get_context("fork")
    start = context.Barrier(2)
    writers = [context.Process(target=write_shards, args=(tmp_path, w, 25, start)) for w in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    data = DataFolder(tmp_path, {"test": 1}).load()
    bounds = zip(data.starts[:-1].tolist(), data.starts[1:].tolist(), strict=True)
    kept = sorted(tuple(data.tokens[a : a + 2].tolist()) for a, _ in bounds)
    assert kept == [(w, n) for w in (1, 2) for n in range(25)]


def test_a_shard_is_never_written_over_and_a_second_writer_is_refused(tmp_path, monkeypatch):
    folder = DataFolder(tmp_path, {"test": 1})
    first = folder.save([conversation(1, 0)])
    monkeypatch.setattr(folder, "shards", list)  # a count taken before the other writer's shard landed
    second = folder.save([conversation(2, 0)])
    assert first != second and len(DataFolder(tmp_path, {"test": 1}).shards()) == 2
    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64)
    busy = rf"another viasd train-drafter \(process {os.getpid()}\) is writing"
    # Another run writes: this one would write the same conversations, from the same count.
    with DataFolder(tmp_path, {"test": 1}).writing(), pytest.raises(ViasdError, match=busy):
        write_data(target, tok, None, folder, 600, 1 << 20, 4, 0, 6, 12, False)
    assert len(DataFolder(tmp_path, {"test": 1}).shards()) == 2


def test_a_checkpoint_is_trained_by_one_run_and_each_out_has_its_own(tmp_path):
    home, a, b = tmp_path / "cache", tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert checkpoint_path(home, None, "chain") == home / "checkpoint.pt"
    assert checkpoint_path(home, a, "chain") == tmp_path / "a.checkpoint.pt"
    started = checkpoint_path(home, b, "attention", "0123456789abcdef")
    assert started == tmp_path / "b.checkpoint-attention-from-0123456789ab.pt"
    folder = DataFolder(tmp_path / "data", {"test": 1})
    folder.save([conversation(1, n) for n in range(8)])
    checkpoint = Checkpoint(checkpoint_path(home, a, "chain"))
    embeddings = torch.randn(8, 4)
    with checkpoint.held(), pytest.raises(ViasdError, match="is in use by another viasd train-drafter"):
        train(folder.load(), embeddings, embeddings, TrainSettings(width=8, vocab=4, steps=1), checkpoint, set())
    assert not checkpoint.path.exists()


class Signalled(list):
    """Requests whose tenth, when asked for, comes with a signal: the writer is asked to stop mid-way."""

    def __init__(self, stop: StopRequest) -> None:
        super().__init__(Opener(f"task {i}", True) for i in range(40))
        self.stop = stop

    def __getitem__(self, index):
        if index == 9:
            self.stop.signum = signal.SIGTERM
        return super().__getitem__(index)


def test_a_stopped_writer_keeps_its_finished_conversations(tmp_path):
    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64, init_scale=0.3)
    folder = DataFolder(tmp_path, {"test": 1})
    stop = StopRequest()
    requests = Signalled(stop)
    held = write_data(target, tok, None, folder, 600, 1 << 62, 4, 0, 6, 12, False, source=requests, stop=stop)
    assert stop and 0 < folder.conversations() < 16 and held == folder.tokens()  # a short shard: what was finished
    assert write_data(target, tok, None, folder, 600, 1 << 62, 4, 0, 6, 12, False, source=requests, stop=stop) == held


def tiny_chat_model_dir(directory: Path) -> Path:
    tiny_model("qwen2", vocab_size=320, hidden=64, dtype=torch.float32).save_pretrained(directory)
    tiny_chat_tokenizer(320).save_pretrained(directory)
    return directory


def test_sigterm_to_a_training_run_leaves_a_checkpoint_and_a_head(tmp_path):
    """SIGTERM killed a training run: the last periodic checkpoint (up to two minutes old) and no head."""
    model = tiny_chat_model_dir(tmp_path / "model")
    out = tmp_path / "head.safetensors"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VIASD_CACHE_DIR": str(tmp_path / "cache"), "VIASD_KERNELS": "off",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    command = [sys.executable, "-m", "viasd", "train-drafter", "--target", str(model), "--quant", "none", "--width",
               "32", "--vocab", "64", "--depth", "2", "--rows", "4", "--tokens", "300", "--train-minutes", "10",
               "--no-progress", "--out", str(out)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("head: ") for line in lines):  # the training loop has begun
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=10)
    output = "".join(lines)
    assert status == 128 + signal.SIGTERM and "Traceback" not in output, output
    assert "stopped by SIGTERM: the checkpoint and the head so far are saved" in output, output
    assert (tmp_path / "head.checkpoint.pt").is_file()
    training = load_head(out).training
    assert training["stopped_by"] == "SIGTERM" and training["steps"] > 0, json.dumps(training)
