"""Per-request logit changes in batched tensor form: each builds one tensor over the rows
that ask for it (no Python loop over the vocabulary) and edits the logits in place.

Order (as in vLLM): ``min_tokens`` (stop tokens forbidden until then), ``logit_bias``
(OpenAI: added to the logits), then the penalties: ``repetition_penalty`` (vLLM/HF:
divides positive logits and multiplies negative ones of every token seen in the prompt or
the output), ``frequency_penalty`` (minus count x penalty) and ``presence_penalty``
(minus penalty once a token appeared), both over the output tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from slimkv.engine.sampling import LogitsProcessor
from slimkv.engine.sequence import Sequence


class Penalties(LogitsProcessor):
    """``min_tokens``, ``logit_bias`` and the penalties, in that order."""

    options = frozenset({"min_tokens", "logit_bias", "penalties"})

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        process_logits_(logits, seqs, self.eos_token_ids)


def process_logits_(logits: torch.Tensor, seqs: Seq[Sequence], eos_ids: frozenset[int]) -> None:
    mask_stop_tokens_(logits, seqs, eos_ids)
    add_logit_bias_(logits, seqs)
    apply_penalties_(logits, seqs)


def mask_stop_tokens_(logits: torch.Tensor, seqs: Seq[Sequence], eos_ids: frozenset[int]) -> None:
    """Rows still short of ``min_tokens`` cannot end: eos and stop tokens get -inf."""
    pairs = [(row, token) for row, seq in enumerate(seqs)
             if seq.num_output_tokens < seq.params.min_tokens
             for token in ({*seq.params.stop_token_ids} | (set() if seq.params.ignore_eos
                                                            else eos_ids))]
    if pairs:
        rows, tokens = _index(pairs, logits)
        logits[rows, tokens] = float("-inf")


def add_logit_bias_(logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
    triples = [(row, token, bias) for row, seq in enumerate(seqs)
               for token, bias in seq.params.logit_bias.items() if token < logits.shape[1]]
    if triples:
        rows, tokens = _index([(r, t) for r, t, _ in triples], logits)
        bias = torch.tensor([b for _, _, b in triples], dtype=logits.dtype, device=logits.device)
        logits.index_put_((rows, tokens), bias, accumulate=True)


def apply_penalties_(logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
    rows = [row for row, seq in enumerate(seqs) if seq.params.has_penalties]
    if not rows:
        return
    picked = [seqs[row] for row in rows]
    vocab, device = logits.shape[1], logits.device
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    output_counts = _counts([s.output_token_ids for s in picked], vocab, device)
    seen = output_counts > 0
    seen |= _counts([s.token_ids[:s.num_prompt_tokens] for s in picked], vocab, device) > 0
    rep = _column([s.params.repetition_penalty for s in picked], sub)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= _column([s.params.frequency_penalty for s in picked], sub) * output_counts
    sub -= _column([s.params.presence_penalty for s in picked], sub) * (output_counts > 0)
    logits[index] = sub


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` occurrence counts, from one padded id tensor (pad = ``vocab``)."""
    width = max(1, max(len(ids) for ids in token_lists))
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for row, ids in enumerate(token_lists):
        padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=counts.dtype,
                                                              device=device))
    return counts[:, :vocab]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _index(pairs: list[tuple[int, int]], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.tensor(pairs, dtype=torch.long, device=logits.device)
    return both[:, 0], both[:, 1]
