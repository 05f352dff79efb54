"""Would tree drafts pay over the chain the head drafts now? Accepted tokens per round and speed, per draft shape.

For every answer position of a written data folder, the head drafts teacher-forced along the true text, and the
rank (in the head's vocabulary) of the true token at each of `--depth` steps is recorded. Along the true path the
head's states are exactly what drafting computes, so a draft tree of rank paths, e.g. ((0,), (1,), (0, 0)): top-1,
top-2, and top-1 after top-1, keeps as many tokens as the deepest of its paths that the true ranks follow. A round
costs the target's pass over 1 + nodes rows (`--costs`, single-token steps by rows, from
scripts/verification_costs.py) plus one head step per tree level (`--head-step`, in target steps), so

    speed over the fast mode = tokens per round / cost per round   (Python overheads left out: compare shapes only)

Shapes: chains of 1-4, the chain that stops after a draft whose top probability is under `--stop` (what `sd`
drafts), static trees, and that chain with the next-ranked siblings of its last draft (a tree that branches only
where the head is unsure). Positions are those where the head drafts in `sd:drafter=lookup+head` (no 3-gram prompt
lookup match); `--all` takes every answer position. `--costs flat` asks a machine whose rows cost nothing up to 16.
Measure a head on answers it never trained on: its ranks on its own training data say nothing.

    python scripts/tree_drafts.py --data ~/.cache/viasd/heads/<fingerprint>/data-tasks
    python scripts/tree_drafts.py --data ... --costs flat
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from viasd.drafters.prompt_lookup import lookup_continuation
from viasd.engine import Engine, EngineSpec
from viasd.heads.find import find_head
from viasd.heads.network import DraftHead
from viasd.training.dataset import DataFolder, TrainingSet

# The Xeon's verification costs (benchmarks/2026-12-04-draft-length-xeon), single-token steps by rows.
XEON_COSTS = "1:1.00,2:1.07,4:1.20,5:1.23,6:1.27,8:1.41,10:1.77,12:1.93,16:2.29"
RankPath = tuple[int, ...]  # ranks along a path from the root: (0, 1) is the top-1 draft, then its top-2 child

STATIC_TREES: dict[str, tuple[RankPath, ...]] = {
    "top-2": ((0,), (1,)),
    "top-2, chain of 3 on top-1": ((0,), (1,), (0, 0), (0, 0, 0)),
    "top-2, chains on both": ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    "top-3, chains (7 nodes)": ((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    "top-2, two children (7 nodes)": ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    "11 nodes": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)),
}


@dataclass(frozen=True)
class Ranks:
    """Per position: the true token's rank at each draft step [n, depth] (a huge rank: outside the vocabulary),
    and the head's top probabilities there [n, depth, 4]."""

    rank: torch.Tensor
    top: torch.Tensor


def cost_curve(spec: str) -> dict[int, float]:
    """Single-token steps for 1..16 rows: `flat`, or rows:steps points joined by straight lines."""
    if spec == "flat":
        return dict.fromkeys(range(1, 17), 1.0)
    points = sorted((int(r), float(c)) for r, c in (part.split(":") for part in spec.split(",")))
    curve = {}
    for rows in range(points[0][0], points[-1][0] + 1):
        (r0, c0), (r1, c1) = next((a, b) for a, b in itertools.pairwise(points) if a[0] <= rows <= b[0])
        curve[rows] = c0 if r1 == r0 else c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    return curve


def tree_kept(paths: tuple[RankPath, ...], rank: torch.Tensor) -> torch.Tensor:
    """Tokens a tree keeps per position: the depth of its deepest path the true ranks follow."""
    kept = torch.zeros(len(rank))
    for path in paths:
        follows = torch.ones(len(rank), dtype=torch.bool)
        for step, wanted in enumerate(path):
            follows &= rank[:, step] == wanted
        kept = torch.where(follows, kept.clamp(min=len(path)), kept)
    return kept


def stop_lengths(top1: torch.Tensor, stop: float) -> torch.Tensor:
    """Drafts in the chain per position: up to and including the first whose top probability is under `stop`."""
    depth = top1.shape[1]
    unsure = top1 < stop
    first = torch.where(unsure.any(1), unsure.float().argmax(1) + 1, torch.full((len(top1),), depth))
    return first.long()


def stop_tree(ranks: Ranks, stop: float, siblings: int, least: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The stopping chain, plus the next `siblings` ranks of its last draft where their probability is at least
    `least`: kept tokens and nodes per position."""
    length = stop_lengths(ranks.top[:, :, 0], stop)
    rows = torch.arange(len(length))
    on_spine = (ranks.rank == 0).long().cumprod(1)  # [n, depth]: the top-1 path still true after step d
    depth_index = torch.arange(ranks.rank.shape[1])[None]
    kept = (on_spine * (depth_index < length[:, None])).sum(1)
    last = length - 1
    extra = (ranks.top[rows, last, 1 : siblings + 1] >= least).sum(1) if siblings else torch.zeros_like(length)
    before_last_right = torch.where(last > 0, on_spine[rows, (last - 1).clamp(min=0)] == 1, torch.ones_like(last) == 1)
    sibling_right = (ranks.rank[rows, last] >= 1) & (ranks.rank[rows, last] <= extra) & before_last_right
    kept = torch.where(sibling_right, length, kept)
    return kept.float(), (length + extra).long()


def speed(kept: torch.Tensor, nodes: torch.Tensor, levels: torch.Tensor, costs: dict[int, float], step: float) -> float:
    """Tokens per round over the cost per round, in single-token steps."""
    cost = torch.tensor([costs[1 + int(n)] for n in nodes]) + step * levels.float()
    return float((1 + kept).mean() / cost.mean())


@torch.inference_mode()
def measure_ranks(head: DraftHead, model: torch.nn.Module, data: TrainingSet, depth: int, every: bool) -> Ranks:
    """The true tokens' ranks and the head's top probabilities, teacher-forced, at each draft step."""
    embeddings = model.get_input_embeddings().weight.detach().float()
    output = model.get_output_embeddings().weight.detach()
    head = head.float()
    rows = output[head.token_ids].float()
    index = torch.full((output.shape[0],), -1, dtype=torch.long)
    index[head.token_ids] = torch.arange(len(head.token_ids))
    row_at = {int(at): i for i, at in enumerate(data.feature_at.tolist())}
    ranks, tops = [], []
    for c in range(data.conversations):
        begin, end = int(data.starts[c]), int(data.starts[c + 1])
        tokens, answer = data.tokens[begin:end].tolist(), data.answer[begin:end].tolist()
        # A round that drafts token p starts from the feature at p - 2 and folds in token p - 1 (the target's).
        starts = [
            p
            for p in range(2, len(tokens) - depth)
            if answer[p] and begin + p - 2 in row_at and (every or not lookup_continuation(tokens[:p], depth, 3, 3))
        ]
        if not starts:
            continue
        state = data.features[[row_at[begin + p - 2] for p in starts]].float()
        rank, top = [], []
        for d in range(depth):
            state = head.step(state, embeddings[[tokens[p - 1 + d] for p in starts]])
            probs = torch.softmax(state @ rows.T, -1)
            truth = index[torch.tensor([tokens[p + d] for p in starts])]
            p_true = probs.gather(1, truth.clamp(min=0)[:, None])[:, 0]
            rank.append(torch.where(truth >= 0, (probs > p_true[:, None]).sum(1), 1 << 30))
            top.append(probs.topk(4, -1).values)
        ranks.append(torch.stack(rank, 1))
        tops.append(torch.stack(top, 1))
    return Ranks(torch.cat(ranks), torch.cat(tops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a training-data folder of viasd train-drafter")
    parser.add_argument("--head", default=None, help="a chain head file (default: the target's, as sd finds it)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--costs", default=XEON_COSTS, help="rows:steps points, or flat")
    parser.add_argument("--head-step", type=float, default=0.07, help="a head step, in target steps")
    parser.add_argument("--stop", type=float, default=0.5, help="sd's stop threshold")
    parser.add_argument("--all", action="store_true", help="every answer position, not only where the head drafts")
    args = parser.parse_args()
    model = Engine(EngineSpec()).target.model
    head = find_head(model, args.head).head
    if not isinstance(head, DraftHead):
        raise SystemExit("tree_drafts.py measures chain heads")
    with open(args.data / "settings.json", "rb") as settings:
        data = DataFolder(args.data, json.load(settings)).load()
    ranks = measure_ranks(head, model, data, args.depth, args.all)
    costs = cost_curve(args.costs)
    n, depth = ranks.rank.shape
    hits = [round(float((ranks.rank[:, 0] < k).float().mean()), 3) for k in (1, 2, 3, 4)]
    print(f"{n} positions; the first draft's true token in the head's top-1/2/3/4: {hits}; costs {args.costs}\n")
    print("| shape | nodes | tokens/round | speed over the fast mode |\n| --- | --- | --- | --- |")
    ones = torch.ones(n, dtype=torch.long)

    def row(name: str, kept: torch.Tensor, nodes: torch.Tensor, levels: torch.Tensor) -> None:
        rate = speed(kept, nodes, levels, costs, args.head_step)
        print(f"| {name} | {nodes.float().mean():.2f} | {1 + kept.mean():.3f} | {rate:.3f} |")

    for length in range(1, depth + 1):
        paths = tuple((0,) * d for d in range(1, length + 1))
        row(f"chain of {length}", tree_kept(paths, ranks.rank), ones * length, ones * length)
    levels = stop_lengths(ranks.top[:, :, 0], args.stop)
    for siblings, least in ((0, 0.0), (1, 0.1), (2, 0.1), (3, 0.05)):
        kept, nodes = stop_tree(ranks, args.stop, siblings, least)
        name = f"chain stopping under {args.stop}"
        row(name + (f", {siblings} siblings of p >= {least} at its end" if siblings else ""), kept, nodes, levels)
    for name, paths in STATIC_TREES.items():
        row(name, tree_kept(paths, ranks.rank), ones * len(paths), ones * max(len(p) for p in paths))


if __name__ == "__main__":
    main()
