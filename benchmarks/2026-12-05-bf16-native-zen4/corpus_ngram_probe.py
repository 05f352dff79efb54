"""Scratch: would an n-gram index over the target's own written conversations draft the report tasks' answers?"""
import json, sys, collections
from pathlib import Path
import torch
from viasd.training.dataset import DataFolder
folder = Path.home() / ".cache/viasd/heads/acf02187573f5bf6/data"
from safetensors import safe_open
toks = []
for shard in sorted(folder.glob("shard-*.safetensors")):
    with safe_open(str(shard), "pt") as f:
        keys = list(f.keys())
        t = f.get_tensor("tokens") if "tokens" in keys else None
        s = f.get_tensor("starts") if "starts" in keys else None
    if t is None:
        print(keys); sys.exit()
    toks.append(t.tolist())
corpus = [x for part in toks for x in part]
print("corpus tokens", len(corpus))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 3
K = 4
index = collections.defaultdict(collections.Counter)
for i in range(len(corpus) - N):
    index[tuple(corpus[i:i + N])][corpus[i + N]] += 1
rows = [json.loads(l) for l in open("benchmarks/2026-12-05-head-2h-zen4/bench/results.jsonl")]
rows = [r for r in rows if r["method"] == "plain"]
fired = kept = total = 0
bycat = collections.defaultdict(lambda: [0, 0, 0])
for r in rows:
    out = r["turns"][0]["tokens"]
    for t in range(N, len(out) - 1):
        total += 1; bycat[r["category"]][2] += 1
        key = tuple(out[t - N:t])
        if key not in index:
            continue
        # greedy chain of up to K from the index
        ctx = list(out[:t]); draft = []
        for _ in range(K):
            c = index.get(tuple(ctx[-N:]))
            if not c: break
            tok, n = c.most_common(1)[0]
            if n < 2 and len(draft) > 0: break
            draft.append(tok); ctx.append(tok)
        fired += 1; bycat[r["category"]][0] += 1
        a = 0
        for j, d in enumerate(draft):
            if t + j < len(out) and out[t + j] == d: a += 1
            else: break
        kept += a; bycat[r["category"]][1] += a
print(f"N={N}: positions {total}, fired {fired} ({fired/total:.0%}), kept per firing {kept/max(fired,1):.2f}")
for c, (f, k, t) in bycat.items():
    print(f"  {c:15s} fired {f/t:.0%} kept/firing {k/max(f,1):.2f}")
