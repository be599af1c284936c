"""Weighted, deterministic blending of token datasets.

`Mixture.sample(i)` is a pure function of (seed, i): no iteration state, so any rank can compute
any sample, and resuming is just knowing the next index.

How sample i is chosen:
1. Source. Indices are cut into blocks of `block_size`. Every block holds the same number of
   samples from each source (the weights, apportioned to whole slots), in an order shuffled per
   block with an RNG keyed by (seed, block). So the mix is exact over every block, not just on
   average, and the position of a sample in the batch says nothing about its source.
2. Instance. Within a block, source k's slots are numbered in order, which gives sample i a
   running count j among source k's samples (block * slots_k + rank in block). With n_k
   instances, j lies in epoch j // n_k at position j % n_k of a permutation of range(n_k) keyed
   by (seed, k, epoch): every instance is seen exactly once per epoch of its source.
Block orders and permutations are computed on first use and kept in small LRU caches.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from optimus.data.dataset import TokenDataset
from optimus.data.errors import DataError

DEFAULT_BLOCK_SIZE = 4096
# Tags that keep the RNG streams of the two uses of randomness apart for the same seed.
_BLOCK_ORDER_STREAM = 1
_INSTANCE_ORDER_STREAM = 2


def apportion_slots(weights: Sequence[float], block_size: int) -> list[int]:
    """Split `block_size` slots among sources in proportion to `weights` (largest remainder).

    Every source with a positive weight gets at least one slot, so none is silently dropped.
    """
    total = float(sum(weights))
    exact = [block_size * w / total for w in weights]
    slots = [max(1, math.floor(x)) if w > 0 else 0 for x, w in zip(exact, weights)]
    # Hand out the missing slots to the most under-served sources (ties: lowest index), and take
    # back any excess (from the "at least one" rule) from the most over-served ones.
    while sum(slots) < block_size:
        k = max((k for k in range(len(weights)) if weights[k] > 0), key=lambda k: exact[k] - slots[k])
        slots[k] += 1
    while sum(slots) > block_size:
        k = max((k for k in range(len(weights)) if slots[k] > 1), key=lambda k: slots[k] - exact[k])
        slots[k] -= 1
    return slots


class _LRUCache:
    """A tiny least-recently-used cache for the per-block and per-epoch arrays."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()

    def get(self, key, compute: Callable[[], np.ndarray]) -> np.ndarray:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._items[key] = compute()
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value


class Mixture:
    """Samples of seq_len + 1 tokens drawn from `datasets` in proportion to `weights`."""

    def __init__(
        self,
        datasets: Sequence[TokenDataset],
        weights: Sequence[float],
        seq_len: int,
        seed: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        """Check the inputs and precompute the per-block slot counts (nothing is read yet)."""
        if not datasets:
            raise DataError("a data mixture needs at least one source: add one under data.sources")
        if len(weights) != len(datasets):
            raise DataError(f"{len(datasets)} data sources but {len(weights)} weights: give one weight per source")
        if any(not math.isfinite(w) or w < 0 for w in weights) or not 0 < sum(weights) < math.inf:
            raise DataError(f"mixture weights {list(weights)} are invalid: use non-negative numbers, not all zero, whose "
                            "sum is finite (e.g. token counts or fractions)")
        if seed < 0:
            raise DataError(f"seed is {seed}: use a non-negative integer")
        if block_size < len(datasets):
            raise DataError(f"block_size {block_size} is smaller than the {len(datasets)} sources: raise it")
        tokenizers = {ds.tokenizer_sha256 for ds in datasets if ds.tokenizer_sha256}
        if len(tokenizers) > 1:
            raise DataError("the data sources were tokenized with different tokenizers: re-tokenize them with one")
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.seq_len = seq_len
        self.seed = int(seed)
        self.block_size = block_size
        self.instances_per_source = [ds.num_instances(seq_len) for ds in self.datasets]
        self.slots_per_block = apportion_slots(self.weights, block_size)
        self._slot_sources = np.repeat(np.arange(len(datasets)), self.slots_per_block)
        self._block_orders = _LRUCache(capacity=4)
        self._permutations = _LRUCache(capacity=2 * len(datasets) + 2)

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, *key])))

    def _block_order(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position, its running count among that source's slots) in `block`."""

        def compute():
            sources = self._rng(_BLOCK_ORDER_STREAM, block).permutation(self._slot_sources)
            ranks = np.empty(self.block_size, dtype=np.int64)
            for k in range(len(self.datasets)):
                positions = np.flatnonzero(sources == k)
                ranks[positions] = np.arange(len(positions))
            return sources, ranks

        return self._block_orders.get(block, compute)

    def _instance_permutation(self, source: int, epoch: int) -> np.ndarray:
        def compute():
            count = self.instances_per_source[source]
            dtype = np.int32 if count < 2**31 else np.int64  # halves the cache for big sources
            return self._rng(_INSTANCE_ORDER_STREAM, source, epoch).permutation(count).astype(dtype)

        return self._permutations.get((source, epoch), compute)

    def locate(self, global_index: int) -> tuple[int, int, int]:
        """(source, epoch of that source, instance index) that sample `global_index` reads."""
        if global_index < 0:
            raise IndexError(f"sample index {global_index} is negative")
        block, position = divmod(int(global_index), self.block_size)
        sources, ranks = self._block_order(block)
        source = int(sources[position])
        seen_before = block * self.slots_per_block[source] + int(ranks[position])
        epoch, offset = divmod(seen_before, self.instances_per_source[source])
        return source, epoch, int(self._instance_permutation(source, epoch)[offset])

    def source_of(self, global_index: int) -> int:
        """Which source sample `global_index` comes from."""
        return self.locate(global_index)[0]

    def sample(self, global_index: int) -> np.ndarray:
        """Sample `global_index`: int64 tokens of shape [seq_len + 1]; same (seed, index), same sample."""
        source, _, instance = self.locate(global_index)
        return self.datasets[source].instance(instance, self.seq_len)

    def epochs_seen(self, num_samples: int) -> list[float]:
        """How many passes over each source the first `num_samples` samples make (for logging)."""
        full_blocks, rest = divmod(num_samples, self.block_size)
        counts = [full_blocks * slots for slots in self.slots_per_block]
        if rest:
            sources, _ = self._block_order(full_blocks)
            for k, extra in enumerate(np.bincount(sources[:rest], minlength=len(self.datasets))):
                counts[k] += int(extra)
        return [count / n for count, n in zip(counts, self.instances_per_source)]
