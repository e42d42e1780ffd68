"""A real one-node Slurm cluster on loopback, for tests that submit batch jobs.

Usage from a test module (the fixture is session-scoped and the cluster a per-process singleton, so several
modules importing the fixture share one set of daemons)::

    from slurm_cluster import slurm_cluster  # noqa: F401  (pytest fixture)

    @pytest.mark.slurm
    def test_x(slurm_cluster):
        job = slurm_cluster.sbatch(script_path, "--wait")
        ...

What it does:
- If `sbatch`/`slurmctld`/`munged` are missing and we are root, installs Debian's `slurm-wlm` and `munge`
  (`apt-get update` once, then `apt-get install -y --no-install-recommends`); not root and missing -> the
  fixture skips with the reason.
- Writes everything into one fresh directory under /tmp: a MUNGE key, munged's socket/pid/log/seed files,
  slurm.conf, gres.conf with eight stand-ins for GPUs (/dev/null-like character devices, so `--gpus=8` also
  sets CUDA_VISIBLE_DEVICES), state/spool/log/pid dirs, TCP ports picked free on 127.0.0.1. Nothing
  system-wide is touched: Slurm reaches the private munged through `AuthInfo=socket=...` (used by auth/munge
  and cred/munge, daemons and clients alike), so the default /run/munge socket is never needed.
- Starts munged, slurmctld and slurmd in the foreground under `subprocess.Popen`, waits (bounded) until `sinfo`
  reports the node idle, and on failure raises with the tail of every daemon's log.
- Teardown cancels all jobs, waits for them to end, then stops every daemon it started by PID (SIGTERM, then
  SIGKILL), then SIGKILLs any descendant still carrying this cluster's SLURM_CONF (an orphaned slurmstepd).
  It runs from the fixture's finaliser and from `atexit`, so it also happens when a test fails; the directory
  is removed unless MPI_FNAS_KEEP_SLURM_DIR=1.

Other test modules get the same running cluster: `from slurm_cluster import slurm_cluster` and use
`slurm_cluster.sbatch(..., env=..., cwd=...)`, `.job_info(id)`, `.wait_for_state(id, {...})`, `.run(cmd...)`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Binaries the harness needs; the Debian packages that ship them.
SLURM_BINARIES = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel", "slurmctld", "slurmd", "munged")
DEBIAN_PACKAGES = ("slurm-wlm", "munge")

# Node and GPU shape every test can rely on (the node declares more CPUs than the 2-core host has; Slurm
# accepts that because of SlurmdParameters=config_overrides).
NODE_CPUS = 16
NODE_GPUS = 8

# Seconds between SIGTERM and SIGKILL when Slurm ends a job (requeue, scancel, time limit). Slurm's default, 30,
# also here: on this loaded 2-core box a DP step of the 9-rank smoke run takes up to ~7 s, and after the stop
# request the ranks still finish that step, write the checkpoint, close the log and tear torch + MPI down; with
# 15 s the ranks were SIGKILLed in MPI_Finalize (harmless for the checkpoint, but it is not the graceful path).
KILL_WAIT_SECONDS = 30
# Job step credential lifetime. Slurm holds a requeued job for this long before it may start again (slurm.conf
# man page, AuthInfo cred_expire; default 120 s), so a small value keeps requeue tests fast. Below 5 slurmd
# logs "AuthInfo=cred_expire=2 invalid" and silently keeps 120.
CRED_EXPIRE_SECONDS = 5


def mpich_segment(job_step: str, node: int = 0) -> Path:
    """Where MPICH (ch4) keeps the node-local shared memory of the srun step `job_step` ("<job id>.<step id>"):
    /dev/shm/mpich_shm_<FNV-1a 32-bit hash of the PMI2 job id, hex>_<node id>. slurm/launch.sh removes these
    for a restarted job; tests/test_slurm_e2e.py checks the name against a real run."""
    digest = 2166136261
    for byte in job_step.encode():
        digest = (digest ^ byte) * 16777619 & 0xFFFFFFFF
    return Path(f"/dev/shm/mpich_shm_{digest:x}_{node}")


class SlurmUnavailableError(RuntimeError):
    """Slurm cannot be provided here (binaries missing and no root to install them, or install failed)."""


# Wall seconds the apt install took in this process (None when nothing was installed); reported by tests.
apt_install_seconds: float | None = None


def missing_binaries() -> list[str]:
    """Names from SLURM_BINARIES that are not on PATH (sbin included: daemons live in /usr/sbin)."""
    search_path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [name for name in SLURM_BINARIES if shutil.which(name, path=search_path) is None]


def ensure_slurm_installed() -> None:
    """Install slurm-wlm and munge from Debian when missing and we are root.

    Raises SlurmUnavailableError (-> skip) when not root or no apt-get; RuntimeError when the install fails.
    """
    global apt_install_seconds
    missing = missing_binaries()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailableError(
            f"Slurm binaries missing ({', '.join(missing)}) and not root: cannot apt-get install "
            f"{' '.join(DEBIAN_PACKAGES)}; install them to run the Slurm tests"
        )
    if shutil.which("apt-get") is None:
        raise SlurmUnavailableError(f"Slurm binaries missing ({', '.join(missing)}) and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Wait for another apt/dpkg run to release its lock instead of failing at once.
    lock_wait = ["-o", "DPkg::Lock::Timeout=300"]
    started = time.monotonic()
    for cmd in (
        ["apt-get", *lock_wait, "update", "-q"],
        ["apt-get", *lock_wait, "install", "-y", "-q", "--no-install-recommends", *DEBIAN_PACKAGES],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            # Root could install but the install broke: an error, not a skip, so CI does not pass silently.
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    apt_install_seconds = time.monotonic() - started
    packages = " ".join(DEBIAN_PACKAGES)
    print(f"slurm_cluster: apt-get installed {packages} in {apt_install_seconds:.1f} s", file=sys.stderr)
    still_missing = missing_binaries()
    if still_missing:
        raise RuntimeError(f"after apt-get install still missing: {', '.join(still_missing)}")


def _free_loopback_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


@dataclass
class SlurmCluster:
    """One slurmctld + one slurmd + a private munged, all rooted in `root`.

    After `start()`, `env` is the environment clients need (SLURM_CONF set); `node` is the node name.
    """

    root: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0] or "localhost")
    cpus: int = NODE_CPUS
    gpus: int = NODE_GPUS
    first_job_id: int = field(default_factory=lambda: 1000 + secrets.randbelow(60_000_000))
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)
    gpu_files_are_devices: bool = False
    start_seconds: float | None = None

    # ----- paths -------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge-socket" / "munge.socket.2"

    @property
    def logs(self) -> dict[str, Path]:
        log_dir = self.root / "log"
        return {
            "munged": log_dir / "munged.log",
            "slurmctld": log_dir / "slurmctld.log",
            "slurmd": log_dir / "slurmd.log",
        }

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    # ----- configuration -----------------------------------------------------------------------------
    def slurm_conf_text(self, ctld_port: int, slurmd_port: int) -> str:
        """The exact slurm.conf this harness uses (also written to `conf`)."""
        r = self.root
        return "\n".join(
            [
                "ClusterName=mpifnas",
                f"SlurmctldHost={self.node}({self.address(self.node)})",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                # Job ids start at a random value, not 1: MPICH names its shared-memory segment after the PMI
                # job id, so a segment left in /dev/shm by a killed run of an earlier test cluster (whose ids
                # also started at 1) would be picked up by this cluster's job 1 and break it.
                f"FirstJobId={self.first_job_id}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_SECONDS}",
                f"StateSaveLocation={r}/state",
                f"SlurmctldPidFile={r}/run/slurmctld.pid",
                f"SlurmctldLogFile={self.logs['slurmctld']}",
                *self.slurmd_path_lines(),
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SchedulerType=sched/backfill",
                # A requeued job becomes eligible only after cred_expire; no event wakes the scheduler then,
                # so it waits for the periodic main loop (default every 60 s): run that loop every 2 s.
                "SchedulerParameters=sched_interval=2,bf_interval=2",
                # cons_tres is what makes --gpus / --gres=gpu:N schedulable.
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "MpiDefault=pmi2",
                "GresTypes=gpu",
                "ReturnToService=2",
                "JobRequeue=1",
                f"KillWait={KILL_WAIT_SECONDS}",
                "MinJobAge=300",
                "SlurmdParameters=config_overrides",
                "MailProg=/bin/true",
                *self.node_lines(),
                f"PartitionName=debug Nodes={','.join(self.layout)} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    # ----- the cluster's shape (NamespaceSlurmCluster overrides these) -------------------------------------
    @property
    def layout(self) -> dict[str, tuple[int, int]]:
        """{node name: (CPUs, GPUs)}: one node here."""
        return {self.node: (self.cpus, self.gpus)}

    def address(self, node: str) -> str:
        return "127.0.0.1"

    def slurmd_path_lines(self) -> list[str]:
        r = self.root
        return [f"SlurmdSpoolDir={r}/spool", f"SlurmdPidFile={r}/run/slurmd.pid",
                f"SlurmdLogFile={self.logs['slurmd']}"]

    def node_lines(self) -> list[str]:
        lines = []
        for node, (cpus, gpus) in self.layout.items():
            gres = f" Gres=gpu:{gpus}" if gpus else ""
            lines.append(f"NodeName={node} NodeAddr={self.address(node)} CPUs={cpus}{gres} State=UNKNOWN")
        return lines

    def on(self, node: str, cmd: list[str]) -> list[str]:
        """`cmd` as it runs on `node` (here: as it is)."""
        return cmd

    def client(self, cmd: list[str]) -> list[str]:
        """A Slurm client command as it reaches slurmctld (here: as it is)."""
        return cmd

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "munge-socket", "state", "spool", "run", "log", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged's checks: the key (and its dir) must not be accessible by others; the socket dir must be
        # searchable by all (clients of any uid connect) but writable only by the owner.
        (self.root / "munge").chmod(0o700)
        (self.root / "munge-socket").chmod(0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        # Stand-ins for /dev/nvidia0..7. slurmd only sets CUDA_VISIBLE_DEVICES for files that are character
        # devices, so make them copies of /dev/null (char 1:3, harmless to open) when mknod is allowed; with
        # empty regular files `--gpus=8` still schedules (SLURM_GPUS*), only CUDA_VISIBLE_DEVICES is missing.
        self.gpu_files_are_devices = True
        for index in range(max((gpus for _, gpus in self.layout.values()), default=0)):
            path = self.root / "dev" / f"gpu{index}"
            try:
                os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            except OSError:
                self.gpu_files_are_devices = False
                path.touch()
        ctld_port, slurmd_port = self.ports()
        self.conf.write_text(self.slurm_conf_text(ctld_port, slurmd_port))
        # Slurm reads gres.conf from the directory that holds slurm.conf. Each node's GPUs are stand-ins from the
        # same files (a node only opens its own).
        gres = [f"NodeName={node} Name=gpu File={self.root}/dev/gpu[0-{gpus - 1}]"
                for node, (_, gpus) in self.layout.items() if gpus]
        (self.conf.parent / "gres.conf").write_text("".join(line + "\n" for line in gres))

    def ports(self) -> tuple[int, int]:
        """(slurmctld's port, slurmd's port): free on loopback."""
        ctld_port, slurmd_port = _free_loopback_port(), _free_loopback_port()
        while slurmd_port == ctld_port:
            slurmd_port = _free_loopback_port()
        return ctld_port, slurmd_port

    # ----- lifecycle ---------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        console = open(self.root / "log" / f"{name}.console", "wb")  # noqa: SIM115 (owned by the process)
        # A new session keeps a Ctrl-C at the terminal from reaching the daemons before our teardown does.
        self._procs[name] = subprocess.Popen(
            cmd, stdout=console, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        console.close()

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.diagnostics()}")

    def _wait_for(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.diagnostics()}")

    def node_state(self) -> str:
        """The node's state as sinfo prints it (e.g. 'idle', 'mixed', 'allocated', 'down*'); '' on error."""
        done = subprocess.run(
            self.client(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"]),
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    def all_idle(self) -> bool:
        done = subprocess.run(self.client(["sinfo", "-h", "-N", "-o", "%N %T"]), env=self.env, capture_output=True,
                              text=True, check=False, timeout=30)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and all(states.get(node) == "idle" for node in self.layout)

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the config, start munged, slurmctld and slurmd, and wait until the node is idle."""
        started = time.monotonic()
        self._write_files()
        munge_dir = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={munge_dir / 'munge.key'}",
                f"--pid-file={self.root / 'run' / 'munged.pid'}",
                f"--log-file={self.logs['munged']}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
        )
        self._wait_for("munged socket", self.munge_socket.exists, timeout)
        # -D: foreground, so the Popen PID is the daemon's PID; -i: ignore (empty) saved state.
        self._spawn("slurmctld", self.on(self.node, ["slurmctld", "-D", "-i", "-f", str(self.conf)]))
        for node in self.layout:
            name = "slurmd" if len(self.layout) == 1 else f"slurmd-{node}"
            self._spawn(name, self.on(node, ["slurmd", "-D", "-f", str(self.conf), "-N", node]))
        self._wait_for(f"nodes {','.join(self.layout)} idle", self.all_idle, timeout)
        self.start_seconds = time.monotonic() - started
        return self

    def cancel_all_jobs(self, timeout: float = 2.0 * KILL_WAIT_SECONDS) -> None:
        """scancel every job and wait (bounded) until squeue lists none, so no job process outlives us."""
        if "slurmctld" not in self._procs or self._procs["slurmctld"].poll() is not None:
            return
        subprocess.run(self.client(["scancel", "--full", "--user", "root"]), env=self.env, capture_output=True,
                       check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = subprocess.run(
                self.client(["squeue", "-h", "-o", "%i"]), env=self.env, capture_output=True, text=True, check=False
            )
            if listed.returncode != 0 or not listed.stdout.strip():
                return
            time.sleep(0.5)

    def stop(self, remove: bool | None = None) -> None:
        """Cancel jobs, then stop every daemon this harness started, by PID; idempotent.

        remove: delete `root` afterwards (default: yes unless MPI_FNAS_KEEP_SLURM_DIR=1).
        """
        with contextlib.suppress(Exception):
            self.cancel_all_jobs()
        # Reverse start order: slurmd (and its steps) first, munged last because the others talk to it.
        for name in reversed(list(self._procs)):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._procs.clear()
        self._kill_leftovers()
        if remove is None:
            remove = os.environ.get("MPI_FNAS_KEEP_SLURM_DIR", "0") != "1"
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """SIGKILL any process still carrying this cluster's SLURM_CONF in its environment.

        Those are our own descendants only (slurmstepd inherits it from slurmd, job tasks from sbatch), and
        they outlive slurmd when a job could not be cancelled (e.g. slurmctld died first). Killed by PID.
        """
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue  # gone, or not ours to read
            if marker in environ:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def diagnostics(self) -> str:
        parts = []
        for name, log in self.logs.items():
            parts.append(f"--- {name} log ({log}) ---\n{_tail(log)}")
            parts.append(f"--- {name} console ---\n{_tail(self.root / 'log' / f'{name}.console', 10)}")
        return "\n".join(parts)

    # ----- client helpers ----------------------------------------------------------------------------
    def run(self, *cmd: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command with SLURM_CONF set; text output captured."""
        done = subprocess.run(self.client(list(cmd)), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
            )
        return done

    def sbatch(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 120.0,
    ) -> int:
        """`sbatch --parsable ARGS...` -> job id. Pass `--wait` among args to block until the job ends
        (sbatch then exits with the job's exit code; that is not treated as an error here).

        env: the submit environment (default: ours plus SLURM_CONF); the job inherits it (--export=ALL).
        cwd: the submit directory (the job's working directory and SLURM_SUBMIT_DIR).
        """
        done = subprocess.run(
            self.client(["sbatch", "--parsable", *args]),
            env=dict(env, SLURM_CONF=str(self.conf)) if env is not None else self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        first = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
        job_id = first.split(";")[0]
        if not job_id.isdigit():
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({done.returncode}): {done.stderr}")
        return int(job_id)

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, ...); {} when unknown."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        info: dict[str, str] = {}
        for token in done.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in info:
                info[key] = value
        return info

    def wait_for_state(self, job_id: int, states: set[str], timeout: float = 90.0) -> dict[str, str]:
        """Poll until the job's JobState is one of `states`; returns the job info."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise RuntimeError(
            f"job {job_id} not in {sorted(states)} after {timeout:.0f} s (last: {info})\n{self.diagnostics()}"
        )


REPO = Path(__file__).resolve().parent.parent
CLUSTER_SH = REPO / "scripts" / "cluster.sh"


@dataclass
class NamespaceSlurmCluster(SlurmCluster):
    """Slurm across the simulated cluster's hosts (scripts/cluster.sh): slurmctld and a slurmd on the first
    host, a slurmd on each other; munged stays on this machine (its Unix socket is a file every host sees).

    Every daemon runs inside its host's namespaces (`cluster.sh on HOST ...`, which execs, so the Popen PID is the
    daemon's), and so does every client command: slurmctld listens on the first host's address only. Each host's
    slurmd has its own spool, pid and log file (%n). `nodes` is {host: (CPUs, GPUs)} in host order.
    """

    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    cluster_env: dict[str, str] = field(default_factory=dict)  # MFC_STATE and MFC_PREFIX of the cluster.sh hosts
    addresses: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.node = next(iter(self.nodes))
        status = subprocess.run([str(CLUSTER_SH), "status"], env={**os.environ, **self.cluster_env},
                                capture_output=True, text=True, check=True, timeout=30).stdout
        self.addresses = {line.split()[0]: line.split()[1] for line in status.splitlines() if line.startswith("n")}
        missing = set(self.nodes) - set(self.addresses)
        if missing:
            raise RuntimeError(f"cluster.sh has no hosts {sorted(missing)}:\n{status}")

    @property
    def layout(self) -> dict[str, tuple[int, int]]:
        return self.nodes

    def address(self, node: str) -> str:
        return self.addresses[node]

    def ports(self) -> tuple[int, int]:
        return 6817, 6818  # Slurm's own: every host has a network stack of its own

    def slurmd_path_lines(self) -> list[str]:
        r = self.root
        return [f"SlurmdSpoolDir={r}/spool-%n", f"SlurmdPidFile={r}/run/slurmd-%n.pid",
                f"SlurmdLogFile={r}/log/slurmd-%n.log"]

    @property
    def logs(self) -> dict[str, Path]:
        log_dir = self.root / "log"
        return {"munged": log_dir / "munged.log", "slurmctld": log_dir / "slurmctld.log",
                **{f"slurmd-{node}": log_dir / f"slurmd-{node}.log" for node in self.nodes}}

    def on(self, node: str, cmd: list[str]) -> list[str]:
        return [str(CLUSTER_SH), "on", node, *cmd]

    def client(self, cmd: list[str]) -> list[str]:
        return self.on(self.node, cmd)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf), **self.cluster_env)


_CLUSTER: SlurmCluster | None = None
_STOP_ON_SIGTERM: list[SlurmCluster] = []


def make_cluster_root() -> Path:
    """A fresh directory for one cluster, directly under the system temp dir.

    munged checks every directory above its socket for search ('x') permission for all users, so the root
    cannot live under pytest's per-user 0700 base temp dir; a 0755 mkdtemp under /tmp passes.
    """
    root = Path(tempfile.mkdtemp(prefix="mpi_fnas-slurm-"))
    root.chmod(0o755)
    return root


def _stop_on_sigterm(cluster: SlurmCluster) -> None:
    """Make SIGTERM (e.g. `timeout pytest ...`, a CI job cancel) stop `cluster` before the process dies.

    atexit handlers do not run when a signal kills the process, and the daemons run in sessions of their own,
    so without this they would outlive the test run. The handler is only installed over the default action;
    it stops every cluster registered here (stop() is idempotent), then dies of the signal as it would have.
    """
    _STOP_ON_SIGTERM.append(cluster)
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def handle(signum: int, frame) -> None:
        for registered in _STOP_ON_SIGTERM:
            with contextlib.suppress(Exception):
                registered.stop()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    with contextlib.suppress(ValueError):  # not the main thread: signal handlers cannot be set there
        signal.signal(signal.SIGTERM, handle)


def get_cluster() -> SlurmCluster:
    """The process-wide cluster, started on first use; stopped (and its directory removed) at exit, also when
    the process gets SIGTERM."""
    global _CLUSTER
    if _CLUSTER is None:
        ensure_slurm_installed()
        cluster = SlurmCluster(root=make_cluster_root())
        atexit.register(cluster.stop)
        _stop_on_sigterm(cluster)
        try:
            cluster.start()
        except BaseException:
            cluster.stop(remove=False)  # keep the logs named in the error
            raise
        _CLUSTER = cluster
    return _CLUSTER


def stop_cluster() -> None:
    global _CLUSTER
    if _CLUSTER is not None:
        _CLUSTER.stop()
        _CLUSTER = None


@pytest.fixture(scope="session")
def slurm_cluster():
    """Session-wide running cluster with SLURM_CONF exported in os.environ for the tests' subprocesses."""
    try:
        cluster = get_cluster()
    except SlurmUnavailableError as exc:
        pytest.skip(str(exc))
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        stop_cluster()
