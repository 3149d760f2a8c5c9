"""The `auto` io path: a choice per call between kernel, bulk, direct and staged."""

from __future__ import annotations

from ..transfer import Transfer
from .bulk_plan import why_not_bulk
from .direct import run_offsets
from .mover import Mover, MoverFactory, share_flag
from .staged import StagedMover
from .staged_plan import LINK_RULE, StagingRule

# Under this many bytes a call is latency: the kernel path's one launch is the cheapest.
AUTO_MIN_BYTES = 4 << 20
# Batched copies this large on average keep the direct path at the link (its descriptors,
# unlike separate copies, follow one another with no gap); smaller ones cost host time.
DIRECT_MIN_COPY_BYTES = 512 << 10
# ... and where the bulk path is offered, direct also needs few copies: the driver's time per
# descriptor is the caller's time, which the bulk path does not spend (docs/DESIGN.md) ...
DIRECT_MAX_COPIES_BESIDE_BULK = 32
# ... or copies this large, where that time is small beside each copy's own at the link and the
# copy engines move more than the bulk path's few blocks (H200, vLLM's cross-layer blocks of
# 1.1-2 MiB: direct 92-96% of the link, bulk 59-79%, with more host time from its longer plan).
DIRECT_MIN_COPY_BYTES_BESIDE_BULK = 1 << 20


class AutoMover(Mover):
    """Picks the io path per call from the transfer's plans, and keeps the choice with its
    indices for its pools.  The rule (the measurements behind it: docs/DESIGN.md):

    1. under AUTO_MIN_BYTES, or indices its pool asked not to read on the host (the other
       paths plan from their values): `kernel`; a call that small is latency, and the
       kernel path is one launch;
    2. the direct plan's copies (runs consecutive on both sides) average at least
       DIRECT_MIN_COPY_BYTES (and, where `bulk` is offered, number at most
       DIRECT_MAX_COPIES_BESIDE_BULK or average DIRECT_MIN_COPY_BYTES_BESIDE_BULK): `direct`,
       the copy engines straight between the pools, no SM and no staging;
    3. where the backend offers `bulk` and its plan carries the transfer (16-byte aligned
       rows): `bulk`, a few blocks beside the model, a launch's host time a call;
    4. where `rule` says staging carries the transfer and `auto` stages it (on GPUs:
       backups, and loads whose copies go as one batched call a chunk): `staged`;
    5. otherwise `kernel`: short host runs would cost the copy engines more per copy than
       the kernel path loses at any placement.

    A load that would stage takes `kernel` while a staged backup of the same pool still
    runs: both staged at once share the link worse than a kernel-path load beside the
    backup.  That part of the choice is made per call, not kept.
    """

    io = "auto"

    def __init__(self, kernel: MoverFactory, direct: MoverFactory, staged: StagedMover, bulk: MoverFactory | None = None,
                 rule: StagingRule = LINK_RULE) -> None:
        super().__init__(staged.device)
        self.movers = {"kernel": kernel(), "direct": direct(), "staged": staged}
        if bulk is not None:
            self.movers["bulk"] = bulk()
        self.parts = tuple(self.movers.values())
        share_flag(self.bad_index, *self.parts)
        self.rule = rule
        self.last_choice = ""  # the path of the latest call, for benchmarks and diagnostics
        self.last_reason = ""  # ... and why auto took it

    def choice(self, transfer: Transfer) -> tuple[str, str]:
        """The io path this mover takes for `transfer` ("kernel", "bulk", "direct" or "staged"), and why."""
        key = ("auto", transfer.to_device, len(transfer.layers) == 1)
        stamp = (len(transfer.layers), self.movers["staged"].staging_bytes, self.rule)
        return transfer.indices.known((transfer.pairs,), key, lambda: self._choose(transfer), stamp)

    def _choose(self, transfer: Transfer) -> tuple[str, str]:
        if transfer.bytes < AUTO_MIN_BYTES:
            return "kernel", f"under {AUTO_MIN_BYTES >> 20} MiB: one launch is the least latency"
        if not transfer.indices.host_readable:
            return "kernel", "indices the pool does not read on the host"
        descriptors = nbytes = 0
        for pair in transfer.pairs:
            sizes = run_offsets(transfer.indices, pair, transfer.page_size)[2]
            descriptors, nbytes = descriptors + sizes.size, nbytes + int(sizes.sum())
        bulk = "bulk" in self.movers and why_not_bulk(transfer) is None
        average = nbytes / descriptors if descriptors else 0
        if average >= DIRECT_MIN_COPY_BYTES and (not bulk or descriptors <= DIRECT_MAX_COPIES_BESIDE_BULK
                                                 or average >= DIRECT_MIN_COPY_BYTES_BESIDE_BULK):
            return "direct", f"{descriptors} copies of {nbytes // descriptors >> 10} KiB on average: the copy engines, no SM"
        if bulk:
            return "bulk", "a few blocks beside the model, one launch a call"
        prepared = self.movers["staged"].prepared(transfer)
        if (prepared is not None and prepared.carried_by(self.rule)
                and self.rule.auto_stages(transfer.to_device, prepared.batched_by(self.rule))):
            return "staged", "long host runs: copy engines into staging, the kernel in device memory"
        return "kernel", "short runs: per-copy costs would exceed the kernel path's"

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        chosen, self.last_reason = self.choice(transfer)
        if chosen == "staged" and transfer.to_device and self.movers["staged"].backup_running():
            chosen, self.last_reason = "kernel", "a staged backup of this pool still runs"
        self.last_choice = chosen
        self.movers[chosen].move(transfer)

    def close(self) -> None:
        for mover in self.parts:
            mover.close()
