"""VIA-SD on the default target as it runs by default (its file's blocks), with the shipped routing profile: it drafts
with the target's draft head and prompt lookup; code goes to the full target (a relaxed gate lost HumanEval points), so
a HumanEval request gets the fast mode's tokens, while prose keeps the relaxed gate, whose slim view settles drafts."""

from __future__ import annotations

import pytest

from viasd.bench.tasks import default_questions_path, humaneval_task, load_humaneval_problems, load_specbench
from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec

pytestmark = pytest.mark.real


def test_via_gives_code_the_fast_modes_tokens_and_leaves_prose_relaxed():
    engine = Engine(EngineSpec())
    assert engine.decoder("via").drafter.describe().startswith("hybrid")  # lookup, else the head: no drafter model
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    for problem in load_humaneval_problems()[:2]:
        ids = engine.encode([{"role": "user", "content": humaneval_task(problem).turns[0]}])
        plain, via = engine.generate(ids, "plain", config), engine.generate(ids, "via", config)
        assert via.stats.task_kind == "code" and via.stats.unchecked_tokens == 0
        assert via.tokens == plain.tokens, problem["task_id"]
    prose = engine.encode([{"role": "user", "content": "Why is the sky blue? Answer in three sentences."}])
    relaxed = engine.generate(prose, "via", config)
    assert relaxed.stats.task_kind == "prose" and relaxed.stats.slim_calls > 0
    assert engine.loaded_models == [engine.target]


def test_via_reads_the_prompt_as_plain_decoding_does():
    """Until a token settles below the full target, `via`'s greedy tokens are plain decoding's, bit for bit: its first
    round goes to the full target, which reads the prompt as plain decoding does. On this long summarization prompt
    the first token differed when `via` read the prompt's last token in viasd's loop (other rounding) instead."""
    engine = Engine(EngineSpec())
    task = next(t for t in load_specbench(default_questions_path()) if t.key == "specbench/318")
    ids = engine.encode([{"role": "user", "content": task.turns[0]}])
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    plain, via = engine.generate(ids, "plain", config), engine.generate(ids, "via", config)
    assert via.stats.task_kind == "prose" and via.stats.unchecked_tokens == 0
    assert via.tokens == plain.tokens
