"""TensorFlow and Keras on local ranks: TF_CONFIG for MultiWorkerMirroredStrategy, Keras 3's
distribution variables, and real multi-worker training in ``%%distributed`` cells.

The rendezvous tests need no TensorFlow; the training tests skip without it (``nbdist[tf]``).
"""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest

import nbdist
from nbdist.world import Hello, plan_world


def tf_config(env: dict[str, str]) -> dict[str, object]:
    return json.loads(env["TF_CONFIG"])  # type: ignore[no-any-return]


# -- the rendezvous: TF_CONFIG and KERAS_DISTRIBUTION_* -----------------------------------------
def test_tf_config_lists_every_rank_as_a_worker_in_rank_order() -> None:
    """Each rank's reserved port is worker RANK in every rank's TF_CONFIG; its task is itself."""
    hellos = {0: Hello(0, "a", 29500, tf_port=2001), 1: Hello(1, "b", tf_port=2002),
              2: Hello(2, "a", tf_port=2003)}
    envs = plan_world(hellos, 3, "r", "j")
    for rank in range(3):
        config = tf_config(envs[rank])
        assert config == {"cluster": {"worker": ["a:2001", "b:2002", "a:2003"]},
                          "task": {"type": "worker", "index": rank}}


def test_keras_distribution_points_at_rank_zero() -> None:
    """Keras 3's job address is MASTER_ADDR:MASTER_PORT; process count and id follow RANK."""
    hellos = {0: Hello(0, "a", 29500, tf_port=1), 1: Hello(1, "b", tf_port=2)}
    envs = plan_world(hellos, 2, "r", "j")
    for rank in (0, 1):
        assert envs[rank]["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "a:29500"
        assert envs[rank]["KERAS_DISTRIBUTION_NUM_PROCESSES"] == "2"
        assert envs[rank]["KERAS_DISTRIBUTION_PROCESS_ID"] == str(rank)


def test_ipv6_hosts_are_bracketed() -> None:
    """An IPv6 host is written [host]:port, as gRPC and JAX's coordinator parse it."""
    envs = plan_world({0: Hello(0, "fd00::1", 29500, tf_port=7)}, 1, "r", "j")
    assert tf_config(envs[0])["cluster"] == {"worker": ["[fd00::1]:7"]}
    assert envs[0]["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "[fd00::1]:29500"
    assert envs[0]["MASTER_ADDR"] == "fd00::1"  # torch takes the bare address


def test_no_tf_config_without_every_port_and_user_env_wins() -> None:
    """A rank without a reserved port leaves TF_CONFIG out; --env TF_CONFIG replaces nbdist's."""
    envs = plan_world({0: Hello(0, "a", 1, tf_port=5), 1: Hello(1, "a")}, 2, "r", "j")
    assert "TF_CONFIG" not in envs[0] and "TF_CONFIG" not in envs[1]
    mine = json.dumps({"cluster": {"chief": ["x:1"]}, "task": {"type": "chief", "index": 0}})
    envs = plan_world({0: Hello(0, "a", 1, tf_port=5)}, 1, "r", "j", user_env={"TF_CONFIG": mine})
    assert envs[0]["TF_CONFIG"] == mine


def test_two_ranks_offering_one_address_is_an_error() -> None:
    """The same host:port for two workers is refused, naming it (one TF server could not start)."""
    with pytest.raises(ValueError, match="same TensorFlow worker address a:5"):
        plan_world({0: Hello(0, "a", 1, tf_port=5), 1: Hello(1, "a", tf_port=5)}, 2, "r", "j")


def test_hello_round_trips_the_tf_port() -> None:
    """The TF port travels in the hello as JSON and comes back as an int (or None)."""
    assert Hello.from_event(1, {"host": "h", "tf_port": 4242}).tf_port == 4242
    assert Hello.from_event(1, {"host": "h", "tf_port": "4242"}).tf_port is None
    assert Hello.from_event(1, {"host": "h"}).tf_port is None


def ports_bind_on_their_rank() -> tuple[str, bool]:
    """On a rank: its TF_CONFIG entry, and whether its port can be bound on all interfaces."""
    import json
    import os
    import socket

    config = json.loads(os.environ["TF_CONFIG"])
    mine = config["cluster"]["worker"][config["task"]["index"]]
    with socket.socket() as s:
        try:
            s.bind(("", int(mine.rsplit(":", 1)[1])))
        except OSError:
            return mine, False
    return mine, True


def test_each_local_rank_gets_a_distinct_port_it_can_bind() -> None:
    """Three local ranks get three distinct TF ports, each free again when the rank runs."""
    results = nbdist.run(ports_bind_on_their_rank, np=3).results
    addresses = [address for address, _ in results]
    assert len(set(addresses)) == 3, addresses
    assert all(free for _, free in results), results


def test_the_reservation_is_held_during_the_rendezvous() -> None:
    """A supervisor's reserved port cannot be bound by anyone else until its rank starts."""
    from nbdist.rank import RankSpec, Supervisor

    sup = Supervisor(RankSpec(rank=1, world_size=2, job_id="j", secret="00", driver=("h", 1),
                              payload=b""))
    port = sup._hello()["tf_port"]
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("", port))
    sup._release_tf_port()
    with socket.socket() as s:
        s.bind(("", port))


# -- hints: known failures and what to do --------------------------------------------------------
KERAS3_FIT = (
    'Traceback (most recent call last):\n  File "<cell In[1]>", line 10, in <module>\n'
    '    model.fit(ds, epochs=1, verbose=0)\n'
    '  File "/site-packages/keras/src/utils/traceback_utils.py", line 122, in error_handler\n'
    "ValueError: Attempt to convert a value (PerReplica:{\n  0: <tf.Tensor: shape=(4, 4)>\n"
    "}) with an unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>)\n"
)


def test_keras3_fit_under_mwms_gets_the_way_out() -> None:
    """Keras 3's PerReplica failure names the upstream bug and both ways out, once."""
    import pickle

    from nbdist.errors import DistributedError

    err = DistributedError("rank 1 failed", failures={1: KERAS3_FIT, 0: "ValueError: other\n"})
    text = err.failures[1]
    assert text.startswith(KERAS3_FIT.rstrip("\n"))
    for words in ("keras-team/keras#20585", "TF_USE_LEGACY_KERAS=1", "tf-keras",
                  "custom loop (strategy.run)", "docs/keras.md"):
        assert words in text
    assert err.failures[0] == "ValueError: other\n"  # nothing known: unchanged
    again = pickle.loads(pickle.dumps(err))
    assert again.failures == err.failures and text.count("nbdist hint:") == 1
    assert "nbdist hint:" in "\n".join(err._render_traceback_())


@pytest.mark.parametrize(("error", "says"), [
    ("RuntimeError: Collective ops must be configured at program startup",
     "create the strategy in the first cell that uses TensorFlow"),
    ("tensorflow.python.framework.errors_impl.UnknownError: Could not start gRPC server",
     "Run the cell again: every job reserves new ports"),
    ("RuntimeError: jax.distributed.initialize() must be called before any JAX computations",
     "call it in the session's first cell that uses JAX"),
    ("RuntimeError: distributed.initialize should only be called once.", "in one cell only"),
])
def test_other_known_failures_say_what_to_do(error: str, says: str) -> None:
    """TF's collective-ops and gRPC failures and JAX's initialize errors carry their fix."""
    from nbdist.hints import with_hint

    assert says in with_hint(f"Traceback (most recent call last):\n{error}\n")


# -- a cell's own leading os.environ settings reach modules imported ahead ----------------------
@pytest.mark.parametrize(("source", "env"), [
    ('import os\nos.environ["KERAS_BACKEND"] = "jax"\nimport keras\n', {"KERAS_BACKEND": "jax"}),
    ('import os as o, os\nfrom os import environ as e\no.environ["A"] = "1"\ne["B"] = "2"\n'
     'os.environ["C"] = "3"\nprint(1)\nos.environ["D"] = "4"\n', {"A": "1", "B": "2", "C": "3"}),
    ('import keras\nimport os\nos.environ["KERAS_BACKEND"] = "jax"\n', {}),  # too late: kept
    ('import os\nos.environ["X"] = os.environ["HOME"]\n', {}),  # not a literal
    ('import os\nprint(os.environ.get("X"))\nos.environ["X"] = "1"\n', {}),  # read first
    ("import os\nos.environ[\n", {}),  # not Python: nothing
])
def test_leading_environ_literals_are_found(source: str, env: dict[str, str]) -> None:
    """Only literal os.environ assignments before anything but `import os` are taken."""
    from nbdist.launch import payload_env

    assert payload_env({"kind": "cell", "source": source}) == env
    assert payload_env({"kind": "call", "source": source}) == {}


def run_cell(ip: object, cell: str) -> object:
    result = ip.run_cell(cell)  # type: ignore[attr-defined]
    assert result.error_before_exec is None and result.error_in_exec is None, (
        result.error_before_exec or result.error_in_exec)
    return result.result


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs keras (nbdist[jax])")
def test_keras_backend_set_in_the_cell_is_the_one_ranks_use(ip: object) -> None:
    """KERAS_BACKEND set at the top of the cell wins over ranks warmed with keras imported."""
    cell = ('%%distributed -np 2 -o backends --quiet\n'
            'import os\nos.environ["KERAS_BACKEND"] = "{}"\nimport keras\n'
            'keras.backend.backend()\n')
    for backend in ("numpy", "numpy", "jax"):  # the second run is forked from a warm zygote
        run_cell(ip, cell.format(backend))
        assert ip.user_ns["backends"] == [backend, backend]  # type: ignore[attr-defined]
