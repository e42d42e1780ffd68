"""The one-line errors of bad input: a config, a launch, a setup. The launch layer catches them without importing
torch, and turns them into exit code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """Invalid user input (config file, ``--set`` override, or a mismatch with the MPI world)."""


class ServerReportedError(ConfigError):
    """On a party: rank 0 found bad input and prints the one line; this rank exits with code 2 quietly."""


class SetupError(ConfigError):
    """Bad input discovered during setup (missing dataset, impossible partition or budget): exit code 2. Here, not
    beside the planner, so the launch layer can catch it without importing torch."""
