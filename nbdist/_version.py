"""nbdist's version, in a module of its own: the code that runs on a rank's host (a Spark task
checking that the executors have the notebook's nbdist) reads it without importing the package
face. ``pyproject.toml`` states the same number (``tests/test_api.py`` holds them equal)."""

__version__ = "0.1.0"
