"""Which config a party trusts, and its refusal of another one from rank 0 (the server is the adversary).

Every rank runs the config text rank 0 broadcasts (:func:`mpi_fnas.cli.decide_on_root`), so a server that lies
could send a party a config with less noise than the user set. A party therefore compares the privacy-relevant
keys (:data:`PRIVACY_KEYS`) of that text with the config it trusts (:func:`trusted_config`) and refuses any
difference with one line (:class:`AssignmentRefusedError`); after a check it pins the accepted text in its own
directory (``RUN_DIR/parties/rank<k>/config.yaml``, 0600), which is what it trusts on ``--resume`` and
``--augment``, where it may have no ``--config`` of its own. docs/privacy.md §2.10.

Pure: no MPI, no torch (the launch layer checks the config before any rank imports torch). The assignment's DP
parameters are checked against this config by :mod:`mpi_fnas.federation.verify`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mpi_fnas.config import Config, config_from_text

#: The keys a party checks in rank 0's config, as dotted names (``section.*``: every key of a section). They set
#: the noise and what it is calibrated to (``privacy.*``, ``mode``, the batch sizes B, ``augment.private``, clip
#: and σ), the number of releases (epochs, steps, optimizers: ADADP releases twice per step), the shards the
#: sample rates q = B/N follow from (the data split, the partition, the seed, the aux slice) and the networks
#: whose size is secure aggregation's accounted dimension D (``space.*``, the augmented network: ``augment.network``
#: and its shape), and the exchange pattern the party allows (``runtime.exchange``: whether its releases may travel
#: through other parties, :mod:`mpi_fnas.federation.topology`).
PRIVACY_KEYS: tuple[str, ...] = (
    "mode", "seed", "privacy.*",
    "data.dataset", "data.train_size", "data.holdout", "data.val_fraction", "data.partition", "data.dirichlet_alpha",
    "data.classes_per_party", "data.image_size",
    "space.*",
    "search.batch_size", "search.epochs", "search.steps_per_epoch", "search.w_optimizer",
    "augment.private", "augment.batch_size", "augment.noise_multiplier", "augment.clip", "augment.epochs",
    "augment.steps_per_epoch", "augment.optimizer", "augment.pool", "augment.network", "augment.layers",
    "augment.channels",
    "augment.auxiliary_weight",
    "federation.parties", "federation.aux_size", "federation.selection",
    "runtime.exchange",
)

#: The pinned config's file name in the party's own directory.
PIN_NAME = "config.yaml"
_PIN_MODE = 0o600  # as every file of the party's directory (mpi_fnas.federation.party_disk)
_DIR_MODE = 0o700


class AssignmentRefusedError(ValueError):
    """A party refuses what rank 0 asks of it: a config or an assignment that differs from what the party derives
    itself. One line of public facts (config keys and values, parameter names, ranks, steps), never data."""


class BudgetRefusedError(ValueError):
    """A party refuses iterations its own ε cap does not allow (:mod:`mpi_fnas.privacy.party_ledger`; one line of
    public facts: counts, ε, the cap)."""


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _checked(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in PRIVACY_KEYS)


def privacy_view(cfg: Config) -> dict[str, Any]:
    """The privacy-relevant keys of `cfg` (dotted name -> value)."""
    return {key: value for key, value in _flatten(cfg.to_dict()).items() if _checked(key)}


def config_differences(trusted: Config, received: Config) -> list[str]:
    """The privacy-relevant keys on which `received` differs from `trusted`, sorted (empty: they agree)."""
    mine, theirs = privacy_view(trusted), privacy_view(received)
    return sorted(key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key))


def check_config(trusted: Config, received: Config, *, rank: int, trusted_name: str) -> None:
    """Raise :class:`AssignmentRefusedError` (one line) if `received`, rank 0's config, differs from `trusted` (the
    party's `trusted_name`: its own config or its pin) in a privacy-relevant key."""
    differing = config_differences(trusted, received)
    if not differing:
        return
    mine, theirs = privacy_view(trusted), privacy_view(received)
    shown = "; ".join(f"{key}: {theirs.get(key)!r} where {trusted_name} says {mine.get(key)!r}"
                      for key in differing[:3])
    more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
    raise AssignmentRefusedError(f"rank {rank} refuses the config rank 0 sent: {shown}{more}; nothing was computed "
                                 "or sent")


def check_own(own: Config, received: Config, rank: int) -> None:
    """A series command's party (``mpi_fnas.sweep``, ``mpi_fnas.baseline``) checks rank 0's config against its own
    command line's: :func:`check_config`."""
    check_config(own, received, rank=rank, trusted_name="its own --config/--set")


def trusted_config(own: Config | None, *, explicit: bool, resume: bool, augment: bool,
                   overrides: Sequence[str], pin: str | None, rank: int,
                   config_file: bool = False) -> tuple[Config, str]:
    """The config a party checks rank 0's against, and its name for the refusal line.

    * a fresh launch: its own (`own`, from its ``--config``/``--set`` or the defaults, as rank 0's would be);
    * ``--resume``: its pin (the config it accepted when the run started) with its own ``runtime.*`` (and
      ``checkpoint.*``) where it gave them: a ``--config`` file's sections whole (`config_file`), or the ``--set``
      `overrides` of those keys alone, as rank 0 applies its own; or, in a directory with no pin (a run that never
      reached a party), its own when given explicitly (`explicit`: ``--config`` or ``--set``);
    * ``--augment``: its pin with its own ``--set`` `overrides` applied (rank 0 allows only ``augment.*``,
      ``runtime.*`` and ``checkpoint.*`` there), as rank 0 applies them to the search's config.

    Raises :class:`AssignmentRefusedError` when the party has nothing to trust.
    """
    if augment:
        if pin is None:
            raise AssignmentRefusedError(f"rank {rank} refuses --augment: its own directory holds no pinned config "
                                         f"({PIN_NAME}) of the search")
        return config_from_text(pin, list(overrides), where=f"rank {rank}'s --augment", stored=True), \
            "its pinned config with its --set"
    if resume and pin is not None:
        pinned = config_from_text(pin, list(overrides), stored=True)  # runtime.* may change on a resume
        if config_file and own is not None:
            pinned.runtime, pinned.checkpoint = own.runtime, own.checkpoint
        return pinned, "its pinned config" + (" with its own runtime.*" if config_file or overrides else "")
    if resume and not explicit:
        raise AssignmentRefusedError(f"rank {rank} refuses --resume: its own directory holds no pinned config "
                                     f"({PIN_NAME}) and it was given no --config of its own")
    assert own is not None  # a fresh launch without a config of its own has failed before (bad input)
    return own, "its own config"


# -- the party's own directory -------------------------------------------------------------------------------------
def own_run_directory(named: str | None, received: str, *, rank: int) -> Path:
    """The run directory party `rank` keeps its state under: the one it `named` itself (``--resume``, ``--augment``
    or ``--out``), else the one rank 0 chose for a fresh run (`received`). Raises :class:`AssignmentRefusedError`
    when rank 0 names another directory than the party's own (compared resolved): its record and journals are
    there, and a party that wrote them elsewhere would compose none of its earlier launches."""
    if named is None:
        return Path(received)
    own = Path(named)
    if own.resolve() != Path(received).resolve():
        raise AssignmentRefusedError(f"rank {rank} refuses the run directory rank 0 named: {received} is not its own "
                                     f"{named}; nothing was computed or sent")
    return own


def pin_directory(run_dir: Path, rank: int) -> Path:
    """Party `rank`'s own directory under `run_dir`: :func:`mpi_fnas.federation.party_disk.party_dir`, spelled out
    here because that module loads torch and the config is checked before any rank does."""
    return Path(run_dir) / "parties" / f"rank{rank}"


def read_pin(directory: Path) -> str | None:
    """The config text pinned in the party's `directory`, or None."""
    path = Path(directory) / PIN_NAME
    return path.read_text() if path.exists() else None


def write_pin(directory: Path, text: str) -> Path:
    """Pin `text` in the party's `directory` (created 0700; the file 0600, replaced atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
    os.chmod(directory, _DIR_MODE)
    path, tmp = directory / PIN_NAME, directory / f".{PIN_NAME}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _PIN_MODE)
    os.fchmod(fd, _PIN_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
