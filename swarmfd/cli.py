"""The ``swarmfd`` command line: parse, call the library, map errors to exit codes.

Nothing here implements behaviour; each command is a thin click wrapper over
a library module (``launch`` for ``run``, ``bench`` for ``bench``, the
``swarm`` package for the Docker Swarm commands, imported lazily so that
``swarmfd run`` never loads the docker SDK).
"""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarmfd")
def main() -> None:
    """swarmfd: data-parallel training primitives over a ZeroMQ ring, local or on Docker Swarm."""


# --- swarmfd run (launch.py) -------------------------------------------------

# --- swarmfd bench (bench.py) ------------------------------------------------

# --- swarm commands (cli_swarm.py registers deploy, ls, ps, logs, rm) --------
