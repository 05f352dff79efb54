"""`viasd chat` on the real default pair, the target as its GGUF file stores it (viasd's fused low-bit layers): a
10-turn conversation whose every turn reads only its new message and the template's tokens around it, and whose
answers are a fresh chat's over the same history, bit for bit."""

import os
import re
import subprocess
import sys

import pytest
import torch

from viasd.chat import Conversation, bit_exact_reuse
from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.prompting import encode_text

pytestmark = pytest.mark.real

MESSAGES = [
    "Name a prime number.",
    "Another one?",
    "Add them up.",
    "Say hello in French.",
    "What is 7 times 6?",
    "Name a colour.",
    "Which planet is the largest?",
    "Write a Python expression that reverses a list x.",
    "How many legs has a spider?",
    "Thanks! Summarise our chat in five words.",
]


def test_a_ten_turn_chat_reads_only_each_new_message_and_answers_as_a_fresh_chat():
    engine = Engine(EngineSpec())
    decoder = engine.decoder("plain")
    assert bit_exact_reuse(decoder) is None  # the gguf view runs the fused layers: entries are kept
    config = GenerationConfig(max_new_tokens=12)
    chat = Conversation(decoder, engine.encode, config, system="You are terse.")
    assert chat.reuse
    previous: tuple[list[int], list[int], bool] | None = None  # last prompt, answer, whether it ran out of tokens
    around = set()
    for message in MESSAGES:
        prompt = engine.encode(chat.messages(message))
        turn = chat.say(message)
        assert turn is not None and turn.prompt_tokens == len(prompt)
        if previous is not None:
            last, answer, cut_short = previous
            assert prompt[: len(last) + len(answer)] == last + answer  # the history re-encodes as it was decoded
            # Read: what follows the last prompt and its answer (whose last token a decoder never reads when the
            # answer ran out of tokens): the template's tokens around the new message, and the message.
            assert turn.read == len(prompt) - len(last) - len(answer) + cut_short
            around.add(turn.read - cut_short - len(encode_text(engine.tokenizer, message)))
        previous = (prompt, turn.result.tokens, turn.result.finish_reason == "length")
    # Closing the last answer, opening and closing the user's turn, opening the next answer: the same few every turn.
    assert len(around) == 1 and 0 < around.pop() <= 12, around
    # The last turn as a fresh chat over the same history answers it: the same text, the same cache, bit for bit.
    other = engine.decoder("plain", slot=1)
    fresh = Conversation(other, engine.encode, config, system=chat.system, history=chat.turns[:-1])
    again = fresh.say(MESSAGES[-1])
    assert again is not None and again.read == again.prompt_tokens and again.text == chat.turns[-1][1]
    mine, theirs = decoder.sessions()[0], other.sessions()[0]
    assert mine.tokens == theirs.tokens
    held = len(mine.tokens)
    for a, b in zip(mine.cache.layers, theirs.cache.layers, strict=True):
        assert torch.equal(a.keys[..., :held, :], b.keys[..., :held, :])
        assert torch.equal(a.values[..., :held, :], b.values[..., :held, :])


def test_the_chat_command_keeps_the_conversation_between_lines():
    stdin = "Name a prime number.\n\nAnother one?\n/exit\n"
    run = subprocess.run(
        [sys.executable, "-m", "viasd", "chat", "--method", "plain", "-n", "8"],
        input=stdin, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.strip().splitlines()) == 2 and "Traceback" not in run.stderr
    reads = [(int(m[1]), int(m[2])) for m in re.finditer(r"read (\d+) of (\d+) prompt tokens", run.stderr)]
    assert len(reads) == 2 and reads[0][0] == reads[0][1] and reads[1][0] < reads[1][1] - reads[0][1], run.stderr
