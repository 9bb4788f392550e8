"""Execute a notebook headlessly in a real kernel and print what each cell showed.

    python notebooks/run.py notebooks/01-quickstart.ipynb [--save OUT.ipynb]
"""

from __future__ import annotations

import argparse
import sys

import nbformat
from nbclient import NotebookClient


def _text(output: dict) -> str:  # type: ignore[type-arg]
    if output.get("output_type") == "stream":
        return str(output.get("text", ""))
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", [])) + "\n"
    data = output.get("data", {})
    return str(data.get("text/plain", "")) + "\n" if "text/plain" in data else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--save", help="write the executed notebook here")
    parser.add_argument("--timeout", type=int, default=600, help="per cell, in seconds")
    args = parser.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3")
    try:
        client.execute()
    finally:
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            first = cell.source.splitlines()[0] if cell.source else ""
            sys.stdout.write(f"--- In [{i}]: {first}\n")
            for output in cell.get("outputs", []):
                sys.stdout.write(_text(output))
        if args.save:
            nbformat.write(nb, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
