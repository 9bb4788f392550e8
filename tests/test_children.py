"""Children of a rank: notebook classes and functions reach spawned, forkserver and forked
children (nbdist/rank/children.py), notebook logging reaches the ranks (nbdist/_logcarry.py), and
Lightning's forking strategies are caught (nbdist/capture/_launchers.py, nbdist/hints.py).

The table (start method × DataLoader workers, Pool, ProcessPoolExecutor,
torch.multiprocessing) is compared with the same code run as a plain script.
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbdist import session as sessions
from nbdist.errors import CaptureError, DistributedError

from . import children
from .helpers import Gate, run, wait_for


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_table_as_a_plain_script_gives_what_is_worked_out_by_hand(tmp_path: Path) -> None:
    """The table's premise: run as a plain script (``__main__`` guarded), every start method
    gives ``children.expected_by_hand()``. The ranks' tests (here and on Spark) compare with
    that table, so they give what the script gives. Run once in the suite: the script starts
    24 children, most of them fresh interpreters importing torch."""
    found = children.reference(tmp_path)
    for method in children.METHODS:
        assert found[method] == children.expected_by_hand(), method


@pytest.fixture
def notebook(ip: Any) -> Iterator[Any]:
    """The shell with the table's earlier cell run (a Dataset subclass and a function)."""
    run(ip, children.NOTEBOOK)
    yield ip
    for name in ("OFFSET", "square", "Squares"):
        ip.user_ns.pop(name, None)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", children.METHODS)
def test_notebook_code_reaches_every_kind_of_child_of_a_local_rank(
    notebook: Any, method: str
) -> None:
    """DataLoader workers, Pool, ProcessPoolExecutor, torch.multiprocessing: as the script
    (``test_the_table_as_a_plain_script_gives_what_is_worked_out_by_hand``)."""
    out = run(notebook, children.cell((method,)))
    assert json.loads(out)[method] == children.expected_by_hand()


@pytest.mark.timeout(120)
def test_plain_pickle_on_a_rank_finds_the_cells_classes(ip: Any) -> None:
    """The cell runs in a real module ``__main__``: pickle by name works as in a script."""
    out = run(ip, "%%distributed -np 1 --quiet\n"
                  "import pickle, sys\n"
                  "class Point:\n"
                  "    def __init__(self, x):\n"
                  "        self.x = x\n"
                  "p = pickle.loads(pickle.dumps(Point(3)))\n"
                  "(p.x, type(p) is Point, sys.modules['__main__'].Point is Point)\n")
    assert out == (3, True, True)


@pytest.mark.timeout(120)
def test_a_notebook_function_that_cannot_travel_to_a_child_is_named(ip: Any) -> None:
    """A cell function holding a lock, given to a spawn Pool: an error naming it and the fix."""
    with pytest.raises(DistributedError) as err:
        run(ip, "%%distributed -np 1 --quiet\n"
                "import multiprocessing, threading\n"
                "lock = threading.Lock()\n"
                "def locked(i):\n"
                "    with lock:\n"
                "        return i\n"
                "with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
                "    pool.map(locked, range(2))\n")
    text = err.value.failures[0]
    assert "nbdist cannot send the notebook's function 'locked'" in text, text
    assert "(defined in <cell In[" in text and "line 4)" in text, text
    assert "cannot pickle '_thread.lock' object" in text and "inside the child" in text, text


@pytest.mark.timeout(120)
def test_plain_pickle_of_a_lambda_on_a_rank_gets_a_hint(ip: Any) -> None:
    """pickle.dumps of a lambda fails as in a script, with a hint saying what goes by value."""
    with pytest.raises(DistributedError) as err:
        run(ip, "%%distributed -np 1 --quiet\nimport pickle\npickle.dumps(lambda: 0)\n")
    text = err.value.failures[0]
    assert "attribute lookup <lambda> on __main__ failed" in text, text
    assert "nbdist hint: Plain pickle" in text and "cloudpickle.dumps" in text, text


@pytest.mark.timeout(120)
def test_a_function_of_a_script_s_main_given_to_nbdist_run_reaches_spawn_children() -> None:
    """nbdist.run(fn) from a script: fn's own lambdas and functions reach a spawn Pool."""
    import nbdist

    script: dict[str, Any] = {"__name__": "__main__"}  # what a script's functions have
    exec(textwrap.dedent("""\
        def double(i):
            return 2 * i

        def work():
            import multiprocessing
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                return pool.map(double, range(3)), pool.map(lambda i: i + 1, range(3))
        """), script)
    assert nbdist.run(script["work"], np=1).result(timeout=100) == ([0, 2, 4], [1, 2, 3])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_s_children_import_the_script_again_as_under_torchrun(
    ip: Any, tmp_path: Path, capsys: Any
) -> None:
    """``%distributed train.py``: spawn children find the script's functions by name."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import multiprocessing, sys

        def triple(i):
            return 3 * i

        if __name__ == "__main__":
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                print("tripled", pool.map(triple, range(4)), triple.__module__)
        """))
    run(ip, f"%distributed -np 1 {script}")
    # the script's own __main__ (it has a __file__): by name, as torchrun runs it
    printed = capsys.readouterr().out
    assert "[rank 0] tripled [0, 3, 6, 9] __main__" in printed, printed


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("no_session")
def test_a_session_class_from_an_earlier_cell_reaches_a_spawn_pool(ip: Any) -> None:
    """A class and function defined in one session cell work in a spawn Pool of a later one."""
    run(ip, "%dist_session start -np 1")
    try:
        run(ip, "%%distributed\n"
                "class Tripler:\n"
                "    def __init__(self, k):\n"
                "        self.k = k\n"
                "    def __call__(self, i):\n"
                "        return self.k * i\n"
                "def tripled(i):\n"
                "    return Tripler(3)(i)\n")
        out = run(ip, "%%distributed\n"
                      "import multiprocessing\n"
                      "with multiprocessing.get_context('spawn').Pool(2) as pool:\n"
                      "    got = (pool.map(tripled, range(4)), pool.map(Tripler(2), range(3)))\n"
                      "got\n")
        assert out == ([0, 3, 6, 9], [0, 2, 4])
    finally:
        live = sessions.current()
        if live is not None and live.alive:
            live.stop()


# -- logging ----------------------------------------------------------------------------------
@pytest.fixture
def notebook_logging() -> Iterator[None]:
    """The kernel's root logger as a test leaves it found (basicConfig changes it)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("notebook_logging")
def test_notebook_logging_reaches_a_rank_live(ip: Any, gate: Gate) -> None:
    """An earlier cell's basicConfig: a rank's logger.info shows formatted while it runs."""
    run(ip, "import logging, sys\n"
            "logging.getLogger().handlers.clear()\n"
            "logging.basicConfig(level=logging.INFO, format='%(levelname)s|%(message)s',"
            " stream=sys.stdout)\n")
    job = run(ip, "%%distributed -np 1 --bg --quiet\n"
                  "import logging\n"
                  "logging.getLogger('x').info('hi')\n"
                  "logging.getLogger('x').debug('below the level')\n"
                  + gate.code())
    try:
        wait_for(lambda: [ln.text for ln in job.state.ranks[0].log] == ["INFO|hi"], 60,
                 "the rank's log line, while the rank runs")
        assert not job.done()
    finally:
        gate.open()
    job.result(timeout=60)
    assert [ln.text for ln in job.state.ranks[0].log] == ["INFO|hi"]


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("notebook_logging")
def test_the_cells_own_basic_config_wins(ip: Any, capsys: Any) -> None:
    """The cell's basicConfig replaces the carried handlers and level, as in a fresh script."""
    run(ip, "import logging, sys\n"
            "logging.getLogger().handlers.clear()\n"
            "logging.basicConfig(level=logging.INFO, format='nb|%(message)s', stream=sys.stdout)")
    capsys.readouterr()
    run(ip, "%%distributed -np 1\n"
            "import logging\n"
            "logging.basicConfig(format='cell|%(message)s')\n"
            "logging.getLogger('x').info('hidden: WARNING is the level again')\n"
            "logging.getLogger('x').warning('shown')\n")
    printed = capsys.readouterr().out
    assert "[rank 0] cell|shown" in printed, printed
    assert "hidden" not in printed and "nb|" not in printed, printed


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("notebook_logging")
def test_without_notebook_logging_a_rank_logs_as_a_fresh_script(ip: Any, capsys: Any) -> None:
    """Nothing configured in the notebook: info is dropped, a warning shows unformatted."""
    logging.getLogger().handlers.clear()
    logging.getLogger().setLevel(logging.WARNING)
    capsys.readouterr()
    run(ip, "%%distributed -np 1\n"
            "import logging\n"
            "logging.getLogger('x').info('dropped')\n"
            "logging.getLogger('x').warning('plain')\n")
    printed = capsys.readouterr().out
    assert "[rank 0] plain" in printed and "dropped" not in printed, printed


# -- Lightning's forking strategies -------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_fork_find_unused_parameters_true"])
def test_lightning_ddp_notebook_is_refused_before_launch(ip: Any, strategy: str) -> None:
    """strategy="ddp_notebook" in the cell: refused before launch, naming the line and "ddp"."""
    with pytest.raises(CaptureError) as err:
        run(ip, "%%distributed -np 2\n"
                "import lightning as L\n"
                f"trainer = L.Trainer(accelerator='cpu', devices=2, strategy={strategy!r})\n")
    text = str(err.value)
    plain = strategy.replace("_notebook", "").replace("_fork", "")
    assert "line 3: `trainer = L.Trainer(" in text, text
    assert f"use strategy={plain!r}" in text and "EADDRINUSE" in text, text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_ddp_notebook_from_a_variable_fails_with_a_hint(ip: Any) -> None:
    """A forking strategy capture cannot see: the rank's real failure carries the hint."""
    pytest.importorskip("lightning")
    ip.user_ns["STRATEGY"] = "ddp_notebook"
    try:
        with pytest.raises(DistributedError) as err:
            run(ip, "%%distributed -np 2 --quiet --timeout 240\n"
                    "import lightning as L, torch\n"
                    "from torch.utils.data import DataLoader, TensorDataset\n"
                    "class Tiny(L.LightningModule):\n"
                    "    def __init__(self):\n"
                    "        super().__init__()\n"
                    "        self.layer = torch.nn.Linear(2, 1)\n"
                    "    def training_step(self, batch, i):\n"
                    "        return self.layer(batch[0]).sum()\n"
                    "    def configure_optimizers(self):\n"
                    "        return torch.optim.SGD(self.parameters(), 0.1)\n"
                    "trainer = L.Trainer(strategy=STRATEGY, accelerator='cpu', devices=2,\n"
                    "                    max_steps=1, logger=False, enable_checkpointing=False,\n"
                    "                    enable_progress_bar=False, enable_model_summary=False)\n"
                    "trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 2))))\n")
    finally:
        ip.user_ns.pop("STRATEGY", None)
    text = "\n".join(err.value.failures.values())
    assert "nbdist hint: Lightning started processes of its own" in text, text
    assert 'Use strategy="ddp"' in text, text
