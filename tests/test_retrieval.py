"""Retrieval and recall prompt generators: the planted fact is where they say, in
prompts that fit their context. Needs only the embedded tokenizer."""

from __future__ import annotations

import pytest

from slimkv.eval.corpus import Filler, windows
from slimkv.eval.harness import SUITES
from slimkv.eval.prompts import MAX_NEW_TOKENS, Probe, is_match
from slimkv.eval.recall import FACT_KINDS, conversation_probes, document_probes
from slimkv.eval.retrieval import passkey_probes
from slimkv.model_io import Tokenizer, default_model_path

CONTEXTS = [1024, 2048, 4096, 7168]
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def _check_fits(probe: Probe) -> None:
    """Prompt plus answer fit the context, and the prompt really is that long."""
    assert len(probe.prompt_ids) + MAX_NEW_TOKENS <= probe.context
    assert len(probe.prompt_ids) >= 0.95 * probe.context


def _check_needle(tokenizer: Tokenizer, probe: Probe) -> None:
    start, end = probe.needle
    assert probe.answer in tokenizer.decode(probe.prompt_ids[start:end])
    assert probe.answer not in tokenizer.decode(probe.prompt_ids[end:])


def test_corpus_has_20k_tokens_in_1024_token_windows(tokenizer: Tokenizer) -> None:
    assert sum(map(len, windows(tokenizer, 1024))) >= 20_000


def test_passkey_is_planted_at_the_stated_depth(tokenizer: Tokenizer) -> None:
    probes = passkey_probes(tokenizer, CONTEXTS, DEPTHS)
    assert [(p.context, p.label) for p in probes] == [
        (c, f"{d:.0%}") for c in CONTEXTS for d in DEPTHS]
    longest_sentence = max(map(len, Filler(tokenizer).pieces))
    for probe, depth in zip(probes, DEPTHS * len(CONTEXTS)):
        _check_fits(probe)
        _check_needle(tokenizer, probe)
        doc_start, doc_end = probe.document
        room = doc_end - doc_start - (probe.needle[1] - probe.needle[0])
        expected = doc_start + depth * room
        # Planted at the sentence boundary nearest the stated depth.
        assert abs(probe.needle[0] - expected) <= longest_sentence / 2 + 1
    assert len({p.answer for p in probes}) == len(probes)


def test_passkey_edges_sit_at_document_start_and_end(tokenizer: Tokenizer) -> None:
    first, last = passkey_probes(tokenizer, [2048], [0.0, 1.0])
    assert first.needle[0] == first.document[0]
    assert last.needle[1] == last.document[1]
    assert "pass key" in tokenizer.decode(last.prompt_ids[last.document[1]:])


def test_document_facts_open_the_first_section(tokenizer: Tokenizer) -> None:
    probes = document_probes(tokenizer, Filler(tokenizer), 4096, seed=3)
    assert [p.label for p in probes] == [k.name for k in FACT_KINDS]
    for probe, kind in zip(probes, FACT_KINDS):
        _check_fits(probe)
        _check_needle(tokenizer, probe)
        head = tokenizer.decode(probe.prompt_ids[:probe.needle[0]])
        assert head.endswith("Section 1. The expedition (remember these facts)\n")
        assert probe.depth == 0
        tail = tokenizer.decode(probe.prompt_ids[probe.document[1]:])
        assert kind.question in tail and tail.endswith("According to section 1, " + kind.primer)
    assert len({tuple(p.prompt_ids[:p.document[1]]) for p in probes}) == 1


def test_conversation_facts_are_in_turn_one_question_in_turn_n(tokenizer: Tokenizer) -> None:
    turns = 5
    probes = conversation_probes(tokenizer, Filler(tokenizer), 4096, turns, seed=1)
    for probe, kind in zip(probes, FACT_KINDS):
        _check_fits(probe)
        _check_needle(tokenizer, probe)
        text = tokenizer.hf.decode(probe.prompt_ids)
        before = tokenizer.hf.decode(probe.prompt_ids[:probe.needle[0]])
        assert before.count("<|im_start|>user") == 1
        assert text.count("<|im_start|>user") == turns
        last_turn = text.rsplit("<|im_start|>user", 1)[1]
        assert kind.question in last_turn and probe.answer not in last_turn
    assert len({tuple(p.prompt_ids[:p.document[1]]) for p in probes}) == 1


def test_suites_prompts_fit(tokenizer: Tokenizer) -> None:
    for suite in SUITES.values():
        for probe in suite.probes(tokenizer):
            _check_fits(probe)
            _check_needle(tokenizer, probe)


@pytest.mark.parametrize(("answer", "generated", "expected"), [
    ("48213", " 48213.", True),
    ("48213", " 482130", False),
    ("48213", " 4821", False),
    ("Silver Finch", " silver finch. The", True),
    ("Carrow", ' "Carrow" to the port', True),
    ("rope", " ropes", False),
])
def test_exact_match(answer: str, generated: str, expected: bool) -> None:
    assert is_match(answer, generated) is expected
