"""A stage as rank 0 sets it up before handing out the assignments: :class:`StageSetup` and what builds it.

:func:`stage_setup` gathers, around a stage's plan, the test split, the network, the server's selection and its aux
set, and the stage's DP releases; :func:`job_ledger` makes the job's privacy ledgers and :func:`guarantee` says what
the stage's result may claim. :func:`selection_schema` and :func:`rates` are the log's selection facts and a metrics
row's loss and accuracy columns. Rank 0's alone: a party's side of a stage never builds a setup, and rank 0's log and
ledgers (h5py, dp_accounting, scipy) are imported only inside the functions that use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.evaluation import ratio
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.job_plan import AugmentPlan, RunPlan, SetupError, open_split
from mpi_fnas.federation.selection import Selector, selection_stream
from mpi_fnas.privacy.release import securely_aggregated

if TYPE_CHECKING:  # rank 0's log (h5py) and ledgers (dp_accounting, scipy): imported where they are used
    from mpi_fnas.privacy.federation_ledger import FederationLedger
    from mpi_fnas.privacy.params import PrivacyPlan
    from mpi_fnas.privacy.release import Release
    from mpi_fnas.runlog import SelectionSchema


@dataclass
class StageSetup:
    """A stage as rank 0 planned it before handing out the assignments."""

    plan: RunPlan | AugmentPlan
    ledger: FederationLedger | None  # the job's privacy ledgers (dpfnas): the augmentation continues the search's
    private: bool  # this stage's releases are DP and charged on `ledger`
    guarantee: str  # what the stage's result may claim: "holds", or one line saying why not
    selector: Selector
    aux: tuple[torch.Tensor | None, torch.Tensor | None]  # the server's aux set (secprobe), else (None, None)
    test: Any  # the test split (rank 0 evaluates on it)
    model: torch.nn.Module  # the network the stage trains (the supernet; the augmentation's network of its cell)
    search_plan: RunPlan  # the search's partition (the augmentation's: its log when it did not search)
    releases: dict[str, Release] | None = None  # the stage's DP releases by name (None: not private)
    launch_id: bytes | None = None  # secure aggregation: the launch's id, from the relayed public keys

    @property
    def secure(self) -> bool:
        """Whether the stage's releases are securely aggregated (rank 0 relays keys and opens sums)."""
        return securely_aggregated(self.releases)


def job_ledger(privacy: PrivacyPlan) -> FederationLedger:
    """The job's privacy ledgers for its privacy plan (imported here: a non-DP job never loads the accountant)."""
    from mpi_fnas.privacy.federation_ledger import FederationLedger
    return FederationLedger(privacy)


def guarantee(cfg: Config, private: bool, ledger: FederationLedger | None) -> str:
    """What a stage's result may claim: the privacy parameters' guarantee, or one line saying why not."""
    if private:
        return ledger.plan.params.guarantee
    if cfg.mode == "dpfnas":
        return ("none: augment.private is false, so the augmentation used exact gradients and the final weights are "
                "NOT private; ε covers the search only")
    return f"none: mode {cfg.mode} makes no privacy claim"


def selection_schema(cfg: Config, selector: Selector) -> SelectionSchema | None:
    """The log's fixed facts of the selection (``/selection`` and ``/augment/selection`` attrs); None for ``all``."""
    from mpi_fnas.runlog import SelectionSchema  # rank 0's alone (h5py)

    fed = cfg.federation
    if fed.selection == "all":
        return None
    return SelectionSchema(selection=fed.selection, select=selector.select, epsilon_per_step=fed.selection_epsilon,
                           score_window=fed.score_window, aux_size=fed.aux_size, sensitivity=selector.sensitivity,
                           delta=selector.delta)


def rates(name: str, sums: np.ndarray | None) -> dict[str, float]:
    """``<name>_loss`` and ``<name>_acc`` of the sums [loss_sum, correct, count, …] (NaN without sums or examples)."""
    loss, correct, count = sums[:3] if sums is not None else (math.nan,) * 3
    return {f"{name}_loss": ratio(loss, count), f"{name}_acc": ratio(correct, count)}


def stage_setup(cfg: Config, name: str, plan: RunPlan | AugmentPlan, ledger: FederationLedger | None, private: bool,
                search_plan: RunPlan, earlier: dict | None, build: Callable[..., torch.nn.Module]) -> StageSetup:
    """The stage's setup around its `plan`: the test split, the network ``build(in_channels=, num_classes=)``, and
    the selector continuing an earlier stage's draws (`earlier`: its ``Selector.summary``) with the aux set it
    scores on ((None, None) unless secprobe). SetupError when the earlier stage drew at another ε_EM or K′."""
    test = open_split(cfg, "test")
    selector = Selector(cfg.federation, len(search_plan.assignments), selection_stream(cfg, name),
                        search_plan.unreliable)
    try:
        selector.continue_after(earlier)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    aux = open_aux_set(cfg, open_split(cfg, "train")) if selector.scores_needed else (None, None)
    model = build(in_channels=test.in_channels, num_classes=test.num_classes)
    releases = None
    if private and name == "search":
        releases = plan.privacy.params.search_releases(plan.privacy.w_releases_per_step)
    elif private:
        releases = {"W": plan.releases.release}
    return StageSetup(plan, ledger, private, guarantee(cfg, private, ledger), selector, aux, test, model, search_plan,
                      releases)
