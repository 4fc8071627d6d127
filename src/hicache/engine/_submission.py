"""How the engine's operations start (private): merged submissions onto the copy streams.

- Submitting: the part of TransferEngine that builds an operation from checked page sets
  (its per-step page maps and bytes), submits what was prepared (one batch per kind per
  ``submit()``), orders each copy stream after its ordering points, and copies a layer-wise
  backup's layer when the forward pass reports it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hicache.domain.errors import HiCacheError, TransferError
from hicache.domain.pools import PoolName
from hicache.domain.ports import Direction, PageMap, Transfer
from hicache.engine._ops import Batch, Op, OpKind, PageDict
from hicache.engine._settling import Settling, _Life
from hicache.engine.logs import get_logger
from hicache.engine.stats import OperationState

log = get_logger("hicache.engine")


class Submitting(Settling):
    """Submission; TransferEngine sets the state declared here and in Settling."""

    _transfer: Transfer
    _next_batch: int
    _next_op: int
    _owners: tuple[PoolName, ...]
    _sidecars: tuple[PoolName, ...]
    _anchor: PoolName
    _layer_pools: tuple[frozenset[PoolName], ...]
    _page_layer_bytes: dict[PoolName, int]
    _layer_patterns: dict[tuple[PoolName, ...], tuple[tuple[int, ...], ...]]

    def _check_open(self, what: str) -> None:  # pragma: no cover - TransferEngine's
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------
    # submission
    # ---------------------------------------------------------------------------------------
    def submit(self) -> None:
        """Submit everything prepared since the last call: one merged submission per kind.

        Loads: one copy call and one event per transfer layer for all of them; backups: one
        copy call after the compute; layer-wise backups: one event set whose layers are copied
        as the forward pass reports them. Never blocks; copy failures surface in the handles.
        """
        if self._life is not _Life.OPEN:
            self._check_open("submit")
        self._sweep()
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        try:
            for kind in OpKind:
                ops = [op for op in queued if op.kind is kind]
                if ops:
                    self._launch(kind, ops)
        except BaseException as e:
            # Nothing may be lost: operations that did not reach a copy stream stay queued,
            # with their slots and pins, for a later submit(), a cancel or close() to settle.
            self._queued = [op for op in queued if op.state is OperationState.QUEUED]
            if isinstance(e, Exception) and not isinstance(e, HiCacheError):
                raise TransferError(
                    f"engine {self._name!r}: the copy streams refused a submission "
                    f"({type(e).__name__}: {e}); {len(self._queued)} operation(s) stay queued"
                ) from e
            raise
        if self._wakeup is not None:
            self._wakeup.set()

    def _launch(self, kind: OpKind, ops: list[Op]) -> None:
        steps = 1 if kind is OpKind.BACKUP else self._layers
        call = self._call(kind)
        batch = Batch(
            batch_id=self._next_batch,
            kind=kind,
            ops=ops,
            call=call,
            events=self._event_sets.acquire(steps),
        )
        self._next_batch += 1
        self._counts["submissions"] += 1
        now = time.perf_counter()
        for op in ops:
            self._ledger.submitted(op.id)
            op.state = OperationState.RUNNING
            op.t_submitted = now
            if kind is OpKind.LAYERWISE_BACKUP:  # nothing is recorded until layer_computed
                op.batch = batch
        self._running.append(batch)
        log.debug(
            "batch_submitted",
            engine=self._name,
            batch=batch.id,
            kind=kind.value,
            ops=len(ops),
            pages=sum(op.pages for op in ops),
            steps=steps,
        )
        if kind is OpKind.LAYERWISE_BACKUP:
            return
        # A backup reads what compute wrote; a load writes device pages that a request freed
        # a moment ago may still have queued kernels reading. Either way the copy stream
        # first waits for the compute issued so far (a GPU-side wait; nothing on CPU).
        try:
            self._order(kind.direction, ops)
        except Exception as e:
            with batch.lock:
                for op in ops:
                    op.stopped = True
                    op.failed_step = 0
                    op.error = e
        for step in range(steps):
            batch.submit_step(step, self._streams)
            if step == 0 and steps > 1:
                # Hand the GIL over once: a CPU copy worker needs it to begin layer 0, and
                # otherwise waited until this thread had submitted every layer and blocked in
                # wait_layer, which put the whole submission in series with layer 0's copy
                # (bench overlap --timeline: the first copy began only after submit returned).
                time.sleep(0)
        # Only now: a forward pass on another thread that sees the batch must find every
        # step's event recorded (an event not recorded yet reads as finished).
        for op in ops:
            op.batch = batch

    def _call(self, kind: OpKind) -> Any:
        transfer = self._transfer
        if kind is OpKind.LOAD:
            return transfer.load_layer
        if kind is OpKind.LAYERWISE_BACKUP:
            return transfer.backup_layer

        def backup_all(_step: int, maps: Sequence[PageMap]) -> int:
            return transfer.backup(maps)

        return backup_all

    def submit_layer(self, batch: Batch, layer: int, after: object | None = None) -> None:
        """A layer-wise backup's layer was computed: copy it (once per submission).

        Ordered after ``after`` if given, else after each operation's own ordering point.
        """
        if batch.step_state[layer]:
            return
        if after is not None:
            self._streams.after_compute(Direction.BACKUP, after)
        else:
            self._order(Direction.BACKUP, batch.ops)
        batch.submit_step(layer, self._streams)

    def _order(self, direction: Direction, ops: Sequence[Op]) -> None:
        """Order the direction's copy stream after every distinct ordering point of ``ops``."""
        points: list[object] = []
        default = False
        for op in ops:
            if op.after is None:
                default = True
            elif not any(p is op.after for p in points):
                points.append(op.after)
        if default:
            self._streams.after_compute(direction)
        for point in points:
            self._streams.after_compute(direction, point)

    def _new_op(
        self,
        kind: OpKind,
        host: PageDict,
        device: PageDict,
        allocated_host: bool,
        allocated_device: bool,
        key: tuple[tuple[PoolName, tuple[int, ...]], ...] | None,
    ) -> Op:
        maps = [PageMap(pool, host[pool], device[pool]) for pool in self._owners if pool in host]
        if self._anchor in host:
            anchor_host, anchor_device = host[self._anchor], device[self._anchor]
            maps.extend(PageMap(side, anchor_host, anchor_device) for side in self._sidecars)
        # Which maps each transfer layer carries depends only on the pools present: worked out
        # once per pool set, then per operation by position (no per-layer set lookups).
        pools = tuple(m.pool for m in maps)
        pattern = self._layer_patterns.get(pools)
        if pattern is None:
            pattern = tuple(
                tuple(i for i, p in enumerate(pools) if p in layer) for layer in self._layer_pools
            )
            self._layer_patterns[pools] = pattern
        per_layer = [[maps[i] for i in idx] for idx in pattern]
        # Bytes per transfer layer from the plan's geometry (what Transfer.layer_bytes reports),
        # without a call into the copy backend per layer.
        sizes = [len(m) * self._page_layer_bytes[m.pool] for m in maps]
        layer_bytes = [sum(sizes[i] for i in idx) for idx in pattern]
        if kind is OpKind.BACKUP:
            steps, step_bytes = [maps], [sum(layer_bytes)]
        else:
            steps, step_bytes = per_layer, layer_bytes
        op = Op(
            op_id=self._next_op,
            kind=kind,
            host=host,
            device=device,
            allocated_host=allocated_host,
            allocated_device=allocated_device,
            steps=steps,
            step_bytes=step_bytes,
            key=key,
        )
        self._next_op += 1
        return op
