"""The text rank 0 prints at the end of a job: the search's outcome, then the augmentation's (what it trained, its
test accuracy, ε and whom it holds against, its cost). Read from the stages' outcomes alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpi_fnas.config import CELL_NETWORK

if TYPE_CHECKING:
    from mpi_fnas.stages.augment import AugmentOutcome
    from mpi_fnas.stages.search import SearchOutcome


#: Above this mean entropy of A's edges (÷ log ops; 1 = uniform) the summary says the search barely moved A: the
#: argmax that derives the cell then picks between near-equal weights. The threshold lies between the DARTS values'
#: 10 private steps and a search that steers (docs/log/benchmarks.md, "More levers, and a search that moves").
ALPHA_ENTROPY_UNMOVED = 0.999


def summary(search: SearchOutcome | None, augment: AugmentOutcome | None) -> str:
    """The text rank 0 prints at the end of a job: the search's part, then the augmentation's."""
    lines = [""]
    if search is not None:
        lines += _search_lines(search)
    if augment is not None:
        lines += _augment_lines(augment, search)
    return "\n".join(lines)


def _search_lines(outcome: SearchOutcome) -> list[str]:
    mins, secs = divmod(outcome.wall_seconds, 60)
    if outcome.epsilon is None:
        val = f"{outcome.val_acc:.4f}  (loss {outcome.val_loss:.4f}, all parties' validation shards)"
    else:
        val = "not released under DP (it would be an unaccounted release); see the test accuracy"
    lines = [
        "== mpi_fnas search finished ==",
        f"mode            {outcome.mode}",
        f"parties         {outcome.parties}",
        f"epochs          {outcome.epochs} ({outcome.steps} steps; {outcome.stop_reason})",
        f"final val acc   {val}",
        f"test acc        {outcome.test_acc:.4f}  (server's test split, supernet)",
    ]
    if outcome.epsilon is not None and outcome.privacy_guarantee != "holds":
        lines += [f"privacy         ε VOID: {outcome.privacy_guarantee}"]
    elif outcome.epsilon is not None:
        eps, mu = outcome.epsilon, outcome.mu_gdp
        bound = "tight PLD bound" if outcome.epsilon_collusion is None else \
            f"against {_observer(outcome)} (secure aggregation; RDP bound)"
        lines += [
            f"privacy         ε = {eps.max():.4g} (worst party) … {eps.min():.4g} (best) at δ = "
            f"{outcome.delta.max():.3g} — {bound}, per party, max over its train/val ledgers",
            *_collusion_lines(outcome),
            f"                (paper's Theorem 3.1 μ-GDP, a CLT approximation: μ = {mu.max():.4g}; not the guarantee)",
        ]
    lines += [
        f"alphas          moved from uniform: entropy {outcome.alpha_entropy:.4f} of uniform's, top-op margin "
        f"{outcome.alpha_margin:.4f} (means over edges; uniform: 1 and 0)",
        *(["                A has barely moved: the derived cell is close to an arbitrary pick (more search steps, a "
           "larger search.a_lr, or under DP a larger search.batch_size move it: docs/benchmarks.md)"]
          if outcome.alpha_entropy > ALPHA_ENTROPY_UNMOVED else []),
        f"genotype        {outcome.genotype}",
        f"wall time       {int(mins)}m{secs:04.1f}s",
        f"log             {outcome.log_path}",
    ]
    return lines


def _observer(outcome) -> str:
    """Whom a secure stage's ε holds against: the server, with ``privacy.colluders`` parties when t > 0."""
    t = outcome.colluders
    return f"the server and any {t} colluding part{'y' if t == 1 else 'ies'} (privacy.colluders)" if t else "the server"


def _collusion_lines(outcome) -> list[str]:
    """Under secure aggregation: the ε against the server alone (when the guarantee admits colluders) and the ε a
    party keeps if all K − 1 other parties collude with the server."""
    if outcome.epsilon_collusion is None:
        return []
    lines = []
    if outcome.epsilon_server is not None:
        lines.append(f"                ε = {outcome.epsilon_server.max():.4g} (worst party) against the server alone")
    worst = outcome.epsilon_collusion.max()
    return [*lines, f"                ε = {worst:.4g} (worst party) if the K − 1 other parties collude with the "
                    "server (only its own 1/K of the noise is left)"]


def _augment_lines(outcome: AugmentOutcome, search: SearchOutcome | None) -> list[str]:
    mins, secs = divmod(outcome.wall_seconds, 60)
    cell = outcome.network == CELL_NETWORK
    lines = [
        "" if search is not None else None,
        "== mpi_fnas augmentation finished ==",
        f"genotype        {outcome.genotype}" if cell else
        f"network         {outcome.network} (hand-designed, no cell)",
        f"epochs          {outcome.epochs} ({outcome.steps} steps; {outcome.stop_reason})",
        f"test acc        {outcome.test_acc:.4f}  (test error {1 - outcome.test_acc:.4f}; the "
        f"{'cell' if cell else 'network'} trained from scratch)",
        f"params          {outcome.params / 1e6:.4f} M ({outcome.params}"
        f"{' without the auxiliary head' if cell else ''})",
    ]
    if outcome.private and outcome.privacy_guarantee != "holds":
        lines += [f"privacy         ε VOID: {outcome.privacy_guarantee}"]
    elif outcome.private:
        eps, release = outcome.epsilon, outcome.release
        bound = "tight PLD bound" if release.secure is None else f"against {_observer(outcome)} (secure; RDP bound)"
        spent_on = "search + augmentation composed" if outcome.composed_with_search else "the augmentation alone"
        alone = outcome.epsilon_alone
        lines += [f"privacy         ε = {eps.max():.4g} (worst party) … {eps.min():.4g} (best) at δ = "
                  f"{outcome.delta.max():.3g} — {spent_on}, {bound}", *_collusion_lines(outcome),
                  *([f"                ε = {alone.max():.4g} (worst party) for the augmentation's releases by "
                     "themselves, its search not charged (as DPNAS reports; not the guarantee)"]
                    if outcome.composed_with_search and alone is not None else []),
                  f"noise           σ = {release.noise_multiplier:.4g} per release ({release.aggregation}), "
                  f"expected batch B = {release.expected_batch_size:g} per party"]
    elif outcome.mode == "dpfnas":
        eps = outcome.epsilon
        search_eps = f"ε = {eps.max():.4g} (worst party) covers the SEARCH ONLY; " if eps is not None else ""
        lines += [f"privacy         NOT PRIVATE: augment.private is false: {search_eps}the final weights were "
                  "trained with exact gradients"]
    search_cost = f"search {search.wall_seconds:.1f} s, " if search is not None else ""
    lines += [
        f"cost            {search_cost}augmentation {outcome.wall_seconds:.1f} s (wall)",
        f"wall time       {int(mins)}m{secs:04.1f}s (augmentation)",
        f"log             {outcome.log_path} (/augment)",
    ]
    return [line for line in lines if line is not None]
