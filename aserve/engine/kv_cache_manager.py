"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, a block table per
request, and prefix caching by block hash. Pure logic: it never touches a tensor.

Block lifecycle::

    free (no hash) ──allocate──► in use (ref_cnt ≥ 1) ──full──► in use + hashed
          ▲                                                        │ free (ref 0)
          │                                                        ▼
          └───────── evicted (LRU, hash dropped) ◄────────── free + hashed ──hit──► in use

Free blocks that have been used sit in one LRU queue; a hashed block in it can still be
hit by a new request until it is handed out again. A request's blocks are freed tail
first so its last blocks, the least likely to be shared, are evicted first. A freed
block without a hash (a request's partial last block, or a duplicate of a block already
cached) holds nothing anyone can hit, so it goes to the front of the queue.

Blocks never used yet are a separate stack, handed out in id order. The worker commits
the KV pool's pages lazily, on first write, so a pool whose queue cycled through every
block would end up resident in full, the cache of a short load included; and each first
write is a page fault on the step's path. So a never-used block is handed out only while
the queue of used free blocks is shorter than the reserve (``prefix_cache_reserve`` of
the pool, a quarter by default): beyond it, the queue's oldest block is evicted instead.
The resident pool then stays near what requests hold plus the reserve, and the whole
pool is used once requests need it. vLLM touches its whole pool at start and caches
into all of it; with a reserve of 1.0 aserve does too, once the pool has been touched.

Block 0 is reserved (always zero in the cache tensors) and never handed out.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from aserve.config import DEFAULT_PREFIX_CACHE_RESERVE
from aserve.engine.request import Request


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, cache_reserve: int) -> None:
        """``cache_reserve``: used free blocks kept before a never-used one is handed out
        (``num_blocks - 1``: every block is used once before any is evicted)."""
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.num_usable_blocks = num_blocks - 1
        self.cache_reserve = cache_reserve
        # Used free blocks in LRU order: the first entry is evicted first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._fresh: deque[KVCacheBlock] = deque(self.blocks[1:])  # never handed out, by id
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._fresh)

    @property
    def num_fresh_blocks(self) -> int:
        """Blocks never handed out (their cache pages not yet written)."""
        return len(self._fresh)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def _next_free(self) -> KVCacheBlock:
        if self._free:
            oldest = next(iter(self._free.values()))
            # An unhashed block holds nothing to keep; a hashed one is evicted once the
            # queue has reached the reserve, or when no block is left untouched.
            if oldest.block_hash is None or len(self._free) >= self.cache_reserve or not self._fresh:
                del self._free[oldest.block_id]
                return oldest
        return self._fresh.popleft()

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[KVCacheBlock]:
        """Hand out ``n`` free blocks (evicting their cached contents)."""
        out = []
        for _ in range(n):
            block = self._next_free()
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to cached blocks a new request shares."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference. A block no longer used joins the end of the LRU queue if it
        is cached, and its front if not (see the module docstring)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def register(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Make a full block findable by its hash (the first block with a hash wins)."""
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            block.block_hash = block_hash

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Which blocks each request owns, and which of them are shared through the cache."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool,
                 prefix_cache_reserve: float = DEFAULT_PREFIX_CACHE_RESERVE) -> None:
        self.pool = BlockPool(num_blocks, cache_reserve=round(prefix_cache_reserve * (num_blocks - 1)))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_registered: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of the request's leading full blocks already in the cache.

        At least one token is always left to compute, since the step that computes it
        produces the logits for the next token. Requests asking for prompt logprobs
        get no hit: those need logits at every prompt position.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached: list[KVCacheBlock] = ()) -> list[int] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens.

        ``cached`` are prefix blocks found by :meth:`find_cached_prefix` for a request
        being scheduled from the waiting queue. Returns the ids of the blocks newly
        added to its table (cached ones first), or None, changing nothing, when the
        pool is short.
        """
        blocks = self._req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(cached)
        # Cached blocks that nobody holds sit in the free queue: using them shrinks it.
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self._req_blocks[request.request_id]
            return None
        self.pool.touch(cached)
        new_blocks = [*cached, *self.pool.take(max(needed, 0))]
        blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            registered = self._num_registered.get(request.request_id, 0)
            if cached:
                registered = max(registered, len(blocks) - len(new_blocks) + len(cached))
            full = min((num_computed + num_new_tokens) // self.block_size, len(request.block_hashes))
            for i in range(registered, full):
                self.pool.register(blocks[i], request.block_hashes[i])
            self._num_registered[request.request_id] = max(registered, full)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.release(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
