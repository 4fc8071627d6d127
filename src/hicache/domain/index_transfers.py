"""The prefix index's two-phase transfers: prepare pins the source and reserves the destination.

- IndexTransfers: the transfer half of PrefixIndex (its base, over IndexState).
- prepare_backup(keys, host) / prepare_load(keys, device) / prepare_prefetch(keys, host) /
  prepare_store(keys): check the pages and destinations, pin each source, mark each
  destination pending (invisible to match) and return the Ticket in flight. A load or prefetch
  destination without the anchor is a fill: it adds the pools a page's copy on that tier lacks
  (the copy stays pinned until complete).
- complete(ticket, ok): the pages whose copy succeeded become visible on the destination
  (a prefetch also records the storage objects read); failed destinations and the sources a
  write_back eviction waited for come back in ``free``; a host arrival may ask for storage
  writes (write_through).
- abort(ticket): complete(ticket, False).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.index_pages import PageRecord, destination_refusal
from hicache.domain.index_state import IndexState
from hicache.domain.tiers import Actions, Freed, OpKind, Placement, Ticket, Tier


class IndexTransfers(IndexState):
    """Two-phase transfers of the prefix index (see the module docstring)."""

    def _new_ticket(
        self,
        kind: OpKind,
        pages: Sequence[PageRecord],
        dests: Sequence[Placement],
    ) -> Ticket:
        src, dst = kind.source, kind.dest
        plain = self._plain_whole_pages(kind, pages, dests)
        if not plain:
            self._check_ticket(kind, pages, dests)
        ticket = Ticket(
            id=self._next_ticket,
            kind=kind,
            keys=tuple(p.key for p in pages),
            # Not copied: the index replaces placements, never changes them in place.
            sources=tuple(p.at[src] or {} for p in pages),
            dests=tuple(dests),
        )
        self._next_ticket += 1
        if plain:
            # One pool, whole pages between DEVICE and HOST: the steps below, inline.
            tid, name = ticket.id, self._anchor._value_
            held = self._held[dst][name]
            slot = self._slot[src, self._anchor]
            unstamp = self._lru.unstamp
            for p, dest in zip(pages, dests, strict=True):
                pending = p.pending
                if type(pending) is not list:
                    pending = p.pending = list(pending)
                pending[dst] = tid
                held[dest[self._anchor]] = p.key
                pins = p.pins
                pins[src] += 1
                if pins[src] == 1 and p.stamp[slot]:
                    unstamp(p, slot)
            self._tickets[ticket.id] = ticket
            return ticket
        for p, dest in zip(pages, dests, strict=True):
            p.set_pending(dst, ticket.id)
            self._hold(dst, p.key, dest)
            if self._anchor not in dest:  # a fill: keep the copy it completes where it is
                p.pins[dst] += 1
                if p.pins[dst] == 1:
                    self._lru_remove(p, dst)
            if src != Tier.STORAGE:
                p.pins[src] += 1
                if p.pins[src] == 1:
                    self._lru_remove(p, src)
        self._tickets[ticket.id] = ticket
        return ticket

    def _plain_whole_pages(
        self, kind: OpKind, pages: Sequence[PageRecord], dests: Sequence[Placement]
    ) -> bool:
        """Whether a ticket is whole pages of the one pool between DEVICE and HOST that pass
        every check of ``_check_ticket`` (False: let that check, and name what it refuses)."""
        src, dst = kind.source, kind.dest
        if len(self._owners) != 1 or Tier.STORAGE in (src, dst):
            return False
        anchor = self._anchor
        held = self._held[dst][anchor._value_].get
        if len({p.key for p in pages}) != len(pages):
            return False
        for p, dest in zip(pages, dests, strict=True):
            at = p.at
            if len(dest) != 1 or at[dst] is not None or at[src] is None or p.pending[dst]:
                return False
            pid = dest.get(anchor)
            if pid is None:
                return False
            other = held(pid)
            if other is not None and other != p.key:
                return False
        return True

    def _check_ticket(
        self, kind: OpKind, pages: Sequence[PageRecord], dests: Sequence[Placement]
    ) -> None:
        """CacheStateError naming the first page a ticket may not take (see _new_ticket)."""
        src, dst = kind.source, kind.dest
        seen: set[bytes] = set()
        for p, dest in zip(pages, dests, strict=True):
            if p.key in seen:
                raise CacheStateError(f"{kind.value}: page {p.key.hex()[:16]} twice in one batch")
            seen.add(p.key)
            refused = destination_refusal(p, kind, dest, self._anchor)
            if refused is None:
                refused = self._held_by_other(dst, p.key, dest)
            if refused is not None:
                raise CacheStateError(refused)
            source = p.at[src]
            if src == Tier.STORAGE:
                continue
            if source is None:
                raise CacheStateError(f"{kind.value}: page {p.key.hex()[:16]} is not on {src.name}")
            if dst != Tier.STORAGE and not dest.keys() <= source.keys():
                # The source's pools are the index's state, which may have changed since the
                # caller read it (a race), so this is a state error, not bad input.
                raise CacheStateError(
                    f"{kind.value}: page {p.key.hex()[:16]} has pools "
                    f"{sorted(q.value for q in source)} on {src.name}; a destination for "
                    f"{sorted(q.value for q in dest)} would register pages nothing was copied to"
                )

    def prepare_backup(self, keys: Sequence[bytes], host: Sequence[Placement]) -> Ticket:
        """Device -> host into the caller's host pages ``host`` (one placement per key)."""
        self._same_len(keys, host, "prepare_backup")
        dests = [self._check_placement(w, "prepare_backup") for w in host]
        return self._new_ticket(OpKind.BACKUP, [self._page(k) for k in keys], dests)

    def prepare_load(self, keys: Sequence[bytes], device: Sequence[Placement]) -> Ticket:
        """Host -> device into the caller's device pages ``device`` (without the anchor: a fill)."""
        self._same_len(keys, device, "prepare_load")
        dests = [self._check_placement(w, "prepare_load", fill=True) for w in device]
        return self._new_ticket(OpKind.LOAD, [self._page(k) for k in keys], dests)

    def prepare_prefetch(self, keys: Sequence[bytes], host: Sequence[Placement]) -> Ticket:
        """Storage -> host into ``host``; pages the index did not know are created (hidden).

        A placement without the anchor is a fill of a page on host that lacks those pools.
        """
        self._same_len(keys, host, "prepare_prefetch")
        dests = [self._check_placement(w, "prepare_prefetch", fill=True) for w in host]
        fresh = [k for k in dict.fromkeys(keys) if k not in self._pages]
        for k in fresh:
            self._pages[k] = PageRecord(k, self._slots)
        try:
            return self._new_ticket(OpKind.PREFETCH, [self._pages[k] for k in keys], dests)
        except BaseException:
            for k in fresh:
                self._forget(self._pages[k])
            raise

    def prepare_store(self, keys: Sequence[bytes]) -> Ticket:
        """Host -> storage; the ticket's ``sources`` are the host placements to write from."""
        pages = [self._page(k) for k in keys]
        dests = [self._objects(p.at[Tier.HOST] or {}) for p in pages]
        return self._new_ticket(OpKind.STORE, pages, dests)

    def complete(self, ticket: Ticket, ok: bool | Sequence[bool]) -> Actions:
        """Finish a transfer: pages whose copy succeeded become visible on the destination.

        ``ok`` is one flag for the batch or one per page. Failed destinations come back in
        ``free``; so do sources that a write_back eviction was waiting on.
        """
        if self._tickets.get(ticket.id) is not ticket:
            raise CacheStateError(f"ticket {ticket.id} ({ticket.kind.value}) is not in flight")
        flags = [ok] * len(ticket) if isinstance(ok, bool) else list(ok)
        if len(flags) != len(ticket):
            raise ConfigError(f"complete: {len(flags)} flags for a ticket of {len(ticket)} pages")
        del self._tickets[ticket.id]
        src, dst = ticket.kind.source, ticket.kind.dest
        free: list[Freed] = []
        arrived: list[PageRecord] = []
        for key, dest, good in zip(ticket.keys, ticket.dests, flags, strict=True):
            page = self._pages[key]
            page.set_pending(dst, 0)
            fill = self._anchor not in dest
            if fill:
                page.pins[dst] -= 1
            if good:
                page.at[dst] = {**(page.at[dst] or {}), **dest}
                if ticket.kind is OpKind.PREFETCH:
                    got = dict.fromkeys(dest, 0) if fill else self._objects(dest)
                    page.at[Tier.STORAGE] = {**(page.at[Tier.STORAGE] or {}), **got}
                arrived.append(page)
            elif dst != Tier.STORAGE:
                free.extend(Freed(dst, pool, pid) for pool, pid in dest.items())
                for pool, pid in dest.items():
                    self._unhold(dst, pool, pid)
            self._lru_add(page, dst)  # no-op unless the copy there is whole and unpinned
            if src != Tier.STORAGE:
                page.pins[src] -= 1
                scope = page.evicting[src]
                if scope is not None and ticket.kind in (OpKind.BACKUP, OpKind.STORE):
                    # The copy a write_back eviction waited for: drop the source now, unless a
                    # request pinned it meanwhile (then it stays and returns to the LRU on unpin).
                    page.set_evicting(src, None)
                    if page.pins[src] == 0:
                        free.extend(self._drop(page, src, scope))
                    self._lru_add(page, src)  # what the eviction did not take (another pool's)
                elif page.pins[src] == 0:
                    self._lru_add(page, src)
            if page.idle():
                self._forget(page)
        if arrived and dst != Tier.STORAGE:
            self._touch(arrived)
        store = self._wanted(arrived, Tier.STORAGE) if dst == Tier.HOST else ()
        return Actions(store=store, free=tuple(free))

    def abort(self, ticket: Ticket) -> Actions:
        """Give up a transfer: complete(ticket, False)."""
        return self.complete(ticket, False)


__all__ = ["IndexTransfers"]
