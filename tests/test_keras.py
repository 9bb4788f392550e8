"""TensorFlow and Keras on local ranks: TF_CONFIG for MultiWorkerMirroredStrategy, Keras 3's
distribution variables, and real multi-worker training in ``%%distributed`` cells.

The rendezvous tests need no TensorFlow; the training tests skip without it (``nbdist[tf]``).
"""

from __future__ import annotations

import importlib.util
import json
import socket
from typing import Any

import pytest

import nbdist
from nbdist.world import Hello, plan_world


def tf_config(env: dict[str, str]) -> dict[str, object]:
    return json.loads(env["TF_CONFIG"])


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
    """A supervisor's reserved ports (every rank's TF port, rank 0's JAX coordinator port)
    cannot be bound by anyone else until its rank starts."""
    from nbdist.rank.supervisor import RankSpec, Supervisor

    for rank, key in ((1, "tf_port"), (0, "jax_port")):
        sup = Supervisor(RankSpec(rank=rank, world_size=2, job_id="j", secret="00",
                                  driver=("h", 1), payload=b""))
        port = sup._hello()[key]  # type: ignore[literal-required]
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("", port))
        sup._release_ports()
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
    from nbdist.launch.payload import payload_env

    assert payload_env({"kind": "cell", "source": source}) == env
    assert payload_env({"kind": "call", "source": source}) == {}


def run_cell(ip: object, cell: str) -> object:
    result = ip.run_cell(cell)  # type: ignore[attr-defined]
    assert result.error_before_exec is None and result.error_in_exec is None, (
        result.error_before_exec or result.error_in_exec)
    return result.result


def same_weights(ranks: list[Any], at: int) -> bool:
    """Whether ranks 0 and 1 returned equal weight arrays at ``ranks[r][at]``."""
    return all((w0 == w1).all() for w0, w1 in zip(ranks[0][at], ranks[1][at], strict=True))


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


# -- real training: tf.keras under MultiWorkerMirroredStrategy, Keras 3 on JAX -------------------
needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("tf_keras") is None,
    reason="needs tensorflow and tf-keras (nbdist[tf])")
needs_jax = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None or importlib.util.find_spec("keras") is None,
    reason="needs jax and keras 3 (nbdist[jax])")

#: The Horovod tf.keras example's shape, on MultiWorkerMirroredStrategy and scikit-learn's
#: bundled digits: each worker reads its own shard, the optimizer's rate scales with the workers.
#: Returns what the tests compare: workers seen, first and last loss, every weight, the parent.
TF_KERAS_CELL = '''\
import os
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).with_options(options)
with strategy.scope():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((64,)),
                                 tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05 * strategy.num_replicas_in_sync),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(data, epochs=3, verbose=2)
(strategy.num_replicas_in_sync, history.history["loss"], model.get_weights(), os.getppid(),
 type(model).__module__)
'''


def check_tf_keras_ranks(ranks: list[Any]) -> None:
    """What TF_KERAS_CELL's ranks returned: two workers, falling loss, equal weights."""
    for workers, losses, _, _, module in ranks:
        assert workers == 2
        assert losses[-1] < losses[0]
        assert module.startswith("tf_keras.")  # the legacy Keras, as TF_USE_LEGACY_KERAS asks
    assert same_weights(ranks, 2)


@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tf_keras_mwms_trains_identically_on_two_ranks(ip: object) -> None:
    """tf.keras under MWMS in a cell: two workers, falling loss, equal weights on both ranks;
    and again on ranks forked from the zygote that imported what the first run used."""
    from nbdist.launch.local import pool

    for run in ("first", "second"):
        run_cell(ip, f"%%distributed -np 2 -o tf_ranks --quiet\n{TF_KERAS_CELL}")
        ranks = ip.user_ns["tf_ranks"]  # type: ignore[attr-defined]
        check_tf_keras_ranks(ranks)
        # Forked from a zygote that imported TensorFlow (and, for the second run, tf_keras
        # and the rest of what the first run's ranks imported) but ran no TF operation: MWMS
        # still configured its collective ops "at program startup".
        assert {parent for *_, parent, _ in ranks} <= set(pool.pids()), run
        assert "tensorflow" in pool.modules
        pool.wait_ready(timeout=120)  # the first run's modules, imported for the second
    assert "tf_keras" in pool.modules


#: Keras 3 on JAX: keras.distribution.initialize() reads nbdist's KERAS_DISTRIBUTION_* and
#: joins the processes; DataParallel replicates the model over every process's devices. Each
#: rank feeds its own shard (auto_shard_dataset=False: the shards are already disjoint).
JAX_CELL = '''\
import os
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import keras
from sklearn.datasets import load_digits

keras.distribution.initialize()
import jax
data_parallel = keras.distribution.DataParallel(
    devices=keras.distribution.list_devices(), auto_shard_dataset=False)
keras.distribution.set_distribution(data_parallel)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
shard = slice(rank * 800, (rank + 1) * 800)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(0.05 * world),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x[shard], y[shard], batch_size=32, epochs=3, verbose=2)
(jax.process_count(), keras.backend.backend(), history.history["loss"],
 [np.asarray(w) for w in model.get_weights()], float(x[shard].sum()))
'''


@needs_jax
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_keras3_jax_data_parallel_trains_identically_on_two_ranks(ip: object) -> None:
    """Keras 3 on JAX, DataParallel over two processes: equal weights from different shards."""
    run_cell(ip, f"%%distributed -np 2 -o jax_ranks --quiet\n{JAX_CELL}")
    check_jax_ranks(ip.user_ns["jax_ranks"])  # type: ignore[attr-defined]


def check_jax_ranks(ranks: list[Any]) -> None:
    """What JAX_CELL's ranks returned: two JAX processes, falling loss, equal weights."""
    for processes, backend, losses, _, _ in ranks:
        assert (processes, backend) == (2, "jax")
        assert losses[-1] < losses[0]
    assert ranks[0][4] != ranks[1][4]  # the shards differed: equality comes from all-reduce
    assert same_weights(ranks, 3)


@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_taken_worker_port_fails_the_job_fast_and_clearly(ip: object, tmp_path: object) -> None:
    """Rank 1's TF port taken: rank 1 says why, and rank 0, stuck in the strategy's
    constructor (TF has no timeout there), is torn down by nbdist."""
    from nbdist.errors import DistributedError

    # Rank 0 takes rank 1's port (as another program could, after nbdist's reservation) and
    # only then lets rank 1 create its strategy.
    cell = f'''%%distributed -np 2 --quiet
import json, os, socket, time
import tensorflow as tf
workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
taken = os.path.join({str(tmp_path)!r}, "taken")
if os.environ["RANK"] == "0":
    squatter = socket.socket()
    squatter.bind(("", int(workers[1].rsplit(":", 1)[1])))
    squatter.listen()
    open(taken, "w").close()
else:
    while not os.path.exists(taken):
        time.sleep(0.05)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
'''
    result = ip.run_cell(cell)  # type: ignore[attr-defined]
    error = result.error_in_exec
    assert isinstance(error, DistributedError), error
    assert error.reason == "failed"
    assert list(error.failures) == [1], error.failures  # rank 0 was stopped, not failed
    assert "Could not start gRPC server" in error.failures[1]
    assert "nbdist hint: TensorFlow could not start this worker's server" in error.failures[1]
    assert "nbdist stopped ranks 0" in str(error)


@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras3_fit_under_mwms_says_to_use_tf_keras(ip: object) -> None:
    """Keras 3's model.fit under MWMS (keras#20585) fails with the way out in the error."""
    from nbdist.errors import DistributedError

    cell = '''%%distributed -np 2 --quiet
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
import keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
ones = np.ones((64, 4), "float32")
model.fit(tf.data.Dataset.from_tensor_slices((ones, ones[:, :1])).batch(8), verbose=0)
'''
    error = ip.run_cell(cell).error_in_exec  # type: ignore[attr-defined]
    assert isinstance(error, DistributedError), error
    assert error.failures
    for text in error.failures.values():
        assert "PerReplica" in text
        assert "nbdist hint: Keras 3's model.fit does not work under" in text
        assert "TF_USE_LEGACY_KERAS=1" in text


#: Keras 3 under MWMS without model.fit: a custom loop with strategy.run works (docs/keras.md).
KERAS3_LOOP_CELL = '''\
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
import keras
from sklearn.datasets import load_digits

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x, y = load_digits(return_X_y=True)
global_batch = 64
data = tf.data.Dataset.from_tensor_slices(((x / 16.0).astype("float32"), y)).batch(global_batch)
dist_data = strategy.experimental_distribute_dataset(data)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05 * strategy.num_replicas_in_sync)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

@tf.function
def train_step(batch):
    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            per_example = loss_fn(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    per_replica = strategy.run(step, args=(batch,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

losses = []
for epoch in range(3):
    losses.append(sum(float(train_step(batch)) for batch in dist_data))
(strategy.num_replicas_in_sync, losses, [w.numpy() for w in model.weights])
'''


@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras3_custom_loop_under_mwms_trains_identically(ip: object) -> None:
    """Keras 3 layers trained by strategy.run under MWMS: equal weights, falling loss."""
    run_cell(ip, f"%%distributed -np 2 -o loop_ranks --quiet\n{KERAS3_LOOP_CELL}")
    ranks = ip.user_ns["loop_ranks"]  # type: ignore[attr-defined]
    for workers, losses, _ in ranks:
        assert workers == 2 and losses[-1] < losses[0]
    assert same_weights(ranks, 2)


# -- persistent sessions: the strategy first, then any number of training cells ----------------
@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.usefixtures("no_session")
def test_a_session_keeps_the_strategy_and_model_across_cells(ip: object) -> None:
    """MWMS created in a session's first TF cell serves later cells; training goes on."""
    run_cell(ip, "%dist_session start -np -2")
    workers = run_cell(ip, "%%distributed --quiet\n"
                           "import os\n"
                           'os.environ["TF_USE_LEGACY_KERAS"] = "1"\n'
                           "import tensorflow as tf\n"
                           "strategy = tf.distribute.MultiWorkerMirroredStrategy()\n"
                           "strategy.num_replicas_in_sync")
    assert workers == 2
    train = ("%%distributed -o session_fit --quiet\n"
             "history = model.fit(data, epochs=2, verbose=0)\n"
             "(history.history['loss'], [w.sum() for w in model.get_weights()])")
    run_cell(ip, "%%distributed --quiet\n"
                 "from sklearn.datasets import load_digits\n"
                 "x, y = load_digits(return_X_y=True)\n"
                 "data = tf.data.Dataset.from_tensor_slices((x / 16.0, y)).batch(64)\n"
                 "with strategy.scope():\n"
                 "    tf.keras.utils.set_random_seed(0)\n"
                 "    model = tf.keras.Sequential([tf.keras.layers.Dense(10)])\n"
                 "    model.compile(optimizer='sgd', loss=tf.keras.losses.\n"
                 "                  SparseCategoricalCrossentropy(from_logits=True))")
    run_cell(ip, train)
    first = ip.user_ns["session_fit"]  # type: ignore[attr-defined]
    run_cell(ip, train)
    second = ip.user_ns["session_fit"]  # type: ignore[attr-defined]
    assert first[0][1] == first[1][1] and second[0][1] == second[1][1]  # equal weights
    assert second[0][0][-1] < first[0][0][0]  # the second cell went on from the first
    run_cell(ip, "%dist_session stop")


@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("no_session")
def test_a_strategy_after_other_tf_work_in_a_session_says_so(ip: object) -> None:
    """A session that ran a TF op before creating MWMS gets TF's error and the way out."""
    from nbdist.errors import DistributedError

    run_cell(ip, "%dist_session start -np -2")
    run_cell(ip, "%%distributed --quiet\nimport tensorflow as tf\nfloat(tf.constant(1.0) + 1)")
    error = ip.run_cell("%%distributed --quiet\n"  # type: ignore[attr-defined]
                        "strategy = tf.distribute.MultiWorkerMirroredStrategy()").error_in_exec
    assert isinstance(error, DistributedError), error
    text = next(iter(error.failures.values()))
    assert "Collective ops must be configured at program startup" in text
    assert "create the strategy in the first cell that uses TensorFlow" in text
    run_cell(ip, "%dist_session stop")
