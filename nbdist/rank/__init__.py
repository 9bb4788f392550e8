"""The rank side: what runs on a rank's host, beside the rank or in it.

- ``supervisor.py``: one per rank, on its host: hello and rendezvous, start the rank's
  interpreter, pump its output and events to the driver, return how it ended.
- ``cells.py``: what the supervisor sends its rank (a job's payload, or a session's cells).
- ``client.py``: the rank's end of the event channel.
- ``runtime.py``: the rank's interpreter itself (``python -c "from nbdist.rank.runtime import
  main; main()"``), with ``streams.py`` (its stdout and stderr), ``shell.py`` (``!cmd`` and
  ``%pip`` on a rank), ``children.py`` (the notebook's classes in the rank's child processes)
  and ``reporting.py`` (``nbdist.progress``, ``nbdist.report``, the tqdm bridge).

These modules import only each other and the modules both sides share (``protocol.py``,
``channel.py``, ``world.py``, ...); never the kernel's (jobs, sessions, magics, views), and
never IPython or ipywidgets. ``tests/test_architecture.py`` holds them to it. Importing this
package imports none of them.
"""
