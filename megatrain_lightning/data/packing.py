"""Packing short samples into full rows: fewer padding tokens, the same samples, no attention across them.

A padded batch is as wide as its longest sample, so with samples of mixed length much of each step is
spent on padding. Packing fills rows of ``max_length`` tokens with several samples each (best-fit
decreasing: the longest sample first, each into the fullest row it still fits), once, at setup; the
loader then shuffles rows. ``collate_packed`` (``sft_batch.py``) restarts position ids per sample, which is
how the model keeps each sample's attention to itself. The trade: the order of samples within an epoch
is fixed by the packing (rows are shuffled, not samples), and every step has about ``batch_size x
max_length`` tokens, so memory is that of full rows.
"""

from __future__ import annotations

import bisect


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity`` tokens, best-fit decreasing.

    Each length must be at most ``capacity``. Rows come out in the order they were opened (the first
    holds the longest sample); within a row, indices are in the order placed.
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted: the fullest row that fits is found by bisect
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than a row's {capacity}")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows
