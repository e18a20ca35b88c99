"""LoRA adapters served beside the base model: each request may name one (multi-LoRA serving,
as vLLM's ``--lora-modules`` and S-LoRA do it), and a step's rows of different adapters share
the base model's matmuls.

Each decoder layer holds, per engine projection, every adapter slot's pair stacked
(``SlotStack``; read by ``engine.lora_loading``). A step adds ``(x[rows] @ A^T) @ B^T`` to each
projection's output for each adapter's rows (``AdapterRows``): in place where an adapter's rows
are contiguous, else through two batched matmuls over the stacked pairs, whatever the number of
adapters; a decode step on a GPU through every slot's pairs side by side (``RowSlots``), which a
CUDA graph replays. ``AdapterTable`` keeps which version of which adapter is in which slot, and frees a
slot once no running request uses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.host_to_device import to_device
from engine.lora_loading import PROJECTIONS, LoraPair, load_adapter

logger = logging.getLogger(__name__)


class SlotStack:
    """One engine projection's pairs of every adapter slot, stacked for batched matmuls:
    ``a`` [slots, in, rank] and ``b`` [slots, rank, out], ranks zero-padded to the largest, a slot
    whose adapter leaves the projection alone (or an empty slot) all zeros."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, present: list[bool], ranks: list[int]):
        self.a, self.b, self.present = a, b, present
        self.ranks = ranks  # each slot's own rank (0: empty)
        # Every slot's pair side by side, for RowSlots: a_cat [in, slots * rank] (slot-major
        # columns), b_cat [slots * rank, out] (a view of b), and each column's slot.
        slots, rank = a.shape[0], a.shape[2]
        self.a_cat = a.permute(1, 0, 2).reshape(a.shape[1], slots * rank)  # a view where a is SlotStack.of's
        self.b_cat = b.view(slots * rank, b.shape[2])
        self.column_slots = torch.arange(slots, device=a.device).repeat_interleave(rank)

    @classmethod
    def of(cls, pairs: list["LoraPair | None"], like: "LoraPair") -> "SlotStack":
        rank = max(p.a_t.shape[1] for p in pairs if p is not None)
        # a is a view of RowSlots' side-by-side layout ([in, slots * rank], slot-major): one copy.
        a = like.a_t.new_zeros((like.a_t.shape[0], len(pairs) * rank)).view(like.a_t.shape[0], len(pairs), rank).permute(1, 0, 2)
        b = like.b_t.new_zeros((len(pairs), rank, like.b_t.shape[1]))
        for slot, pair in enumerate(pairs):
            if pair is not None:
                a[slot, :, : pair.a_t.shape[1]] = pair.a_t
                b[slot, : pair.b_t.shape[0]] = pair.b_t
        return cls(a, b, [p is not None for p in pairs], [0 if p is None else p.a_t.shape[1] for p in pairs])

    def pairs(self) -> list["LoraPair | None"]:
        """Each slot's pair back at its own rank (views into the stack), None where empty: a
        stack rebuilt from them is padded to the largest rank still there, not to one unloaded."""
        return [LoraPair(self.a[s, :, : r], self.b[s, :r]) if here else None for s, (here, r) in enumerate(zip(self.present, self.ranks))]


class AdapterRows:
    """Which rows of one step go through which adapter: built once per step by the model
    runner, handed to every layer, which adds each adapter's delta to those rows' projections.

    Where each adapter's rows are already contiguous (a prompt chunk, a batch of one adapter)
    its delta is one pair of matmuls added in place. Else the rows with an adapter are gathered
    once per projection, grouped by adapter and padded to the largest group, and every group's
    delta comes from one batched matmul pair over the stacked weights (``SlotStack``), added back
    with one ``index_add_``: a step's cost in calls does not grow with its adapters."""

    def __init__(self, runs: list[tuple[int, int, int]], grouped: "_Grouped | None" = None):
        self.runs = runs  # (adapter slot, first, end) of contiguous rows (used where ``grouped`` is None)
        self.grouped = grouped

    @classmethod
    def of_slices(cls, slice_adapters: list[int], slice_lengths: list[int], device: str) -> "AdapterRows | None":
        """From each slice's adapter slot (-1: none) and row count, in step order; None when no
        row of the step has an adapter."""
        rows: dict[int, list[int]] = {}
        first = 0
        for slot, length in zip(slice_adapters, slice_lengths):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(first, first + length))
            first += length
        if not rows:
            return None
        if all(indices[-1] - indices[0] + 1 == len(indices) for indices in rows.values()):
            return cls([(slot, indices[0], indices[-1] + 1) for slot, indices in rows.items()])
        return cls([], _Grouped.of(rows, device))

    def add_deltas(self, out: torch.Tensor, x: torch.Tensor, stack: SlotStack) -> torch.Tensor:
        """``out`` (a projection's output for ``x``) with each adapter's delta added to its rows."""
        if self.grouped is None:
            for slot, first, end in self.runs:
                if stack.present[slot]:
                    out[first:end].addmm_(x[first:end] @ stack.a[slot], stack.b[slot])
            return out
        return self.grouped.add_deltas(out, x, stack)


class RowSlots:
    """Decode rows' adapters as one slot id per row on the device (-1: the base model), for a
    decode step on a GPU: each projection's delta is two matmuls over every slot's pairs side by
    side (``SlotStack.a_cat``, ``b_cat``), a row's columns of other slots zeroed between them.
    Three kernels a projection whatever the mix of adapters, and shapes that depend on the row
    count alone: a CUDA graph captured with a buffer of slot ids (engine.cuda_graphs) replays any
    mix. (Eagerly, the grouped path's gathers, padding and scatter took six; a step through
    adapters ran outside the graphs: on an H200, 23.4 ms for the 135M shape's batch of 32 through
    4 adapters against 1.47 ms for the base model's graph.) The extra work, every row through
    every slot's rank, is small beside the projection's own while slots x rank stays well below
    its output width."""

    def __init__(self, row_slots: torch.Tensor):
        self.row_slots = row_slots  # [rows] long

    def add_deltas(self, out: torch.Tensor, x: torch.Tensor, stack: SlotStack) -> torch.Tensor:
        if stack.a_cat.shape[1] == 0:
            return out
        hidden = torch.mm(x, stack.a_cat)
        # Other slots' columns to 0 (a fill, not a product: an inf there stays out of the row).
        hidden.masked_fill_(self.row_slots.unsqueeze(1) != stack.column_slots, 0.0)
        return out.addmm_(hidden, stack.b_cat)


class _Grouped:
    """A step's adapter rows grouped by adapter: each group padded to ``size`` rows for batched
    matmuls, or, where padding would more than double the rows (a long prompt chunk beside a few
    decode rows of other adapters), one matmul pair per group over its own rows (``runs``)."""

    # Padded rows past this many times the real ones: per-group matmuls instead.
    MAX_PADDING_FACTOR = 2

    def __init__(self, slots: list[int], size: int, gather: torch.Tensor, targets: torch.Tensor, real: torch.Tensor | None,
                 runs: list[tuple[int, int, int]] | None, device: str):
        self.slots = slots
        self.slot_index = to_device(slots, torch.long, device)
        self.slots_in_order = slots == list(range(len(slots)))  # the stack's first len(slots) slots as they are
        self.size = size
        self.gather = gather  # the rows of x to gather: padded (a group's first row repeated), or as ``targets``
        self.targets = targets  # the real rows, grouped by adapter
        self.real = real  # positions of the real rows among the padded ones (None: no padding)
        self.runs = runs  # per-group matmuls: (slot, first, end) in ``targets``; None: batched

    @classmethod
    def of(cls, rows: dict[int, list[int]], device: str) -> "_Grouped":
        size = max(len(indices) for indices in rows.values())
        targets = [row for indices in rows.values() for row in indices]
        if size * len(rows) > cls.MAX_PADDING_FACTOR * len(targets):
            runs, first = [], 0
            for slot, indices in rows.items():
                runs.append((slot, first, first + len(indices)))
                first += len(indices)
            index = to_device(targets, torch.long, device)
            return cls(list(rows), size, index, index, None, runs, device)
        gather, real = [], []
        for group, indices in enumerate(rows.values()):
            real.extend(range(group * size, group * size + len(indices)))
            gather.extend(indices + [indices[0]] * (size - len(indices)))
        padded = len(gather) != len(targets)
        return cls(list(rows), size, to_device(gather, torch.long, device), to_device(targets, torch.long, device),
                   to_device(real, torch.long, device) if padded else None, None, device)

    def add_deltas(self, out: torch.Tensor, x: torch.Tensor, stack: SlotStack) -> torch.Tensor:
        if not any(stack.present[slot] for slot in self.slots):
            return out
        if self.runs is not None:
            gathered = x.index_select(0, self.gather)
            deltas = out.new_zeros((len(self.targets), out.shape[-1]))
            for slot, first, end in self.runs:
                if stack.present[slot]:
                    torch.mm(gathered[first:end] @ stack.a[slot], stack.b[slot], out=deltas[first:end])
            return out.index_add_(0, self.targets, deltas)
        if self.slots_in_order and len(self.slots) == len(stack.present):  # every slot, in order: the stack as it is
            a, b = stack.a, stack.b
        else:
            a, b = stack.a.index_select(0, self.slot_index), stack.b.index_select(0, self.slot_index)
        gathered = x.index_select(0, self.gather).view(len(self.slots), self.size, x.shape[-1])
        deltas = torch.bmm(torch.bmm(gathered, a), b).view(-1, out.shape[-1])
        if self.real is not None:
            deltas = deltas.index_select(0, self.real)
        return out.index_add_(0, self.targets, deltas)


def install_adapter(model: torch.nn.Module, slot: int, adapter_dir: str | Path, dtype: torch.dtype, device: str) -> None:
    """Load an adapter for ``model``'s shard into slot ``slot`` of every decoder layer (replacing
    whatever the slot held)."""
    loaded = load_adapter(adapter_dir, model.config, model.shard, dtype, device)
    # Every projection's stack covers every slot a step may name (a row's slot indexes them all).
    num_slots = max([slot + 1, *(len(stack.present) for layer in model.layers for stack in layer.lora.values())])
    try:
        for layer, pairs in zip(model.layers, loaded):
            for projection in PROJECTIONS:
                _set_slot(layer, projection, slot, pairs.get(projection), num_slots)
    finally:  # also when it failed part way: some layers hold new stacks already
        _stacks_changed(model)
    logger.info("LoRA adapter %s loaded into slot %d", adapter_dir, slot)


def remove_adapter(model: torch.nn.Module, slot: int) -> None:
    """Free slot ``slot``'s weights in every decoder layer; the stacks shrink to the slots still
    held (a step's rows went through every slot's columns, the freed ones' zeros too)."""
    try:
        stacks = [stack for layer in model.layers for stack in layer.lora.values()]
        held = [s for stack in stacks for s, here in enumerate(stack.present) if here and s != slot]
        num_slots = max(held, default=-1) + 1  # (every projection covers every slot a step may name)
        for layer in model.layers:
            for projection in list(layer.lora):
                if slot < len(layer.lora[projection].present):  # a rank whose load failed never grew its stacks to the slot
                    _set_slot(layer, projection, slot, None, num_slots)
                elif len(layer.lora[projection].present) > num_slots:
                    _set_slot(layer, projection, None, None, num_slots)
    finally:
        _stacks_changed(model)


def _stacks_changed(model: torch.nn.Module) -> None:
    """Count a change of the model's stacks (new tensors): CUDA graphs that captured the old
    ones are stale (engine.cuda_graphs reads ``lora_version``)."""
    model.lora_version = getattr(model, "lora_version", 0) + 1


def _set_slot(layer: torch.nn.Module, projection: str, slot: int | None, pair: LoraPair | None, num_slots: int) -> None:
    """Restack one projection's ``num_slots`` slots with ``pair`` in ``slot`` (None: as they are;
    slots from ``num_slots`` on are empty), the projection dropped where no slot has a pair left."""
    stack = layer.lora.get(projection)
    pairs = stack.pairs() if stack is not None else []
    pairs.extend([None] * (num_slots - len(pairs)))
    if slot is not None:
        pairs[slot] = pair
    del pairs[num_slots:]
    like = next((p for p in pairs if p is not None), None)
    if like is None:
        layer.lora.pop(projection, None)
    else:
        layer.lora[projection] = SlotStack.of(pairs, like)


@dataclass(slots=True)
class AdapterTable:
    """The adapter versions an engine holds, each by digest in a slot of the model, and the
    version each name gives a new request.

    A request keeps the version it started with (``Sequence.adapter_slot``), or the one its
    router pinned (``SamplingParams.lora_digest``): a version replaced under its name stays held
    until dropped (``drop``), and a dropped one until no running request uses it (``release``)."""

    names: dict[str, str] = field(default_factory=dict)  # name -> digest new requests by that name get
    slots: dict[str, int] = field(default_factory=dict)  # digest -> slot, every version held
    retiring: set[str] = field(default_factory=set)  # dropped digests, freed once unused

    def __bool__(self) -> bool:
        return bool(self.slots)

    @property
    def served(self) -> dict[str, str]:
        """Name -> digest of the adapters new requests may name."""
        return dict(self.names)

    def resolve(self, name: str, digest: str | None) -> str | None:
        """The digest a request through ``name`` (pinned to ``digest`` where given) computes with;
        None if this engine does not hold it."""
        if digest is None:
            return self.names.get(name)
        return digest if digest in self.slots else None

    def free_slot(self) -> int:
        taken = set(self.slots.values())
        return next(slot for slot in range(len(taken) + 1) if slot not in taken)

    def add(self, name: str, digest: str, slot: int) -> None:
        self.names[name], self.slots[digest] = digest, slot
        self.retiring.discard(digest)

    def drop(self, digest: str) -> bool:
        """No new request gets this version (its names are forgotten); False if not held."""
        if digest not in self.slots:
            return False
        self.retiring.add(digest)
        for name in [n for n, d in self.names.items() if d == digest]:
            del self.names[name]
        return True

    def forget(self, name: str, keep_version: bool = False) -> bool:
        """No new request gets a version through ``name``; its version is dropped unless another
        name still gives it (one adapter's files may be served under two names) or
        ``keep_version`` (a router drops it later: requests it pinned to it may still come).
        False if ``name`` is not served."""
        digest = self.names.pop(name, None)
        if digest is None:
            return False
        if not keep_version and digest not in self.names.values():
            self.retiring.add(digest)
        return True

    def release(self, slots_in_use: set[int]) -> list[int]:
        """The slots of dropped versions no request uses any more (forgotten here)."""
        freed = []
        for digest in sorted(self.retiring):
            if self.slots[digest] not in slots_in_use:
                freed.append(self.slots.pop(digest))
                self.retiring.discard(digest)
        return freed
