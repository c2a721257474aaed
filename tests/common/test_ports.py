"""free_port's range: LAB_PORT_RANGE keeps two test lanes' servers apart (the lanes' halves: tests/conftest.py)."""

from __future__ import annotations

import pytest

from scripts.common import server
from scripts.common.server import PORT_RANGE_ENV, ServerError, free_port, port_range


def test_ports_are_drawn_inside_the_range(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21040")
    monkeypatch.setattr(server, "_ephemeral_low", lambda: 32768)
    assert port_range() == (21000, 21040)
    for _ in range(20):
        base = free_port(4)
        assert base >= 21000 and base + 4 <= 21040


def test_the_range_stays_below_the_ephemeral_ports(monkeypatch):
    monkeypatch.setattr(server, "_ephemeral_low", lambda: 30000)
    monkeypatch.setenv(PORT_RANGE_ENV, "25000-40000")
    assert port_range() == (25000, 30000)
    monkeypatch.delenv(PORT_RANGE_ENV)
    assert port_range() == (20000, 30000)


@pytest.mark.parametrize("text", ["20000", "a-b", "30000-20000", "80-2000"])
def test_a_bad_range_is_one_line(monkeypatch, text):
    monkeypatch.setenv(PORT_RANGE_ENV, text)
    with pytest.raises(ServerError, match=PORT_RANGE_ENV):
        port_range()
