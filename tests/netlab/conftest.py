"""Fixtures for tests that build real network namespaces with scripts/netlab.py."""

import pytest

from scripts import netlab


def _skip_unless_available() -> None:
    reason = netlab.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def netlab_session():
    """Clears stale labs of crashed runs before the suite, and whatever is stale after it."""
    _skip_unless_available()
    netlab.destroy_stale()
    yield
    netlab.destroy_stale()


@pytest.fixture
def netlab_factory(netlab_session):
    """`make(num_hosts, rate=None)` -> Lab; every lab made is removed, pass, fail or SIGTERM."""
    with netlab.sigterm_as_interrupt(), netlab.open_labs() as make:
        yield make
