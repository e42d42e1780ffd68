"""The shared launch layer without MPI: decisions on rank 0 reach every rank, and every ending maps to an exit code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpi_fnas import cli
from mpi_fnas.config import ConfigError, ServerReportedError


class FakeChannel:
    """Rank `rank` of a job whose rank 0 broadcast `sent` (what bcast_object returns on a party)."""

    def __init__(self, rank: int, sent: object = None) -> None:
        self.rank, self.sent, self.aborted = rank, sent, None
        self.is_server = rank == 0
        self.notices: list[str] = []

    def bcast_object(self, obj: object = None) -> object:
        if self.is_server:
            self.sent = obj
        return self.sent

    def notify_failure(self, message: str, grace: float | None = None) -> None:
        self.notices.append(message)

    def abort(self, code: int = 1) -> None:
        self.aborted = code
        raise SystemExit(code)  # MPI_Abort never returns


def decide_everywhere(decide):
    """Run decide_on_root on rank 0, then on a party with what rank 0 broadcast; (server outcome, party outcome)."""
    server = FakeChannel(0)
    outcomes = []
    for channel in (server, FakeChannel(1)):
        if not channel.is_server:
            channel.sent = server.sent
        try:
            outcomes.append(cli.decide_on_root(channel, decide))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


def test_a_decision_reaches_every_rank():
    assert decide_everywhere(lambda: ("yaml", "runs/x")) == [("yaml", "runs/x")] * 2


def test_bad_input_on_rank_0_is_bad_input_everywhere_and_printed_once(capsys):
    def decide():
        raise ConfigError("--resume: no such run")

    server, party = decide_everywhere(decide)
    assert type(server) is ConfigError and isinstance(party, ServerReportedError)
    assert cli.run_guarded(FakeChannel(0), lambda: (_ for _ in ()).throw(server)) == cli.EXIT_BAD_INPUT
    assert cli.run_guarded(FakeChannel(1), lambda: (_ for _ in ()).throw(party)) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip().splitlines() == ["mpi_fnas: error: --resume: no such run"]


def test_any_other_error_on_rank_0_ends_every_rank_with_exit_1():
    """No rank hangs on an error: an OSError on rank 0 while deciding left the parties waiting for good."""
    def decide():
        raise OSError("file is already open for write")

    server, party = decide_everywhere(decide)
    for outcome in (server, party):
        assert isinstance(outcome, cli.LaunchFailedError) and "OSError" in str(outcome)
        assert cli.run_guarded(FakeChannel(1), lambda o=outcome: (_ for _ in ()).throw(o)) == cli.EXIT_FAILURE


def test_a_dp_party_failure_sends_a_generic_reason_and_keeps_the_details(tmp_path):
    channel = FakeChannel(2)

    def body() -> int:
        raise MemoryError("CUDA out of memory. Tried to allocate 1234 MiB")

    with pytest.raises(SystemExit):
        cli.run_guarded(channel, body, private=True, party_dir=tmp_path / "rank2")
    assert channel.aborted == cli.EXIT_FAILURE
    assert len(channel.notices) == 1 and "1234" not in channel.notices[0] and "error.log" in channel.notices[0]
    assert "1234 MiB" in (tmp_path / "rank2" / "error.log").read_text()


def test_a_message_that_is_not_data_is_refused_in_one_line_even_by_a_dp_party(tmp_path, capsys):
    """A pickle where rank 0 should send an assignment (tests/mpi/test_wire_from_server.py): the party says so, in
    one line on its stderr and to rank 0, not the generic line of a DP party's failure."""
    from mpi_fnas.wire import WireError

    channel = FakeChannel(2)
    refusal = WireError("rank 0 sent a message that is not data: header is not JSON: Expecting value")
    with pytest.raises(SystemExit):
        cli.run_guarded(channel, lambda: (_ for _ in ()).throw(refusal), private=True, party_dir=tmp_path / "rank2")
    line = "WireError: rank 0 sent a message that is not data: header is not JSON: Expecting value"
    assert channel.notices == [line] and channel.aborted == cli.EXIT_FAILURE
    assert capsys.readouterr().err.splitlines() == [f"[mpi_fnas rank 2] error: {line}; aborting the job"]


def test_a_plain_party_failure_sends_its_reason():
    channel = FakeChannel(1)
    with pytest.raises(SystemExit):
        cli.run_guarded(channel, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert channel.notices == ["RuntimeError: boom"]


#: What a party rank imports (the job command, both stages' party sides) and what only rank 0 needs.
PARTY_IMPORTS = ("mpi_fnas.run, mpi_fnas.stages.job, mpi_fnas.stages.party_driver, mpi_fnas.stages.search, "
                 "mpi_fnas.stages.augment")
RANK0_ONLY = ("dp_accounting", "scipy", "h5py")  # the accountant, the planner's optimiser, the log


def imported_after(modules: str) -> dict[str, bool]:
    """In a fresh interpreter: whether each RANK0_ONLY package is loaded after importing `modules`."""
    script = f"import json, sys; import {modules}; print(json.dumps({{m: m in sys.modules for m in {RANK0_ONLY!r}}}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_a_party_rank_does_not_import_rank_0s_accountant_planner_or_log():
    # ~1.2 s of start-up and ~80 MB a party rank. Rank 0's side (serve) loads the log; the accountant only once a DP
    # stage builds its ledgers (~1 s of a non-DP job's start-up, on the path every party waits on).
    assert imported_after(PARTY_IMPORTS) == {name: False for name in RANK0_ONLY}
    assert imported_after("mpi_fnas.stages.rank0_driver") == {"dp_accounting": False, "scipy": False, "h5py": True}
    assert (imported_after("mpi_fnas.stages.rank0_driver, mpi_fnas.privacy.federation_ledger")
            == {name: True for name in RANK0_ONLY})


def test_bad_input_is_refused_before_any_rank_imports_torch():
    # A refusal costs the user ~0.5 s, not the ~3 s of every rank importing torch first (the launch layer catches
    # SetupError from mpi_fnas.config, not from the torch-importing planner).
    from conftest import mpirun

    out = mpirun(3, "--set", "nope=1", env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=120)
    assert out.returncode == 2 and "nope: unknown key" in out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "mpi4py.MPI" in imported  # the profile did cover the ranks' imports
    assert "torch" not in imported and "mpi_fnas.federation.job_plan" not in imported
