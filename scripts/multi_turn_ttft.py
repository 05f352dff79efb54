"""Time to first token of a multi-turn chat's later turns, against an OpenAI-compatible server (`viasd serve`, or any).

A chat client resends the whole conversation every turn; a server with a prefix cache reads only what is new. This
plays conversations turn by turn, one request at a time, streamed and greedy, each turn's answer appended to the
history, and prints the median time to first token per turn. Run it against `viasd serve` (the cache off by default)
and against `viasd serve --prefix-cache-mb 512` to see what the cache saves on turns 2 and later:

    viasd serve --methods plain &                             # then, once it is up:
    python scripts/multi_turn_ttft.py http://127.0.0.1:8000 --turns 4 --out off.jsonl
    viasd serve --methods plain --prefix-cache-mb 512 &       # after stopping the first one
    python scripts/multi_turn_ttft.py http://127.0.0.1:8000 --turns 4 --out on.jsonl

Conversations: the 40 two-turn ones of Spec-Bench's development questions (viasd's bench data), continued with this
script's follow-up requests up to --turns. Every request has the same `max_tokens` and `ignore_eos`, so each turn's
history grows alike with and without the cache. Where the server exports viasd's prefix-cache counters in /metrics,
it prints how they moved. Needs only the `openai` client (a viasd dependency) and the server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import openai

DATA = Path(__file__).resolve().parent.parent / "src" / "viasd" / "bench" / "data" / "question_dev.jsonl"
FOLLOW_UPS = (
    "Now say the same in half as many words.",
    "Which part of your answer are you least sure of, and why?",
    "Give one concrete example that supports your answer.",
    "Rewrite your first answer for a ten-year-old.",
)
COUNTERS = ("hits_total", "misses_total", "reused_tokens_total", "evictions_total", "bytes")


def conversations(count: int, turns: int) -> list[list[str]]:
    """`count` conversations of `turns` user messages: Spec-Bench's two-turn questions, then the follow-ups."""
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    two_turn = [row["turns"] for row in rows if len(row["turns"]) >= 2]
    if count > len(two_turn):
        raise SystemExit(f"--conversations is at most {len(two_turn)} (the two-turn questions), got {count}")
    return [(list(messages) + list(FOLLOW_UPS))[:turns] for messages in two_turn[:count]]


def prefix_cache_counters(base_url: str, api_key: str | None) -> dict[str, float]:
    """viasd's viasd_prefix_cache_* samples from /metrics (empty where the server has none)."""
    request = urllib.request.Request(base_url.rstrip("/") + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode("utf-8", "replace")
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"viasd_prefix_cache_{name} "):
                found[name] = float(line.split()[-1])
    return found


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]], args: argparse.Namespace) -> dict:
    """One streamed turn: its answer, time to first token and total time (seconds), and prompt tokens."""
    extra = {"ignore_eos": True, **({"method": args.method} if args.method else {}), **args.extra_body}
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - start
                pieces.append(choice.delta.content)
    total = time.perf_counter() - start
    return {
        "answer": "".join(pieces),
        "ttft": first if first is not None else total,
        "seconds": total,
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server's address, e.g. http://127.0.0.1:8000 (without /v1)")
    parser.add_argument("--model", help="model id (default: the first /v1/models lists)")
    parser.add_argument("--method", help="viasd method to ask for (default: the server's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation (>= 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write one JSON line per turn here")
    parser.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help='more request fields, a JSON object (llama-server without its cache: {"cache_prompt": false})',
    )
    args = parser.parse_args()
    if args.turns < 2 or args.conversations < 1 or args.max_tokens < 1:
        raise SystemExit("--turns must be >= 2, --conversations and --max-tokens >= 1")
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0)
    model = args.model or client.models.list().data[0].id
    before = prefix_cache_counters(args.url, args.api_key)
    records = []
    for number, users in enumerate(conversations(args.conversations, args.turns)):
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(users, start=1):
            messages.append({"role": "user", "content": text})
            result = ask(client, model, messages, args)
            messages.append({"role": "assistant", "content": result.pop("answer")})
            records.append({"conversation": number, "turn": turn, **result})
    after = prefix_cache_counters(args.url, args.api_key)
    if args.out:
        args.out.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    by_turn: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_turn[record["turn"]].append(record)
    print("turn  requests  prompt tokens (median)  TTFT median ms  TTFT mean ms")
    for turn, rows in sorted(by_turn.items()):
        tokens = [row["prompt_tokens"] for row in rows if row["prompt_tokens"] is not None]
        ttfts = [row["ttft"] * 1000 for row in rows]
        median_tokens = statistics.median(tokens) if tokens else float("nan")
        print(
            f"{turn:>4}  {len(rows):>8}  {median_tokens:>22.0f}  "
            f"{statistics.median(ttfts):>14.1f}  {statistics.fmean(ttfts):>12.1f}"
        )
    later = [row["ttft"] * 1000 for row in records if row["turn"] >= 2]
    print(f"turns 2-{args.turns}: TTFT median {statistics.median(later):.1f} ms over {len(later)} requests")
    if after:
        moved = {name: after[name] - before.get(name, 0.0) for name in COUNTERS if name != "bytes"}
        print(
            "prefix cache: "
            + ", ".join(f"{name.removesuffix('_total')} +{value:.0f}" for name, value in moved.items())
            + f", {after.get('bytes', 0) / 2**20:.1f} MiB held"
        )
    else:
        print("prefix cache: the server exports no viasd_prefix_cache_* metrics (off, or not viasd)")


if __name__ == "__main__":
    main()
