"""Run an eval suite: the same model, corpus windows and probes through every KV dtype,
next-token statistics against a reference dtype, exact-match accuracy per task."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from slimkv.config import Config
from slimkv.eval import corpus
from slimkv.eval.perplexity import TokenStats, next_token_logprobs
from slimkv.eval.prompts import MAX_NEW_TOKENS, Probe, is_match
from slimkv.eval.recall import conversation_probes, document_probes
from slimkv.eval.retrieval import passkey_probes, placed_passkey_probes
from slimkv.llm import LLM
from slimkv.model_io.tokenizer import Tokenizer
from slimkv.engine.sampling import SamplingParams

TASKS = ("passkey", "head_recall", "multi_turn")
# Prefill budget per step while evaluating: results do not depend on it (every chunk reads
# the quantized pool back), long prompts just take fewer passes over their prefix.
_STEP_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class Suite:
    name: str
    window: int                          # perplexity window, tokens
    num_windows: int | None              # None: every window of the corpus (else the first)
    passkey_contexts: tuple[int, ...]
    depths: tuple[float, ...]
    document_contexts: tuple[int, ...]
    conversation_contexts: tuple[int, ...]
    turns: int
    strided_windows: int | None = None   # sliding windows (corpus.strided_windows); None: disjoint
    keys_per_cell: int = 1                # passkey probes per (context, placement) cell
    placements: tuple[str, ...] = ()      # token placements of the passkey, before the depths
    floor_chunk: int | None = None        # the reference again, prefilled in chunks of this

    @property
    def max_context(self) -> int:
        return max(self.window, *self.passkey_contexts, *self.document_contexts,
                   *self.conversation_contexts)

    def probes(self, tokenizer: Tokenizer) -> list[Probe]:
        filler = corpus.Filler(tokenizer)
        if self.placements or self.keys_per_cell > 1:
            probes = placed_passkey_probes(tokenizer, list(self.passkey_contexts),
                                           [*self.placements, *self.depths], self.keys_per_cell)
        else:
            probes = passkey_probes(tokenizer, list(self.passkey_contexts), list(self.depths))
        for i, context in enumerate(self.document_contexts):
            probes += document_probes(tokenizer, filler, context, seed=i)
        for i, context in enumerate(self.conversation_contexts):
            probes += conversation_probes(tokenizer, filler, context, self.turns, seed=100 + i)
        return probes

    def windows(self, tokenizer: Tokenizer) -> list[tuple[list[int], int]]:
        """Corpus windows and how many of their last tokens each scores."""
        if self.strided_windows:       # num_windows: only the first ones (small test runs)
            out = corpus.strided_windows(tokenizer, self.window, self.strided_windows)
            return out[:self.num_windows]
        return [(w, len(w) - 1) for w in corpus.windows(tokenizer, self.window, self.num_windows)]


# Documents stop at 6K: from a 7K document the float32 reference itself recalls none of the
# head facts (transformers agrees), so such a cell would measure nothing (docs/accuracy.md).
SUITES = {
    "quick": Suite("quick", 1024, 2, (1024,), (0.0, 0.5, 1.0), (1024,), (1024,), 3),
    "full": Suite("full", 1024, None, (1024, 2048, 4096, 7168), (0.0, 0.25, 0.5, 0.75, 1.0),
                  (2048, 4096, 6144), (4096,), 6),
    # Issue 46: 200 sliding 1,024-token windows scoring disjoint ~104-token segments (paired
    # bootstrap intervals), 10 keys per passkey cell with needles inside KV blocks 0 and 1
    # and across block edges (McNemar), and the floor: the reference prefilled 64 at a time.
    # Depth 0% is block0 (the document opens the prompt). Sized for ~3 min per format in
    # bf16 on 2 cores (docs/accuracy.md).
    "stats": Suite("stats", 1024, None, (1024,), (0.25, 0.5, 0.75, 1.0), (), (), 0,
                   strided_windows=200, keys_per_cell=10,
                   placements=("block0", "block1", "edge16", "edge_mid"), floor_chunk=64),
}


@dataclass(slots=True)
class DtypeRun:
    """What one KV dtype scored: corpus statistics and a hit per probe."""

    dtype: str
    stats: TokenStats = field(default_factory=TokenStats)
    windows: list[TokenStats] = field(default_factory=list)   # per corpus window
    hits: list[bool] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def add_window(self, logprobs: torch.Tensor, targets: torch.Tensor,
                   reference: torch.Tensor) -> None:
        """One corpus window's predictions (:meth:`TokenStats.add`), kept apart and summed."""
        stats = TokenStats()
        stats.add(logprobs, targets, reference)
        self.windows.append(stats)
        total = self.stats
        total.tokens, total.nll = total.tokens + stats.tokens, total.nll + stats.nll
        total.kl, total.agree = total.kl + stats.kl, total.agree + stats.agree

    def accuracy(self, probes: list[Probe], task: str) -> float | None:
        marks = [hit for probe, hit in zip(probes, self.hits) if probe.task == task]
        return sum(marks) / len(marks) if marks else None


@dataclass(slots=True)
class EvalRun:
    suite: Suite
    model: str
    corpus_tokens: int
    probes: list[Probe]
    reference: DtypeRun
    runs: list[DtypeRun]

    @property
    def floor(self) -> DtypeRun | None:
        """The reference dtype's second run with another prefill chunking, if any."""
        prefix = self.reference.dtype + "@"
        return next((run for run in self.runs if run.dtype.startswith(prefix)), None)


def eval_config(config: Config, dtype: str, max_context: int) -> Config:
    """``config`` with ``dtype`` for K and V and a pool of 1.5 times the longest context (a
    small pool per dtype, since every dtype's engine stays alive for the run). ``dtype`` may
    name a key scale layout too, ``int4:per_channel_block``; without one the config's
    ``kv_cache.k_scale`` applies. ``+`` adds ``kv_cache.int4`` options over the config's:
    ``int4:per_token+g64+rotate_k+rotate_v`` (``gN``: ``group_size`` N; ``no_X``: X false;
    ``int8_layers=0.1.28.29``: those layers int8, ``kv_cache.layer_dtypes``).
    ``dtype@chunk=N`` prefills (and scores) N tokens a step instead: the same dtype with
    another chunking, whose distance from the plain run is the floor of rounding noise (in
    bf16 activations, not zero)."""
    dtype, _, chunking = dtype.partition("@")
    blocks = math.ceil(1.5 * max_context / config.kv_cache.block_size)
    dtype, *options = dtype.split("+")
    dtype, _, k_scale = dtype.partition(":")
    int4 = asdict(config.kv_cache.int4)  # a mapping: its keys are checked as YAML's are
    layer_dtypes = None
    for option in options:
        name, _, value = option.partition("=")
        if name == "int8_layers":        # the ablation's int8 boundary layers: 0.1.28.29
            layer_dtypes = {"int8": [int(x) for x in value.split(".")]}
            continue
        int4.update({"group_size": int(option[1:])} if option[:1] == "g" else
                    {option[3:]: False} if option.startswith("no_") else {option: True})
    config = config.replace("kv_cache", dtype=dtype, k_dtype=None, v_dtype=None,
                            layer_dtypes=layer_dtypes, num_blocks=blocks,
                            k_scale=k_scale or config.kv_cache.k_scale, int4=int4)
    budget = max(config.scheduler.max_num_batched_tokens, _STEP_TOKENS)
    if chunking:
        name, _, value = chunking.partition("=")
        if name != "chunk" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"expected DTYPE@chunk=N, got {dtype}@{chunking}")
        budget = int(value)
    return config.replace("scheduler", max_num_batched_tokens=budget)


def run_eval(config: Config, dtypes: list[str], suite: Suite, reference: str = "float32",
             progress: bool = True, floor_chunk: int | None = None) -> EvalRun:
    """Evaluate ``reference`` and every dtype of ``dtypes`` (each its own engine, so a
    dtype equal to the reference is a genuine second run). With a floor chunk (default the
    suite's; 0: none), ``reference@chunk=N`` runs first after the reference."""
    chunk = suite.floor_chunk if floor_chunk is None else floor_chunk
    floor = f"{reference}@chunk={chunk}"
    if chunk and floor not in dtypes:
        dtypes = [floor, *dtypes]
    llms = [LLM(eval_config(config, dtype, suite.max_context)) for dtype in [reference, *dtypes]]
    runs = [DtypeRun(dtype) for dtype in [reference, *dtypes]]
    tokenizer = llms[0].tokenizer
    windows = suite.windows(tokenizer)
    for window, scored in tqdm(windows, desc="perplexity windows", disable=not progress):
        _score_window(llms, runs, window, scored)
    probes = suite.probes(tokenizer)
    for llm, run in zip(llms, runs):
        _answer(llm, run, probes, progress)
    # Tokens of the corpus the windows cover (disjoint windows: their lengths).
    covered = sum(scored for _, scored in windows) + (1 if suite.strided_windows else len(windows))
    return EvalRun(suite, llms[0].engine.model_name, covered, probes, runs[0], runs[1:])


def _score_window(llms: list[LLM], runs: list[DtypeRun], window: list[int], scored: int) -> None:
    """One window through every engine, its last ``scored`` tokens predicted; only this
    window's logits are ever held."""
    reference = next_token_logprobs(llms[0].engine.score(window, last=scored + 1))
    targets = torch.tensor(window[len(window) - scored:])
    for llm, run in zip(llms, runs):
        run.add_window(reference if run is runs[0]
                       else next_token_logprobs(llm.engine.score(window, last=scored + 1)),
                       targets, reference)


def _answer(llm: LLM, run: DtypeRun, probes: list[Probe], progress: bool) -> None:
    """Probes one at a time, in order: probes sharing a document then reuse its prefix
    from the cache instead of all prefilling it in the same batch."""
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    for probe in tqdm(probes, desc=f"tasks ({run.dtype} KV)", disable=not progress):
        [result] = llm.generate(probe.prompt_ids, params)
        run.outputs.append(result.text)
        run.hits.append(is_match(probe.answer, result.text))
