"""Probe: the shipped draft head teacher-forced on the benchmark's own tasks, against what it kept when decoding them.

For each task of a `viasd bench` run, the prompt as the bench built it and the answer the target gave (`plain`'s
tokens; the exact methods give the same) go through the target's GGUF view in chunks of 32 tokens, recording the
feature of every position, as `viasd train-drafter` records them. The head then drafts from every answer position,
teacher-forced (training's held-out measure: top-1 per draft step, the run of right drafts in a chain of 4), and a
greedy decode is replayed round by round on the recorded features (gamma 4, stop 0.5 as `sd` drafts: each round
starts after the last kept token and its correction). The replay's drafts and kept tokens per round should match
the decode's own counts in the run's results; a large gap would say the decoder feeds the head something other than
what it trained on.

    python teacher_forced.py RUN_FOLDER METHOD      # e.g. ../2026-12-04-head-more-data-xeon sd:drafter=head:head=...
"""

import json
import sys
from pathlib import Path

import torch
from recorded_features import default_target, features_of

from viasd.bench.runner import turn_prompt
from viasd.bench.tasks import load_specbench
from viasd.drafters.base import stops_after

run, method = Path(sys.argv[1]), sys.argv[2]
GAMMA, STOP, DEPTH, CHUNK = 4, 0.5, 4, 32

rows = [json.loads(line) for line in (run / "results.jsonl").open()]
answers = {r["key"]: r["turns"][0] for r in rows if r["method"] == "plain"}
decoded = {r["key"]: r["turns"][0]["stats"] for r in rows if r["method"] == method}
tasks = {t.key: t for t in load_specbench() if t.key in answers}

model, tokenizer, view, head = default_target()
ids = head.token_ids
rows_out = model.get_output_embeddings().weight.detach()[ids].float()
embeddings = model.get_input_embeddings().weight.detach()


@torch.inference_mode()
def chain(feature: torch.Tensor, fed: int) -> list[tuple[int, float]]:
    """Greedy drafts (token, top probability) from a feature after folding in token `fed`."""
    state, out = feature, []
    token = fed
    for _ in range(DEPTH):
        state = head.step(state, embeddings[token].float())
        probs = (rows_out @ state).softmax(-1)
        top = int(probs.argmax())
        token = int(ids[top])
        out.append((token, float(probs[top])))
    return out


totals = {"positions": 0, "right": [0] * DEPTH, "kept4": 0, "rounds": 0, "drafted": 0, "kept": 0, "outside": 0}
vocabulary = set(ids.tolist())
by_category: dict[str, list[int]] = {}  # category: [positions, right at step 1, kept per chain of 4]
decode = {"rounds": 0, "drafted": 0, "accepted": 0}
for key, answer in answers.items():
    task = tasks[key]
    prompt = turn_prompt(tokenizer, task, [], 0, chat=True)
    stats = decoded.get(key)
    if stats is None or stats["prompt_tokens"] != len(prompt):
        raise SystemExit(
            f"{key}: the prompt rebuilt has {len(prompt)} tokens, the run's {stats and stats['prompt_tokens']}"
        )
    tokens = prompt + answer["tokens"]
    features = features_of(model, view, tokens, CHUNK)
    p, end = len(prompt), len(tokens)
    drafts = {t: chain(features[t], tokens[t + 1]) for t in range(p - 1, end - 2)}
    for t, drafted in drafts.items():  # teacher-forced: drafts of x[t+2 ..] from h_t and x[t+1]
        labels = tokens[t + 2 : t + 2 + DEPTH]
        hits = [i < len(labels) and drafted[i][0] == labels[i] for i in range(DEPTH)]
        totals["positions"] += 1
        for i, hit in enumerate(hits):
            totals["right"][i] += hit
        run_length = 0
        while run_length < DEPTH and hits[run_length]:
            run_length += 1
        totals["kept4"] += run_length
        totals["outside"] += labels[0] not in vocabulary
        counts = by_category.setdefault(task.category, [0, 0, 0])
        counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + hits[0], counts[2] + run_length
    # The decode replayed: a round from h_t with x[t+1] known drafts up to GAMMA (stop after an unsure token),
    # keeps the run of right drafts, and the target adds one token; the next round starts after it.
    t = p - 1
    while t < end - 2:
        drafted = drafts[t][:GAMMA]
        length = next((i + 1 for i, (_, top) in enumerate(drafted) if stops_after(top, STOP)), len(drafted))
        labels = tokens[t + 2 : t + 2 + length]
        kept = 0
        while kept < min(length, len(labels)) and drafted[kept][0] == labels[kept]:
            kept += 1
        totals["rounds"] += 1
        totals["drafted"] += length
        totals["kept"] += kept
        t += kept + 1
    for name in decode:
        decode[name] += stats[name if name != "rounds" else "target_calls"]
    print(f"{key}: {p} prompt tokens, {end - p} answer tokens", flush=True)

n = totals["positions"]
print(
    f"teacher-forced on {n} answer positions: top-1 per draft step "
    + " / ".join(f"{100 * r / n:.1f}%" for r in totals["right"])
    + f", kept per chain of 4 {totals['kept4'] / n:.3f}"
)
print(f"step 1's label outside the head's {len(vocabulary)} tokens: {100 * totals['outside'] / n:.1f}%")
for category, (count, right, kept) in by_category.items():
    print(
        f"  {category}: {count} positions, top-1 at step 1 {100 * right / count:.1f}%, "
        f"kept per chain {kept / count:.3f}"
    )
print(
    f"replayed decode (gamma {GAMMA}, stop {STOP}): {totals['rounds']} rounds, "
    f"{totals['drafted'] / totals['rounds']:.2f} drafted and {totals['kept'] / totals['rounds']:.2f} kept per round"
)
print(
    f"the run's {method}: {decode['rounds']} target calls, {decode['drafted'] / decode['rounds']:.2f} drafted and "
    f"{decode['accepted'] / decode['rounds']:.2f} accepted per call"
)
