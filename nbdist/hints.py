"""Known failures of training libraries under nbdist, recognised in a rank's traceback.

A rank's traceback says what broke, in the library's words; for a few failures those words do
not say what to do, and the fix is known (docs/keras.md). :func:`with_hint` appends it, once,
to the traceback text that ``DistributedError`` shows. Each hint names the upstream cause and
the way out. Pure functions; standard library only (``errors.py`` is imported on ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

#: What starts a hint in a traceback, so it is added once (a DistributedError may be rebuilt).
MARK = "nbdist hint: "


@dataclass(frozen=True)
class Hint:
    """``text`` is shown when every string of ``match`` occurs in the traceback."""

    match: tuple[str, ...]
    text: str


HINTS = (
    Hint(
        # keras-team/keras#20585: Keras 3's TensorFlow trainer hands PerReplica values on.
        ("Attempt to convert a value (PerReplica", "keras/src/"),
        "Keras 3's model.fit does not work under tf.distribute.MultiWorkerMirroredStrategy "
        "(keras-team/keras#20585). Use tf.keras from tf-keras instead: `pip install tf-keras` "
        "and set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported (e.g. `%%distributed "
        "--env TF_USE_LEGACY_KERAS=1`), then build the model with tf.keras; or train with a "
        "custom loop (strategy.run); or use Keras 3 on JAX with keras.distribution.DataParallel. "
        "See docs/keras.md.",
    ),
    Hint(
        ("Collective ops must be configured at program startup",),
        "MultiWorkerMirroredStrategy must be created before this process runs any TensorFlow "
        "operation. In a %dist_session, create the strategy in the first cell that uses "
        "TensorFlow (restart the session: %dist_session stop, then start); in a %%distributed "
        "cell, create it before any other TensorFlow call.",
    ),
    Hint(
        ("Could not start gRPC server",),
        "TensorFlow could not start this worker's server on its TF_CONFIG port: another "
        "process took the port after nbdist reserved it (or a TF_CONFIG given with --env names "
        "a taken port). Run the cell again: every job reserves new ports.",
    ),
    Hint(
        ("jax.distributed.initialize() must be called before",),
        "keras.distribution.initialize() (jax.distributed.initialize()) must run before any "
        "JAX computation in the process. In a %dist_session, call it in the session's first "
        "cell that uses JAX (restart the session: %dist_session stop, then start).",
    ),
    Hint(
        ("distributed.initialize should only be called once",),
        "keras.distribution.initialize() (jax.distributed.initialize()) runs once per process: "
        "in a %dist_session, call it in one cell only, not in every cell.",
    ),
    Hint(
        # Lightning's ddp_notebook / ddp_fork / ddp_spawn: the Trainer starts its own processes
        # (nbdist.capture refuses the literal strategy names before launch).
        ("strategies/launchers/multiprocessing.py",),
        "Lightning started processes of its own on this rank (strategy=\"ddp_notebook\", "
        "\"ddp_fork\" or \"ddp_spawn\"): under %%distributed every rank already is one of "
        "the processes, with the torchrun environment set. Use strategy=\"ddp\", with "
        "devices=N for `%%distributed -np N` on one machine.",
    ),
    Hint(
        # Plain pickle of a class or function that was never a module attribute (a lambda, a
        # function defined inside another): multiprocessing's own pickling goes by value on a
        # rank (nbdist.rank.children), plain pickle.dumps/torch.save go by name.
        ("attribute lookup", "on __main__ failed"),
        "Plain pickle (pickle.dumps, torch.save, a library's own pickler) stores a class or "
        "function of the notebook by name, and finds only those defined at the top level of "
        "the cell or of an earlier cell. nbdist sends notebook classes and functions to "
        "multiprocessing's children (DataLoader workers, Pool, ProcessPoolExecutor, "
        "torch.multiprocessing) by value; for other picklers use cloudpickle.dumps, save a "
        "state_dict rather than the object, or define it at the top level of a cell.",
    ),
    Hint(
        ("Can't get attribute", "on <module '__m"),
        "A new process could not find a class or function of the notebook by name: its "
        "__main__ is not the cell's. nbdist sends them by value through multiprocessing "
        "(DataLoader workers, Pool, ProcessPoolExecutor, torch.multiprocessing); bytes made "
        "with plain pickle (pickle.dumps, torch.save) name them only. Pass the object itself "
        "to the child, pickle it with cloudpickle, or define it in a module file next to the "
        "notebook and import it.",
    ),
)


def hint_for(traceback: str) -> str | None:
    """The hint for a rank's traceback text, or None."""
    for hint in HINTS:
        if all(m in traceback for m in hint.match):
            return hint.text
    return None


def with_hint(traceback: str) -> str:
    """``traceback`` with its hint appended (once), or unchanged."""
    text = hint_for(traceback)
    if text is None or MARK in traceback:
        return traceback
    body = traceback.rstrip("\n")
    return f"{body}\n\n{MARK}{text}\n"
