"""A write of a tensor-parallel worker is one leg per rank pair: it is over only when every leg
is. A leg that failed must not make the write look over while another still writes (the sender
would post it again, or report the request quiesced and let the reader reuse the blocks, while
that leg may yet land in them), and a leg's handle, once released, is never touched again (NIXL
reads a released handle's freed request)."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from types import SimpleNamespace

import pytest

from kvtransfer.descriptors import merge_runs
from kvtransfer.errors import TransferFailedError
from kvtransfer.leases import LeasePolicy
from kvtransfer.sharded_transport import RankEndpoint, RankTransport, ShardedTransport
from kvtransfer.sharding import KVShard
from kvtransfer.transport import XferState
from tests.kvtransfer.test_protocol import COMPAT, REGION, ScriptedTransport, dest, make_sender
from workers.ranks import RankActor


class LegTransport(ScriptedTransport):
    """One rank's transport: each write's state set by the test; refuses use after release."""

    def __init__(self) -> None:
        super().__init__()
        self.released: set[int] = set()

    def check(self, handle):
        assert handle not in self.released, "checked after its release"
        return self.states[handle]

    def release(self, handle) -> bool:
        assert handle not in self.released, "released twice"
        if not super().release(handle):
            return False
        self.released.add(handle)
        return True


def _two_rank_write():
    """A write from a 2-rank worker into a 2-rank peer (one leg per rank), and each rank's transport."""
    compat = dataclasses.replace(COMPAT, num_kv_heads=2)
    legs = [LegTransport(), LegTransport()]
    ranks = [RankTransport(KVShard(2, r, r, 1), REGION, legs[r], f"P/r{r}") for r in range(2)]
    transport = ShardedTransport("P", ranks, compat)
    peer = [RankEndpoint(KVShard(2, r, r, 1), f"D/r{r}", b"md", REGION) for r in range(2)]
    transport.add_peer("D", pickle.dumps(peer), REGION)
    return transport, transport.post_write("D", merge_runs([0, 1], [0, 1]), b"n"), legs


def test_a_write_with_a_failed_leg_is_not_over_while_another_leg_writes():
    transport, write, legs = _two_rank_write()
    legs[1].cancellable = False
    legs[0].states[0] = XferState.FAILED
    assert transport.check(write) is XferState.IN_PROGRESS  # rank 1's leg could not be stopped: it may land
    assert not transport.release(write)
    assert transport.check(write) is XferState.IN_PROGRESS  # rank 0's released leg is not checked again
    legs[1].states[0] = XferState.DONE
    assert transport.check(write) is XferState.FAILED
    assert transport.release(write)  # nothing left to release (releasing a leg twice would raise)


def test_a_cancellable_leg_is_cancelled_once_another_failed():
    transport, write, legs = _two_rank_write()
    legs[0].states[0] = XferState.FAILED
    assert transport.check(write) is XferState.FAILED and legs[1].released == {0}
    assert transport.release(write)


class _Uncancellable(ScriptedTransport):
    def release(self, handle) -> bool:
        return self.states[handle] is XferState.DONE or self.cancellable


def test_a_failed_write_that_cannot_be_stopped_is_not_posted_again_and_keeps_the_request_unquiesced():
    sender, transport = make_sender(LeasePolicy(max_write_retries=2))
    stuck = _Uncancellable()
    stuck.cancellable = False
    sender._transport = stuck
    sender.push("r", dest("r", [0, 1]), [0, 1], [0, 1], 2)
    stuck.states[0] = XferState.FAILED
    (event,) = sender.poll()
    assert isinstance(event.error, TransferFailedError) and len(stuck.posts) == 1  # failed, not posted again
    report = sender.quiesce_report("r")
    assert not report.quiesced and report.num_in_flight == 1
    stuck.cancellable = True
    assert sender.quiesce_report("r").quiesced


def test_a_rank_never_checks_a_write_it_released():
    """Rank 0 cancels a rank's leg (a timeout): the rank's polling of that write stops, and a
    write it could not cancel stays polled, and releasable again."""
    leg = LegTransport()
    rank = SimpleNamespace(_transport=leg, _writes={}, _released_early=set())

    async def scenario():
        cancelled = asyncio.create_task(RankActor.write(rank, 0, "D", merge_runs([0], [0]), b"n", None))
        await asyncio.sleep(0.01)
        assert await RankActor.release(rank, 0)
        first = await asyncio.wait_for(cancelled, 1)  # LegTransport raises on a check after release
        leg.cancellable = False
        running = asyncio.create_task(RankActor.write(rank, 1, "D", merge_runs([0], [0]), b"n", None))
        await asyncio.sleep(0.01)
        refused = await RankActor.release(rank, 1)
        leg.states[1] = XferState.DONE
        return first, refused, await asyncio.wait_for(running, 1)

    assert asyncio.run(scenario()) == (XferState.FAILED.value, False, XferState.DONE.value)
    assert leg.released == {0, 1}


def test_a_write_released_before_it_reaches_its_rank_is_never_posted():
    """A rank actor's calls may run out of order: rank 0 cancels a leg (its other leg failed to
    post) and the release runs first. The rank answered "stopped" for a write it did not know,
    rank 0 counted it over and the reader reused the blocks, and the write then ran and wrote
    into them. Now it is not posted."""
    leg = LegTransport()
    rank = SimpleNamespace(_transport=leg, _writes={}, _released_early=set())

    async def scenario():
        assert await RankActor.release(rank, 7)  # before its write
        return await asyncio.wait_for(RankActor.write(rank, 7, "D", merge_runs([0], [0]), b"n", None), 1)

    assert asyncio.run(scenario()) == XferState.FAILED.value
    assert leg.posts == []
    assert rank._released_early == set()


def test_a_write_whose_second_leg_fails_to_post_is_kept_while_its_first_cannot_be_stopped():
    """Rank 1's leg does not post and rank 0's, already posted, cannot be stopped: the write is
    not forgotten (raised, the sender never counted it, reported the request quiesced and let
    the reader reuse the blocks the first leg still wrote); it fails once that leg ends."""
    from kvtransfer.errors import TransportError

    transport, _, legs = _two_rank_write()

    def refuse(*args, **kwargs):
        raise TransportError("no route to the peer's rank 1")

    legs[1].post_write = refuse
    legs[0].cancellable = False
    write = transport.post_write("D", merge_runs([2], [2]), b"m")
    assert transport.check(write) is XferState.IN_PROGRESS
    legs[0].states[1] = XferState.DONE
    assert transport.check(write) is XferState.FAILED  # done, but rank 1's part never went
    legs[0].cancellable = True
    with pytest.raises(TransportError):  # a leg that could be stopped: raised as before
        transport.post_write("D", merge_runs([3], [3]), b"o")


def test_a_write_posted_again_completes_only_with_legs_of_one_post():
    """A write's first post had one leg land and one fail; the sender posts every leg again with
    the same notification. The reader completed the write from the first post's landed leg and
    the second post's other leg while the second post's first leg was still writing into the
    blocks, which the decode actor then took (or freed) as written."""
    from kvtransfer.transport import Incoming

    transport, first, legs = _two_rank_write()
    legs[0].states[0], legs[1].states[0] = XferState.DONE, XferState.FAILED
    assert transport.check(first) is XferState.FAILED and transport.release(first)
    transport.post_write("D", merge_runs([0, 1], [0, 1]), b"n")  # the retry
    reader_legs = [ScriptedTransport(), ScriptedTransport()]
    compat = dataclasses.replace(COMPAT, num_kv_heads=2)
    reader = ShardedTransport("D", [RankTransport(KVShard(2, r, r, 1), REGION, reader_legs[r], f"D/r{r}") for r in range(2)], compat)

    def lands(rank: int, post: int) -> list[bytes]:
        reader_legs[rank].inbox.append(Incoming(sender=f"P/r{rank}", message=legs[rank].posts[post][2]))
        return [incoming.message for incoming in reader.get_incoming()]

    assert lands(0, 0) == []  # the first post's first leg (its second failed)
    assert lands(1, 1) == [], "completed from two posts' legs while the retry's first leg still writes"
    assert lands(0, 1) == [b"n"]
    assert not reader._partial, "the failed post's leg outlived the write"
