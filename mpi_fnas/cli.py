"""The launch layer every entry point shares (``run``, ``sweep``, ``bench``, and those to come).

* arguments: ``--config``, ``--set``, ``--verbose``, ``--debug``, ``--version``, parsed the same way everywhere;
* exit codes: 0 finished · 1 failure (the whole job is aborted) · 2 bad input (one line, from rank 0) ·
  75 interrupted after a checkpoint (resume me);
* thread limits, set before torch is imported (9 ranks on 2 cores must not each start 2 threads);
* "decide on rank 0 and broadcast the decision or the error" (:func:`decide_on_root`), so no rank ever waits for
  a decision that will not come;
* the failure policy (:func:`run_guarded`): any exception on any rank ends the whole job quickly with a non-zero
  exit; a DP party sends the server only a generic reason and keeps the details in its own ``error.log``;
* a series of jobs in one MPI job (:func:`run_series`: ``sweep``, ``baseline``), set up under that policy;
* the exchange pattern every rank agrees on (:func:`agree_on_exchange`);
* signals (:class:`StopRequest`): SIGTERM, SIGUSR1 and SIGINT ask for a checkpoint at the next step boundary;
* the exit (:func:`exit_process`).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from mpi_fnas import __version__
from mpi_fnas.config import Config, ConfigError, ServerReportedError, SetupError, load_config
from mpi_fnas.refusal import ReportedRefusalError, refusal_line, refusal_text

if TYPE_CHECKING:
    from mpi_fnas.federation.comm import Channel

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: checkpointed, resume me (the Slurm scripts requeue on it)

T = TypeVar("T")


class LaunchFailedError(RuntimeError):
    """Rank 0 failed while deciding something every rank waits for (not bad input): exit code 1 everywhere."""


# -- arguments ------------------------------------------------------------------------------------------------------
def exit_process(code: int) -> NoReturn:
    """End the process with exit status `code` (every entry point's ``__main__``).

    Why ``gc.freeze()`` first: the interpreter's last collections would walk every object torch's import made, a
    cost every rank of every job pays at its exit; frozen objects are skipped (the atexit handlers, MPI's finalize
    and the flushes still run)."""
    gc.freeze()
    sys.exit(code)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every entry point takes: the config, overrides, verbosity and the version."""
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: built-in = configs/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set search.epochs=2 (repeatable; value is YAML)")
    parser.add_argument("--verbose", action="store_true", help="print the resolved config at the start")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for bad input too")
    parser.add_argument("--version", action="version", version=f"mpi_fnas {__version__}")


def command_parser(module: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """The parser of ``python -m <module>``: `description`, `epilog` with its line breaks kept, and the options every
    entry point takes (:func:`add_config_arguments`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    return parser


def load_config_args(args: argparse.Namespace) -> tuple[Config | None, ConfigError | None]:
    """The config of ``--config``/``--set``, or the error; parsed before MPI so bad input is cheap everywhere."""
    try:
        return load_config(args.config, args.overrides), None
    except ConfigError as exc:
        return None, exc


def make_dir(path: Path) -> None:
    """Create a run directory (and its parents); a failure is bad input naming the path."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out: cannot create {path}: {exc.strerror}") from None


# -- processes, threads and MPI -------------------------------------------------------------------------------------
def launcher_rank(comm: Any = None) -> int | None:
    """This process's rank in `comm` when one is given, else as the launcher set it (before MPI_Init); None outside
    a launcher."""
    if comm is not None:
        return comm.Get_rank()
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return None


def _local_ranks() -> int:
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def threads(cfg: Config | None) -> int:
    """runtime.threads_per_rank, else OMP_NUM_THREADS (a launcher's choice, e.g. --cpus-per-task), else the cores
    this process may use divided by the ranks on this node."""
    if cfg is not None and cfg.runtime.threads_per_rank:
        return cfg.runtime.threads_per_rank
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // _local_ranks())


def start_mpi(cfg: Config | None) -> Any:
    """Limit the thread pools (before torch is imported), initialise MPI and return COMM_WORLD."""
    n = str(threads(cfg))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, n)
    from mpi4py import MPI  # MPI_Init happens here, after the cheap argument checks

    return MPI.COMM_WORLD


def limit_torch_threads(cfg: Config | None) -> int:
    """Set torch's intra-op threads to ``runtime.threads_per_rank`` (default: this rank's share of the cores it may
    use); the number set."""
    import torch

    torch.set_num_threads(threads(cfg))
    return torch.get_num_threads()


# -- decisions ------------------------------------------------------------------------------------------------------
def decide_on_root(channel: Channel, decide: Callable[[], T]) -> T:
    """Rank 0 runs `decide()`; every rank returns its value, or raises its error.

    A :class:`ConfigError` becomes a ConfigError on every rank (bad input: exit 2, printed once by rank 0); any
    other exception becomes :class:`LaunchFailedError` (exit 1), with rank 0's traceback printed by rank 0. The
    broadcast is polled, so the parties sleep while rank 0 decides.
    """
    message: tuple[str, Any] = ("ok", None)
    if channel.is_server:
        try:
            message = ("ok", decide())
        except ConfigError as exc:
            message = ("bad_input", str(exc))
        except Exception as exc:
            traceback.print_exc()
            message = ("failure", f"{type(exc).__name__}: {exc}".splitlines()[0])
    kind, value = channel.bcast_object(message)
    if kind == "bad_input":
        raise ConfigError(value) if channel.is_server else ServerReportedError(value)
    if kind == "failure":
        raise LaunchFailedError(value)
    return value


def agree_on_exchange(channel: Channel, cfg: Config, own: Config, facts: list | None,
                      pending: list | None = None) -> str:
    """Rank 0 chooses the per-step exchanges' pattern from every rank's `facts` (hosts, cores) and `cfg`; a party
    refuses a collective one its `own` config does not allow
    (:func:`~mpi_fnas.federation.topology.collective_refusal`). Sets ``channel.pattern``; rank 0 gets the line to
    print. With `pending` (a party's refusals so far), a party adds its refusal there instead of answering with it,
    to report it in its first setup report, where rank 0 marks the log failed."""
    from mpi_fnas.federation.topology import COLLECTIVE, choose_exchange, collective_refusal
    from mpi_fnas.privacy.trusted_config import AssignmentRefusedError

    pattern, why = decide_on_root(channel, lambda: choose_exchange(cfg, facts))
    refusal = None
    if not channel.is_server and pattern == COLLECTIVE and (reason := collective_refusal(own)) is not None:
        refusal = f"rank {channel.rank} refuses the collective exchange rank 0 chose: {reason}"
        if pending is not None:
            pending.append(AssignmentRefusedError(refusal))
            refusal = None
    # Every party answers (None: it agrees), so that rank 0 ends the job at once rather than in its next wait.
    answers = channel.gather_objects(refusal)
    if refusal is not None:
        raise AssignmentRefusedError(refusal)
    refused = [answer for answer in answers or () if answer is not None]
    if refused:
        raise AssignmentRefusedError(str(refused[0]))
    channel.pattern, channel.pattern_reason = pattern, why
    return f"exchange: {pattern} ({why})"


def require_parties(channel: Channel, tool: str, launch: str) -> None:
    """ConfigError unless the world has a server and at least one party; `launch` shows how to start `tool`."""
    if channel.size < 2:
        raise ConfigError(f"{tool} needs at least 2 MPI ranks (1 server + K parties); launch it as: {launch}")


def report_bad_input(rank: int, exc: BaseException, debug: bool) -> int:
    """Rank 0 prints the one line; every rank returns exit code 2."""
    if rank == 0:
        if debug:
            traceback.print_exception(exc)
        print(f"mpi_fnas: error: {exc}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


# -- failures -------------------------------------------------------------------------------------------------------
def run_guarded(channel: Channel, body: Callable[[], int], *, debug: bool = False, private: bool = False,
                party_dir: Path | None = None) -> int:
    """Run `body()` and map every way it can end to an exit code, ending the whole job on a failure.

    `private`: this rank is a DP party, whose error texts could carry data (an out-of-memory message holds an
    allocation size): it sends rank 0 a generic reason and writes the details to ``party_dir/error.log``.
    """
    code, value = run_guarded_value(channel, body, debug=debug, private=private, party_dir=party_dir)
    return value if code == EXIT_OK else code


def run_guarded_value(channel: Channel, body: Callable[[], T], *, debug: bool = False, private: bool = False,
                      party_dir: Path | None = None) -> tuple[int, T | None]:
    """Run `body()` under :func:`run_guarded`'s failure policy: (``EXIT_OK``, what it returned), or (the exit code
    its end maps to, None)."""
    from mpi_fnas.federation.comm import PartyFailedError
    from mpi_fnas.privacy.trusted_config import AssignmentRefusedError, BudgetRefusedError
    from mpi_fnas.secagg.identities import IdentityError
    from mpi_fnas.secagg.keyset import KeySetError
    from mpi_fnas.wire import WireError

    try:
        return EXIT_OK, body()
    except (KeySetError, IdentityError, AssignmentRefusedError, BudgetRefusedError, ReportedRefusalError,
            WireError) as exc:  # WireError: a message that is not data (a pickle), refused unread
        refuse_job(channel, exc)
    except ServerReportedError:
        return EXIT_BAD_INPUT, None  # rank 0 prints the line
    except SetupError as exc:  # found while running: on a party only that party knows, so it must fail the job
        if channel.is_server:
            return report_bad_input(channel.rank, exc, debug), None
        fail_job(channel, exc, private=private, party_dir=party_dir)
    except ConfigError as exc:  # the same input on every rank: rank 0 prints it once, everyone exits 2
        return report_bad_input(channel.rank, exc, debug), None
    except LaunchFailedError as exc:
        if channel.is_server:
            print(f"mpi_fnas: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE, None
    except PartyFailedError as exc:
        print(f"mpi_fnas: error: {exc}; aborting the job (log marked failed)", file=sys.stderr, flush=True)
        channel.abort(EXIT_FAILURE)
    except KeyboardInterrupt:
        print(f"mpi_fnas: rank {channel.rank} interrupted; aborting the job", file=sys.stderr, flush=True)
        channel.abort(130)
    except BaseException as exc:  # anything else must end the whole job, never hang it
        fail_job(channel, exc, private=private, party_dir=party_dir)
    return EXIT_FAILURE, None  # not reached: abort ends the process


def refuse_job(channel: Channel, exc: BaseException) -> None:
    """This party refuses to go on (a key set, an identity, a config, an assignment, or a message that is not
    data): its one line on its own stderr and to rank 0, which marks the log failed, then the whole job ends. Such a
    text names ranks, files, config keys and what is wrong, never data or a key, so a DP party sends it as it is.

    A :class:`ReportedRefusalError`: it only waits for rank 0 to end the job, and ends it itself after the same grace
    as a notice."""
    if isinstance(exc, ReportedRefusalError):
        from mpi_fnas.federation.comm import FAILURE_GRACE

        time.sleep(min(FAILURE_GRACE, channel.timeout))
    else:
        print(refusal_line(channel.rank, exc), file=sys.stderr, flush=True)
        channel.notify_failure(refusal_text(exc))
    channel.abort(EXIT_FAILURE)


def fail_job(channel: Channel, exc: BaseException, *, private: bool, party_dir: Path | None) -> None:
    """Report this rank's failure (rank 0 marks the log) and abort the whole job."""
    details = f"[mpi_fnas rank {channel.rank}] " + "".join(traceback.format_exception(exc))
    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if channel.is_server:
        sys.stderr.write(details)
        print(f"mpi_fnas: error: server failed: {message}; aborting the job (log marked failed)",
              file=sys.stderr, flush=True)
    elif private:
        where = "its own error.log"
        if party_dir is not None:
            from mpi_fnas.federation.party_disk import PartyStore

            where = str(PartyStore(party_dir).write_error(details))
        generic = f"the party failed; under DP its error text stays with it (details in {where})"
        print(f"[mpi_fnas rank {channel.rank}] {generic}", file=sys.stderr, flush=True)
        channel.notify_failure(generic)
    else:
        sys.stderr.write(details)
        sys.stderr.flush()
        channel.notify_failure(refusal_text(exc))
    channel.abort(EXIT_FAILURE)


# -- commands that run a series of jobs -----------------------------------------------------------------------------
def run_series(cfg: Config | None, config_error: ConfigError | None, setup: Callable[[Channel], tuple[Any, ...]],
               run: Callable[..., int], *, debug: bool, comm: Any = None) -> int:
    """The MPI part of a command that runs a series of jobs in one MPI job (``mpi_fnas.sweep``,
    ``mpi_fnas.baseline``); returns the exit code.

    Starts MPI with `cfg`'s thread limits and installs the :class:`StopRequest`. Under :func:`run_guarded` (bad input
    ends every rank with exit 2), `config_error`, the bad input found before MPI, is raised, else ``setup(channel)``
    returns what every rank agreed on: the resolved config first, then anything else the series needs. Then
    ``run(channel, stop, config, *rest)`` runs with the channel's timeout from that config; further stop signals are
    ignored once it returns. `comm`: the communicator to run on, default COMM_WORLD (as :func:`mpi_fnas.run.main`).
    """
    from mpi_fnas.federation.comm import Channel

    channel = Channel(start_mpi(cfg) if comm is None else comm)
    stop = StopRequest.install()

    def guarded_setup() -> tuple[Any, ...]:
        if config_error is not None:
            raise config_error
        return setup(channel)

    code, agreed = run_guarded_value(channel, guarded_setup, debug=debug)
    if code != EXIT_OK:
        return code
    resolved, *rest = agreed
    channel.timeout = resolved.runtime.comm_timeout

    def exchange() -> int:
        from mpi_fnas.federation.memory import node_facts

        facts = channel.gather_objects(node_facts(resolved.runtime.node_memory_mb))
        line = agree_on_exchange(channel, resolved, cfg if cfg is not None else resolved, facts)
        if channel.is_server:
            print(line, flush=True)
        return EXIT_OK

    code = run_guarded(channel, exchange, debug=debug)
    if code != EXIT_OK:
        return code
    code = run(channel, stop, resolved, *rest)
    stop.disarm()
    return code


# -- signals --------------------------------------------------------------------------------------------------------
class StopRequest:
    """SIGTERM / SIGUSR1 / SIGINT only set a flag; rank 0 turns it into a checkpoint at the next step boundary.

    Every rank installs it (SIGUSR1 would otherwise kill a party); only rank 0's flag decides, and the parties
    learn the decision from the server's control word. A second SIGINT raises KeyboardInterrupt as usual.
    """

    def __init__(self) -> None:
        self.reason: str | None = None

    @classmethod
    def install(cls) -> StopRequest:
        """A request whose handlers are installed for SIGTERM, SIGUSR1 and SIGINT (each only records the signal)."""
        request = cls()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, request._handle)
        return request

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.reason is not None:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name

    def __call__(self) -> str | None:
        return self.reason

    def disarm(self) -> None:
        """Ignore further stop signals: this rank has decided to exit. Python resets its own handlers to the
        default during shutdown, so a late SIGTERM/SIGUSR1 (a requeue racing the exit) would otherwise turn exit
        75 into death by signal; SIG_IGN survives shutdown."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
