"""Block bookkeeping: exact block ids, free-queue order, prefix-cache index, eviction."""

import os
import subprocess
import sys

import pytest

from slimkv.kv.block_pool import BlockPool, FreeBlockQueue, Block, hash_block


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_is_doubly_linked_and_o1_removable():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2]
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_new_blocks_come_from_the_head_and_return_to_the_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.5)
    pool.free_blocks(reversed(a))  # a sequence frees tail-first
    assert ids(pool.free_queue) == [3, 4, 5, 2, 1, 0]
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)


def test_chained_hash_depends_on_parent():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(h1, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_chained_hash_is_the_same_in_every_process():
    """Keys are shared by replicas and the disk tier: no per-process salt (Python's hash
    of str/bytes changes with PYTHONHASHSEED)."""
    code = ("from slimkv.kv.block_pool import hash_block as h;"
            "print(h(h(None, [1, 70000]), list(range(16))).hex())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert digests == {hash_block(hash_block(None, [1, 70000]), list(range(16))).hex() + "\n"}


def test_prefix_hit_reuses_the_exact_block_and_eviction_is_lazy():
    pool = BlockPool(3)
    [b] = pool.get_new_blocks(1)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(b, h)
    pool.free_blocks([b])
    assert pool.get_cached_block(h) is b           # still cached while free
    pool.touch([b])
    assert b.ref_cnt == 1 and b not in list(pool.free_queue)
    pool.free_blocks([b])
    pool.get_new_blocks(3)                          # reuse everything: b is evicted now
    assert pool.get_cached_block(h) is None and pool.num_evictions == 1


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    for i, blk in enumerate(a + b):
        pool.cache_block(blk, hash_block(None, [i]))
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert ids(pool.free_queue) == [3, 2, 1, 0]
    assert ids(pool.get_new_blocks(1)) == [3]


def test_fifo_evicts_in_order_of_first_allocation():
    pool = BlockPool(4, evict_policy="fifo")
    a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert ids(pool.free_queue) == [0, 1, 2, 3]


def test_session_heads_are_evicted_after_every_other_free_block():
    pool = BlockPool(4)
    head, tail = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.set_session_head(head, "s1")
    pool.free_blocks(reversed(head + tail))
    assert ids(pool.free_queue) == [3, 2] and ids(pool.protected) == [1, 0]
    assert ids(pool.get_new_blocks(3)) == [3, 2, 1]
    pool.set_session_head([pool.blocks[0]], None)   # session ended: back to the LRU queue
    assert ids(pool.free_queue) == [0] and len(pool.protected) == 0


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [7])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
