"""One step's gradient reduction in a fixed layout, overlapped with backward.

DDP hands its communication hook buckets whose layout is its own: one bucket of everything in
a replica's first backward, then buckets rebuilt from the order gradients became ready. A spare
that joins after the others rebuilt theirs would issue other collectives than they do. So the
hook never communicates DDP's buckets: it copies their gradients into a *canonical layout*
(:class:`Layout`), a function of the model's parameters alone and so the same on every member,
and launches each canonical bucket's reduction as soon as it is full, in canonical order. Every
member therefore issues the same operations in the same order whatever DDP's buckets are, and a
step can be reduced again on another group from the kept inputs (:meth:`StepReduction.relaunch`)
while the spare that joined reduces it for the first time.

Exact mode sums in rank order (:mod:`torchpass_p2p.collective.reduce`): a bucket below
:data:`~torchpass_p2p.collective.group.SHARDED_MIN_BYTES` gathered whole (an all-to-all in which
each rank sends its bucket to every other), a larger one by an all-to-all of shards, each rank
summing its shard, then an all-to-all in which each rank sends its sums to every other. The
element sum ``((g0 + g1) + g2) + ...``
does not depend on how elements are grouped into buckets, so the result is bitwise the same as
one reduction of the whole gradient. Native mode (same step, not bitwise) sums from 1 MiB on
with the backend's all-reduce, of each rank's gradient divided by the world size first, as
DDP's default hook does; the division is the copy into the bucket, not a pass of its own. Below
1 MiB the ring's round trips cost more than one exchange, so small buckets are gathered in
both modes.

Operations are launched from one thread (the autograd thread) in one order: a sharded bucket's
exchange of sums is launched just before the next bucket's first operation, never from a
completion callback, whose thread and timing differ between ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torchpass_p2p.collective import ManagedGroup
from torchpass_p2p.collective.group import SHARDED_MIN_BYTES, Watch
from torchpass_p2p.collective.reduce import (
    divide,
    from_shards,
    shard_sizes,
    sum_in_rank_order,
)

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Ballot", "Layout", "StepReduction"]

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
"""Canonical bucket caps: DDP's own defaults (``first_bucket_bytes_cap`` 1 MiB, ``bucket_cap_mb``
25 MiB), so the first reduction starts as early as DDP's would."""


Pieces = tuple[tuple[int, int, int, int], ...]
"""A DDP bucket in the canonical layout: ``(start in DDP's bucket, canonical bucket, offset,
numel)`` per run of its parameters that lie back to back there
(:meth:`StepReduction.fill_bucket`)."""


@dataclass(frozen=True)
class Layout:
    """Where each trainable parameter's gradient lives in the canonical buckets.

    Parameters are taken in reverse registration order (gradients of the last layers are ready
    first). A bucket closes where the dtype or device changes, or once it holds its cap or
    more: as DDP closes its buckets (``_compute_bucket_assignment_by_size``). A model whose
    gradients arrive in reverse registration order then gets, once DDP rebuilt its buckets in
    arrival order, DDP buckets that are the canonical ones (:meth:`StepReduction.fill_bucket`
    copies those whole).

    Attributes:
        sizes: elements per bucket.
        dtypes: each bucket's dtype.
        devices: each bucket's device.
        where: ``{parameter index: (bucket, offset in elements, numel)}``, indices into
            ``params`` as given to :meth:`of`.
    """

    sizes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[torch.device, ...]
    where: dict[int, tuple[int, int, int]]

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], *,
           first_bytes: int = FIRST_BUCKET_BYTES, bytes_cap: int = BUCKET_BYTES) -> Layout:
        """The layout of ``params`` (trainable parameters in registration order).

        Raises:
            ValueError: no parameters.
        """
        if not params:
            raise ValueError("the model has no trainable parameters")
        sizes: list[int] = []
        dtypes: list[torch.dtype] = []
        devices: list[torch.device] = []
        where: dict[int, tuple[int, int, int]] = {}
        used, full = 0, False
        for i in reversed(range(len(params))):
            p = params[i]
            if full or not sizes or dtypes[-1] != p.dtype or devices[-1] != p.device:
                sizes.append(0)
                dtypes.append(p.dtype)
                devices.append(p.device)
                used = 0
            where[i] = (len(sizes) - 1, sizes[-1], p.numel())
            sizes[-1] += p.numel()
            used += p.numel() * p.element_size()
            full = used >= (first_bytes if len(sizes) == 1 else bytes_cap)
        return cls(tuple(sizes), tuple(dtypes), tuple(devices), where)

    def describe(self) -> list[Any]:
        """Plain data every member must agree on: ``[[numel, dtype], ...]`` per bucket."""
        return [[n, str(d)] for n, d in zip(self.sizes, self.dtypes, strict=True)]


class Ballot(NamedTuple):
    """A step's commit vote in flight (:meth:`StepReduction.launch_ready`)."""

    work: Any
    """Its own operation, for :meth:`ManagedGroup.complete`; None when it rides in the last
    bucket's, which :meth:`StepReduction.wait` completes."""
    rows: torch.Tensor
    """Every rank's vote, row ``r`` from rank ``r`` (float64, on the group's device), once
    the operation completed."""


class StepReduction:
    """The reduction of one step's gradients (module docstring), filled bucket by bucket.

    The inputs (:meth:`input_of`) are this member's local gradients of the step, so that the
    same step can be reduced again on another group. An exact bucket's all-to-all only reads
    its input, so the input is kept as it is, and when DDP's bucket is a whole canonical bucket
    it is DDP's own buffer, not a copy (DDP keeps it until the hook's future completes); any
    other gradient is copied once, into the buffer its bucket's first operation reads,
    allocated when first written. A native all-reduced bucket's input is the gradient divided
    by the world size given to :meth:`reset`, and its all-reduce overwrites it with the sum:
    such a bucket is written again at its next launch from the gradients ``fill`` was given
    (after :meth:`forget`, or on a group of another size), which the caller must keep
    unchanged until the step closes (DDP keeps its bucket's gradients until the hook's future
    completes). The operations' own buffers (what they receive, the sums) are kept for the
    next step's but one: a bucket's worth allocated afresh each step is faulted in again page
    by page (``docs/benchmarks.md`` has what that cost). They are reused only after every
    operation that wrote into them completed; an abandoned operation may still write into its
    buffers later, so :meth:`forget` drops them, and a native bucket's input with them.

    The results of the last step handed out (:attr:`held`) stay intact until the step after
    the next one opens: steps alternate between two *banks* of buffers (the inputs this class
    owns, the operations' buffers), so the next step's reduction never writes the last one's
    results. A member that committed a step can hand them to a peer whose reduction of that
    step failed (:mod:`.handoff`); no member can reach the step after the next without every
    peer's vote on the next one, which that peer can give only once it holds the last step.
    This costs one more gradient's worth of memory: native mode's inputs, or exact mode's
    gathered sums. Exact mode's sums are sent from one buffer per bucket outside the banks
    (``world_size`` copies of this rank's shard: about one more gradient's worth; an
    abandoned operation only reads it, so it is written again at once).

    Args:
        layout: the canonical layout.
        exact: rank-order sums (True) or the backend's all-reduce.
    """

    def __init__(self, layout: Layout, *, exact: bool) -> None:
        self.layout = layout
        self.exact = exact
        # each bank's input buffers (each allocated when first written: an exact bucket read
        # where DDP's lies needs none) and operation buffers, by (bucket, kind)
        n = len(layout.sizes)
        self._own_banks: list[list[torch.Tensor | None]] = [[None] * n, [None] * n]
        self._scratch_banks: list[dict[tuple[int, str], list[torch.Tensor]]] = [{}, {}]
        # exact mode: each sharded bucket's sums, n times, sent (not banked: class docstring)
        self._sums_out: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._bank = 0
        self._held: list[torch.Tensor] | None = None
        self._held_bank = -1
        # a bucket's input this step: DDP's buffer (fill_bucket), this bank's own, or None
        # until written (_input)
        self._send: list[torch.Tensor | None] = [None] * n
        # native mode: each bucket's fills, (offset, flat gradient), to write it again from
        self._sources: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._n: int | None = None  # native mode: the world size fills divide by
        self._stale: set[int] = set()  # native buckets whose input is not yet what launch sends
        self._pieces: dict[tuple[int, ...], Pieces] = {}
        self._handed: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor,
                                 Sequence[torch.Tensor], Sequence[int],
                                 Pieces | None]] = []  # DDP's buckets this step
        self._overwritten: set[int] = set()  # native buckets whose input holds a sum
        self._missing = list(layout.sizes)
        self._group: ManagedGroup | None = None
        self._launched = 0
        self._works: list[tuple[int, str, Any, Any]] = []  # (bucket, kind, work, output)
        self._results: list[torch.Tensor | None] = [None] * len(layout.sizes)
        self._watch: Watch | None = None
        self.blocked_s = 0.0
        """Seconds this step spent blocked waiting for its collectives, since :meth:`reset`:
        on the first rank to arrive, the others' lateness (:mod:`.stragglers`)."""

    def input_of(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s input this step (1-d, the layout's size, dtype and device): DDP's
        buffer when it is the whole bucket (exact mode), else this bank's own one."""
        src = self._send[b]
        if src is None:
            own = self._own_banks[self._bank]
            src = own[b]
            if src is None:
                layout = self.layout
                src = own[b] = torch.empty(layout.sizes[b], dtype=layout.dtypes[b],
                                           device=layout.devices[b])
            self._send[b] = src
        return src

    @property
    def _scratch(self) -> dict[tuple[int, str], list[torch.Tensor]]:
        """This bank's operation buffers, by ``(bucket, kind)``."""
        return self._scratch_banks[self._bank]

    @property
    def held(self) -> list[torch.Tensor] | None:
        """The averaged gradient, per bucket, of the last step :meth:`hand_out` completed,
        intact until the step after the next one opens (class docstring); None before the
        first. Which step it is, the caller knows."""
        return self._held

    # ------------------------------------------------------------------ filling

    def reset(self, world_size: int | None = None) -> None:
        """A new step: every bucket empty again (inputs are overwritten as they are filled),
        in the bank that does not hold :attr:`held`. Its buffers are kept from the step before
        the last when every operation on them was waited for. ``world_size``: the size of
        the group the step will be reduced on, if known (native mode divides as it fills; a
        bucket filled for another size is written again at its launch)."""
        if self._works:  # launched, never waited for: they may still write
            self.forget()
        if self._held_bank == self._bank:
            self._bank ^= 1
        self._missing = list(self.layout.sizes)
        self.blocked_s = 0.0
        self._send = [None] * len(self._send)  # DDP's buffers are its own again
        self._sources = {}  # the last step's: nothing to copy again
        self._handed = []
        self._n = world_size
        self._stale = set()  # every element of every bucket is filled again
        self._overwritten = set()
        self._group = None
        self._launched = 0
        self._results = [None] * len(self.layout.sizes)

    def forget(self) -> None:
        """Drop every launched operation, result and operation buffer, keeping the inputs (the
        group they ran on is being given up): a native bucket's input, overwritten by its
        all-reduce, gets new storage, written at its next launch from the gradients ``fill``
        was given. A
        gloo group's connections close only when its last reference goes, and an operation
        holds one: kept, it would leave the peers waiting on this member in their next
        collective instead of failing at once."""
        self._group = None
        self._launched = 0
        self._works = []
        self._results = [None] * len(self.layout.sizes)
        self._scratch_banks[self._bank] = {}
        for b in self._overwritten:  # stale since their launch; never DDP's (exact only)
            self._own_banks[self._bank][b] = self._send[b] = None
        self._overwritten = set()

    def fill(self, index: int, grad: torch.Tensor) -> None:
        """Copy parameter ``index``'s gradient (any shape, ``numel`` elements) into its place.
        In native mode ``grad`` must keep its values until the step closes (class docstring)."""
        b, offset, n = self.layout.where[index]
        self._put(b, offset, grad.reshape(-1))

    def fill_bucket(self, indices: Sequence[int], grads: Sequence[torch.Tensor],
                    flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Copy a DDP bucket's gradients (``grads[j]`` of parameter ``indices[j]``; ``flat``
        the bucket's buffer, ``grads`` concatenated, as ``GradBucket`` gives them) into their
        places. Returns the future for DDP's communication hook: :meth:`hand_out` completes
        it with the bucket's averaged gradient. ``flat`` is copied in pieces, each a run of
        parameters that lie back to back, in this order, in one canonical bucket
        (:meth:`_pieces_of`), and the results are copied back into it, which DDP copies into
        the gradients. When it is one piece (DDP's rebuilt buckets of a model whose gradients
        arrive in reverse registration order are), the result is a view of the canonical
        result instead, and in exact mode a whole canonical bucket is not copied at all. As
        for :meth:`fill`, in native mode the gradients must keep their values until the step
        closes; in exact mode ``flat`` must, when it is a whole canonical bucket (it is the
        bucket's input then)."""
        pieces = self._pieces_of(tuple(indices))
        flat = flat.reshape(-1)
        kept: Pieces | None = pieces
        if flat.numel() != pieces[-1][0] + pieces[-1][3]:  # not the gradients back to back
            kept = None
            for i, g in zip(indices, grads, strict=True):
                self.fill(i, g)
        elif (self.exact and len(pieces) == 1 and pieces[0][2] == 0
              and pieces[0][3] == self.layout.sizes[pieces[0][1]]):
            # An exact reduction only reads its input: DDP's buffer is read where it is. An
            # abandoned operation may go on reading it, never writes it.
            self._send[pieces[0][1]] = flat
            self._missing[pieces[0][1]] -= pieces[0][3]
        else:
            for at, b, offset, n in pieces:
                self._put(b, offset, flat[at:at + n])
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._handed.append((future, flat, grads, indices, kept))
        return future

    def hand_out(self, results: list[torch.Tensor]) -> None:
        """Complete the future of every bucket :meth:`fill_bucket` took this step, with its
        averaged gradient from ``results`` (as :meth:`wait` returns them)."""
        handed, self._handed = self._handed, []
        self._held, self._held_bank = results, self._bank
        for future, flat, grads, indices, pieces in handed:
            if pieces is not None and len(pieces) == 1:
                _, b, offset, n = pieces[0]
                future.set_result(results[b][offset:offset + n])
            elif pieces is not None:
                for at, b, offset, n in pieces:
                    flat[at:at + n].copy_(results[b][offset:offset + n])
                future.set_result(flat)
            else:
                for i, g in zip(indices, grads, strict=True):
                    self.copy_out(results, i, g)
                future.set_result(flat)

    def _pieces_of(self, indices: tuple[int, ...]) -> Pieces:
        """DDP's bucket of the parameters ``indices`` (in its order) as pieces ``(start in
        DDP's bucket, canonical bucket, offset, numel)``: consecutive parameters that lie back
        to back in one canonical bucket make one piece (a BatchNorm's weight reaching DDP
        before its bias, as it does, splits a rebuilt bucket in three)."""
        pieces = self._pieces.get(indices)
        if pieces is None:
            merged: list[list[int]] = []
            at = 0
            for i in indices:
                b, offset, n = self.layout.where[i]
                last = merged[-1] if merged else None
                if last is not None and last[1] == b and last[2] + last[3] == offset:
                    last[3] += n
                else:
                    merged.append([at, b, offset, n])
                at += n
            pieces = self._pieces[indices] = tuple((a, b, o, n) for a, b, o, n in merged)
        return pieces

    def _put(self, b: int, offset: int, flat: torch.Tensor) -> None:
        self._write(b, offset, flat, self._n)
        self._missing[b] -= flat.numel()
        if not self.exact:
            self._sources.setdefault(b, []).append((offset, flat))

    def _write(self, b: int, offset: int, flat: torch.Tensor, n: int | None) -> None:
        """Bucket ``b``'s input at ``offset``: ``flat``, divided by ``n`` when a native
        all-reduce on a group of ``n`` ranks will sum it."""
        into = self.input_of(b)[offset:offset + flat.numel()]
        if n is not None and not self.exact and not self._small(b, n):
            # DDP's default hook divides by the world size (a Python number) before its sum
            torch.div(flat, n, out=into)
        else:
            into.copy_(flat)

    def _small(self, b: int, n: int) -> bool:
        """Bucket ``b`` is gathered whole on a group of ``n`` ranks, in both modes."""
        size = self.layout.sizes[b] * self.layout.dtypes[b].itemsize
        return n == 1 or size < SHARDED_MIN_BYTES

    @property
    def filled(self) -> bool:
        return not any(self._missing)

    # ------------------------------------------------------------------ communication

    def launch_ready(self, group: ManagedGroup, watch: Watch | None,
                     vote: torch.Tensor | None = None) -> Ballot | None:
        """Launch, in canonical order, every full bucket not launched yet on ``group``
        (``watch`` as for :meth:`ManagedGroup.complete`: a sharded bucket's all-to-all may be
        waited for here). Raises what :meth:`ManagedGroup.complete` raises.

        ``vote``: the step's commit vote (1-d float64, any device), given with the step's last
        bucket; every rank's comes back as the rows of the returned :class:`Ballot`. It rides
        in the last bucket's exchange when that bucket is gathered (one operation a step
        fewer: each costs every rank a wake-up, ``docs/benchmarks.md``), else it is exchanged
        on its own right behind it. Every rank decides alike: the layout, the world size and
        the vote's length are the same on all of them. Returns None without a vote."""
        self._watch = watch
        if self._group is not group:
            if self._group is not None or self._launched:
                self.forget()
            self._group = group
        if not self.exact and group.spec.world_size != self._n:
            # filled for another size: every bucket is written again at its launch
            self._n = group.spec.world_size
            self._stale = set(range(len(self._send)))
        last = len(self._send) - 1
        ballot = None
        while self._launched <= last and self._missing[self._launched] == 0:
            b = self._launched
            ballot = self._launch(group, b, vote if b == last else None)
            self._launched += 1
        if vote is not None and ballot is None:
            ballot = Ballot(*group.launch_exchange(vote))
        return ballot

    def relaunch(self, group: ManagedGroup, watch: Watch | None,
                 vote: torch.Tensor | None = None) -> Ballot | None:
        """Reduce the kept inputs again, from the first bucket, on ``group``, with ``vote`` as
        :meth:`launch_ready` has it."""
        self.forget()
        return self.launch_ready(group, watch, vote)

    def _buffers(self, b: int, kind: str, shapes: list[tuple[int, ...]],
                 store: dict[tuple[int, str], list[torch.Tensor]] | None = None,
                 dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Bucket ``b``'s buffers for operations of ``kind``, one per shape, kept in ``store``
        (this bank's operation buffers by default), of ``dtype`` (the bucket's by default):
        last step's when they have these shapes (the world size may have changed), else new
        ones."""
        store = self._scratch if store is None else store
        kept = store.get((b, kind))
        if kept is None or [tuple(t.shape) for t in kept] != shapes:
            src = self.input_of(b)  # zeros: padding sent is never another step's data
            kept = [torch.zeros(s, dtype=dtype or src.dtype, device=src.device)
                    for s in shapes]
            store[(b, kind)] = kept
        return kept

    def _launch(self, group: ManagedGroup, b: int, vote: torch.Tensor | None = None,
                ) -> Ballot | None:
        """Launch bucket ``b``'s first operation; with ``vote`` (the last bucket's, to ride in
        it: :meth:`launch_ready`) when ``b`` is gathered, returning the vote's rows."""
        self._flush_sharded(group, self._watch)
        n = group.spec.world_size
        if b in self._stale:
            for offset, flat in self._sources[b]:
                self._write(b, offset, flat, n)
            self._stale.discard(b)
        src = self.input_of(b)
        small = self._small(b, n)
        if not self.exact and not small:
            self._overwritten.add(b)
            self._stale.add(b)  # it will hold the sum
            self._works.append((b, "sum", group.launch(lambda pg: pg.allreduce([src])), src))
        elif small:  # native mode too: one exchange has less latency than gloo's ring
            return self._gather(group, b, src, vote)
        else:
            # Shard r is the r-th run of `width` elements (the last ones shorter), so the input
            # is sent as it lies; this rank receives its shard from every rank, as rows.
            splits = shard_sizes(src.numel(), n)
            mine, width = splits[group.spec.rank], splits[0]
            (recv,) = self._buffers(b, "shards", [(n * width,)])
            into = recv[:n * mine]  # gloo splits along dim 0
            self._works.append((b, "shards", group.launch(
                lambda pg: pg.alltoall_base(into, src, [mine] * n, list(splits))),
                into.view(n, mine)))
        return None

    def _gather(self, group: ManagedGroup, b: int, src: torch.Tensor,
                vote: torch.Tensor | None) -> Ballot | None:
        """Every rank's bucket ``b``, by one all-to-all of n copies (ManagedGroup.exchange
        says why not an all-gather): row r of the output is rank r's. With ``vote``, each row
        is bytes: the bucket's, then the vote's float64s from the next multiple of 8; returns
        the vote's rows."""
        n = group.spec.world_size
        if vote is None:
            send, out = self._buffers(b, "gather", [(n, src.numel())] * 2)
            copies, rows, ballot = send, out, None
        else:
            body = src.numel() * src.element_size()
            start = -(-body // 8) * 8
            send, out = self._buffers(b, "gather+vote", [(n, start + 8 * vote.numel())] * 2,
                                      dtype=torch.uint8)
            send[:, start:].view(torch.float64).copy_(vote.reshape(1, -1).expand(n, -1))
            copies, rows = send[:, :body].view(src.dtype), out[:, :body].view(src.dtype)
            ballot = Ballot(None, out[:, start:].view(torch.float64))
        copies.copy_(src.reshape(1, -1).expand(n, -1))
        self._works.append((b, "gather", group.launch(
            lambda pg: pg.alltoall_base(out, send, [], [])), rows.unbind(0)))
        return ballot

    def _flush_sharded(self, group: ManagedGroup, watch: Watch | None = None) -> None:
        """Turn the last launched bucket's finished all-to-all into the exchange of its sums
        (the one place that is launched: before the next bucket's first operation, or when
        the step is waited for)."""
        if not self._works or self._works[-1][1] != "shards":
            return
        b, _, work, rows = self._works.pop()
        self._complete(group, work, watch)
        n, mine = rows.shape
        # Every rank's sums to every rank by one all-to-all of n copies, as a small bucket
        # goes (ManagedGroup.exchange says why not an all-gather; gloo's also stages what it
        # gathers in a buffer of its own and copies it out). The sums are taken from what was
        # received, whose buffer then receives every rank's sums, in shard order: the
        # averaged bucket, contiguous.
        (copies,) = self._buffers(b, "sums", [(n, mine)], self._sums_out)
        divide(sum_in_rank_order(rows.unbind(0), out=copies[0]), n)
        copies[1:].copy_(copies[0].expand(n - 1, mine))
        (gathered,) = self._scratch[(b, "shards")]
        numel = self.layout.sizes[b]
        into = gathered[:numel]
        self._works.append((b, "sharded", group.launch(lambda pg: pg.alltoall_base(
            into, copies.view(-1), list(shard_sizes(numel, n)), [mine] * n)), gathered))

    def wait(self, group: ManagedGroup, watch: Watch | None) -> list[torch.Tensor]:
        """Wait for every bucket (all must be launched) and return the averaged gradient per
        bucket, in the layout's order. Raises ``CollectiveError`` or ``Superseded`` as
        :meth:`ManagedGroup.complete` does."""
        assert self._launched == len(self._send) and self._group is group
        self._flush_sharded(group, watch)
        n = group.spec.world_size
        for b, kind, work, out in self._works:
            self._complete(group, work, watch)
            if kind == "gather":
                self._results[b] = divide(sum_in_rank_order(out), n)
            elif kind == "sharded":
                self._results[b] = from_shards(out, self.input_of(b))
            else:  # the sum of gradients divided before (_write)
                self._results[b] = out
        self._works = []
        results = self._results
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _complete(self, group: ManagedGroup, work: Any, watch: Watch | None) -> None:
        began = time.monotonic()
        try:
            group.complete(work, watch=watch)
        finally:
            self.blocked_s += time.monotonic() - began

    def copy_out(self, results: list[torch.Tensor], index: int, grad: torch.Tensor) -> None:
        """Write parameter ``index``'s averaged gradient from ``results`` into ``grad``."""
        b, offset, n = self.layout.where[index]
        grad.copy_(results[b][offset:offset + n].view_as(grad))


def flat_tensors(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """The tensors concatenated per dtype (in order), as new 1-d tensors."""
    by: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {d: torch.cat(ts) for d, ts in by.items()}


def unflat_into(flats: dict[torch.dtype, torch.Tensor], tensors: Sequence[torch.Tensor],
                ) -> None:
    """Undo :func:`flat_tensors` into ``tensors`` in place."""
    offsets = dict.fromkeys(flats, 0)
    for t in tensors:
        o = offsets[t.dtype]
        t.detach().copy_(flats[t.dtype][o:o + t.numel()].view_as(t))
        offsets[t.dtype] = o + t.numel()

