"""Run configuration: a typed schema, YAML loading, ``--set`` overrides and validation.

The schema's defaults *are* the default configuration (:mod:`~mpi_fnas.config.schema`), so ``python -m
mpi_fnas.run`` works from an installed wheel without any file. Every leaf field carries its meaning: ``--help``
prints it beside the type and default, and ``configs/default.yaml`` is generated from the schema with the meanings
as comments (:mod:`~mpi_fnas.config.describe`; a test keeps the file identical to it). Every problem with user
input raises :class:`ConfigError`, one line naming the key (:mod:`~mpi_fnas.config.parsing`,
:mod:`~mpi_fnas.config.checks`; the errors: :mod:`~mpi_fnas.config.errors`); the CLI turns it into exit code 2.
Nothing here touches MPI, torch or the file system beyond reading the YAML file.
"""

from mpi_fnas.config.checks import check_world, validate
from mpi_fnas.config.describe import KeyDoc, describe_keys, documented_defaults_yaml, key_docs
from mpi_fnas.config.errors import ConfigError, ServerReportedError, SetupError
from mpi_fnas.config.parsing import (
    ADDED_KEYS,
    REMOVED_KEYS,
    config_from_text,
    load_config,
    parse_override,
    read_config_file,
    yaml_mapping,
)
from mpi_fnas.config.schema import (
    AUGMENT_NETWORKS,
    CELL_NETWORK,
    DIGIT_DATASETS,
    HANDCRAFTED_NETWORKS,
    HELP,
    MAX_AUX_SIZE,
    MODES,
    AdadpConfig,
    AugmentConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    FederationConfig,
    PrivacyConfig,
    RuntimeConfig,
    SearchConfig,
    SpaceConfig,
    searches_first,
)

__all__ = [
    "ADDED_KEYS", "AUGMENT_NETWORKS", "CELL_NETWORK", "DIGIT_DATASETS", "HANDCRAFTED_NETWORKS", "HELP",
    "MAX_AUX_SIZE", "MODES", "REMOVED_KEYS", "AdadpConfig", "AugmentConfig", "CheckpointConfig", "Config",
    "ConfigError", "DataConfig", "FederationConfig", "KeyDoc", "PrivacyConfig", "RuntimeConfig", "SearchConfig",
    "ServerReportedError", "SetupError", "SpaceConfig", "check_world", "config_from_text", "describe_keys",
    "documented_defaults_yaml", "key_docs", "load_config", "parse_override", "read_config_file", "searches_first",
    "validate", "yaml_mapping",
]
