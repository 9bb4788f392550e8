"""nbdist without pyspark: it imports, runs locally, and says how to get the Spark backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_nbdist_works_without_pyspark_and_explains_the_spark_backend() -> None:
    """With pyspark unimportable, nbdist and its magics import, ``auto`` is local, and
    ``--backend spark`` is an ImportError naming the extra to install."""
    script = textwrap.dedent("""
        import sys
        sys.modules["pyspark"] = None  # any `import pyspark` now raises ImportError
        import nbdist, nbdist.launch.backends, nbdist.magics
        launcher, n = nbdist.launch.backends.choose(2)
        assert (launcher.name, n) == ("local", 2), launcher.name
        try:
            nbdist.launch.backends.choose(2, "spark")
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "the Spark backend needs pyspark: pip install 'nbdist[spark]'" in out.stdout
