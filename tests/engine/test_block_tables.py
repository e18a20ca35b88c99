"""A step's block tables and layout: built from what changed, equal to the tables themselves."""

import random

import numpy as np

from engine.attention.base import SeqSlice, lay_out
from engine.attention.block_tables import BlockTables


class Seq:
    """An owner of a block table (the engine's Sequence, by identity)."""

    def __init__(self, block_table):
        self.block_table = block_table


def _rows_hold(tables: BlockTables, rows: list[int], seqs: list[Seq]) -> bool:
    return all(list(tables.array[row, : len(s.block_table)]) == s.block_table for row, s in zip(rows, seqs))


def test_a_decoding_step_sends_only_the_blocks_it_appended():
    """What rank 0 broadcasts to the other ranks each step: nothing while no block is added,
    one block when a sequence crosses into a new one, however long the tables are."""
    seqs = [Seq(list(range(i * 3000, i * 3000 + 2048))) for i in range(4)]  # 32k tokens each at block size 16
    rank0, rank1 = BlockTables(), BlockTables()
    rows, updates = rank0.sync([(s, s.block_table) for s in seqs])
    assert sorted(len(u.block_ids) for u in updates) == [2048] * 4
    for copy in (rank0, rank1):
        copy.apply(updates)
    assert rank0.sync([(s, s.block_table) for s in seqs]) == (rows, [])
    seqs[2].block_table.append(99_999)
    again, updates = rank0.sync([(s, s.block_table) for s in seqs])
    assert again == rows
    assert [(u.row, u.start, u.block_ids) for u in updates] == [(rows[2], 2048, [99_999])]
    for copy in (rank0, rank1):
        copy.apply(updates)
    assert _rows_hold(rank0, rows, seqs) and _rows_hold(rank1, rows, seqs)
    np.testing.assert_array_equal(rank0.array, rank1.array)


def test_a_replaced_table_is_sent_whole_and_rows_of_finished_sequences_are_reused():
    tables = BlockTables(rows=2, width=2)
    a, b = Seq([1, 2, 3]), Seq([4])
    rows, updates = tables.sync([(a, a.block_table), (b, b.block_table)])
    tables.apply(updates)
    a.block_table = [7, 8]  # preempted and readmitted, or its blocks traded: a new list
    rows2, updates = tables.sync([(a, a.block_table)])  # b finished: its row is free again
    assert rows2 == rows[:1] and [(u.start, u.block_ids) for u in updates] == [(0, [7, 8])]
    tables.apply(updates)
    c, d = Seq([5, 6]), Seq(list(range(10, 20)))
    rows3, updates = tables.sync([(a, a.block_table), (c, c.block_table), (d, d.block_table)])
    tables.apply(updates)
    assert rows3[1] == rows[1] and len(set(rows3)) == 3  # b's row, then a grown array
    assert _rows_hold(tables, rows3, [a, c, d])


def test_an_in_place_change_to_a_synced_block_is_caught():
    """The invariant's tripwire: a table changed in place (not grown) is resent whole."""
    tables = BlockTables()
    a = Seq([1, 2, 3])
    rows, updates = tables.sync([(a, a.block_table)])
    tables.apply(updates)
    a.block_table[2] = 9
    _, updates = tables.sync([(a, a.block_table)])
    tables.apply(updates)
    assert _rows_hold(tables, rows, [a])


def test_a_step_over_some_sequences_keeps_the_others_rows():
    """The draft model's later forwards cover only the sequences still guessing."""
    tables = BlockTables()
    a, b = Seq([1, 2]), Seq([3, 4])
    rows, updates = tables.sync([(a, a.block_table), (b, b.block_table)])
    tables.apply(updates)
    assert tables.sync([(a, a.block_table)], release_absent=False) == ([rows[0]], [])
    assert tables.sync([(a, a.block_table), (b, b.block_table)]) == (rows, [])


def _reference_layout(slices: list[tuple[list[int], int, int, bool]], block_size: int):
    """A step's layout token by token, from the lists themselves."""
    slot_blocks, slot_offsets, decode_tables, decode_lens, chunks = [], [], [], [], []
    row = 0
    for table, context, num, decode in slices:
        for pos in range(context, context + num):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        if decode:
            for length in range(context + 1, context + num + 1):
                decode_tables.append(table[: -(-length // block_size)])
                decode_lens.append(length)
        else:
            chunks.append((row, context, num, table[: -(-(context + num) // block_size)]))
        row += num
    return slot_blocks, slot_offsets, decode_tables, decode_lens, chunks


def test_the_layout_is_the_one_computed_token_by_token():
    rng = random.Random(0)
    block_size = 4
    for trial in range(20):
        seqs = []
        for i in range(rng.randint(1, 8)):
            decode = i < rng.randint(0, 8)
            context = rng.randint(0, 60)
            num = rng.randint(1, 4) if decode else rng.randint(1, 30)
            blocks = rng.sample(range(500), -(-(context + num) // block_size))
            seqs.append((blocks, context, num, decode))
        seqs.sort(key=lambda s: not s[3])  # decode slices first
        owners = [Seq(blocks) for blocks, *_ in seqs]
        tables = BlockTables(rows=2, width=3)
        earlier = [Seq(rng.sample(range(500), 20)) for _ in owners]  # rows that held other, longer tables
        tables.apply(tables.sync([(o, o.block_table) for o in earlier])[1])
        tables.sync([])
        rows, updates = tables.sync([(o, o.block_table) for o in owners])
        tables.apply(updates)
        layout = lay_out([SeqSlice(row, context, num, decode) for row, (_, context, num, decode) in zip(rows, seqs)], tables.array, block_size)
        slot_blocks, slot_offsets, decode_tables, decode_lens, chunks = _reference_layout(seqs, block_size)
        assert layout.slot_blocks.tolist() == slot_blocks and layout.slot_offsets.tolist() == slot_offsets
        assert layout.decode_lens.tolist() == decode_lens
        assert [list(t[: len(want)]) for t, want in zip(layout.decode_tables(), decode_tables)] == decode_tables
        got_chunks = zip(layout.chunk_first_rows, layout.chunk_context_lens, layout.chunk_num_tokens, layout.chunk_tables())
        assert [(int(r), int(c), int(n), list(t[: len(want[3])])) for (r, c, n, t), want in zip(got_chunks, chunks)] == chunks
        assert layout.num_chunks == len(chunks)
