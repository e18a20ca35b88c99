"""The block tables of the sequences a model runner steps, as rows of one persistent array.

A decode step used to copy every sequence's whole block table out of its Python list into the
step's tensors: at batch 64 and context 32k (2,048 blocks a sequence) that was 6-8 ms of
Python a step, more than an H100 decode step of a 1.5B model. Here each sequence keeps a row
of a numpy array for as long as it is scheduled, and a step writes only what changed since
the last: the blocks appended (usually none, one every ``block_size`` tokens), or the whole
table when it was replaced. A step's tables are then slices and gathers of that array.

Who writes what: rank 0's runner computes a step's ``TableUpdate``s from its sequences
(``sync``); every rank (rank 0 included) applies them to its own copy (``apply``) before it
builds the step's attention metadata, so a tensor-parallel rank receives only the changes.

A change is seen by identity and length: a sequence's ``block_table`` list only grows in place
(``extend``); any other change assigns a new list (engine.sequence.Sequence.block_table). A
row also checks its last synced block against the list, and resends the whole table if they
differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_INITIAL_ROWS = 64
_INITIAL_WIDTH = 256  # blocks a row holds before the array widens (4k tokens at block size 16)


@dataclass(slots=True)
class TableUpdate:
    """Write ``block_ids`` into row ``row`` from column ``start`` (a broadcast message: plain data)."""

    row: int
    start: int
    block_ids: list[int]


@dataclass(slots=True)
class _Tracked:
    row: int
    table: list[int]  # the sequence's own list (held: its identity is how a replacement is seen)
    num_synced: int
    stamp: int  # the last sync that saw it


class BlockTables:
    """Rows of block ids: ``array[row, :n]`` is a sequence's first ``n`` blocks.

    Columns past a table's length hold stale (but valid) block ids: the metadata's lengths keep
    them from being attended."""

    def __init__(self, rows: int = _INITIAL_ROWS, width: int = _INITIAL_WIDTH):
        self.array = np.zeros((rows, width), dtype=np.int64)
        self._tracked: dict[object, _Tracked] = {}  # owner (a Sequence, compared by identity) -> its row
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        self._num_rows = rows
        self._stamp = 0

    @classmethod
    def holding(cls, tables: list[list[int]]) -> "BlockTables":
        """Tables for a one-off step over ``tables``, in rows 0, 1, ... (not tracked)."""
        block_tables = cls(rows=max(1, len(tables)), width=max([1, *map(len, tables)]))
        block_tables.apply([TableUpdate(row, 0, list(table)) for row, table in enumerate(tables)])
        return block_tables

    def sync(self, owned_tables: list[tuple[object, list[int]]], release_absent: bool = True) -> tuple[list[int], list[TableUpdate]]:
        """The rows of this step's tables (``(owner, block_table)`` pairs), and the updates that bring
        the rows up to date. Owners absent from the step give their rows back (unless
        ``release_absent`` is False: a step over some of the sequences of the last)."""
        self._stamp += 1
        rows: list[int] = []
        updates: list[TableUpdate] = []
        for owner, table in owned_tables:
            tracked = self._tracked.get(owner)
            if tracked is None:
                tracked = self._tracked[owner] = _Tracked(self._take_row(), table, 0, self._stamp)
            elif tracked.table is not table or len(table) < tracked.num_synced or not self._last_synced_matches(tracked):
                tracked.table, tracked.num_synced = table, 0  # replaced: resend it whole
            tracked.stamp = self._stamp
            if len(table) > tracked.num_synced:
                updates.append(TableUpdate(tracked.row, tracked.num_synced, table[tracked.num_synced :]))
                tracked.num_synced = len(table)
            rows.append(tracked.row)
        if release_absent and len(self._tracked) > len(owned_tables):
            for owner in [o for o, t in self._tracked.items() if t.stamp != self._stamp]:
                self._free_rows.append(self._tracked.pop(owner).row)
        return rows, updates

    def apply(self, updates: list[TableUpdate]) -> None:
        """Write a step's updates into this copy (the array grows where they need it)."""
        for update in updates:
            end = update.start + len(update.block_ids)
            if update.row >= self.array.shape[0] or end > self.array.shape[1]:
                self._grow(update.row + 1, end)
            self.array[update.row, update.start : end] = update.block_ids

    def _last_synced_matches(self, tracked: _Tracked) -> bool:
        """A cheap check of the invariant (a table changes in place only by growing)."""
        last = tracked.num_synced - 1
        if last < 0:
            return True
        # Not in the array (a step prepared but never run): resent whole, as for any mismatch.
        return last < self.array.shape[1] and tracked.table[last] == self.array[tracked.row, last]

    def _take_row(self) -> int:
        if not self._free_rows:
            self._free_rows = list(range(2 * self._num_rows - 1, self._num_rows - 1, -1))
            self._num_rows *= 2
        return self._free_rows.pop()

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.array.shape
        grown = np.zeros((max(rows, old_rows), max(width, 2 * old_width if width > old_width else old_width)), dtype=np.int64)
        grown[:old_rows, :old_width] = self.array
        self.array = grown
