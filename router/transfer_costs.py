"""What a cross-node KV transfer costs a request, measured, in the units routing weighs.

Per chunk, a prefill actor's writes overlap the next chunk's compute; what a request pays for
its transfer is the part left after the last chunk (``PrefillTiming.transfer_ms``), which is
larger when the bytes cross nodes (TCP or RDMA between hosts instead of shared memory on one).
The dispatcher reports each finished prefill here with whether its prefill and decode actors
shared a node; the difference of the two smoothed means is the extra seconds a cross-node
pair costs, and a prefill actor's measured rate turns those into prompt tokens of queue, the
unit the selectors compare (``router/routing.py``). Until both kinds were seen, the extra cost
is unknown and routing only prefers the decode actor's node among equally loaded actors.
"""

from __future__ import annotations


class TransferCosts:
    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.same_node_ms: float | None = None
        self.cross_node_ms: float | None = None

    def observe(self, same_node: bool, exposed_transfer_ms: float) -> None:
        """A finished prefill's transfer time left after its last chunk."""
        previous = self.same_node_ms if same_node else self.cross_node_ms
        value = exposed_transfer_ms if previous is None else self.smoothing * exposed_transfer_ms + (1 - self.smoothing) * previous
        if same_node:
            self.same_node_ms = value
        else:
            self.cross_node_ms = value

    def cross_node_extra_s(self) -> float:
        """Seconds a request pays for crossing nodes rather than not (0 while unmeasured)."""
        if self.same_node_ms is None or self.cross_node_ms is None:
            return 0.0
        return max(0.0, self.cross_node_ms - self.same_node_ms) / 1000.0
