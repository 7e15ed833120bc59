"""The suite's xdist groups reach the scheduler (the engine tests share compiled programs through them)."""

import pytest


@pytest.mark.xdist_group("xdist-groups-check")
def test_xdist_groups_reach_the_scheduler(request):
    """pytest 9.2 made ``--dist loadgroup`` ignore the groups without a word (pytest-dev/pytest-xdist#1386):
    every grouped engine test then compiled its own programs, minutes of suite time."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs only under pytest-xdist with --dist loadgroup (the default addopts); this run has -n 0")
    assert request.node.nodeid.endswith("@xdist-groups-check"), request.node.nodeid
