"""The decode graphs' block-table rows (engine/cuda_graphs.py): each host twin rewrites only
what changed since it was last used — the new blocks of a request whose list grew, whole rows
where another request (or a replaced list: preemption) took the row, padding where rows
emptied. Checked on CPU against writing every table whole from padding, over random steps."""

import random

import numpy as np

from splitserve.engine.cuda_graphs import _clear_rows, _write_row

SCRATCH = 999


def test_incremental_table_rows_equal_whole_tables_over_random_steps():
    rng = random.Random(7)
    bucket, width = 8, 12
    pad = np.full((bucket, width), SCRATCH, dtype=np.int64)
    twins = [(pad.copy(), [None] * bucket) for _ in range(2)]
    live: dict[int, list[int]] = {}  # request -> its block list (grown in place, or replaced)
    next_block = iter(range(10**6))
    for step in range(400):
        for rid in list(live):  # finish / preempt (a new list) / grow in place
            roll = rng.random()
            if roll < 0.08:
                del live[rid]
            elif roll < 0.14:
                live[rid] = [next(next_block) for _ in range(rng.randint(1, 3))]
            elif roll < 0.5 and len(live[rid]) < width:
                live[rid].append(next(next_block))
        while len(live) < rng.randint(1, bucket):
            live[len(live) + 1000 * step] = [next(next_block) for _ in range(rng.randint(1, 4))]
        batch = rng.sample(sorted(live), min(len(live), bucket))  # the rows' order changes too
        tables, rows = twins[step % 2]
        want = pad.copy()
        for i, rid in enumerate(batch):
            blocks = live[rid]
            n = rng.randint(max(1, len(blocks) - 1), len(blocks))  # the table may hold one block ahead
            _write_row(tables, rows, i, blocks, n, pad)
            want[i, :n] = blocks[:n]
        _clear_rows(tables, rows, len(batch), pad)
        assert np.array_equal(tables, want), step
