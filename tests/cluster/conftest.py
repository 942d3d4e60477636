"""Fixtures of the cluster tests: the JetStream spikes' cluster and client (issue 41), and the
record's two layouts."""

import pytest

from tests.support import clusterharness
from tests.support.spikes import cluster, nc

__all__ = ["cluster", "layout", "nc"]


@pytest.fixture(params=["format-2", "format-3"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The layout new tasks are created in: the snapshot bucket, or the task log (issue 41).

    A module runs every test on both with ``pytestmark = pytest.mark.usefixtures("layout")``
    (instances it starts, in this process or as ``serve`` processes, create tasks in the log
    with ``format-3``); a test keeps to one with ``parametrize("layout", [...], indirect=True)``.
    """
    monkeypatch.setattr(clusterharness, "TASK_LOG", request.param == "format-3")
    return str(request.param)
