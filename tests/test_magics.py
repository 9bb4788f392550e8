"""``%%distributed`` through a real InteractiveShell with the extension loaded."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from IPython.core.error import UsageError

import nbdist

from .helpers import GONE_WITHIN_S, Gate, run


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("", "needs -np N"),
        ("-np 0", "-np 0 runs nothing"),
        ("-np abc", "whole number of ranks, not 'abc'"),
        ("-np 2 --frobnicate", "unrecognized arguments: --frobnicate"),
        ("-np 2 --timeout -1", "positive number of seconds"),
        ("-np 2 --env NOEQUALS", "KEY=VALUE"),
        ("-np 2 -o 1bad", "variable name"),
        ("-np 2 --backend yarn", "invalid choice: 'yarn'"),
        ("-np 2 stray", "unexpected argument 'stray'"),
    ],
)
def test_bad_options_are_usage_errors(ip: Any, line: str, message: str) -> None:
    """Every malformed option is a UsageError that says what is wrong."""
    result = ip.run_cell(f"%%distributed {line}\n1")
    err = result.error_in_exec or result.error_before_exec
    assert type(err) is UsageError
    assert message in str(err)


def test_cell_uses_notebook_names_and_returns_rank0_value(ip: Any, capsys: Any) -> None:
    """Aliased modules, notebook functions/classes and values travel; rank 0's value is Out."""
    run(ip, "import numpy as np\nimport os.path\nfrom math import sqrt as s\n"
            "import collections.abc as cabc\n"
            "SCALE = 3\nweights = np.arange(4.0)\n"
            "def scaled(x):\n    return np.sqrt(x) * SCALE\n"
            "class Box:\n    def __init__(self, v):\n        self.v = v\n")
    out = run(ip, "%%distributed -np 2\n"
                  "import os\n"
                  "rank = int(os.environ['RANK'])\n"
                  "print('rank', rank, 'of', os.environ['WORLD_SIZE'], flush=True)\n"
                  "b = Box(scaled(16.0) + s(4.0) + weights.sum())\n"
                  "(rank, b.v, os.path.basename('/a/b'), isinstance([], cabc.Sequence))\n")
    assert out == (0, 12.0 + 2.0 + 6.0, "b", True)
    assert ip.user_ns["_"] == out
    printed = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2" in printed and "[rank 1] rank 1 of 2" in printed


def test_trailing_semicolon_suppresses_the_result_and_o_stores_all(ip: Any) -> None:
    """A trailing ';' returns nothing, and -o VAR keeps every rank's value."""
    out = run(ip, "%%distributed -np 2 -o per_rank --quiet\n"
                  "import os\nint(os.environ['RANK']) * 10;\n")
    assert out is None
    assert ip.user_ns["per_rank"] == [None, None]
    run(ip, "%%distributed -np 3 -o per_rank --quiet\nimport os\nint(os.environ['RANK']) * 10\n")
    assert ip.user_ns["per_rank"] == [0, 10, 20]


def test_env_option_and_negative_np(ip: Any) -> None:
    """--env reaches every rank and -np -2 runs two local ranks."""
    out = run(ip, "%%distributed -np -2 --env GREETING=hi --env EMPTY= -o got --quiet\n"
                  "import os\n(os.environ['GREETING'], os.environ['EMPTY'], os.environ['RANK'])\n")
    assert out == ("hi", "", "0") and ip.user_ns["got"][1] == ("hi", "", "1")


def test_a_failing_cell_raises_and_the_next_cell_runs(ip: Any) -> None:
    """A rank's exception surfaces as DistributedError with the user's line; the shell goes on."""
    result = ip.run_cell("%%distributed -np 2\n"
                         "import os\n"
                         "if os.environ['RANK'] == '1':\n"
                         "    {}['missing']\n")
    err = result.error_in_exec
    assert isinstance(err, nbdist.DistributedError)
    assert "rank 1 of 2 failed: KeyError: 'missing'" in str(err)
    assert "line 4" in err.failures[1] and "{}['missing']" in err.failures[1]
    assert run(ip, "%%distributed -np 2 --quiet\n21 * 2") == 42


def test_an_exception_that_cannot_be_printed_still_names_its_rank_and_type(ip: Any) -> None:
    """A job's exception whose __str__ raises is reported with its rank, type and repr."""
    result = ip.run_cell("%%distributed -np 2\n"
                         "import os\n"
                         "class NoStr(Exception):\n"
                         "    def __str__(self):\n"
                         "        raise RuntimeError('no str')\n"
                         "if os.environ['RANK'] == '1':\n"
                         "    raise NoStr(7)\n")
    err = result.error_in_exec
    assert isinstance(err, nbdist.DistributedError)
    assert str(err).startswith(
        "rank 1 of 2 failed: NoStr: NoStr(7) (its __str__ raised RuntimeError)")
    assert "raise NoStr(7)" in err.failures[1]


def test_line_form_runs_a_script_with_arguments(ip: Any, tmp_path: Path, capsys: Any) -> None:
    """`%distributed -np 2 train.py --lr 0.1` runs the script on both ranks with its argv."""
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint('argv', sys.argv[1:], os.environ['RANK'])\n")
    run(ip, f"%distributed -np 2 {script} --lr 0.1")
    printed = capsys.readouterr().out
    assert "[rank 0] argv ['--lr', '0.1'] 0" in printed
    assert "[rank 1] argv ['--lr', '0.1'] 1" in printed
    with pytest.raises(UsageError, match="no such script"):
        run(ip, "%distributed -np 2 missing_script.py")
    with pytest.raises(UsageError, match="needs a script"):
        run(ip, "%distributed -np 2")


def test_dist_status_lists_jobs_and_details(ip: Any, capsys: Any) -> None:
    """%dist_status shows the kernel's jobs and capacity; with a job id, its ranks."""
    run(ip, "%%distributed -np 2 --quiet\nprint('status line')\n1")
    job = nbdist.job.get_job()
    assert job is not None
    capsys.readouterr()
    run(ip, "%dist_status")
    table = capsys.readouterr().out
    assert job.id in table and "capacity" in table
    run(ip, f"%dist_status {job.id}")
    detail = capsys.readouterr().out
    assert "status line" in detail and "done" in detail
    with pytest.raises(UsageError, match="no job 'j999'"):
        run(ip, "%dist_status j999")


def test_syntax_error_shows_the_users_line_not_nbdists_frames(ip: Any) -> None:
    """A SyntaxError in a distributed cell renders as IPython's own: file, line, caret."""
    from nbdist.errors import CellSyntaxError

    with pytest.raises(CellSyntaxError) as info:
        run(ip, "%%distributed -np 1\nx = 1\nreturn x")
    shown = "\n".join(info.value._render_traceback_())
    assert "'return' outside function" in shown and "line 3" in shown
    assert "nbdist" not in shown and "Traceback" not in shown


def _reply(kc: Any, code: str, timeout: float = 120) -> tuple[str, str]:
    """Run ``code`` in a kernel: its stdout, and its stderr with its error's traceback (IPython
    prints a UsageError on stderr)."""
    from .test_kernel_live import execute

    try:
        msgs = execute(kc, code, timeout)
    except AssertionError as exc:
        return "", str(exc)

    def stream(name: str) -> str:
        return "".join(m["content"]["text"] for m in msgs
                       if m["msg_type"] == "stream" and m["content"]["name"] == name)

    return stream("stdout"), stream("stderr")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_unload_stops_what_nbdist_started_and_load_starts_over(gate: Gate) -> None:
    """%unload_ext nbdist refuses while a job runs; then it stops the session, the warm
    processes and the event server, and removes the magics; %load_ext nbdist works again."""
    from jupyter_client.manager import start_new_kernel

    from .test_kernel_live import ROOT

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    kernel: psutil.Process | None = None
    try:
        out, _ = _reply(kc, "import os\nprint(os.getpid())")
        kernel = psutil.Process(int(out))
        assert _reply(kc, "%load_ext nbdist") == ("", "")
        assert not _reply(kc, "%dist_session start -np -2")[1]
        assert not _reply(kc, "%%distributed -np -2 --quiet\nimport json\n1")[1]
        assert not _reply(kc, f"%%distributed -np -1 --quiet --bg\n{gate.code()}")[1]
        out, _ = _reply(kc, "import json, nbdist.events as e, nbdist.job as j\n"
                            "print(json.dumps([[s.address for s in e._shared.values()], "
                            "j.get_job().id]))")
        addresses, running = json.loads(out)
        assert addresses and kernel.children(recursive=True)

        _, error = _reply(kc, "%unload_ext nbdist")
        assert f"nbdist was not unloaded: job {running} is still running" in error
        assert f"%dist_cancel {running}" in error
        gate.open()
        assert not _reply(kc, "j.get_job().result(timeout=60)")[1]

        assert _reply(kc, "%unload_ext nbdist") == ("", "")
        assert "Cell magic `%%distributed` not found" in _reply(kc, "%%distributed -np 2\n1")[1]
        assert "`%dist_status` not found" in _reply(kc, "%dist_status")[1]
        deadline = time.monotonic() + GONE_WITHIN_S
        while kernel.children(recursive=True):  # session ranks, zygote, warm interpreters
            assert time.monotonic() < deadline, f"left running: {kernel.children(True)}"
            time.sleep(0.05)
        for host, port in addresses:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, port), timeout=5).close()
        out, _ = _reply(kc, "import threading\n"
                            "print([t.name for t in threading.enumerate() if 'nbdist' in t.name])")
        assert out.strip() == "[]"

        assert _reply(kc, "%load_ext nbdist") == ("", "")
        assert _reply(kc, "%%distributed -np -2 --quiet -o values\n6 * 7") == ("", "")
        assert _reply(kc, "print(values)") == ("[42, 42]\n", "")
        out, _ = _reply(kc, "%dist_session")
        assert "no session" in out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
