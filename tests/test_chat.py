"""`viasd chat` (chat.py): a conversation's turns answer as a fresh chat with the same history would, while each turn
reads only the tokens after what the previous turns left in the KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from test_stored_model import write_gguf
from tiny import tiny_chat_tokenizer, tiny_model
from viasd.chat import Conversation, bit_exact_reuse
from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.errors import ViasdError
from viasd.models.gguf_file import GgufFile
from viasd.models.loading import LoadedModel
from viasd.models.stored import build
from viasd.passes.prepare import prepare
from viasd.passes.session import KVSession, common_prefix_length

MESSAGES = ["Write a Python function.", "what is 2+2?", "The quick brown fox.", "reverse a string", "It is 4."]
CONFIG = GenerationConfig(max_new_tokens=6)


def dense_engine() -> Engine:
    """Tiny float64 models as loaded (a ChatML template): no fused low-bit layers, so no bit-exact reuse."""
    tok = tiny_chat_tokenizer()
    target = LoadedModel(tiny_model("qwen2", vocab_size=320, seed=3), tok, "t", "t")
    drafter = LoadedModel(tiny_model("qwen2", vocab_size=320, layers=2, seed=4), tok, "d", "d")
    return Engine(EngineSpec(target="t", drafter="d"), target=target, drafter=drafter)


def gguf_engine(tmp_path: Path) -> Engine:
    """A tiny bf16 model as its GGUF file stores it: the engine runs its `gguf` view, viasd's fused layers."""
    dense = tiny_model("qwen2", hidden=256, layers=2, vocab_size=320, dtype=torch.bfloat16, seed=5)
    path = tmp_path / "model.gguf"
    write_gguf(dense, path, "qwen2")
    stored = build(GgufFile(path), dense.config, torch.bfloat16)
    prepare(stored)
    return Engine(EngineSpec(target=str(path)), target=LoadedModel(stored, tiny_chat_tokenizer(), "t", str(path)))


def fresh(engine: Engine, method: str, conversation: Conversation, message: str) -> tuple[str, str]:
    """What a fresh chat with `conversation`'s history answers to `message`, and a fresh generation of the whole
    prompt in one call (no kept entries at all)."""
    decoder = engine.decoder(method)
    again = Conversation(decoder, engine.encode, conversation.config, system=conversation.system,
                         history=conversation.turns, reuse=conversation.reuse, notice=lambda line: None)  # fmt: skip
    turn = again.say(message)
    assert turn is not None and turn.read == turn.prompt_tokens  # it had nothing kept
    whole = decoder.generate(engine.encode(conversation.messages(message)), conversation.config).text
    return turn.text, whole


def fed_tokens(session: KVSession) -> list[int]:
    """Counts the tokens `session` reads from now on (every pass, every way in)."""
    fed = [0]
    run = session._run

    def counted(ids, view, keep):
        fed[0] += len(ids)
        return run(ids, view, keep)

    session._run = counted  # type: ignore[method-assign]
    return fed


@pytest.mark.parametrize("method", ["plain", "sd", "lookup"])
def test_each_turn_answers_as_a_fresh_chat_and_reads_only_what_follows_the_kept_prefix(method):
    engine = dense_engine()
    decoder = engine.decoder(method)
    chat = Conversation(decoder, engine.encode, CONFIG, system="You are terse.", reuse=True)
    target = decoder.sessions()[0]
    fed = fed_tokens(target)
    held: list[int] = []  # what the target's session held when the last turn ended
    for number, message in enumerate(MESSAGES):
        want, whole = fresh(engine, method, chat, message)
        prompt = engine.encode(chat.messages(message))
        fed[0] = 0
        turn = chat.say(message)
        assert turn is not None and turn.text == want == whole
        assert turn.prompt_tokens == len(prompt)
        # Read: the prompt after the longest prefix the last turn's entries share with it (its last 2 tokens always).
        assert turn.read == len(prompt) - min(common_prefix_length(held, prompt), len(prompt) - 2)
        if number:
            assert turn.read < len(prompt) - 10  # the system prompt and the first turn were not read again
        if method == "plain":  # and the session read no more: the prompt's part, then one step per token but the last
            steps = len(turn.result.tokens) - (turn.result.finish_reason == "length")
            assert fed[0] == turn.read + steps
        held = list(target.tokens)
        assert chat.turns[-1] == (message, turn.text)


def test_the_gguf_view_keeps_entries_bit_for_bit_those_of_a_fresh_chat(tmp_path: Path):
    """On viasd's fused low-bit layers a kept entry is the bits a fresh chat's reading writes: the new tokens are
    read in passes of the fused layers' size (a prompt's one long pass through torch's attention rounds otherwise),
    so the whole cache after each turn equals a fresh chat's over the same history."""
    engine = gguf_engine(tmp_path)
    decoder = engine.decoder("plain")
    notes: list[str] = []
    chat = Conversation(decoder, engine.encode, CONFIG, system="You are terse.", notice=notes.append)
    assert bit_exact_reuse(decoder) is None and chat.reuse and not notes
    other = engine.decoder("plain", slot=1)  # the fresh chats' own sessions
    for number, message in enumerate(MESSAGES):
        again = Conversation(other, engine.encode, CONFIG, system=chat.system, history=chat.turns)
        want = again.say(message)
        turn = chat.say(message)
        assert turn is not None and want is not None and turn.text == want.text
        assert want.read == want.prompt_tokens and (number == 0 or turn.read < turn.prompt_tokens - 10)
        mine, theirs = decoder.sessions()[0], other.sessions()[0]
        assert mine.tokens == theirs.tokens
        for a, b in zip(mine.cache.layers, theirs.cache.layers, strict=True):
            assert torch.equal(a.keys[..., : len(mine.tokens), :], b.keys[..., : len(mine.tokens), :])
            assert torch.equal(a.values[..., : len(mine.tokens), :], b.values[..., : len(mine.tokens), :])


def test_a_target_without_fused_layers_reads_the_whole_conversation_and_says_so():
    engine = dense_engine()
    notes: list[str] = []
    chat = Conversation(engine.decoder("plain"), engine.encode, CONFIG, notice=notes.append)
    assert not chat.reuse and len(notes) == 1 and "each turn reads the whole conversation again" in notes[0]
    for message in MESSAGES[:3]:
        want, whole = fresh(engine, "plain", chat, message)
        turn = chat.say(message)
        assert turn is not None and turn.text == want == whole and turn.read == turn.prompt_tokens


def test_reset_forgets_the_turns_and_the_kept_entries():
    engine = dense_engine()
    chat = Conversation(engine.decoder("plain"), engine.encode, CONFIG, system="Be brief.", reuse=True)
    chat.say(MESSAGES[0])
    chat.say(MESSAGES[1])
    chat.reset()
    assert chat.turns == [] and chat.system == "Be brief."
    want, whole = fresh(engine, "plain", chat, MESSAGES[2])
    prompt = engine.encode(chat.messages(MESSAGES[2]))
    turn = chat.say(MESSAGES[2])
    assert turn is not None and turn.text == want == whole
    # Nothing kept: the whole prompt is read (the system prompt alone would have been shared with the old entries).
    assert turn.read == turn.prompt_tokens == len(prompt)


def test_an_empty_message_generates_nothing():
    engine = dense_engine()
    chat = Conversation(engine.decoder("plain"), engine.encode, CONFIG, reuse=True)
    chat.say(MESSAGES[0])
    turns = list(chat.turns)
    fed = fed_tokens(engine.decoder("plain").sessions()[0])
    assert chat.say("") is None and chat.say("  \n\t") is None
    assert chat.turns == turns and fed[0] == 0


def test_a_conversation_beyond_the_context_drops_its_oldest_turns_and_says_so():
    engine = dense_engine()
    notes: list[str] = []
    decoder = engine.decoder("plain")
    roomy = Conversation(decoder, engine.encode, CONFIG, system="Be brief.", reuse=True, notice=notes.append)
    for message in MESSAGES[:4]:
        roomy.say(message)
    need = len(engine.encode(roomy.messages(MESSAGES[4]))) + CONFIG.max_new_tokens
    tight = Conversation(decoder, engine.encode, CONFIG, system="Be brief.", history=roomy.turns, reuse=True,
                         context=need - 1, notice=notes.append)  # fmt: skip
    history = list(tight.turns)
    turn = tight.say(MESSAGES[4])
    assert turn is not None and turn.dropped >= 1
    assert len(notes) == 1 and f"dropped the oldest {turn.dropped} of 4 turns" in notes[0]
    assert tight.turns == [*history[turn.dropped :], (MESSAGES[4], turn.text)]  # the system prompt stays
    assert tight.messages()[0] == {"role": "system", "content": "Be brief."}
    assert turn.prompt_tokens + CONFIG.max_new_tokens <= need - 1
    # As a fresh chat with what was kept answers.
    kept = Conversation(decoder, engine.encode, CONFIG, system="Be brief.", history=history[turn.dropped :])
    assert kept.say(MESSAGES[4]).text == turn.text  # type: ignore[union-attr]


def test_a_message_that_does_not_fit_alone_is_refused_and_the_chat_goes_on():
    engine = dense_engine()
    chat = Conversation(engine.decoder("plain"), engine.encode, CONFIG, reuse=True, context=60,
                        notice=lambda line: None)  # fmt: skip
    chat.say(MESSAGES[0])
    turns = list(chat.turns)
    with pytest.raises(ViasdError, match="exceeds the model's context of 60 tokens; not sent") as refused:
        chat.say("t " * 200)
    assert "\n" not in str(refused.value) and chat.turns == turns
    want, _ = fresh(engine, "plain", chat, MESSAGES[1])
    assert chat.say(MESSAGES[1]).text == want  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["dense", "gguf"])
def test_a_turn_stopped_on_the_way_leaves_the_next_one_equal_to_a_fresh_chats(tmp_path: Path, where: str):
    engine = dense_engine() if where == "dense" else gguf_engine(tmp_path)
    method = "sd" if where == "dense" else "plain"
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    chat = Conversation(engine.decoder(method), engine.encode, config, reuse=True)
    chat.say(MESSAGES[0])
    turns = list(chat.turns)
    pieces: list[str] = []

    def interrupt(piece: str) -> None:
        pieces.append(piece)
        raise KeyboardInterrupt  # Ctrl-C while the answer streams

    with pytest.raises(KeyboardInterrupt):
        chat.say(MESSAGES[1], on_text=interrupt)
    assert pieces and chat.turns == turns  # the partial answer is not kept
    want, whole = fresh(engine, method, chat, MESSAGES[2])
    turn = chat.say(MESSAGES[2])
    assert turn is not None and turn.text == want and turn.read < turn.prompt_tokens
    if where == "dense":
        assert turn.text == whole


def test_the_chat_command_streams_answers_from_a_pipe(monkeypatch: pytest.MonkeyPatch):
    from viasd import cli

    engine = dense_engine()
    monkeypatch.setattr("viasd.engine.Engine", lambda spec: engine)
    stdin = f"{MESSAGES[0]}\n\n/reset\n{MESSAGES[1]}\n/exit\n{MESSAGES[2]}\n"
    result = CliRunner().invoke(cli.app, ["chat", "--method", "plain", "-n", "6", "--system", "Be brief."], input=stdin)
    assert result.exit_code == 0, result.output
    # The same answers as a fresh chat's: the first message, then (after /reset) the second alone; nothing after /exit.
    first = Conversation(engine.decoder("plain"), engine.encode, GenerationConfig(max_new_tokens=6),
                         system="Be brief.", notice=lambda line: None)  # fmt: skip
    want = [first.say(MESSAGES[0]).text]  # type: ignore[union-attr]
    first.reset()
    want.append(first.say(MESSAGES[1]).text)  # type: ignore[union-attr]
    assert result.stdout == "".join(text + "\n" for text in want)
    assert ">>>" not in result.stdout  # no prompt marker on a pipe
    assert "each turn reads the whole conversation again" in result.stderr
    assert result.stderr.count("prompt tokens") == 2 and "the conversation is forgotten" in result.stderr
