"""Children of Spark ranks: notebook classes and functions reach spawned, forkserver and forked
children of a rank that is a Spark barrier task, and notebook logging reaches it, as on local
ranks (tests/test_children.py has the table's local half)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

from nbdist import job as jobs
from nbdist import session as sessions

from .. import children
from ..helpers import run

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def notebook(ip: Any, spark_local: SparkSession) -> Iterator[Any]:
    """The table's earlier cell, run in a shell whose %%distributed goes to Spark."""
    run(ip, children.NOTEBOOK)
    yield ip
    for name in ("OFFSET", "square", "Squares"):
        ip.user_ns.pop(name, None)


def test_notebook_code_reaches_every_kind_of_child_of_a_spark_rank(notebook: Any) -> None:
    """Every start method × DataLoader workers, Pool, ProcessPoolExecutor, torch.multiprocessing
    on a Spark rank gives what the same code gives as a plain script (the table worked out by
    hand, which tests/test_children.py checks against the script)."""
    out = json.loads(run(notebook, children.cell(children.METHODS)))
    assert jobs.jobs()[-1].state.backend == "spark"
    assert out == {method: children.expected_by_hand() for method in children.METHODS}


@pytest.mark.usefixtures("no_session")
def test_spark_session_class_and_notebook_logging_reach_the_ranks(
    ip: Any, spark_local: SparkSession, capsys: Any
) -> None:
    """On a Spark session: an earlier session cell's class in a spawn Pool, and notebook
    logging shown formatted."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    run(ip, "%dist_session start -np 1")
    try:
        live = sessions.current()
        assert live is not None and live.launcher.name == "spark"
        run(ip, "%%distributed\n"
                "class Tripler:\n"
                "    def __call__(self, i):\n"
                "        return 3 * i\n")
        run(ip, "import logging, sys\n"
                "logging.getLogger().handlers.clear()\n"
                "logging.basicConfig(level=logging.INFO, format='%(levelname)s|%(message)s',"
                " stream=sys.stdout)\n")
        capsys.readouterr()
        out = run(ip, "%%distributed\n"
                      "import logging, multiprocessing\n"
                      "logging.getLogger('x').info('hi')\n"
                      "with multiprocessing.get_context('spawn').Pool(2) as pool:\n"
                      "    got = pool.map(Tripler(), range(4))\n"
                      "got\n")
        assert out == [0, 3, 6, 9]
        assert "[rank 0] INFO|hi" in capsys.readouterr().out
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        live = sessions.current()
        if live is not None and live.alive:
            live.stop()


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
@pytest.mark.parametrize("zygote", ["1", "0"], ids=["executor zygote", "NBDIST_ZYGOTE=0"])
def test_a_child_forked_during_a_flood_on_a_spark_rank_repeats_nothing(
    spark_local: SparkSession, how: str, zygote: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The local test's fork after 20,000 buffered lines, on a Spark rank (forked from the
    executor's zygote, or fresh): every line arrives exactly once, in order."""
    import nbdist
    from nbdist import state

    from ..test_run import print_then_fork

    monkeypatch.setenv("NBDIST_ZYGOTE", zygote)  # read by the Spark backend at each launch
    monkeypatch.setattr(state, "LOG_LINES", 250_000)  # keep every line to compare them all
    job = nbdist.run(print_then_fork, how, np=1, backend="spark", timeout=200)
    n = job.result(timeout=210)
    assert n >= 20_000, "the rank's stdout was not block-buffered when it forked"
    r = job.state.ranks[0]
    assert [line.text for line in r.log] == [f"p {i}" for i in range(n)] + ["child",
                                                                             "parent done"]
    if zygote == "0":  # the rank says why it was not forked
        assert (r.start, r.start_why) == ("fresh", "zygotes are off (NBDIST_ZYGOTE=0 or "
                                          "NBDIST_WARM_POOL=0 in the notebook)")
