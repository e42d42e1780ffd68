"""``data.partition: local``: what each party tells rank 0 about its own folder before anything is planned.

With a local partition no one reads a party's data but the party (``data.root/party-<k>/``). Rank 0 still needs a
party's shard sizes (the sample rates q = B / N are public, and the plan divides the steps by them) and must know
that every party labels the same classes. So at the start of each stage, before the assignments, every party opens
its own folder and sends one :class:`LocalInventory`: its number of examples, its class names, its image side and
channels. Nothing else about its data leaves it; docs/privacy.md ("Data that stays with its party") says what is
then public. A party whose folder is unusable sends the one-line reason instead, and rank 0 refuses the setup with
it (exit 2 on every rank).

Both sides live here, a few lines each (no autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi_fnas.config import Config
from mpi_fnas.data import DatasetNotFoundError, open_dataset
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.job_plan import SetupError, open_split
from mpi_fnas.wire import wire_type


@wire_type
@dataclass(frozen=True)
class LocalInventory:
    """The public facts of one party's folder."""

    examples: int
    classes: tuple[str, ...]
    image_size: int
    in_channels: int


# -- a party ---------------------------------------------------------------------------------------------------------
def report_inventory(cfg: Config, channel: Channel) -> None:
    """Party: send rank 0 the inventory of its own folder, or the one-line reason it cannot be used."""
    if cfg.data.partition != "local":
        return
    try:
        data = open_dataset(cfg.data.dataset, "train", root=cfg.data.root, image_size=cfg.data.image_size,
                            size=cfg.data.train_size, seed=cfg.seed, party=channel.rank)
        report: object = LocalInventory(len(data), tuple(data.classes), data.image_size, data.in_channels)
    except (ValueError, DatasetNotFoundError) as exc:
        report = ("error", f"party {channel.rank}: {exc}")
    channel.gather_objects(report)


# -- rank 0 ----------------------------------------------------------------------------------------------------------
def gather_inventory(cfg: Config, channel: Channel) -> list[int] | None:
    """Rank 0: every party's number of examples (party k at index k - 1), checked against the server's own test
    split (the same classes, image side and channels); None unless the partition is local.

    The gather comes first, whatever happens next: every party is in it. Raises SetupError (one line) for a
    party's unusable folder, an unusable test folder or a disagreement; the caller then refuses the setup.
    """
    if cfg.data.partition != "local":
        return None
    reports = channel.gather_objects(None)[1:]
    test = open_split(cfg, "test")
    for rank, report in enumerate(reports, start=1):
        if isinstance(report, tuple):
            raise SetupError(report[1])
        if not isinstance(report, LocalInventory):
            raise SetupError(f"party {rank} sent no inventory of its folder")
        if report.classes != tuple(test.classes):
            missing = sorted(set(test.classes) - set(report.classes))
            extra = sorted(set(report.classes) - set(test.classes))
            raise SetupError(f"data.partition local: party {rank}'s classes differ from the test folder's (missing "
                             f"{missing or 'none'}, extra {extra or 'none'}); every folder must have the same class "
                             "sub-folders")
        if (report.image_size, report.in_channels) != (test.image_size, test.in_channels):
            raise SetupError(f"data.partition local: party {rank} holds {report.in_channels}-channel "
                             f"{report.image_size}x{report.image_size} images, the test folder "
                             f"{test.in_channels}-channel {test.image_size}x{test.image_size}")
        if report.examples < 2:
            raise SetupError(f"data.partition local: party {rank} holds {report.examples} image(s); a party needs "
                             "at least 2 (a search-train and a search-validation example)")
    return [report.examples for report in reports]
