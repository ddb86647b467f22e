"""The incremental detokenizer: a split UTF-8 character and a possible stop string are
held back until they resolve; a stop string never reaches the output."""

from __future__ import annotations

from slimkv.engine.outputs import Detokenizer
from slimkv.engine.sampling_params import SamplingParams
from slimkv.engine.sequence import Sequence


class ByteTokenizer:
    """Token ``i`` is byte ``i``; decoding replaces an incomplete UTF-8 tail with U+FFFD,
    as real byte-level tokenizers do. Token 256 is a special end-of-turn token."""

    eos_token_ids = frozenset({256})

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        pieces, run = [], bytearray()
        for i in ids:
            if i == 256:
                pieces += [run.decode("utf-8", errors="replace"),
                           "" if skip_special_tokens else "<|end|>"]
                run = bytearray()
            else:
                run.append(i)
        return "".join(pieces) + run.decode("utf-8", errors="replace")


def stream(text: bytes, stop: list[str] | None = None) -> tuple[list[str], Sequence]:
    """The deltas emitted for ``text`` fed one byte (token) at a time."""
    seq = Sequence("r", [0], SamplingParams(stop=stop or []))
    detok = Detokenizer(ByteTokenizer())
    deltas = []
    for byte in text:
        if seq.finish_reason is not None:
            break
        seq.token_ids.append(byte)
        deltas.append(detok.update(seq))
    return deltas, seq


def test_a_split_utf8_character_is_held_back_until_complete() -> None:
    deltas, seq = stream("aé€".encode())         # é: 2 bytes, €: 3 bytes
    assert deltas == ["a", "", "é", "", "", "€"]
    assert "\ufffd" not in "".join(deltas) and seq.output_text == "aé€"


def test_a_possible_stop_prefix_is_held_back_then_released() -> None:
    deltas, seq = stream(b"ab ENx", stop=["END"])
    assert deltas == ["a", "b", " ", "", "", "ENx"]
    assert seq.finish_reason is None and "".join(deltas) == "ab ENx"


def test_a_stop_string_ends_the_output_without_appearing_in_it() -> None:
    deltas, seq = stream(b"ab ENDcd", stop=["END", "zz"])
    assert deltas == ["a", "b", " ", "", "", ""]
    assert seq.finish_reason == "stop" and seq.output_text == "ab "


def test_the_longest_stop_prefix_wins() -> None:
    deltas, seq = stream(b"xSTOS", stop=["STOP", "SS"])
    # "S" may start either; "ST", "STO" may start STOP; "STOS" ends in "S" (SS, STOP).
    assert deltas == ["x", "", "", "", "STO"]
    assert seq.finish_reason is None


def test_special_tokens_kept_on_request_but_never_the_end_of_turn() -> None:
    """``skip_special_tokens: false`` shows special tokens, except the end-of-turn token
    that ends the output (vLLM's rule)."""
    for skip in (True, False):
        seq = Sequence("r", [0], SamplingParams(skip_special_tokens=skip))
        detok = Detokenizer(ByteTokenizer())
        for token in (*b"h", 256, *b"i"):  # as with ignore_eos: no stop at the first
            seq.token_ids.append(token)
            detok.update(seq)
        assert seq.output_text == ("hi" if skip else "h<|end|>i")
        seq.token_ids.append(256)
        seq.finish_reason = "stop"  # as the engine sets it for an end-of-turn token
        detok.update(seq)
        assert seq.output_text == ("hi" if skip else "h<|end|>i")


class CountingTokenizer:
    """The embedded model's tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.calls = tokenizer, []
        self.eos_token_ids = tokenizer.eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def test_incremental_text_equals_a_full_decode_with_short_windows() -> None:
    """Against the real byte-level BPE tokenizer: random vocabulary ids (byte tokens that
    split multi-byte characters included) and a real multilingual text, streamed one id at
    a time, add up to the full decode, and no decode call sees more than a few ids (a full
    decode per token made long outputs quadratic)."""
    import random

    from slimkv.model_io import Tokenizer, default_model_path

    real = Tokenizer.from_gguf(default_model_path())
    rng = random.Random(0)
    texts = [real.encode("Zürich → 東京, naïve café: ünïcödé ✓ 🚀 and plain text. " * 8,
                         add_special_tokens=False),
             [rng.randrange(real.vocab_size) for _ in range(400)]]
    for ids in texts:
        for skip in (True, False):
            tok = CountingTokenizer(real)
            seq = Sequence("r", [0], SamplingParams(skip_special_tokens=skip, ignore_eos=True))
            detok = Detokenizer(tok)
            deltas = []
            for token in ids:
                seq.token_ids.append(token)
                deltas.append(detok.update(seq))
            full = real.decode(ids, skip)
            assert seq.output_text == full
            assert full.startswith("".join(deltas))
            assert max(tok.calls) < 16, max(tok.calls)
