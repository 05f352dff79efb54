"""Teacher-forced: what several draft heads get right on the report tasks of a `viasd bench` run, with the
vocabulary they draft with (their own tokens and the context's, as `head_vocab=context` does). Counts only, no timing.

    python heads_on_tasks.py RUN HEAD_FILE [HEAD_FILE ...]     # `shipped` names the head in the package

RUN: a bench run's folder (its `plain` answers are the labels). Prints per head: top-1 per draft step and the drafts
a greedy chain of 4 keeps, per answer position (and per category).
"""

import json
import sys
from pathlib import Path

import torch

from viasd.bench.runner import turn_prompt
from viasd.bench.tasks import load_specbench
from viasd.heads.find import find_head

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-12-05-head-on-tasks-xeon"))
from recorded_features import default_target, features_of

run, names = Path(sys.argv[1]), sys.argv[2:]
DEPTH, CHUNK = 4, 32
rows = [json.loads(line) for line in (run / "results.jsonl").open()]
answers = {r["key"]: r["turns"][0] for r in rows if r["method"] == "plain"}
tasks = {t.key: t for t in load_specbench() if t.key in answers}
model, tokenizer, view, _ = default_target()
heads = {name: find_head(model, None if name == "shipped" else name).head.float() for name in names}
output = model.get_output_embeddings().weight.detach()
embeddings = model.get_input_embeddings().weight.detach()
special = set(tokenizer.all_special_ids)


@torch.inference_mode()
def chain(head, feature: torch.Tensor, fed: int, vocab: torch.Tensor) -> list[int]:
    """Greedy drafts from a feature after folding in token `fed`, over the vocabulary `vocab`."""
    rows_out, state, out, token = output[vocab].float(), feature, [], fed
    for _ in range(DEPTH):
        state = head.step(state, embeddings[token].float())
        token = int(vocab[int((rows_out @ state).argmax())])
        out.append(token)
    return out


def widened(ids: torch.Tensor, context: list[int]) -> torch.Tensor:
    mine = set(ids.tolist())
    more = list(dict.fromkeys(t for t in context if t not in mine and t not in special))
    return torch.cat([ids, torch.tensor(more, dtype=torch.long)])


totals = {name: {"positions": 0, "right": [0] * DEPTH, "kept": 0} for name in names}
by_category: dict[tuple[str, str], list[int]] = {}
for key, answer in answers.items():
    task = tasks[key]
    prompt = turn_prompt(tokenizer, task, [], 0, chat=True)
    tokens = prompt + answer["tokens"]
    features = features_of(model, view, tokens, CHUNK)
    for name, head in heads.items():
        for t in range(len(prompt) - 1, len(tokens) - 2):  # drafts of x[t+2 ..] from h_t and x[t+1]
            drafted = chain(head, features[t], tokens[t + 1], widened(head.token_ids, tokens[: t + 2]))
            labels = tokens[t + 2 : t + 2 + DEPTH]
            hits = [i < len(labels) and drafted[i] == labels[i] for i in range(DEPTH)]
            kept = next((i for i, hit in enumerate(hits) if not hit), DEPTH)
            counts = totals[name]
            counts["positions"] += 1
            counts["kept"] += kept
            for i, hit in enumerate(hits):
                counts["right"][i] += hit
            cat = by_category.setdefault((task.category, name), [0, 0])
            cat[0], cat[1] = cat[0] + 1, cat[1] + kept
    print(f"{key}: {len(prompt)} prompt tokens, {len(tokens) - len(prompt)} answer tokens", flush=True)

for name, c in totals.items():
    n = c["positions"]
    steps = " / ".join(f"{100 * r / n:.1f}%" for r in c["right"])
    print(f"{name}: {n} answer positions, top-1 per draft step {steps}, kept per chain of 4 {c['kept'] / n:.3f}")
for category in dict.fromkeys(k[0] for k in by_category):
    kept = "; ".join(f"{by_category[category, m][1] / by_category[category, m][0]:.3f}" for m in names)
    print(f"  {category}: kept per chain of 4 {kept}")
