"""Probe: does the draft head get more right when its vocabulary also holds the tokens of the context so far?

The head reads its logits with the target's own output head restricted to its 8,192 tokens, so a sixth of the
report tasks' next tokens (names, words of another language, rare code identifiers) are out of its reach. Those
tokens often stand in the prompt. Since the head shares the target's output head, any token's logit costs one more
row of that head: a vocabulary of the head's tokens plus those of the prompt (or of the whole context so far) costs
a few hundred rows more per draft step, and needs no training. This probe teacher-forces the shipped head on the
report tasks of a `viasd bench` run (as ../2026-12-05-head-on-tasks-xeon/teacher_forced.py does) with three
vocabularies and prints top-1 per draft step, kept per chain of 4, and the share of labels out of reach.

    python context_vocab.py ../2026-12-04-head-more-data-xeon
"""

import json
import sys
from pathlib import Path

import torch

from viasd.bench.runner import turn_prompt
from viasd.bench.tasks import load_specbench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-12-05-head-on-tasks-xeon"))
from recorded_features import default_target, features_of

run = Path(sys.argv[1])
DEPTH, CHUNK = 4, 32
MODES = ("head", "head+prompt", "head+context")

rows = [json.loads(line) for line in (run / "results.jsonl").open()]
answers = {r["key"]: r["turns"][0] for r in rows if r["method"] == "plain"}
tasks = {t.key: t for t in load_specbench() if t.key in answers}

model, tokenizer, view, head = default_target()
ids = head.token_ids
output = model.get_output_embeddings().weight.detach()
embeddings = model.get_input_embeddings().weight.detach()
special = set(tokenizer.all_special_ids)


@torch.inference_mode()
def chain(feature: torch.Tensor, fed: int, vocab: torch.Tensor, rows_out: torch.Tensor) -> list[int]:
    """Greedy drafts from a feature after folding in token `fed`, over the vocabulary `vocab`."""
    state, out, token = feature, [], fed
    for _ in range(DEPTH):
        state = head.step(state, embeddings[token].float())
        token = int(vocab[int((rows_out @ state).argmax())])
        out.append(token)
    return out


def extended(extra: set[int]) -> torch.Tensor:
    """The head's ids followed by the extra tokens it lacks (special tokens left out)."""
    mine = set(ids.tolist())
    more = sorted(t for t in extra if t not in mine and t not in special)
    return torch.cat([ids, torch.tensor(more, dtype=torch.long)])


totals = {m: {"positions": 0, "right": [0] * DEPTH, "kept4": 0, "outside": 0, "size": 0} for m in MODES}
by_category: dict[tuple[str, str], list[int]] = {}
for key, answer in answers.items():
    task = tasks[key]
    prompt = turn_prompt(tokenizer, task, [], 0, chat=True)
    tokens = prompt + answer["tokens"]
    features = features_of(model, view, tokens, CHUNK)
    p, end = len(prompt), len(tokens)
    for mode in MODES:
        fixed = {"head": ids, "head+prompt": extended(set(prompt))}.get(mode)
        for t in range(p - 1, end - 2):  # drafts of x[t+2 ..] from h_t and x[t+1]
            vocab = fixed if fixed is not None else extended(set(tokens[: t + 2]))
            drafted = chain(features[t], tokens[t + 1], vocab, output[vocab].float())
            labels = tokens[t + 2 : t + 2 + DEPTH]
            hits = [i < len(labels) and drafted[i] == labels[i] for i in range(DEPTH)]
            run_length = next((i for i, hit in enumerate(hits) if not hit), DEPTH)
            counts = totals[mode]
            counts["positions"] += 1
            counts["kept4"] += run_length
            counts["outside"] += labels[0] not in set(vocab.tolist())
            counts["size"] += len(vocab)
            for i, hit in enumerate(hits):
                counts["right"][i] += hit
            cat = by_category.setdefault((task.category, mode), [0, 0, 0])
            cat[0], cat[1], cat[2] = cat[0] + 1, cat[1] + hits[0], cat[2] + run_length
    print(f"{key}: {p} prompt tokens, {end - p} answer tokens", flush=True)

for mode, c in totals.items():
    n = c["positions"]
    print(
        f"{mode}: {n} answer positions, mean vocabulary {c['size'] / n:.0f}, top-1 per draft step "
        + " / ".join(f"{100 * r / n:.1f}%" for r in c["right"])
        + f", kept per chain of 4 {c['kept4'] / n:.3f}, step 1's label out of reach {100 * c['outside'] / n:.1f}%"
    )
for category in dict.fromkeys(k[0] for k in by_category):
    print(
        f"  {category}: "
        + "; ".join(
            f"{m} top-1 {100 * by_category[category, m][1] / by_category[category, m][0]:.1f}% "
            f"kept {by_category[category, m][2] / by_category[category, m][0]:.3f}"
            for m in MODES
        )
    )
