"""The `auto` io path: a choice per plan between kernel, bulk, direct and staged."""

from __future__ import annotations

from ..transfer import Transfer
from .bulk_pieces import why_not_bulk
from .direct import run_offsets
from .mover import Launch, Mover
from .staged import StagedMover
from .staging_schedule import LINK_RULE, StagingRule

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


# Off the caller's critical path, copies this long on average go to the copy engines: a page
# of 64 tokens of one layer's K or V is 64 KiB and more in the models served; a token's
# row (page_first, page_head) is a few KiB, and a descriptor per row would cost the
# calling thread more than the copy.
BACKGROUND_MIN_COPY_BYTES = 16 << 10


def copy_counts(transfer: Transfer) -> tuple[int, int]:
    """How many merged runs the direct path copies of one layer of `transfer` (a run of a
    layout whose heads lie apart is one copy a head group), and their bytes."""
    descriptors = nbytes = 0
    for pair in transfer.pairs:
        sizes = run_offsets(transfer.indices, pair, transfer.page_size)[2]
        descriptors, nbytes = descriptors + sizes.size, nbytes + int(sizes.sum())
    return descriptors, nbytes


def call_copies(transfer: Transfer, descriptors: int, nbytes: int) -> str:
    """The direct path's copies of one call of `transfer` in words, from `copy_counts` of one layer:
    every layer the call moves repeats that layer's copies."""
    layers = len(transfer.layers)
    return (f"{descriptors * layers} copies of {nbytes // descriptors >> 10} KiB on average "
            f"over {layers} layer{'s' if layers != 1 else ''}")


class AutoMover(Mover):
    """Picks the io path per plan, direction and layer span from the transfer's shape.  The
    rule (the measurements behind it: docs/DESIGN.md):

    1. a transfer off the caller's critical path (`background`: a backup during decode, a
       prefetch) whose copies average BACKGROUND_MIN_COPY_BYTES: `direct`, the copy engines,
       which cost a decode step beside them 4-7% where SM and TMA copies cost it 14-128%;
    2. under AUTO_MIN_BYTES, or indices its pool asked not to read on the host (the other
       paths plan from their values): `kernel`; a call that small is latency, and the
       kernel path is one launch;
    3. the direct copies (runs consecutive on both sides) average at least
       DIRECT_MIN_COPY_BYTES (and, where `bulk` is offered, number at most
       DIRECT_MAX_COPIES_BESIDE_BULK or average DIRECT_MIN_COPY_BYTES_BESIDE_BULK): `direct`,
       the copy engines straight between the pools, no SM and no staging;
    4. where the backend offers `bulk` and its pieces carry the transfer (16-byte aligned
       rows): `bulk`, a few blocks beside the model, a launch's host time a call;
    5. where `rule` says staging carries the transfer and `auto` stages it (on GPUs:
       backups, and loads whose copies go as one batched call a chunk): `staged`;
    6. otherwise `kernel`: short host runs would cost the copy engines more per copy than
       the kernel path loses at any placement.

    A load that would stage takes `kernel` while a staged backup of the same pool still
    runs: both staged at once share the link worse than a kernel-path load beside the
    backup.  That part of the choice is made per call (AutoStaged).
    """

    io = "auto"

    def __init__(self, movers: dict[str, Mover], rule: StagingRule = LINK_RULE) -> None:
        self.movers = movers  # the pool's own kernel, direct, staged and (where offered) bulk movers
        self.rule = rule

    def choice(self, transfer: Transfer) -> tuple[str, str]:
        """The io path auto takes for `transfer` ("kernel", "bulk", "direct" or "staged"), and why."""
        readable = transfer.indices.host_readable
        descriptors, nbytes = copy_counts(transfer) if readable else (0, 0)
        average = nbytes / descriptors if descriptors else 0
        if transfer.background and average >= BACKGROUND_MIN_COPY_BYTES:
            return "direct", f"off the caller's critical path, {call_copies(transfer, descriptors, nbytes)}: the copy engines, no SM"
        if transfer.bytes < AUTO_MIN_BYTES:
            return "kernel", f"under {AUTO_MIN_BYTES >> 20} MiB: one launch is the least latency"
        if not readable:
            return "kernel", "indices the pool does not read on the host"
        bulk = "bulk" in self.movers and why_not_bulk(transfer) is None
        if average >= DIRECT_MIN_COPY_BYTES and (not bulk or descriptors <= DIRECT_MAX_COPIES_BESIDE_BULK
                                                 or average >= DIRECT_MIN_COPY_BYTES_BESIDE_BULK):
            return "direct", f"{call_copies(transfer, descriptors, nbytes)}: the copy engines, no SM"
        if bulk:
            return "bulk", "a few blocks beside the model, one launch a call"
        staged = self.movers["staged"]
        assert isinstance(staged, StagedMover)
        copies = staged.copies(transfer)
        if copies is not None and copies.carried_by(self.rule) and self.rule.auto_stages(transfer.to_device, copies.batched_by(self.rule)):
            return "staged", "long host runs: copy engines into staging, the kernel in device memory"
        return "kernel", "short runs: per-copy costs would exceed the kernel path's"

    def build(self, transfer: Transfer) -> Launch:
        chosen, reason = self.choice(transfer)
        launch = self.movers[chosen].build(transfer)
        if launch.path == chosen or chosen == "kernel":  # else the path's own reason for handing it on stands
            launch.reason = reason
        if chosen == "staged" and transfer.to_device:
            return AutoStaged(self.movers["staged"], launch, self.movers["kernel"], transfer)
        return launch


class AutoStaged(Launch):
    """A staged load that takes the kernel path while a staged backup of its pool still runs."""

    def __init__(self, staged: Mover, launch: Launch, kernel: Mover, transfer: Transfer) -> None:
        assert isinstance(staged, StagedMover)
        self.staged, self.launch, self.kernel, self.transfer = staged, launch, kernel, transfer
        self.beside_backup: Launch | None = None
        self.path, self.reason = launch.path, launch.reason

    def run(self, layers: range, stream: int | None) -> None:
        if self.staged.backup_running():
            if self.beside_backup is None:
                self.beside_backup = self.kernel.build(self.transfer)
            self.path, self.reason = "kernel", "a staged backup of this pool still runs"
            self.beside_backup.run(layers, stream)
            return
        self.path, self.reason = self.launch.path, self.launch.reason
        self.launch.run(layers, stream)
