"""Peak resident memory of each decoding method, each measured in its own fresh process.

Usage: python scripts/peak_memory.py [--methods sd,via] [--tokens 128] [--prompt TEXT]
Prints one JSON line per method and the ratio of each method's peak to the first method's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
from viasd.engine import Engine, EngineSpec
from viasd.decode.base import GenerationConfig
method, tokens, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
engine = Engine(EngineSpec())
decoder = engine.decoder(method)
ids = engine.encode([{"role": "user", "content": prompt}])
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = decoder.generate(ids, GenerationConfig(max_new_tokens=tokens, ignore_eos=True))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"method": method, "peak_rss_mib": peak / 1024, "after_load_mib": loaded / 1024,
                  "new_tokens": result.stats.new_tokens, "prompt_tokens": len(ids)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", default="sd,via")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", default="Write a Python class implementing an LRU cache with tests.")
    args = parser.parse_args()
    rows = []
    for method in args.methods.split(","):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, method, str(args.tokens), args.prompt],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["peak_rss_mib"]
    for row in rows[1:]:
        print(f"{row['method']} / {rows[0]['method']} peak memory: {row['peak_rss_mib'] / base:.3f}")


if __name__ == "__main__":
    main()
