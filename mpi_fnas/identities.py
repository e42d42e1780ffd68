"""``python -m mpi_fnas.identities RUN_DIR --parties K``: make the parties' identities for secure aggregation's
``privacy.party_identities`` (docs/privacy.md §8).

Writes a fresh Ed25519 private key for each party 1..K into its own directory,
``RUN_DIR/parties/rank<k>/identity.key`` (mode 0600, the directory 0700), and the roster of their public keys
(default ``RUN_DIR/party_identities.yaml``, public) that ``privacy.party_identities`` names. Nothing is
overwritten. In a real federation each hospital makes its own key on its own machine and the roster is assembled
from the public halves, as certificates are exchanged; this command does all K at once for a simulation on one
machine. Then run, e.g.::

    python -m mpi_fnas.identities runs/hosp --parties 4
    mpirun -n 5 python -m mpi_fnas.run --out runs/hosp --set privacy.aggregation=secure \\
        --set privacy.party_identities=runs/hosp/party_identities.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpi_fnas.secagg.identities import IdentityError, make_identities

ROSTER_NAME = "party_identities.yaml"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpi_fnas.identities``."""
    parser = argparse.ArgumentParser(prog="python -m mpi_fnas.identities",
                                     description="Make the parties' Ed25519 identities and their roster "
                                     "(privacy.party_identities).")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (the --out of the run to come)")
    parser.add_argument("--parties", type=int, required=True, metavar="K", help="parties of the job (ranks 1..K)")
    parser.add_argument("--roster", metavar="FILE", help=f"where to write the roster (default RUN_DIR/{ROSTER_NAME})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Make the identities; 0, or 2 with one line on bad input."""
    args = build_parser().parse_args(argv)
    if args.parties < 1:
        print("mpi_fnas.identities: error: --parties must be >= 1", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    roster = Path(args.roster) if args.roster else run_dir / ROSTER_NAME
    try:
        make_identities(run_dir, args.parties, roster)
    except IdentityError as exc:
        print(f"mpi_fnas.identities: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.parties} party identities in {run_dir / 'parties'}; roster: {roster} (set "
          f"privacy.party_identities={roster})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
