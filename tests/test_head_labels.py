"""A chain head trained on the target's own distribution (`labels="distribution"`): the teacher is the target's
distribution at the label's position, the loss is its cross-entropy there (the written token elsewhere), a head
learns from it, and bad settings and older checkpoints are handled."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from test_head import borrowed, tiny_data
from viasd.errors import ViasdError
from viasd.heads.network import DraftHead, HeadConfig
from viasd.training.train import (
    Checkpoint,
    Target,
    TrainSettings,
    examples,
    head_vocabulary,
    loss_of,
    train,
    unroll,
)

QUIET = {"progress": False, "log": lambda _: None}


def test_the_loss_is_the_teachers_cross_entropy_where_taught_and_the_written_tokens_elsewhere():
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 3, 5), torch.randn(2, 3, 5) * 3
    labels = torch.tensor([[0, 4, -1], [2, 2, 1]])
    taught = torch.tensor([[True, False, True], [False, True, True]])
    weights = torch.tensor([[1.0, 0.3, 1.0], [1.0, 1.0, 0.3]])
    got = loss_of(logits, labels, weights, teacher, taught)
    per_example = torch.zeros(2, 3)
    for d in range(2):
        for b in range(3):
            if labels[d, b] < 0:
                continue  # past its conversation's end: counts for nothing
            log_p = torch.log_softmax(logits[d, b], -1)
            if taught[d, b]:
                per_example[d, b] = -(torch.softmax(teacher[d, b], -1) * log_p).sum()
            else:
                per_example[d, b] = -log_p[labels[d, b]]
    per_step = (per_example * weights).sum(1) / (labels >= 0).sum(1)
    step_weight = torch.tensor([1.0, 0.8])
    torch.testing.assert_close(got, (per_step * step_weight).sum() / step_weight.sum())
    # A teacher sure of the written token is the written token's loss.
    sure = functional.one_hot(labels.clamp_min(0), 5).float() * 1e4
    torch.testing.assert_close(loss_of(logits, labels, weights, sure, taught), loss_of(logits, labels, weights))


def test_the_teacher_is_the_targets_distribution_at_the_labels_position(tmp_path):
    # The tiny target wrote its answers greedily, so its distribution at a label's position ranks the written token
    # first (an off-by-one would rank it first about as often as chance).
    target, _, folder = tiny_data(tmp_path, 16)
    data = folder.load()
    embeddings, output = borrowed(target)
    token_ids = head_vocabulary(data, 320, {2})
    ex = examples(data, token_ids, torch.arange(len(data.feature_at)))
    head = DraftHead(HeadConfig(64, 32, 1, len(token_ids)), token_ids)
    unrolled = unroll(head, Target(embeddings, output[token_ids]), data, ex, ex.starts, 3, teacher=True)
    assert unrolled.teacher is not None and unrolled.taught is not None
    at = data.feature_at[ex.starts]
    for d in range(3):
        answer = data.answer[(at + d + 1).clamp(max=len(data.tokens) - 1)]
        checked = unrolled.taught[d] & answer & (unrolled.labels[d] >= 0)
        assert int(checked.sum()) > 100
        agree = (unrolled.teacher[d].argmax(-1) == unrolled.labels[d])[checked].float().mean()
        assert float(agree) > 0.97, (d, float(agree))
    # Where no feature was recorded (the chat template's tokens), nothing is taught.
    recorded = torch.zeros(len(data.tokens), dtype=torch.bool)
    recorded[data.feature_at] = True
    inside = at + 2 < ex.end_of[at]
    assert torch.equal(unrolled.taught[0], recorded[at + 1] & inside) and not bool(unrolled.taught[0].all())


def test_a_head_learns_from_the_targets_distribution(tmp_path):
    target, _, folder = tiny_data(tmp_path, 96)
    data = folder.load()
    shape = {"width": 64, "vocab": 320, "depth": 3, "batch": 32, "seconds": 600}
    _, taught = train(data, *borrowed(target), TrainSettings(**shape, lr=3e-3, steps=300, labels="distribution"),
                      Checkpoint(tmp_path / "taught.pt"), {2}, **QUIET)  # fmt: skip
    _, untrained = train(data, *borrowed(target), TrainSettings(**shape, lr=0.0, steps=1),
                         Checkpoint(tmp_path / "untrained.pt"), {2}, **QUIET)  # fmt: skip
    mean = sum(taught["accuracy"]) / len(taught["accuracy"])
    assert mean > sum(untrained["accuracy"]) / len(untrained["accuracy"]) + 0.05, (taught, untrained)
    assert taught["accepted_per_chain"] > untrained["accepted_per_chain"]


def test_labels_are_checked_and_older_checkpoints_resume_as_trained(tmp_path):
    target, _, folder = tiny_data(tmp_path, 16)
    data = folder.load()
    weights = borrowed(target)
    with pytest.raises(ViasdError, match="labels must be one of"):
        train(data, *weights, TrainSettings(labels="soft", steps=1), Checkpoint(tmp_path / "a.pt"), {2}, **QUIET)
    with pytest.raises(ViasdError, match="written tokens only"):
        attention = TrainSettings(design="attention", labels="distribution", steps=1)
        train(data, *weights, attention, Checkpoint(tmp_path / "b.pt"), {2}, **QUIET)
    # A checkpoint written before labels were a setting trained on the tokens: it resumes as such, and refuses the
    # distribution, which it never learned from.
    settings = TrainSettings(width=32, vocab=64, depth=2, batch=8, steps=3, seconds=600)
    checkpoint = Checkpoint(tmp_path / "old.pt")
    train(data, *weights, settings, checkpoint, {2}, **QUIET)
    state = torch.load(checkpoint.path, weights_only=False)
    del state["settings"]["labels"]
    checkpoint.save(state)
    _, resumed = train(data, *weights, TrainSettings(**{**settings.to_dict(), "steps": 5}), checkpoint, {2}, **QUIET)
    assert resumed["steps"] == 5
    with pytest.raises(ViasdError, match="other settings"):
        train(data, *weights, TrainSettings(**{**settings.to_dict(), "labels": "distribution"}), checkpoint, {2},
              **QUIET)  # fmt: skip
