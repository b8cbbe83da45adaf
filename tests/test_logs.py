"""rrpc.logs: one line per kind of event and peer per interval, never one per call."""

from __future__ import annotations

import logging

from rrpc import logs


def test_a_flood_of_one_event_from_one_peer_logs_one_line_then_counts_the_rest(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(logs, "_last", {})
    with caplog.at_level(logging.WARNING, logger="rrpc"):
        for _ in range(100):
            logs.event("malformed", "10.0.0.9:5555", "malformed frame from %s", "10.0.0.9:5555")
        logs.event("malformed", "10.0.0.7:4444", "malformed frame from %s", "10.0.0.7:4444")
        now[0] += logs.INTERVAL
        logs.event("malformed", "10.0.0.9:5555", "malformed frame from %s", "10.0.0.9:5555")
    assert [record.getMessage() for record in caplog.records] == [
        "rrpc: malformed frame from 10.0.0.9:5555",
        "rrpc: malformed frame from 10.0.0.7:4444",
        "rrpc: malformed frame from 10.0.0.9:5555 (99 more like it in the last 10 s)",
    ]
    assert all(record.name == "rrpc" for record in caplog.records)
