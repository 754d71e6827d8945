"""The block pool, block tables and prefix caching, without any tensor."""

from __future__ import annotations

from aserve.engine.kv_cache_manager import KVCacheManager
from aserve.engine.request import Request
from aserve.sampling_params import SamplingParams
from aserve.wire.messages import EngineCoreRequest


def make_request(rid: str, tokens: list[int], *, salt: str | None = None, block_size: int = 4) -> Request:
    req = Request(EngineCoreRequest(rid, tokens, SamplingParams(), cache_salt=salt), max_model_len=1000)
    req.update_block_hashes(block_size)
    return req


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    req = make_request("a", list(range(10)))
    assert kv.allocate(req, 10) == [1, 2, 3]
    assert kv.pool.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert kv.allocate(req, 2) == []  # fits in the third block
    assert kv.allocate(req, 3) == [4]
    kv.free(req)
    assert kv.pool.num_free_blocks == 8
    assert kv.usage == 0.0


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    big = make_request("big", list(range(20)))
    assert kv.allocate(big, 20) is None
    assert kv.pool.num_free_blocks == 3
    assert kv.block_ids("big") == []


def test_block_hashes_chain_and_salt():
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(12)))
    c = make_request("c", list(range(12)), salt="tenant-2")
    d = make_request("d", [99, *range(1, 12)])
    assert len(a.block_hashes) == 3
    assert a.block_hashes == b.block_hashes
    assert not set(a.block_hashes) & set(c.block_hashes)  # the salt isolates the cache
    assert not set(a.block_hashes) & set(d.block_hashes)  # a changed first block changes every later hash


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    kv.allocate(a, 12)
    b = make_request("b", list(range(12)))
    hits = kv.find_cached_prefix(b)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit.
    assert [blk.block_id for blk in hits] == kv.block_ids("a")[:2]
    assert kv.allocate(b, 4, hits) is not None
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert hits[0].ref_cnt == 2


def test_lru_eviction_prefers_oldest_and_tail_blocks():
    # A reserve of the whole pool: every block is used before any cached one is evicted.
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True, prefix_cache_reserve=1.0)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8)
    kv.free(a)  # blocks 1, 2 are free but still cached
    assert kv.pool.num_free_blocks == 4
    again = make_request("again", list(range(8)) + [50])
    assert len(kv.find_cached_prefix(again)) == 2
    # Taking 3 blocks evicts the unhashed block first, then a's tail block (2), keeping its head (1).
    other = make_request("other", list(range(100, 112)))
    kv.allocate(other, 12)
    assert [b.block_id for b in kv.find_cached_prefix(again)] == [1]


def test_reset_prefix_cache_forgets_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    kv.allocate(make_request("a", list(range(9))), 9)
    req = Request(EngineCoreRequest("b", list(range(9)), SamplingParams(prompt_logprobs=1)), max_model_len=100)
    req.update_block_hashes(4)
    assert kv.find_cached_prefix(req) == []


def test_freed_blocks_without_a_hash_are_reused_before_untouched_ones():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))  # two full blocks and a partial one
    assert kv.allocate(a, 10) == [1, 2, 3]
    kv.free(a)
    b = make_request("b", list(range(100, 104)))
    # The partial block 3 is reused; untouched blocks 4.. stay untouched.
    assert kv.allocate(b, 4) == [3]
    # a's full blocks are still cached, and the next allocation takes an untouched block.
    c = make_request("c", list(range(200, 204)))
    assert kv.allocate(c, 4) == [4]
    assert [blk.block_id for blk in kv.find_cached_prefix(make_request("d", list(range(9))))] == [1, 2]


def test_without_prefix_caching_freed_blocks_are_reused_first():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    for i in range(5):
        req = make_request(f"r{i}", list(range(12)))
        assert kv.allocate(req, 12) == [1, 2, 3]
        kv.free(req)


def test_cached_blocks_beyond_the_reserve_are_evicted_before_untouched_blocks_are_used():
    # 16 usable blocks, a reserve of a quarter: 4 freed cached blocks are kept.
    kv = KVCacheManager(num_blocks=17, block_size=4, enable_prefix_caching=True, prefix_cache_reserve=0.25)
    assert kv.pool.cache_reserve == 4
    handed_out = set()
    for i in range(10):  # ten 3-block requests one after another, no prefix shared
        req = make_request(f"r{i}", list(range(100 * i, 100 * i + 12)))
        ids = kv.allocate(req, 12)
        assert ids is not None
        handed_out.update(ids)
        kv.free(req)
    # Only the first blocks were ever touched: no more than one request holds plus the
    # reserve (a block is taken untouched while fewer than 4 wait in the queue).
    assert handed_out == set(range(1, 7))
    assert kv.pool.num_fresh_blocks == 10 and kv.pool.num_free_blocks == 16
    # The reserve keeps the latest requests' blocks: the last one is still a hit, the
    # first one's blocks were handed out again.
    assert len(kv.find_cached_prefix(make_request("again9", list(range(900, 912)) + [1]))) == 3
    assert kv.find_cached_prefix(make_request("again0", list(range(0, 12)) + [1])) == []


def test_untouched_blocks_are_used_when_requests_need_them():
    kv = KVCacheManager(num_blocks=17, block_size=4, enable_prefix_caching=True, prefix_cache_reserve=0.25)
    a = make_request("a", list(range(12)))
    kv.allocate(a, 12)
    kv.free(a)
    # 13 blocks at once: the 3 cached ones are below the reserve, so untouched blocks go
    # first, and the cached ones are evicted only when nothing untouched is left.
    big = make_request("big", list(range(1000, 1064)))
    assert kv.allocate(big, 52) == list(range(4, 17))
    assert kv.pool.num_fresh_blocks == 0
    assert len(kv.find_cached_prefix(make_request("a2", list(range(12)) + [1]))) == 3
    assert kv.allocate(big, 56)[-1] in (1, 2, 3)  # one more block: a cached one, evicted
    assert kv.pool.num_free_blocks == 2


def test_reserve_zero_reuses_every_freed_block_first():
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True, prefix_cache_reserve=0.0)
    for i in range(4):
        req = make_request(f"r{i}", list(range(100 * i, 100 * i + 8)))
        assert sorted(kv.allocate(req, 8)) == [1, 2]
        kv.free(req)
    assert kv.pool.num_fresh_blocks == 6
