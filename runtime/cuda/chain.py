"""A decode step's launches waiting on counts instead of on the whole grid before them (flag
K4_COUNT_WAIT; kernels_cu/chain.cuh, docs/PERF.md session 54).

Today every decode kernel waits for the kernel before it with griddepcontrol.wait: the whole grid
ends and its writes are flushed before any block of the next one reads. With K4_COUNT_WAIT each
linked launch of a one-token step (the products on gemv_q8 and gemv_q8_pair, attn_short, and
sample_finish, the step's last) gets a slot of an int32 array: its blocks add up to CHAIN_DONE
there once their writes are done, and the next linked launch's blocks poll that slot instead of
waiting for the grid. A Chain hands the slots out in launch order, one step at a time.

Only consecutive launches can pair up: a launch the chain did not link (any other kernel, seen by
launch.launch_count) counts nothing, so the next linked launch waits for the grid before it
(CHAIN_GRID in its `at`), as every kernel does without the flag. Importable without CuPy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .constants import CHAIN_GRID

# The define that builds a module's kernels with the chain's waits and counts (kernels_cu/chain.cuh).
COUNT_WAIT_DEFINE = "K4_COUNT_WAIT=1"

# A launch's (chain, at) arguments without a chain: a null pointer and 0.
NO_CHAIN = (np.uint64(0), np.int32(0))

# Linked launches a layer makes at most: three q/k/v runs, attention, the output product, separate gate and
# up products, the down product.
LINKS_PER_LAYER = 8


def chain_slots(n_layer: int) -> int:
    """The slots a decode step of n_layer layers may link: every layer's, the output head's and the
    last launch's, with room to spare."""
    return LINKS_PER_LAYER * n_layer + 8


class ChainFull(RuntimeError):
    """A decode step linked more launches than its slots hold."""


class Chain:
    """The slots of one decode step. slots: the device int32 array (zeros at the step's start;
    the step's last launch zeroes what the step used), n_slots its length; launches: a function
    returning how many kernel launches this thread has made so far (launch.launch_count), so the
    chain sees launches it did not link."""

    def __init__(self, slots, n_slots: int, launches: Callable[[], int]):
        if n_slots < 1:
            raise ValueError(f"a chain needs at least one slot, got {n_slots}")
        self.slots, self.n_slots, self._launches = slots, n_slots, launches
        self.used = 0  # slots handed out
        self._counted_at = None  # launch_count() right after the last counting launch, or None
        self.closed = False  # the step's last launch is linked: nothing may follow

    def _at(self) -> int:
        """This launch's `at`: the next slot, plus CHAIN_GRID unless the launch just before it was
        a linked, counting one."""
        if self.closed:
            raise RuntimeError("a launch linked after the decode step's last (Chain.last)")
        if self.used >= self.n_slots:
            raise ChainFull(f"a decode step linked more than {self.n_slots} launches; the chain's slots "
                            "(buffers.chain_slots) are too few for this model")
        follows = self._counted_at is not None and self._launches() == self._counted_at
        return self.used | (0 if follows else CHAIN_GRID)

    def link(self) -> tuple:
        """The (chain, at) kernel arguments of the next launch, one that waits and counts
        (chain.cuh chain_wait, chain_count). Call it right before that launch, then launch."""
        at = self._at()
        self.used += 1
        self._counted_at = self._launches() + 1  # after this launch
        return self.slots, np.int32(at)

    def last(self) -> tuple:
        """The (chain, at) kernel arguments of the step's last launch (sample_finish): it waits,
        counts nothing, and zeroes slots 0 .. at - 1 (chain.cuh chain_reset). No launch may follow
        in the step."""
        at = self._at()
        self._counted_at, self.closed = None, True
        return self.slots, np.int32(at)


def chain_args(chain: Chain | None) -> tuple:
    """The (chain, at) kernel arguments of a launch that may be linked: chain.link()'s, or a null
    pointer and 0 without a chain (chain.cuh: the kernel as without the flag)."""
    return chain.link() if chain is not None else NO_CHAIN


def last_args(chain: Chain | None) -> tuple:
    """The (chain, at) kernel arguments of the step's last launch: chain.last()'s, or a null pointer
    and 0 without a chain."""
    return chain.last() if chain is not None else NO_CHAIN


def waits_for_grid(at: int) -> bool:
    """Whether a launch given `at` waits by griddepcontrol.wait (the launch before it counts nothing)."""
    return bool(at & CHAIN_GRID)


def slot_of(at: int) -> int:
    """The slot a launch given `at` counts into."""
    return int(at) & ~CHAIN_GRID

