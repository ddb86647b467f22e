"""A step's inputs on the device (slimkv.engine.step_inputs): the incrementally updated block
tables equal a full rebuild from the sequences' block lists after random admissions, growth,
frees, preemptions and prefix hits through the real KV manager; positions, slots and the
decode plan equal the metadata built from lists; and no layer changes the step's metadata."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from slimkv.attention.metadata import AttentionMetadata
from slimkv.engine.sampling_params import SamplingParams
from slimkv.engine.sequence import Sequence
from slimkv.engine.step_inputs import BlockTables, build_step
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.manager import KVCacheManager

BS = 4


def _rebuilt(seqs: list[Sequence]) -> torch.Tensor:
    """The step's tables as a fresh build pads them (0 past each table's end)."""
    width = max(len(s.blocks) for s in seqs)
    return torch.tensor([[b.block_id for b in s.blocks] + [0] * (width - len(s.blocks))
                         for s in seqs])


def _used(meta: AttentionMetadata, seqs: list[Sequence]) -> list[list[int]]:
    return [meta.block_tables[i, :len(s.blocks)].tolist() for i, s in enumerate(seqs)]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_tables_equal_a_full_rebuild(seed: int) -> None:
    rng = random.Random(seed)
    pool = BlockPool(48)
    manager = KVCacheManager(pool, BS, session_ttl_s=60, num_staging_slots=4)
    tables = BlockTables(width=32, device=torch.device("cpu"), rows=2)  # rows grow, get reused
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    running: list[Sequence] = []
    for step in range(120):
        action = rng.random()
        if action < 0.2 and len(running) < 4:  # admit, often with a shared prefix
            prompt = rng.choice(prompts) + [rng.randrange(5) for _ in range(rng.randrange(3))]
            seq = Sequence(f"r{step}", prompt, SamplingParams(max_tokens=64))
            computed = manager.get_computed_blocks(seq)
            if manager.can_allocate(seq, seq.num_tokens, computed):
                manager.allocate(seq, seq.num_tokens - len(computed) * BS, computed)
                running.append(seq)
        elif action < 0.3 and running:  # finish or preempt (blocks back, list replaced)
            seq = running.pop(rng.randrange(len(running)))
            manager.free(seq)
            if rng.random() < 0.5:  # preempted: readmitted later from its tokens
                seq.num_computed_tokens = 0
                computed = manager.get_computed_blocks(seq)
                if manager.can_allocate(seq, seq.num_tokens, computed):
                    manager.allocate(seq, seq.num_tokens - len(computed) * BS, computed)
                    running.append(seq)
        if not running:
            continue
        scheduled = []
        for seq in running:  # everything uncomputed, then a decode's new token
            n = seq.num_tokens - seq.num_computed_tokens
            if manager.can_allocate(seq, n):
                manager.allocate(seq, n)
                scheduled.append((seq, n))
        if not scheduled:
            continue
        rng.shuffle(scheduled)  # batch order changes: rows must follow their sequences
        step_inputs = build_step(tables, scheduled, BS, staged=True, piece_dtype=None)
        seqs = [s for s, _ in scheduled]
        meta = step_inputs.meta
        expected = AttentionMetadata.build(BS, [[b.block_id for b in s.blocks] for s in seqs],
                                           [n for _, n in scheduled],
                                           [s.num_computed_tokens + n for s, n in scheduled],
                                           torch.device("cpu"),
                                           [s.staging_slot for s in seqs])
        assert _used(meta, seqs) == _used(expected, seqs)
        assert meta.block_tables.shape == _rebuilt(seqs).shape
        assert torch.equal(meta.slot_mapping, expected.slot_mapping)
        assert torch.equal(meta.seq_lens_t, expected.seq_lens_t)
        assert torch.equal(meta.staging_slots, expected.staging_slots)
        starts = [s.num_computed_tokens for s in seqs]
        assert step_inputs.positions.tolist() == [p for s, (_, n) in zip(starts, scheduled)
                                                  for p in range(s, s + n)]
        assert step_inputs.ids.tolist() == [t for s, (seq, n) in zip(starts, scheduled)
                                            for t in seq.token_ids[s:s + n]]
        for name in ("rows", "block_tables", "seq_lens", "last_block", "last_block_id",
                     "offsets", "filled", "staging_slots"):
            got, want = (getattr(m.decode, name) if m.decode else None for m in (meta, expected))
            assert (got is None and want is None) or torch.equal(got, want), name
        for seq, n in scheduled:  # computed; then each running sequence decodes a token
            seq.num_computed_tokens += n
            seq.token_ids.append(rng.randrange(5))
            manager.cache_full_blocks(seq)


def _snapshot(meta: AttentionMetadata) -> dict:
    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if dataclasses.is_dataclass(x):
            return {f.name: copy(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [copy(y) for y in x]
        return x
    return copy(meta)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_equal, a, b))
    return a == b


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_a_forward_pass_leaves_the_step_metadata_unchanged(tmp_path, kv_dtype: str) -> None:
    """A mixed step (prefill chunks with a prefix, decodes) through every layer of a real
    engine: the metadata the layers read is the metadata the step built."""
    from slimkv.config import Config
    from slimkv.plugins import build_engine

    engine = build_engine(Config.from_dict({"kv_cache": {"dtype": kv_dtype, "memory_gb": 0.05},
                                            "scheduler": {"max_num_batched_tokens": 64}}))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, length in enumerate((150, 9, 40)):
        engine.add_request(list(range(10 + i, 10 + i + length)), params)
    runner, seen = engine.runner, []
    forward = runner._forward

    def checked(step):
        before = _snapshot(step.meta)
        out = forward(step)
        seen.append((step.meta.prefills != (), step.meta.decode is not None))
        assert _equal(_snapshot(step.meta), before)
        with pytest.raises(dataclasses.FrozenInstanceError):
            step.meta.decode = None
        return out

    runner._forward = checked
    while engine.has_unfinished():
        engine.step()
    assert (True, True) in seen  # a step mixing prefill chunks and decodes was checked
