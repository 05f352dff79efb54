"""The command line as users run it: a real subprocess, exit codes and one-line errors."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
NO_MODEL = "/nonexistent/model-dir"


def viasd(*args: str, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "viasd", *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["generate", ""], None, "the prompt is empty"),
        (["generate"], "   \n", "the prompt is empty"),
        (["generate", "hi", "--temperature", "-1"], None, "temperature must be"),
        (["generate", "hi", "--top-p", "1.5"], None, "top_p must be in (0, 1]"),
        (["generate", "hi", "--top-p", "0"], None, "top_p must be in (0, 1]"),
        (["generate", "hi", "-n", "0"], None, "max_new_tokens must be >= 1"),
        (["generate", "hi", "--target", "no-such-model-xyz/nothing", "--method", "plain"], None, "cannot load model"),
        (["generate", "hi", "--target", "/does/not/exist.gguf", "--method", "plain"], None, "cannot load model"),
        (["generate", "hi", "--dtype", "int3", "--method", "plain"], None, "dtype"),
        (["generate", "hi", "--method", "warp"], None, "unknown method 'warp'"),
        (["generate", "hi", "--method", "via:gamma=0"], None, "method option gamma must be in 1..64, got 0"),
        (["generate", "hi", "--method", "sd:cap=4"], None, "method 'sd' takes no option 'cap'"),
        (["generate", "hi", "--seed", str(2**64)], None, "seed must be an integer in [-9223372036854775808, 1844"),
        (["generate", "hi", "--temperature", "nan"], None, "temperature must be a finite number"),
        (["generate", "hi", "--presence-penalty", "3"], None, "presence_penalty must be a number in [-2, 2], got 3"),
        (["generate", "hi", "--logit-bias", "42"], None, "a logit bias is TOKEN_ID=BIAS (e.g. 42=-100), got '42'"),
        (["generate", "hi", "-n", "2", "--min-tokens", "3"], None, "min_tokens (3) must not exceed max_new_tokens (2)"),
        (["generate", "hi", "--target", NO_MODEL, "--gamma", "0"], None, "--gamma must be in 1..64, got 0"),
        (["generate", "hi", "--target", NO_MODEL, "--gamma", "65"], None, "--gamma must be in 1..64, got 65"),
        (
            ["serve", "--target", NO_MODEL, "--port", "-1"],
            None,
            "--port must be in [0, 65535] (0 picks a free one), got -1",
        ),
        (
            ["serve", "--target", NO_MODEL, "--prefix-cache-mb", "-1"],
            None,
            "--prefix-cache-mb must be 'auto' or a whole number",
        ),
        (["serve", "--target", NO_MODEL, "--prefix-cache-mb", "abc"], None, "MiB >= 0 (0 turns the prefix cache off)"),
        (["serve", "--target", NO_MODEL, "--prefix-cache-mb", "1.5"], None, "got '1.5'"),
        (["serve", "--target", NO_MODEL, "--suffix-cache", "-1"], None, "--suffix-cache must be a number of tokens"),
        # (a bench that wrongly accepted these would fail fast on the missing model, not run)
        (["bench", "--target", NO_MODEL, "--humaneval-timeout", "nan"], None, "--humaneval-timeout must be a finite"),
        (["bench", "--target", NO_MODEL, "--gamma", "-2"], None, "--gamma must be in 1..64, got -2"),
        (
            ["bench", "--target", NO_MODEL, "--count", "1", "--category-max-new-tokens", "maths=8"],
            None,
            "--category-max-new-tokens names maths, which no task of this run has",
        ),
    ],
)
def test_invalid_input_gives_one_line_error(args, stdin, message):
    result = viasd(*args, stdin=stdin)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bench_refuses_a_file_as_out_and_a_damaged_run_in_one_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    damaged = tmp_path / "run"
    damaged.mkdir()
    (damaged / "results.jsonl").write_text("")
    env = damaged / "environment.json"
    cases = [
        (None, ["--out", str(a_file)], "is a file"),
        ('{"settings": {"target": "x"', ["--out", str(damaged), "--resume"], "environment.json is damaged"),
        ("[1, 2]", ["--out", str(damaged), "--report-only"], "environment.json is damaged"),
    ]
    for contents, args, message in cases:
        if contents is not None:
            env.write_text(contents)
        result = viasd("bench", "--target", NO_MODEL, "--count", "1", *args)
        assert result.returncode == 2, (contents, args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (contents, args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # Other damage takes the same path: every unreadable record is one ViasdError.
    from viasd.bench.command import read_environment
    from viasd.errors import ViasdError

    for contents in ('{"settings": 3}', "\udcff", ""):
        env.write_text(contents, errors="surrogateescape")
        with pytest.raises(ViasdError, match=r"environment\.json is damaged"):
            read_environment(env)
    env.unlink()
    env.mkdir()
    with pytest.raises(ViasdError, match=r"environment\.json is damaged"):
        read_environment(env)


def test_corrupt_model_file_gives_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1000))
    result = viasd("generate", "hi", "--target", str(bad), "--method", "plain")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.real
def test_mismatched_tokenizers_are_refused():
    result = viasd("generate", "hi", "--target", "smollm2-135m", "--drafter", "qwen2.5-coder-0.5b", "--method", "sd")
    assert result.returncode == 2 and "does not share the tokenizer" in result.stderr and "--drafter" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.real
def test_the_default_method_with_another_target_needs_no_drafter():
    """`generate --target smollm2-135m` with the default method: the default drafter (another tokenizer) is
    left out before anything is fetched, and auto picks among the methods that need no drafter."""
    out = viasd("generate", "Say hello.", "--target", "smollm2-135m", "-n", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert "does not share this target's tokenizer" in out.stderr
    choice = json.loads(out.stdout)["stats"]["choice"]
    from viasd import auto

    # smollm2's Q4_1 file runs as its own blocks (the gguf view) where the kernels run, else as its dense copy.
    fast = auto.int4a8_is_fast(torch.device("cpu"))
    needs_no_drafter = auto.candidates(False, int4a8=fast, gguf=fast, quantized_target=fast)
    assert choice["method"] in needs_no_drafter and set(choice["tokens_per_second"]) == set(needs_no_drafter)
    assert not any(name.startswith("sd") for name in choice["tokens_per_second"])


@pytest.mark.real
def test_generate_json_and_streaming_on_a_real_model():
    out = viasd("generate", "Say hello.", "--target", "smollm2-135m", "--method", "lookup", "-n", "12", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["stats"]["new_tokens"] == len(data["tokens"]) > 0
    assert data["setup"]["method"] == "lookup" and data["setup"]["drafter"].startswith("prompt lookup")
    assert "gguf" in data["setup"]["target_view"] and data["exact"] and "w4a8" in data["setup"]["kernels"]
    # fp32: in bf16 the model's second token is a tie to one bf16 step ("!" 15.5 against " there" 15.44), which
    # the last-bit noise of two processes' matrix products can break either way.
    model = ("--target", "smollm2-135m", "--dtype", "fp32", "--method", "plain", "-n", "12")
    plain = viasd("generate", "Say hello.", *model, "--json")
    streamed = viasd("generate", "-", *model, stdin="Say hello.")
    assert streamed.returncode == 0 and streamed.stdout.strip() == json.loads(plain.stdout)["text"].strip()
    assert "tokens in" in streamed.stderr
    # The prompt's read apart from decoding: "N tokens in Ts (...), ..., first token after Fs, then R tok/s".
    found = re.search(r"tokens in ([\d.]+)s .*first token after ([\d.]+)s, then ([\d.]+) tok/s", streamed.stderr)
    assert found and float(found[2]) <= float(found[1]) and float(found[3]) > 0, streamed.stderr
    stats = data["stats"]
    assert 0 < stats["first_token_seconds"] <= stats["total_seconds"]
    assert 1 <= stats["first_tokens"] <= len(data["tokens"])


@pytest.mark.real
def test_cli_sd_prints_the_same_greedy_text_as_plain_on_the_default_pair():
    prompt = "Write a Python function that checks whether a string is a palindrome."
    runs = {
        # The dense fp32 copy (--quant none), as test_real_pair.py says why.
        m: viasd("generate", prompt, "--method", m, "--quant", "none", "--dtype", "fp32", "-n", "32", "--json")
        for m in ("plain", "sd")
    }
    for m, r in runs.items():
        assert r.returncode == 0, f"{m}: {r.stderr}"
    plain, sd = (json.loads(runs[m].stdout) for m in ("plain", "sd"))
    assert sd["text"] == plain["text"] and sd["tokens"] == plain["tokens"]
    assert sd["stats"]["tokens_per_target_call"] > 1.0
    assert plain["stats"]["tokens_per_target_call"] == 1.0


@pytest.mark.real
def test_cli_via_says_what_share_of_its_tokens_the_target_never_checked():
    """Prose takes the relaxed gate, says so, and gives the share it committed unchecked where there is one (the
    shipped profile's slim view settles few drafts: none on some prompts); code (the shipped profile's exact policy
    for it) is routed as code and leaves nothing unchecked."""
    prompt = "Explain in detail how photosynthesis works, step by step."
    prose = viasd("generate", prompt, "--method", "via", "-n", "48")
    assert prose.returncode == 0, prose.stderr
    assert "routed as prose" in prose.stderr, prose.stderr
    words = prose.stderr.split()
    if "never" in words:
        share = words[words.index("never") - 3]  # "..., 2% of tokens never checked by the target"
        assert share.endswith("%") and 0 <= int(share[:-1]) <= 100, prose.stderr
    code = viasd("generate", "Write a Python function that checks whether a string is a palindrome.", "--method", "via",
                 "-n", "48")  # fmt: skip
    assert code.returncode == 0, code.stderr
    assert "routed as code" in code.stderr and "never checked" not in code.stderr, code.stderr
