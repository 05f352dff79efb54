"""Benchmark maths: quality metrics on strings, speedup statistics and per-method summaries (pure functions).

Conventions (docs/design.md, "Measuring"): speedup is measured per prompt (a method's tokens/s over plain
decoding's tokens/s on the same prompt) and summarised by the geometric mean, so one slow prompt does
not dominate; throughput figures are totals (all tokens over all seconds), as Spec-Bench reports them.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from viasd.decode.stats import GenerationStats, SourceStats, TierStats

ALL = "all"  # the category name of the overall summary
SOURCE_COUNTS = ("rounds", "drafted", "evaluated", "accepted")  # what is counted per draft source

# category -> quality metric. Categories not listed get no task metric, only agreement with plain decoding.
QUALITY_METRICS: dict[str, str] = {
    "translation": "bleu",
    "summarization": "rougeL",
    "math_reasoning": "math_accuracy",
    "rag": "reference_match",
    "qa": "reference_match",
    "humaneval": "pass@1",
}

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# ------------------------------------------------------------------------------------ quality metrics


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu defaults, 0..100) of hypotheses against one reference each."""
    import sacrebleu

    if not hypotheses:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def sentence_bleu(hypothesis: str, reference: str) -> float:
    """Sentence BLEU (sacrebleu, 0..100)."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(hypothesis, [reference]).score)


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F1 (rouge-score, with stemming), 0..100."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return 100.0 * float(scorer.score(reference, hypothesis)["rougeL"].fmeasure)


def _number_value(text: str) -> float | None:
    text = text.replace(",", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den) if float(den) != 0 else None
        return float(text)
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The last number in a text (thousands separators and simple fractions understood), or None."""
    for match in reversed(_NUMBER.findall(text)):
        value = _number_value(match)
        if value is not None:
            return value
    return None


def reference_number(reference: str) -> float | None:
    """The answer of a math reference: the number after GSM8K's '####' marker, else its last number."""
    _, marker, answer = reference.rpartition("####")
    return final_number(answer if marker else reference)


def math_correct(output: str, reference: str) -> bool | None:
    """Whether the output's final number equals the reference answer (None: the reference has no number)."""
    want = reference_number(reference)
    if want is None:
        return None
    got = final_number(output)
    return got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def reference_match(output: str, answers: Any) -> bool | None:
    """Whether any accepted answer occurs in the output after normalisation (None: no usable answer)."""
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, (list, tuple)):
        return None
    candidates = [normalize_answer(str(a).rstrip(" *")) for a in answers]
    candidates = [c for c in candidates if c]
    if not candidates:
        return None
    haystack = f" {normalize_answer(output)} "
    return any(f" {c} " in haystack for c in candidates)


def text_score(metric: str, text: str, reference: Any) -> float | None:
    """One turn's score for a text metric (0..100, or 0/1 for accuracies); None when it does not apply."""
    if reference is None or (isinstance(reference, str) and not reference.strip()):
        return None
    if metric == "bleu" and isinstance(reference, str):
        return sentence_bleu(text, reference)
    if metric == "rougeL" and isinstance(reference, str):
        return rouge_l(text, reference)
    if metric == "math_accuracy" and isinstance(reference, str):
        ok = math_correct(text, reference)
        return None if ok is None else float(ok)
    if metric == "reference_match":
        ok = reference_match(text, reference)
        return None if ok is None else float(ok)
    return None


# ------------------------------------------------------------------------------------------- speedups


def geometric_mean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values (None when there are none)."""
    logs = [math.log(v) for v in values if v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def geometric_std(values: Iterable[float]) -> float | None:
    """Geometric standard deviation (a factor >= 1) of positive values."""
    logs = [math.log(v) for v in values if v > 0]
    if not logs:
        return None
    mean = sum(logs) / len(logs)
    return math.exp(math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs)))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ------------------------------------------------------------------------------------ stats of a task


def combine_stats(parts: Sequence[GenerationStats], method: str | None = None) -> GenerationStats:
    """One GenerationStats summing several generations (the turns of a conversation)."""
    total = GenerationStats(method=method or (parts[0].method if parts else ""))
    for part in parts:
        for f in fields(GenerationStats):
            value = getattr(part, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(total, f.name, getattr(total, f.name) + value)
        for table, counters, kind in ((part.tiers, total.tier, TierStats), (part.sources, total.source, SourceStats)):
            for name, counts in table.items():
                into = counters(name)
                for f in fields(kind):
                    setattr(into, f.name, getattr(into, f.name) + getattr(counts, f.name))
        for name, count in part.routes.items():
            total.routes[name] = total.routes.get(name, 0) + count
        total.finish_reason = part.finish_reason
    return total


def tier_counts(stats: Mapping[str, Any]) -> dict[str, int]:
    """Draft tokens decided per tier; methods without tiers had every evaluated token decided by the full target."""
    tiers = stats.get("tiers") or {}
    if tiers:
        return {name: int(t.get("decided", 0)) for name, t in tiers.items()}
    evaluated = int(stats.get("evaluated", 0))
    return {"full": evaluated} if evaluated else {}


def source_counts(stats: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Rounds, drafted, evaluated and accepted draft tokens per draft source, summed over generations."""
    out: dict[str, dict[str, int]] = {}
    for x in stats:
        for name, counts in (x.get("sources") or {}).items():
            into = out.setdefault(name, dict.fromkeys(SOURCE_COUNTS, 0))
            for key in SOURCE_COUNTS:
                into[key] += int(counts.get(key, 0))
    return out


# ---------------------------------------------------------------------------------------- summaries


@dataclass
class Summary:
    """What one method did over one category (or over everything: category "all")."""

    method: str
    category: str
    prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    speedup: float | None = None  # geometric mean over prompts of tokens/s relative to the baseline
    speedup_p10: float | None = None
    speedup_p90: float | None = None
    speedup_gstd: float | None = None
    # Before the first token (the prompt's read and the first round) and after it (decoding proper): None for rows
    # recorded before the split was.
    first_token_seconds: float | None = None  # mean per answer
    first_token_share: float | None = None  # of all seconds
    decode_tokens_per_second: float | None = None
    decode_speedup: float | None = None  # geometric mean over prompts, as speedup
    decode_speedup_p10: float | None = None
    decode_speedup_p90: float | None = None
    tokens_per_target_call: float | None = None
    target_calls_per_token: float = 0.0
    rejection_rate: float | None = None
    tier_fractions: dict[str, float] = field(default_factory=dict)
    unchecked_fraction: float = 0.0  # committed tokens the full target never verified
    peak_rss_bytes: int | None = None
    peak_cuda_bytes: int | None = None
    quality_metric: str | None = None
    quality: float | None = None
    quality_n: int = 0
    identical_to_baseline: float | None = None  # share of tasks whose output text equals the baseline's
    # Where the time goes: seconds per committed token spent drafting, in the slim verifier, in the full
    # target, and elsewhere (sampling, bookkeeping, cache edits).
    cost_per_token: dict[str, float] = field(default_factory=dict)
    drafted_per_token: float = 0.0  # draft tokens proposed per committed token
    unevaluated_drafts: float | None = None  # share of draft tokens cut by an earlier rejection before any check
    slim_calls_per_token: float = 0.0
    rounds_per_token: float = 0.0  # draft-and-verify rounds (plain decoding: one per token)
    drafter_calls_per_token: float = 0.0  # forward passes of the drafter model (prefill and catch-up included)
    # Per draft source (a drafter, or a part of the hybrid drafter): rounds, drafted, evaluated, accepted.
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    # Model passes by the route they took (passes/route.py), all sessions of every generation together.
    routes: dict[str, int] = field(default_factory=dict)


COST_PARTS = ("drafting", "slim verifier", "full target", "other")


def cost_split(stats: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Seconds per committed token by component (COST_PARTS), summed over generations."""
    tokens = sum(int(x["new_tokens"]) for x in stats)
    if not tokens:
        return {}
    parts = [sum(float(x.get(key, 0.0)) for x in stats) for key in ("draft_seconds", "slim_seconds", "verify_seconds")]
    total = sum(float(x["total_seconds"]) for x in stats)
    values = [*parts, max(0.0, total - sum(parts))]
    return {name: v / tokens for name, v in zip(COST_PARTS, values, strict=True)}


def row_output(row: Mapping[str, Any]) -> list[str]:
    """A row's output: the text of every turn.

    Texts, not token ids, are compared: methods that commit a block of tokens at once may keep a few
    tokens past a stop string, which the text (cut at the stop string) does not contain.
    """
    return [str(t.get("text", "")) for t in row.get("turns", [])]


def decode_rate(stats: Mapping[str, Any]) -> float | None:
    """Tokens/s after a task's first token (every turn's), or None: nothing after it, or a row recorded without it."""
    if "first_token_seconds" not in stats:
        return None
    tokens = int(stats["new_tokens"]) - int(stats.get("first_tokens", 0))
    seconds = float(stats["total_seconds"]) - float(stats["first_token_seconds"])
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def _overall_rate(stats: Mapping[str, Any]) -> float | None:
    return stats["tokens_per_second"]


def per_prompt_speedups(
    rows: Sequence[Mapping[str, Any]],
    baseline: str,
    rate: Callable[[Mapping[str, Any]], float | None] = _overall_rate,
) -> dict[tuple[str, str], float]:
    """(method, task key) -> the method's rate over the baseline's on the same task (tokens/s; or `decode_rate`)."""
    base = {r["key"]: rate(r["stats"]) for r in rows if r["method"] == baseline}
    out: dict[tuple[str, str], float] = {}
    for r in rows:
        b = base.get(r["key"])
        mine = rate(r["stats"])
        if b and b > 0 and mine and mine > 0:
            out[(r["method"], r["key"])] = mine / b
    return out


def _first_token_split(s: Summary, rows: Sequence[Mapping[str, Any]], decode: Mapping[tuple[str, str], float]) -> None:
    """Fill in s's split at the first token, from the rows that recorded it."""
    split = [r for r in rows if "first_token_seconds" in r["stats"]]
    if not split:
        return
    answers = sum(max(len(r.get("turns", [])), 1) for r in split)
    first = sum(float(r["stats"]["first_token_seconds"]) for r in split)
    total = sum(float(r["stats"]["total_seconds"]) for r in split)
    after = sum(int(r["stats"]["new_tokens"]) - int(r["stats"].get("first_tokens", 0)) for r in split)
    s.first_token_seconds = first / answers
    s.first_token_share = first / total if total > 0 else None
    s.decode_tokens_per_second = after / (total - first) if after > 0 and total > first else None
    ratios = [decode[(s.method, r["key"])] for r in split if (s.method, r["key"]) in decode]
    if ratios:
        s.decode_speedup = geometric_mean(ratios)
        s.decode_speedup_p10, s.decode_speedup_p90 = percentile(ratios, 10), percentile(ratios, 90)


def quality_value(metric: str, rows: Sequence[Mapping[str, Any]]) -> tuple[float | None, int]:
    """A category's quality: corpus BLEU for translation, else the mean of the per-turn scores."""
    if metric == "bleu":
        hyps, refs = [], []
        for r in rows:
            for turn, ref in zip(r.get("turns", []), r.get("references", []), strict=False):
                if isinstance(ref, str) and ref.strip():
                    hyps.append(turn.get("text", ""))
                    refs.append(ref)
        return (bleu(hyps, refs) if hyps else None), len(hyps)
    scores = [s for r in rows for s in (r.get("quality") or {}).get("scores", []) if s is not None]
    return (sum(scores) / len(scores) if scores else None), len(scores)


def summarize_group(
    method: str,
    category: str,
    rows: Sequence[Mapping[str, Any]],
    speedups: Mapping[tuple[str, str], float],
    baseline_outputs: Mapping[str, list[str]],
    decode_speedups: Mapping[tuple[str, str], float] | None = None,
) -> Summary:
    """Summary of one method's rows in one category (decode_speedups: per_prompt_speedups of `decode_rate`)."""
    s = Summary(method=method, category=category, prompts=len(rows))
    stats = [r["stats"] for r in rows]
    s.new_tokens = sum(int(x["new_tokens"]) for x in stats)
    s.seconds = sum(float(x["total_seconds"]) for x in stats)
    s.tokens_per_second = s.new_tokens / s.seconds if s.seconds > 0 else 0.0
    ratios = [speedups[(method, r["key"])] for r in rows if (method, r["key"]) in speedups]
    if ratios:
        s.speedup = geometric_mean(ratios)
        s.speedup_p10, s.speedup_p90 = percentile(ratios, 10), percentile(ratios, 90)
        s.speedup_gstd = geometric_std(ratios)
    _first_token_split(s, rows, decode_speedups or {})
    calls = sum(int(x["target_calls"]) for x in stats)
    s.tokens_per_target_call = s.new_tokens / calls if calls else None
    s.target_calls_per_token = calls / s.new_tokens if s.new_tokens else 0.0
    evaluated = sum(int(x.get("evaluated", 0)) for x in stats)
    accepted = sum(int(x.get("accepted", 0)) for x in stats)
    s.rejection_rate = (evaluated - accepted) / evaluated if evaluated else None
    decided: dict[str, int] = {}
    for x in stats:
        for name, n in tier_counts(x).items():
            decided[name] = decided.get(name, 0) + n
    total_decided = sum(decided.values())
    s.tier_fractions = {k: v / total_decided for k, v in decided.items()} if total_decided else {}
    s.cost_per_token = cost_split(stats)
    drafted = sum(int(x.get("drafted", 0)) for x in stats)
    s.drafted_per_token = drafted / s.new_tokens if s.new_tokens else 0.0
    s.unevaluated_drafts = (drafted - evaluated) / drafted if drafted else None
    slim_calls = sum(int(x.get("slim_calls", 0)) for x in stats)
    s.slim_calls_per_token = slim_calls / s.new_tokens if s.new_tokens else 0.0
    s.rounds_per_token = sum(int(x.get("rounds", 0)) for x in stats) / s.new_tokens if s.new_tokens else 0.0
    drafter_calls = sum(int(x.get("drafter_calls", 0)) for x in stats)
    s.drafter_calls_per_token = drafter_calls / s.new_tokens if s.new_tokens else 0.0
    s.sources = source_counts(stats)
    for x in stats:  # rows recorded before routes were counted have none
        for name, count in (x.get("routes") or {}).items():
            s.routes[name] = s.routes.get(name, 0) + int(count)
    unchecked = sum(int(x.get("unchecked_tokens", 0)) for x in stats)
    s.unchecked_fraction = unchecked / s.new_tokens if s.new_tokens else 0.0
    rss = [int(r["peak_rss_bytes"]) for r in rows if r.get("peak_rss_bytes")]
    cuda = [int(r["peak_cuda_bytes"]) for r in rows if r.get("peak_cuda_bytes")]
    s.peak_rss_bytes = max(rss) if rss else None
    s.peak_cuda_bytes = max(cuda) if cuda else None
    metrics = {(r.get("quality") or {}).get("metric") for r in rows} - {None}
    if len(metrics) == 1:
        s.quality_metric = metrics.pop()
        s.quality, s.quality_n = quality_value(s.quality_metric, rows)
    compared = [r for r in rows if r["key"] in baseline_outputs]
    if compared:
        same = sum(row_output(r) == baseline_outputs[r["key"]] for r in compared)
        s.identical_to_baseline = same / len(compared)
    return s


def summarize(rows: Sequence[Mapping[str, Any]], baseline: str = "plain") -> list[Summary]:
    """Per method (in order of first appearance): one Summary over all categories, then one per category.

    Rows with an error are left out. Speedups and agreement need the baseline method among the rows.
    """
    good = [r for r in rows if not r.get("error")]
    speedups = per_prompt_speedups(good, baseline)
    decode = per_prompt_speedups(good, baseline, decode_rate)
    baseline_outputs = {r["key"]: row_output(r) for r in good if r["method"] == baseline}
    methods = list(dict.fromkeys(r["method"] for r in good))
    categories = list(dict.fromkeys(r["category"] for r in good))
    out: list[Summary] = []
    for method in methods:
        mine = [r for r in good if r["method"] == method]
        out.append(summarize_group(method, ALL, mine, speedups, baseline_outputs, decode))
        for category in categories:
            group = [r for r in mine if r["category"] == category]
            if group:
                out.append(summarize_group(method, category, group, speedups, baseline_outputs, decode))
    return out
