"""BlockPool and its intrusive free queue: order, O(1) removal, lazy eviction, ref counts."""

import pytest

from pagedmlx.core.kv.block_hash import hash_block_tokens
from pagedmlx.core.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def chain(*token_blocks):
    """The hashes of consecutive blocks of one sequence."""
    hashes, parent = [], None
    for tokens in token_blocks:
        parent = hash_block_tokens(parent, tokens)
        hashes.append(parent)
    return hashes


def take_cached_block(pool: BlockPool, tokens):
    """One block from the pool, cached under the hash of `tokens` as a first block."""
    (h,) = chain(tokens)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h)
    return block, h


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 5
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_get_new_blocks_takes_the_head():
    pool = BlockPool(5)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [0, 1]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert free_ids(pool) == [2, 3, 4]
    assert pool.get_num_free_blocks() == 3


def test_get_too_many_blocks_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0]


def test_finished_chain_is_freed_tail_first_and_unhashed_blocks_go_to_the_front():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # a request's chain: 0, 1, 2 full and cached, 3 partial
    for block, h in zip(blocks, chain((1, 2), (3, 4), (5, 6))):
        pool.cache_block(block, h)
    assert free_ids(pool) == [4, 5]
    pool.free_blocks(reversed(blocks))  # what KVCacheManager.free passes
    # 3 held nothing reusable: first out. The chain's tail (2) is evicted before its head (0).
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6


def test_unhashed_blocks_freed_together_keep_their_order_at_the_front():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.cache_block(b[0], chain((9, 9))[0])
    pool.free_blocks(b)  # 2 hashed -> back; 3 unhashed -> front
    pool.free_blocks(a)  # 0 -> front, then 1 -> front
    assert free_ids(pool) == [1, 0, 3, 4, 2]


def test_remove_from_the_middle_touches_only_the_neighbours(monkeypatch):
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)

    def no_walk(self):
        raise AssertionError("remove must not walk the queue")
    monkeypatch.setattr(FreeKVCacheBlockQueue, "__iter__", no_walk)
    queue.remove(blocks[2])
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert queue.num_free_blocks == len(queue) == 4
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    monkeypatch.undo()
    assert [b.block_id for b in queue] == [1, 3]
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[3]
    with pytest.raises(ValueError):
        queue.popleft()


def test_queue_rejects_removing_an_absent_block_and_inserting_twice():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])
    with pytest.raises(RuntimeError):
        queue.append(blocks[0])
    with pytest.raises(RuntimeError):
        queue.appendleft(blocks[2])
    queue.appendleft(blocks[1])
    assert [b.block_id for b in queue] == [1, 0, 2]
    assert len(queue) == 3


def test_eviction_order_is_the_free_queue_order():
    pool = BlockPool(4)
    hashes = chain((1,), (2,), (3,), (4,))
    blocks = pool.get_new_blocks(4)
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert free_ids(pool) == [2, 0, 3, 1]
    for expected in (2, 0, 3, 1):
        (got,) = pool.get_new_blocks(1)
        assert got.block_id == expected and got.block_hash is None
        assert pool.get_cached_block(hashes[expected]) is None
        # Every block still in the queue is still findable.
        assert all(pool.get_cached_block(hashes[b.block_id]) is b for b in pool.free_block_queue)


def test_lazy_eviction_a_freed_block_stays_findable_until_handed_out():
    pool = BlockPool(3)
    block, h = take_cached_block(pool, (5, 6))
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_hash == h
    assert pool.get_cached_block(h) is block
    assert pool.num_cached_free_blocks() == 1
    # Revived by a hit: out of the free queue, referenced again.
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 2, 0]
    # Handing out the other blocks leaves it cached; handing it out forgets its hash.
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is block
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None and block.ref_cnt == 1
    assert pool.get_cached_block(h) is None
    assert pool.cached_block_hash_to_block == {}


def test_shared_block_ref_counts():
    pool = BlockPool(3)
    block, h = take_cached_block(pool, (1, 2))
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [1, 2]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [1, 2, 0]


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [0, 1]  # unchanged by the failed free


def test_first_block_to_cache_a_hash_keeps_it():
    pool = BlockPool(3)
    (h,) = chain((1, 1))
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h)
    pool.cache_block(b, h)  # a duplicate computed before `a` was cached: stays private
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([a, b])
    assert free_ids(pool) == [1, 2, 0]
    pool.uncache_block(b)  # uncaching the duplicate must not drop a's entry
    assert pool.get_cached_block(h) is a


def test_no_caching_when_disabled():
    pool = BlockPool(2, enable_caching=False)
    block, h = take_cached_block(pool, (1, 1))
    assert block.block_hash is None and pool.get_cached_block(h) is None


def test_reset_prefix_cache():
    pool = BlockPool(3)
    hashes = chain((1,), (2,))
    blocks = pool.get_new_blocks(2)
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False  # block 1 in use: nothing changes
    assert pool.get_cached_block(hashes[0]) is blocks[0] and blocks[1].block_hash == hashes[1]
    pool.free_blocks(blocks[1:])
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == order and pool.get_num_free_blocks() == 3


def test_usage_and_cached_free_count():
    pool = BlockPool(4)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == 0.75
    pool.cache_block(blocks[0], chain((3,))[0])
    pool.free_blocks(blocks[:2])
    assert pool.get_usage() == 0.25
    assert pool.num_cached_free_blocks() == 1
