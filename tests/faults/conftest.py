"""Fixtures: the tiny checkpoint, a colocated reference engine, a cluster of real daemons, and a
prefill/decode pair with short deadlines that each fault module shares (each case leaves it whole
again, or the next case's ``ensure_healthy`` restores it)."""

import pytest

from tests.cluster import Cluster, cluster, colocated, tiny_models  # noqa: F401 (pytest fixtures)
from tests.faults.harness import Pair


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.call_failed = report.failed


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_models):  # noqa: F811 (the fixture above)
    c = Cluster(tmp_path_factory.mktemp("faults") / "logs", *tiny_models)
    try:
        yield Pair.launch(c)
    finally:
        c.stop_all()


@pytest.fixture
def healthy(request, pair):
    """The module's pair, restored and with its pools back at their starting counts. On failure
    the daemons' log tails are printed (pytest shows them with the failure)."""
    pair.ensure_healthy()
    yield pair
    if getattr(request.node, "call_failed", False):
        for proc in pair.cluster.procs:
            print(f"----- {proc.name} ({proc.log_path}) -----\n{proc.tail(6000)}")
