"""The transfer ledger: a hypothesis state machine applies its actions to real pin tables.

Whatever the sequence of facts, the pins held equal the pins of the open operations, an
operation's allocated pages are freed exactly when it ends other than done, every finished
operation left no pin, and every illegal fact raises LedgerError naming the phase, changing
nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.domain import PoolName
from hicache.domain.ledger import (
    Action,
    Free,
    Ledger,
    LedgerError,
    Phase,
    Pin,
    PinTableKind,
    Side,
    Unpin,
)
from hicache.domain.pins import PinTable

KV = PoolName.KV


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.tables = {kind: PinTable(kind.value) for kind in PinTableKind}
        self.freed: Counter[tuple[Side, int]] = Counter()
        self.model: dict[int, dict[str, object]] = {}  # open ops: phase, refs, stopping, ...
        self.ended: dict[int, Phase] = {}
        self.next_op = 1

    def _apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Pin):
                self.tables[a.table].pin(a.pages)
            elif isinstance(a, Unpin):
                self.tables[a.table].unpin(a.pages)
            elif isinstance(a, Free):
                for page in a.pages[KV]:
                    self.freed[(a.side, page)] += 1

    def _ops(self, *phases: Phase) -> list[int]:
        return [op for op, m in self.model.items() if m["phase"] in phases]

    @rule(
        load=st.booleans(),
        host=st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
        device=st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
        allocated=st.booleans(),
    )
    def prepare(self, load: bool, host: list[int], device: list[int], allocated: bool) -> None:
        op = self.next_op
        self.next_op += 1
        self._apply(
            self.ledger.prepared(
                op,
                load=load,
                host={KV: host},
                device={KV: device},
                allocated_host=allocated and not load,
                allocated_device=allocated and load,
            )
        )
        self.model[op] = {
            "phase": Phase.QUEUED, "refs": 1, "stopping": False, "load": load,
            "host": host, "device": device, "allocated": allocated,
        }  # fmt: skip

    @precondition(lambda self: self._ops(Phase.QUEUED, Phase.RUNNING))
    @rule(data=st.data())
    def join(self, data: st.DataObject) -> None:
        op = data.draw(st.sampled_from(self._ops(Phase.QUEUED, Phase.RUNNING)))
        m = self.model[op]
        if m["stopping"]:
            with pytest.raises(LedgerError, match="being cancelled"):
                self.ledger.joined(op)
            return
        m["refs"] = int(m["refs"]) + 1  # type: ignore[call-overload]
        assert self.ledger.joined(op) == m["refs"]

    @precondition(lambda self: self._ops(Phase.QUEUED))
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        op = data.draw(st.sampled_from(self._ops(Phase.QUEUED)))
        self.ledger.submitted(op)
        self.model[op]["phase"] = Phase.RUNNING

    @precondition(lambda self: any(m["refs"] for m in self.model.values()))
    @rule(data=st.data())
    def drop_handle(self, data: st.DataObject) -> None:
        op = data.draw(st.sampled_from([o for o, m in self.model.items() if m["refs"]]))
        m = self.model[op]
        m["refs"] = int(m["refs"]) - 1  # type: ignore[call-overload]
        assert self.ledger.handle_dropped(op) == m["refs"]
        if m["refs"] == 0 and m["phase"] is Phase.RUNNING:
            m["stopping"] = True
        elif m["refs"] == 0:  # the engine cancels a queued op without handles
            self._end(op, self.ledger.cancelled_queued(op), Phase.CANCELLED)

    @precondition(lambda self: self._ops(Phase.RUNNING))
    @rule(data=st.data(), failed=st.booleans())
    def copies_finish(self, data: st.DataObject, failed: bool) -> None:
        op = data.draw(st.sampled_from(self._ops(Phase.RUNNING)))
        if self.model[op]["stopping"]:
            self._end(op, self.ledger.stopped(op, failed=failed),
                      Phase.FAILED if failed else Phase.CANCELLED)  # fmt: skip
        else:
            self._end(op, self.ledger.finished(op, failed=failed),
                      Phase.FAILED if failed else Phase.DONE)  # fmt: skip

    @rule(data=st.data(), fact=st.sampled_from(["submit", "finish", "stop", "cancel", "join"]))
    def illegal_fact_is_refused(self, data: st.DataObject, fact: str) -> None:
        """The broken case: a fact the phase does not allow raises and changes nothing."""
        candidates = list(self.model) + list(self.ended) + [self.next_op + 100]
        op = data.draw(st.sampled_from(candidates))
        phase = self.model[op]["phase"] if op in self.model else None
        stopping = bool(self.model[op]["stopping"]) if op in self.model else False
        legal = {
            "submit": phase is Phase.QUEUED,
            "finish": phase is Phase.RUNNING and not stopping,
            "stop": phase is Phase.RUNNING and stopping,
            "cancel": phase is Phase.QUEUED,
            "join": phase in (Phase.QUEUED, Phase.RUNNING) and not stopping,
        }[fact]
        if legal:
            return
        before = {k: t.snapshot() for k, t in self.tables.items()}
        call = {
            "submit": lambda: self.ledger.submitted(op),
            "finish": lambda: self.ledger.finished(op, failed=False),
            "stop": lambda: self.ledger.stopped(op, failed=False),
            "cancel": lambda: self.ledger.cancelled_queued(op),
            "join": lambda: self.ledger.joined(op),
        }[fact]
        expected = phase.value if phase is not None else "unknown or finished"
        with pytest.raises(LedgerError, match=f"#{op} "):
            call()
        with pytest.raises(LedgerError, match=expected):
            call()
        assert {k: t.snapshot() for k, t in self.tables.items()} == before
        if op in self.model:
            assert self.ledger.phase(op) is phase

    def _end(self, op: int, actions: list[Action], phase: Phase) -> None:
        self._apply(actions)
        m = self.model.pop(op)
        self.ended[op] = phase
        freed = [a for a in actions if isinstance(a, Free)]
        if phase is Phase.DONE or not m["allocated"]:
            assert freed == []  # the caller's pages now, or never the engine's
        else:
            side = Side.DEVICE if m["load"] else Side.HOST
            assert [f.side for f in freed] == [side]

    @invariant()
    def pins_are_those_of_the_open_operations(self) -> None:
        want: dict[PinTableKind, Counter[int]] = {k: Counter() for k in PinTableKind}
        for m in self.model.values():
            host, device = m["host"], m["device"]
            want[PinTableKind.HOST].update(host)  # type: ignore[arg-type]
            want[PinTableKind.DEVICE].update(device)  # type: ignore[arg-type]
            writes = PinTableKind.DEVICE_WRITES if m["load"] else PinTableKind.HOST_WRITES
            want[writes].update(device if m["load"] else host)  # type: ignore[arg-type]
        for kind, table in self.tables.items():
            assert dict(table.snapshot().get(KV, {})) == dict(want[kind])
        assert self.ledger.open_operations() == frozenset(self.model)


LedgerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase


def test_an_illegal_transition_names_the_operation_and_its_phase() -> None:
    ledger = Ledger()
    ledger.prepared(1, load=True, host={KV: [0]}, device={KV: [1]})
    with pytest.raises(LedgerError, match=r"operation #1 is queued: cannot finish it"):
        ledger.finished(1, failed=False)
