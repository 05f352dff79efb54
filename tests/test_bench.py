"""The benchmark: task loading and selection, quality metrics, the HumanEval sandbox, the interleaved
runner with resume, and the report files. Tiny random models only."""

import json
import math
import os
import re
import tempfile
import time

import pytest
import torch
from typer.testing import CliRunner

from tiny import tiny_model, tiny_tokenizer
from viasd.bench import metrics
from viasd.bench.report import comparison, environment, markdown, warmup_line, write_report
from viasd.bench.runner import ResultsFile, RunSettings, pending_pairs, rotation, run_benchmark, run_task
from viasd.bench.sandbox import check_humaneval, run_program
from viasd.bench.tasks import (
    Task,
    build_tasks,
    load_humaneval,
    load_specbench,
    parse_specbench,
    select,
    spread,
)
from viasd.decode.base import Decoder, GenerationConfig
from viasd.decode.hf_assisted import HFAssistedDecoder
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.stats import GenerationStats, TierStats
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import ViasdError

# ------------------------------------------------------------------------------------------- tasks


def test_shipped_questions_load():
    tasks = load_specbench()
    assert len(tasks) == 240
    counts = {c: sum(t.category == c for t in tasks) for c in metrics.QUALITY_METRICS}
    assert counts["translation"] == counts["rag"] == 40
    writing = [t for t in tasks if t.category == "writing"]
    assert len(writing) == 5 and all(len(t.turns) == 2 for t in writing)
    translation = next(t for t in tasks if t.category == "translation")
    assert isinstance(translation.reference(0), str) and translation.reference(1) is None


def test_selection_spreads_and_interleaves_categories():
    tasks = load_specbench()
    chosen = select(tasks, ["translation", "writing"], 2)
    assert [t.category for t in chosen] == ["translation", "writing", "translation", "writing"]
    translations = [t for t in tasks if t.category == "translation"]
    assert [chosen[0], chosen[2]] == [translations[0], translations[20]]
    assert select(tasks, ["translation", "writing"], 2) == chosen  # deterministic
    assert len(select(tasks, ["writing"], 50)) == 5  # more than there are: all of them
    assert spread(list(range(10)), 3) == [0, 3, 6] and spread([1, 2], None) == [1, 2] and spread([1], 0) == []
    with pytest.raises(ViasdError, match="unknown category nope"):
        select(tasks, ["nope"], 1)


def test_a_category_can_have_its_own_count():
    tasks = load_specbench()
    chosen = select(tasks, ["translation:3", "writing:1", "qa"], 2)
    assert [t.category for t in chosen] == ["translation", "writing", "qa", "translation", "qa", "translation"]
    assert [t.category for t in build_tasks(categories=["qa:2", "rag"], count=0)] == ["qa", "qa"]
    for bad in ("qa:x", "qa:-1"):
        with pytest.raises(ViasdError, match="category count"):
            select(tasks, [bad], 1)


def test_bad_question_files_are_refused(tmp_path):
    with pytest.raises(ViasdError, match="line 2: missing field"):
        parse_specbench(['{"question_id": 1, "category": "a", "turns": ["x"]}', '{"question_id": 2}'])
    with pytest.raises(ViasdError, match="not JSON"):
        parse_specbench(["{oops"])
    with pytest.raises(ViasdError, match="duplicate"):
        parse_specbench(['{"question_id": 1, "category": "a", "turns": ["x"]}'] * 2)
    with pytest.raises(ViasdError, match="cannot read"):
        load_specbench(tmp_path / "missing.jsonl")


def test_humaneval_tasks():
    problems = load_humaneval()
    assert len(problems) == 164
    first = problems[0]
    assert first.category == "humaneval" and first.prefix.startswith("```python\n")
    assert first.extra["entry_point"] in first.extra["prompt"] and "\n```" in first.stop
    tasks = build_tasks(categories=["qa"], count=4, humaneval=2)
    sources = [t.source[0] for t in tasks]  # s(pecbench) or h(umaneval), spread over the run
    assert sources == ["s", "h", "s", "s", "h", "s"]
    with pytest.raises(ViasdError, match="no tasks"):
        build_tasks(count=0, humaneval=0)


# ----------------------------------------------------------------------------------------- metrics


def test_text_metrics():
    sentence = "The cat sat on the mat near the door ."
    assert metrics.bleu([sentence], [sentence]) == pytest.approx(100.0)
    assert metrics.sentence_bleu(sentence, sentence) == pytest.approx(100.0)
    assert metrics.bleu(["completely different words here"], [sentence]) < 10
    assert metrics.rouge_l(sentence, sentence) == pytest.approx(100.0)
    assert metrics.rouge_l("alpha beta", "gamma delta") == 0.0
    # LCS "the cat the mat" (4 of 6 and 4 of 6 tokens) -> F1 = 2/3
    assert metrics.rouge_l("the cat ate the mat now", "the cat sat on the mat") == pytest.approx(200 / 3, abs=0.01)


def test_math_and_reference_matching():
    assert metrics.final_number("So she practised 3 + 2 = 5 hours.") == 5
    assert metrics.final_number("It costs $1,234.50 in total") == 1234.5
    assert metrics.final_number("The probability is 35/36.") == pytest.approx(35 / 36)
    assert metrics.final_number("-7 degrees") == -7 and metrics.final_number("no digits") is None
    assert metrics.reference_number("1+2 = <<1+2=3>>3 hours\n#### 5") == 5
    assert metrics.math_correct("The answer is 5.", "blah 3\n#### 5") is True
    assert metrics.math_correct("The answer is 6.", "#### 5") is False
    assert metrics.math_correct("whatever", "no number") is None
    assert metrics.reference_match("It was sung by George Harrison in 1987.", ["James Ray", "George Harrison"])
    assert not metrics.reference_match("Nobody knows.", ["James Ray", "George Harrison"])
    assert metrics.reference_match("The answer: Russia.", ["Russia *"])
    assert metrics.text_score("reference_match", "x", None) is None
    assert metrics.text_score("math_accuracy", "so 12000", "12000") == 1.0


def test_speedup_statistics():
    assert metrics.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert metrics.geometric_mean([]) is None
    assert metrics.geometric_std([3.0, 3.0]) == pytest.approx(1.0)
    assert metrics.geometric_std([1.0, 4.0]) == pytest.approx(2.0)  # logs 0 and ln 4: std ln 2
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10) == pytest.approx(1.4)
    assert metrics.percentile([7.0], 90) == 7.0


def _row(key, method, tps, tokens=(1, 2), category="qa", **stats):
    seconds = len(tokens) / tps
    base = {
        "new_tokens": len(tokens),
        "total_seconds": seconds,
        "tokens_per_second": tps,
        "target_calls": 1,
        "evaluated": 0,
        "accepted": 0,
        "tiers": {},
        "unchecked_tokens": 0,
    }
    base.update(stats)
    return {
        "key": key,
        "method": method,
        "category": category,
        "stats": base,
        "turns": [{"text": " ".join(map(str, tokens)), "tokens": list(tokens)}],
        "peak_rss_bytes": 100,
    }


def test_summary_speedup_is_geometric_mean_of_per_prompt_ratios():
    rows = [
        _row("a", "plain", 10.0, target_calls=2),
        _row("b", "plain", 20.0, target_calls=2),
        _row("a", "sd", 20.0, evaluated=4, accepted=3, routes={"model": 2, "loop": 5}),
        _row("b", "sd", 80.0, tokens=(9, 9), evaluated=4, accepted=1, routes={"model": 2, "fused": 3}),
        _row(
            "a",
            "via",
            30.0,
            category="qa",
            evaluated=10,
            accepted=8,
            tiers={"accept": {"decided": 5}, "slim": {"decided": 3}, "full": {"decided": 2}},
        ),
        {"key": "b", "method": "via", "category": "qa", "error": "boom", "stats": {}},
    ]
    by = {(s.method, s.category): s for s in metrics.summarize(rows)}
    sd = by[("sd", metrics.ALL)]
    assert sd.speedup == pytest.approx(math.sqrt(2 * 4))
    assert sd.speedup_p10 == pytest.approx(2.2) and sd.speedup_p90 == pytest.approx(3.8)
    assert sd.rejection_rate == pytest.approx(4 / 8)
    assert sd.tier_fractions == {"full": 1.0}
    assert sd.identical_to_baseline == 0.5 and sd.tokens_per_target_call == 2.0
    assert sd.routes == {"model": 4, "loop": 5, "fused": 3}  # passes by route, all rows together
    assert by[("plain", metrics.ALL)].routes == {}  # rows recorded without routes count none
    assert by[("plain", metrics.ALL)].speedup == pytest.approx(1.0)
    via = by[("via", "qa")]
    assert via.prompts == 1 and via.speedup == pytest.approx(3.0)
    assert via.tier_fractions == pytest.approx({"accept": 0.5, "slim": 0.3, "full": 0.2})
    assert by[("plain", "qa")].peak_rss_bytes == 100


def test_summary_splits_time_at_the_first_token():
    """Decoding speedups are per task, like speedups; rows recorded before the split (no first_token_seconds) give
    none, and the summary's section is left out rather than filled with zeros."""
    rows = [  # _row's seconds: 2 tokens / tps; first tokens after half of them
        _row("a", "plain", 10.0, first_token_seconds=0.1, first_tokens=1),
        _row("b", "plain", 2.0, first_token_seconds=0.5, first_tokens=1),
        _row("a", "sd", 10.0, tokens=(1, 2, 3, 4, 5), first_token_seconds=0.3, first_tokens=1),  # 4 in 0.2 s
        _row("b", "sd", 4.0, tokens=(1, 2, 3, 4), first_token_seconds=0.5, first_tokens=2),  # 2 in 0.5 s
    ]
    by = {(s.method, s.category): s for s in metrics.summarize(rows)}
    sd, plain = by[("sd", metrics.ALL)], by[("plain", metrics.ALL)]
    assert plain.decode_tokens_per_second == pytest.approx(2 / (0.1 + 0.5))
    assert sd.decode_tokens_per_second == pytest.approx(6 / 0.7)
    assert sd.decode_speedup == pytest.approx(math.sqrt((4 / 0.2) / 10 * (2 / 0.5) / 2))
    assert sd.first_token_seconds == pytest.approx(0.4) and sd.first_token_share == pytest.approx(0.8 / 1.5)
    section = "## First token and decoding"
    assert section in markdown(metrics.summarize(rows), {"settings": {}, "models": {}}, rows)
    assert "\ndecoding after the first token: 2.000x" in comparison(rows, "sd", "plain")  # --compare sd,plain
    old = [_row("a", "plain", 10.0), _row("a", "sd", 20.0)]
    assert metrics.summarize(old)[0].decode_speedup is None
    assert section not in markdown(metrics.summarize(old), {"settings": {}, "models": {}}, old)
    assert "decoding" not in comparison(old, "sd", "plain")


def test_cost_split_per_token():
    rows = [
        _row(
            "a",
            "via",
            4.0,
            tokens=(1, 2, 3, 4),
            drafted=12,
            evaluated=6,
            slim_calls=2,
            rounds=3,
            draft_seconds=0.5,
            slim_seconds=0.2,
            verify_seconds=0.2,
        ),
        _row(
            "b",
            "via",
            4.0,
            tokens=(5, 6, 7, 8),
            drafted=4,
            evaluated=4,
            slim_calls=0,
            rounds=1,
            draft_seconds=0.3,
            slim_seconds=0.0,
            verify_seconds=0.6,
        ),
    ]
    via = metrics.summarize(rows, baseline="plain")[0]
    assert via.cost_per_token == pytest.approx(
        {"drafting": 0.1, "slim verifier": 0.025, "full target": 0.1, "other": 0.025}
    )
    assert sum(via.cost_per_token.values()) == pytest.approx(via.seconds / via.new_tokens)
    assert via.drafted_per_token == 2.0 and via.unevaluated_drafts == pytest.approx(6 / 16)
    assert via.slim_calls_per_token == 0.25 and via.rounds_per_token == 0.5
    text = markdown(metrics.summarize(rows, baseline="plain"), {"settings": {}, "models": {}}, rows)
    assert "## Where the time goes" in text
    assert "| via | 0.100 | 0.025 | 0.100 | 0.025 | 0.250 | 2.00 | 37.5% | 0.500 |" in text


def test_combine_stats_sums_turns():
    a = GenerationStats(method="via", new_tokens=3, target_calls=1, total_seconds=1.0, finish_reason="eos")
    a.tiers["slim"] = TierStats(decided=2, accepted=1, rejected=1, calls=1)
    b = GenerationStats(method="via", new_tokens=5, target_calls=2, total_seconds=1.0, finish_reason="length")
    b.tiers["slim"] = TierStats(decided=1, calls=1)
    total = metrics.combine_stats([a, b])
    assert total.new_tokens == 8 and total.target_calls == 3 and total.tokens_per_second == 4.0
    assert total.tiers["slim"] == TierStats(decided=3, accepted=1, rejected=1, calls=2)


# ----------------------------------------------------------------------------------------- sandbox


# These tests are about the harness and the guard: bubblewrap where it works, else the guard alone (with a warning).
SANDBOX = None

HE_PROBLEM = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def test_sandbox_passes_fails_and_times_out():
    assert check_humaneval(HE_PROBLEM, "    return a + b\n", isolate=SANDBOX).passed
    wrong = check_humaneval(HE_PROBLEM, "    return a - b\n", isolate=SANDBOX)
    assert not wrong.passed and wrong.status == "failed" and "AssertionError" in wrong.detail
    looping = check_humaneval(HE_PROBLEM, "    while True:\n        pass\n", timeout=1.0, isolate=SANDBOX)
    assert not looping.passed and looping.status == "timed out"
    skipping = check_humaneval(HE_PROBLEM, "    import sys\n    sys.exit(0)\n", isolate=SANDBOX)  # skips the tests
    assert not skipping.passed


def test_sandbox_contains_side_effects(tmp_path):
    outside = tmp_path / "written-by-solution"
    marker = tmp_path / "made-by-os-system"
    attempts = [
        f"    open({str(outside)!r}, 'w').write('x')\n    return a + b\n",
        f"    import os\n    os.system('touch {marker}')\n    return a + b\n",
        "    import subprocess\n    subprocess.run(['true'])\n    return a + b\n",
        f"    import os\n    os.remove({str(tmp_path)!r})\n    return a + b\n",
    ]
    for completion in attempts:
        result = check_humaneval(HE_PROBLEM, completion, isolate=SANDBOX)
        assert not result.passed and "sandbox" in result.detail
    assert not outside.exists() and not marker.exists() and tmp_path.exists()
    # Files inside its own directory are fine.
    program = "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\n"
    assert run_program(program, isolate=SANDBOX).passed


# ------------------------------------------------------------------------------------------ runner


class EchoDecoder(Decoder):
    """Answers with fixed tokens and records every prompt it was given."""

    def __init__(self, tokenizer, answer, method):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset()
        self.context_limit = None
        self.answer = answer
        self.method = method
        self.prompts = []

    def _decode(self, prompt, sink, params, stats):
        self.prompts.append(prompt)
        sink.push(self.answer)
        stats.target_calls = 1


def test_multi_turn_answers_are_carried_over_per_method():
    tok = tiny_tokenizer(64)
    task = Task("t/1", "specbench", "writing", ("t3 t4", "t5 t6"))
    settings = RunSettings(methods=["a", "b"], max_new_tokens=8, chat=False)
    for answer in ([7, 8], [9]):
        decoder = EchoDecoder(tok, answer, "a")
        row = run_task(decoder, tok, task, "a", settings)
        assert decoder.prompts[0] == [3, 4]
        assert decoder.prompts[1] == [3, 4, *answer, 5, 6]  # the method's own first answer is in the context
        assert [t["tokens"] for t in row["turns"]] == [answer, answer]
        assert row["stats"]["new_tokens"] == 2 * len(answer) and row["stats"]["target_calls"] == 2


def test_categories_can_get_their_own_budget():
    from viasd.bench.command import parse_category_budgets

    prose = Task("t/1", "specbench", "writing", ("t3",))
    maths = Task("t/2", "specbench", "math_reasoning", ("t3",))
    code = Task("h/1", "humaneval", "humaneval", ("t3",))
    present = ["writing", "math_reasoning", "humaneval"]
    budgets = parse_category_budgets("math_reasoning=256", 20, present)
    assert budgets == {"math_reasoning": 256, "humaneval": 20}
    settings = RunSettings(methods=["a"], max_new_tokens=8, category_max_new_tokens=budgets)
    assert [settings.budget(t) for t in (prose, maths, code)] == [8, 256, 20]
    assert RunSettings(methods=["a"], max_new_tokens=8).budget(code) == 8
    assert parse_category_budgets(" humaneval=5 , writing=3", None, present) == {"humaneval": 5, "writing": 3}
    for text, code_budget, message in [
        ("math_reasoning", None, "takes CATEGORY=N"),
        ("math_reasoning=0", None, "takes CATEGORY=N"),
        ("math_reasoning=-3", None, "takes CATEGORY=N"),
        ("=4", None, "takes CATEGORY=N"),
        ("math_reasoning=2,math_reasoning=3", None, "names math_reasoning twice"),
        ("math=256", None, "names math, which no task of this run has (it has: humaneval, math_reasoning, writing)"),
        ("humaneval=30", 20, "HumanEval's budget is given twice"),
        (None, 0, "--code-max-new-tokens must be >= 1"),
    ]:
        with pytest.raises(ViasdError, match=re.escape(message)):
            parse_category_budgets(text, code_budget, present)


def test_rotation_and_pending_order():
    assert rotation(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotation(["a", "b", "c"], 4) == ["b", "c", "a"]
    tasks = [Task(f"k{i}", "s", "qa", ("t3",)) for i in range(2)]
    order = [(t.key, m) for _, t, m in pending_pairs(tasks, ["a", "b"], [("k0", "a")])]
    assert order == [("k0", "b"), ("k1", "b"), ("k1", "a")]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and much faster than on two when the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_model("qwen2", layers=4, seed=0)
    drafter = tiny_model("qwen2", layers=2, seed=1)
    return target, drafter, tiny_tokenizer(64)


def _decoders(target, drafter, tok):
    return {
        "plain": PlainDecoder(target, tok),
        "sd": SpeculativeDecoder(target, tok, ModelDrafter(drafter, name="small"), 3),
        "lookup": SpeculativeDecoder(target, tok, PromptLookupDrafter(), 3, method="lookup"),
        "hf-assisted": HFAssistedDecoder(target, tok, drafter, gamma=3),
    }


TINY_TASKS = [
    Task("q/1", "specbench", "qa", ("t3 t4 t5 t3 t4",)),
    Task("q/2", "specbench", "writing", ("t6 t7", "t8 t9")),
    Task("q/3", "specbench", "qa", ("t10 t11 t12",)),
]


def test_runner_interleaves_resumes_and_reports(tiny_pair, tmp_path):
    target, drafter, tok = tiny_pair
    decoders = _decoders(target, drafter, tok)
    methods = ["plain", "sd", "lookup", "hf-assisted"]
    settings = RunSettings(methods=methods, max_new_tokens=6, chat=False)
    results = ResultsFile(tmp_path / "results.jsonl")
    seen = []

    def stop_after_five(row):
        seen.append(row)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(TINY_TASKS, decoders.__getitem__, tok, settings, results, on_row=stop_after_five)
    assert len(results.load()) == 5
    with results.path.open("a") as handle:  # a torn line, as if killed while writing
        handle.write('{"key": "q/2", "meth')
    rows = run_benchmark(TINY_TASKS, decoders.__getitem__, tok, settings, results)
    assert len(rows) == 12
    on_disk = results.load()
    # The torn line is kept as it was (reading never rewrites the file) and skipped; the next row has its own line.
    assert results.path.read_text().splitlines()[5] == '{"key": "q/2", "meth'
    assert [(d.line, d.reason) for d in results.damaged] == [(6, "not JSON")]
    assert [(r["key"], r["method"]) for r in on_disk] == [(r["key"], r["method"]) for r in rows]
    assert len({(r["key"], r["method"]) for r in on_disk}) == 12
    # Interleaved: each task's methods run in the rotated order.
    assert [r["method"] for r in on_disk[:4]] == methods
    assert [r["method"] for r in on_disk[4:8]] == rotation(methods, 1)
    assert all(r["position"] == rotation(methods, r["task_index"]).index(r["method"]) for r in on_disk)
    # Greedy exact methods reproduce plain decoding (float64 tiny models).
    plain = {r["key"]: r["turns"] for r in on_disk if r["method"] == "plain"}
    for r in on_disk:
        assert [t["tokens"] for t in r["turns"]] == [t["tokens"] for t in plain[r["key"]]], r["method"]
        assert [t["text"] for t in r["turns"]] == [t["text"] for t in plain[r["key"]]], r["method"]
    assert run_benchmark(TINY_TASKS, decoders.__getitem__, tok, settings, results) == on_disk  # nothing left

    env = environment({"methods": methods, "max_new_tokens": 6}, {"target": "tiny", "drafter": "tiny"}, ["viasd"])
    paths = write_report(tmp_path, on_disk, env)
    text = paths["markdown"].read_text()
    assert "## Overall" in text and "| hf-assisted |" in text and "Speedup by category" in text
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(paths["json"].read_text())
    assert {s["method"] for s in summary} == set(methods)
    assert all(s["identical_to_baseline"] == 1.0 for s in summary)
    assert env["machine"]["cpu_count"] == os.cpu_count() and env["versions"]["torch"]


class FirstLongPassStarts(PlainDecoder):
    """Plain decoding on a tiny model whose first pass over more than 8 tokens, in any method, costs 0.5 s once: the
    start-up a real target has there (a kernel's build and check, the first pass down a long prompt's route, shared
    by every method that runs the target)."""

    def __init__(self, target, tokenizer, started: list[bool]) -> None:
        super().__init__(target, tokenizer)
        self.started = started

    def _decode(self, prompt, sink, params, stats) -> None:
        if len(prompt) > 8 and not self.started:
            time.sleep(0.5)
            self.started.append(True)
        super()._decode(prompt, sink, params, stats)


def test_the_first_timed_generation_is_no_outlier(tiny_pair, tmp_path, monkeypatch):
    """The warm-up ran one short prompt per method: a 9-method run's first task took 12.9 s to its first token
    against 3-4 s everywhere else. Every kernel is built and checked, and every method warmed up on its longest and
    shortest prompts, before the first timed generation."""
    import viasd.kernels.state

    target, _, tok = tiny_pair
    started: list[bool] = []
    decoders = {m: FirstLongPassStarts(target, tok, started) for m in ("plain", "again")}
    checked = []
    monkeypatch.setattr(viasd.kernels.state, "kernel_states", lambda: checked.append(True) or {"w4a8": "compiled"})
    tasks = [Task(f"q/{i}", "specbench", "qa", (" ".join(f"t{3 + j}" for j in range(n)),)) for i, n in
             enumerate((12, 4, 10, 14, 6, 11))]  # fmt: skip
    settings = RunSettings(methods=list(decoders), max_new_tokens=4, chat=False)
    told = []
    rows = run_benchmark(tasks, decoders.__getitem__, tok, settings, ResultsFile(tmp_path / "r.jsonl"),
                         on_warmup=told.append)  # fmt: skip
    ordered = sorted(rows, key=lambda r: (r["task_index"], r["position"]))
    first, *others = [r["turns"][0]["stats"]["first_token_seconds"] for r in ordered]
    assert first <= max(others) + 0.1, (first, others)  # within the spread of the others
    (warmup,) = told
    assert checked and warmup.kernels == {"w4a8": "compiled"}
    assert warmup.prompts == {"plain": [14, 4], "again": [14, 4]} and warmup.seconds >= 0.5
    said = warmup_line(warmup.to_dict())  # on stderr, and in the summary
    assert said.startswith("warmed up before timing anything") and "(1 of 1 compiled here)" in said
    assert said.endswith("on its longest and shortest prompts (14 and 4 tokens)"), said


def test_hf_assisted_matches_plain_and_counts_calls(tiny_pair):
    target, drafter, tok = tiny_pair
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompt = [3, 4, 5, 6, 3, 4]
    want = PlainDecoder(target, tok).generate(prompt, config)
    got = HFAssistedDecoder(target, tok, drafter, gamma=2).generate(prompt, config)
    assert got.stats.new_tokens == 12 and got.stats.target_calls >= 1
    perfect = HFAssistedDecoder(target, tok, _copy(target), gamma=3).generate(prompt, config)
    assert perfect.tokens == want.tokens
    assert perfect.stats.target_calls == 3 and perfect.stats.rejection_rate == 0.0  # 4 tokens per call
    assert got.stats.drafted == got.stats.drafter_calls and got.stats.total_seconds > 0


def test_hf_assisted_counts_drafts_round_by_round_like_sd(tiny_pair):
    """transformers' rounds, read from hooks, give the same draft counts as our SD with the same drafter."""
    target, _, tok = tiny_pair
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    prompt = [3, 4, 5, 6, 3, 4]
    for scale in (0.01, 0.02):  # a drafter close to the target: some drafts accepted, some rejected
        drafter = _copy(target)
        noise = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(scale * torch.randn(p.shape, generator=noise, dtype=p.dtype))
        hf = HFAssistedDecoder(target, tok, drafter, gamma=3).generate(prompt, config)
        sd = SpeculativeDecoder(target, tok, ModelDrafter(drafter), 3).generate(prompt, config)
        assert hf.tokens == sd.tokens
        counts = [(s.rounds, s.drafted, s.evaluated, s.accepted) for s in (hf.stats, sd.stats)]
        assert counts[0] == counts[1], counts
        assert 0 < hf.stats.accepted < hf.stats.evaluated < hf.stats.drafted


def test_hf_assisted_stops_at_stop_strings(tiny_pair):
    target, drafter, tok = tiny_pair
    prompt = [3, 4, 5, 6, 3, 4]
    long = PlainDecoder(target, tok).generate(prompt, GenerationConfig(max_new_tokens=20, ignore_eos=True))
    stop = f" t{long.tokens[4]} "
    config = GenerationConfig(max_new_tokens=20, stop_strings=(stop,), ignore_eos=True)
    want = PlainDecoder(target, tok).generate(prompt, config)
    got = HFAssistedDecoder(target, tok, drafter).generate(prompt, config)
    assert got.finish_reason == want.finish_reason == "stop" and got.text == want.text
    assert got.stats.new_tokens < 20


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_markdown_lists_quality_and_errors():
    sentence = "the cat sat on the mat"
    rows = [
        {
            **_row("a", "plain", 10.0, category="translation"),
            "quality": {"metric": "bleu", "scores": [100.0]},
            "references": [sentence],
            "turns": [{"text": sentence, "tokens": [1]}],
        },
        {"key": "b", "method": "plain", "category": "qa", "error": "too long", "stats": {}},
    ]
    text = markdown(metrics.summarize(rows), {"settings": {}, "models": {}}, rows)
    assert "## Quality" in text and "translation (BLEU)" in text and "100.0 (n=1)" in text
    assert "b (plain): too long" in text


def test_report_with_only_errors(tmp_path):
    rows = [{"key": "b", "method": "plain", "category": "qa", "error": "too long", "stats": {}}]
    paths = write_report(tmp_path, rows, {"settings": {}, "models": {}})
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG" and "too long" in paths["markdown"].read_text()


# ---------------------------------------------------------------------------------------- command


def test_the_quality_panel_draws_tasks_gained_up_and_lost_down():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from viasd.bench.paired import Paired
    from viasd.bench.report import _lost_and_gained

    quality = {
        "via": [Paired("humaneval", "pass@1", 124, 2, 1, -0.008, 1.0), Paired("rag", "match", 20, 0, 3, 0.15, 0.25)],
        "sd": [Paired("rag", "match", 20, 4, 0, -0.2, 0.125)],
    }
    fig, ax = plt.subplots()
    _lost_and_gained(ax, quality, "auto")
    heights = [round(bar.get_height()) for bar in ax.patches]
    plt.close(fig)
    # Per method: gained bars then lost bars, over the categories humaneval, rag (a category it lacks draws 0).
    assert heights == [1, 3, -2, 0, 0, 0, 0, -4]
    assert "against auto" in ax.get_title()


def test_the_decoding_panel_draws_each_method_whole_and_after_its_first_token():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from viasd.bench.report import _overall_and_decoding

    rows = [
        _row("a", "plain", 10.0, first_token_seconds=0.1, first_tokens=1),
        _row("a", "sd", 10.0, tokens=(1, 2, 3, 4, 5), first_token_seconds=0.3, first_tokens=1),
    ]
    overall = [s for s in metrics.summarize(rows) if s.category == metrics.ALL]
    fig, ax = plt.subplots()
    _overall_and_decoding(ax, overall, "plain")
    heights = [round(bar.get_height(), 6) for bar in ax.patches]
    plt.close(fig)
    assert heights == [1.0, 1.0, 1.0, 2.0]  # whole: plain, sd (both 10 tokens/s); decoding: 10 and 20 tokens/s


def test_resuming_compares_the_shipped_profile_by_place_and_content():
    from viasd.bench.command import check_resumable

    here = {"target": "t", "profile": "/home/a/viasd/src/viasd/profiles/p.json", "profile_sha256": "1"}
    check_resumable(here, {**here, "profile": "/venv/lib/site-packages/viasd/profiles/p.json"})
    check_resumable({k: v for k, v in here.items() if k != "profile_sha256"}, here)  # a run from before hashes
    with pytest.raises(ViasdError, match="profile_sha256"):
        check_resumable(here, {**here, "profile_sha256": "2"})
    with pytest.raises(ViasdError, match="profile"):
        check_resumable(here, {**here, "profile": "/home/a/my-profile.json"})


def test_resuming_reads_the_budgets_of_runs_that_recorded_humaneval_s_alone():
    from viasd.bench.command import check_resumable

    before = {"target": "t", "code_max_new_tokens": 192}  # the record of runs before per-category budgets
    check_resumable(before, {"target": "t", "category_max_new_tokens": {"humaneval": 192}})
    with pytest.raises(ViasdError, match=re.escape("{'humaneval': 192} -> {'humaneval': 192, 'math_reasoning': 256}")):
        check_resumable(before, {"target": "t", "category_max_new_tokens": {"humaneval": 192, "math_reasoning": 256}})


def test_bench_command_end_to_end(tmp_path, tiny_pair, monkeypatch):
    from viasd.cli import app
    from viasd.models.loading import LoadedModel

    target, drafter, tok = tiny_pair
    models = {"tiny-target": target, "tiny-drafter": drafter}
    monkeypatch.setattr("viasd.engine.load_model", lambda name, **_: LoadedModel(models[name], tok, name, name))
    questions = tmp_path / "q.jsonl"
    lines = [
        {"question_id": 1, "category": "translation", "turns": ["t3 t4 t5"], "reference": ["t3 t4"]},
        {"question_id": 2, "category": "writing", "turns": ["t6 t7", "t8"]},
    ]
    questions.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    args = [
        "bench",
        "--target",
        "tiny-target",
        "--drafter",
        "tiny-drafter",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--questions",
        str(questions),
        "--methods",
        "plain,sd,lookup,sd:gamma=2",
        "--count",
        "1",
        "-n",
        "5",
        "--category-max-new-tokens",
        "writing=3",
        "--out",
        str(out),
        "--no-warmup",
    ]
    runner = CliRunner()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    for name in ("results.jsonl", "summary.md", "summary.json", "plot.png", "environment.json"):
        assert (out / name).is_file(), name
    assert len((out / "results.jsonl").read_text().splitlines()) == 8
    env = json.loads((out / "environment.json").read_text())
    assert env["settings"]["max_new_tokens"] == 5 and env["models"]["dtype"] == "float64" and env["rows"] == 8
    # What each method ran as: its views, drafter and kernels, for whoever reads the run later.
    assert set(env["setup"]) == {"plain", "sd", "lookup", "sd:gamma=2"}
    assert env["setup"]["sd:gamma=2"]["gamma"] == 2 and env["setup"]["sd"]["drafter"].startswith("model (as loaded)")
    assert env["setup"]["lookup"]["drafter"].startswith("prompt lookup") and env["setup"]["plain"]["exact"]
    assert set(env["setup"]["plain"]["kernels"]) == {"w4a8", "w6a8", "w8a8", "bf16", "bf16native", "attention", "fused"}
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert not any(r.get("error") for r in rows)
    assert [len(r["turns"]) for r in rows if r["key"] == "specbench/2"] == [2, 2, 2, 2]
    turn_lengths = {r["category"]: {len(t["tokens"]) for t in r["turns"]} for r in rows}
    assert turn_lengths["writing"] == {3} and turn_lengths["translation"] == {5}  # the category's own budget
    texts = {(r["key"], r["method"]): [t["text"] for t in r["turns"]] for r in rows}
    for key in ("specbench/1", "specbench/2"):  # the variant of an exact method is labelled as written and exact
        assert texts[key, "sd:gamma=2"] == texts[key, "plain"]
    summary = (out / "summary.md").read_text()
    assert "| sd:gamma=2 |" in summary and "max new tokens: 5 (writing 3)," in summary
    assert env["warmup"] is None and "- no warm-up (--no-warmup): each method's first task carries" in summary
    # The shipped profile is named by its place in the package, not this checkout's absolute path.
    assert "routing profile: `viasd/profiles/" in summary and "(shipped with the package), sha256 " in summary
    assert all(r["quality"]["metric"] == "bleu" for r in rows if r["key"] == "specbench/1")
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "--resume" in again.output
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0 and "0 to run" in resumed.output
    resumed_env = json.loads((out / "environment.json").read_text())
    assert resumed_env["date"] == env["date"] and len(resumed_env["resumed"]) == 1  # the first start is kept
    changed = runner.invoke(app, [*args[:-1], "--resume", "-n", "6"])
    assert changed.exit_code == 2 and "max_new_tokens" in changed.output
    bad = runner.invoke(app, ["bench", "--methods", "plain,warp", "--out", str(tempfile.mkdtemp())])
    assert bad.exit_code == 2 and "unknown method" in bad.output
    (out / "summary.md").unlink()
    monkeypatch.setattr("viasd.engine.load_model", lambda *a, **k: pytest.fail("--report-only loads no model"))
    report = runner.invoke(app, ["bench", "--report-only", "--out", str(out)])
    assert report.exit_code == 0, report.output
    assert "## Where the time goes" in (out / "summary.md").read_text()
    missing = runner.invoke(app, ["bench", "--report-only", "--out", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "holds no benchmark run" in missing.output
    # The summary goes into a document between markers naming the run, replacing the block on a rerun.
    doc = tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\nWritten by hand.\n")
    for _ in range(2):
        into = runner.invoke(app, ["bench", "--report-only", "--out", str(out), "--into", str(doc)])
        assert into.exit_code == 0, into.output
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nWritten by hand.\n") and text.count(f"--out {out}: begin") == 1
    assert "#### Overall" in text and "- command: `viasd " in text  # headings sit two levels down
    doc.write_text(text + "\nMore by hand.\n")
    runner.invoke(app, ["bench", "--report-only", "--out", str(out), "--into", str(doc)])
    assert doc.read_text().endswith("More by hand.\n")
    refused = runner.invoke(app, ["bench", "--out", str(out), "--into", str(doc)])
    assert refused.exit_code == 2 and "--into needs --report-only" in refused.output
    # Two methods of the run compared task by task, without loading a model.
    compared = runner.invoke(app, ["bench", "--out", str(out), "--compare", "sd,plain"])
    assert compared.exit_code == 0, compared.output
    speed = {(r["key"], r["method"]): r["stats"]["tokens_per_second"] for r in rows}
    ratios = [speed[k, "sd"] / speed[k, "plain"] for k in ("specbench/1", "specbench/2")]
    assert f"sd over plain: {math.prod(ratios) ** 0.5:.3f}x (geometric mean over 2 tasks)" in compared.output
    for pair, message in (("sd", "two methods"), ("sd,warp", "no rows for warp")):
        bad = runner.invoke(app, ["bench", "--out", str(out), "--compare", pair])
        assert bad.exit_code == 2 and message in bad.output


def test_a_resume_with_other_questions_is_refused_but_not_a_copy_of_them(tmp_path, tiny_pair, monkeypatch):
    """Rows are keyed by question id: a resume with another file's questions under the same ids would keep the old
    answers as if they were the new questions'. The content decides, not the file's name."""
    from viasd.cli import app
    from viasd.models.loading import LoadedModel

    target, drafter, tok = tiny_pair
    models = {"tiny-target": target, "tiny-drafter": drafter}
    monkeypatch.setattr("viasd.engine.load_model", lambda name, **_: LoadedModel(models[name], tok, name, name))
    first, other, copy = tmp_path / "first.jsonl", tmp_path / "other.jsonl", tmp_path / "copy.jsonl"
    first.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["t3 t4"]}) + "\n")
    other.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["t9 t8 t7"]}) + "\n")
    copy.write_bytes(first.read_bytes())
    out = tmp_path / "run"
    args = ["bench", "--target", "tiny-target", "--drafter", "tiny-drafter", "--dtype", "fp32", "--device", "cpu"]
    args += ["--methods", "plain", "--count", "1", "-n", "2", "--no-warmup", "--out", str(out)]
    runner = CliRunner()
    assert runner.invoke(app, [*args, "--questions", str(first)]).exit_code == 0
    results = (out / "results.jsonl").read_bytes()
    env = (out / "environment.json").read_bytes()
    refused = runner.invoke(app, [*args, "--questions", str(other), "--resume"])
    assert refused.exit_code == 2, refused.output
    assert "cannot resume" in refused.output and "0 to run" not in refused.output
    assert str(first) in refused.output and str(other) in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    assert (out / "results.jsonl").read_bytes() == results and (out / "environment.json").read_bytes() == env
    resumed = runner.invoke(app, [*args, "--questions", str(copy), "--resume"])
    assert resumed.exit_code == 0 and "0 to run" in resumed.output, resumed.output
