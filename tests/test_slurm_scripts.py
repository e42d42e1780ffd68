"""slurm/*.sh: static checks, and their launch/requeue/resume logic under the real loopback Slurm.

The batch scripts run unchanged; only the Python module each rank starts is a stand-in (MPI_FNAS_MODULE, a
documented launch.sh setting), which records its argv and environment and plays the run's exit-code contract:
0 finished, 75 interrupted after writing RUN_DIR/checkpoint.pt. The end-to-end test with the real
`mpi_fnas.run` is tests/test_slurm_e2e.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import mpich_segment, slurm_cluster  # noqa: F401  (slurm_cluster is the fixture)

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "slurm"
WRAPPERS = sorted(SLURM_DIR.glob("*fnas_*.sh"))
ALL_SCRIPTS = sorted(SLURM_DIR.glob("*.sh"))
EXIT_INTERRUPTED = 75

STAND_IN = '''
"""Stand-in for mpi_fnas.run: records argv/env per rank and follows FAKE_RUN_BEHAVIOUR."""
import json, os, signal, sys, time
from pathlib import Path

signals = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda num, frame: signals.append(signal.Signals(num).name))

# PMI_RANK first: under mpirun inside a job every rank inherits the batch shell's SLURM_PROCID=0.
rank = int(os.environ.get("PMI_RANK") or os.environ["SLURM_PROCID"])
attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
keys = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_GPUS", "SLURM_RESTART_COUNT", "SLURM_ARRAY_TASK_ID",
        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "HDF5_USE_FILE_LOCKING", "PYTHONUNBUFFERED", "PMI_RANK")
record = {"rank": rank, "attempt": attempt, "argv": sys.argv[1:], "cwd": os.getcwd(),
          "env": {k: os.environ.get(k) for k in keys}, "signals": signals}
out = Path(os.environ["FAKE_RUN_RECORDS"]) / os.environ.get("SLURM_JOB_ID", "nojob")
out.mkdir(parents=True, exist_ok=True)

def save():
    tmp = out / f".attempt{attempt}-rank{rank}.json"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"attempt{attempt}-rank{rank}.json")

save()
behaviour = os.environ.get("FAKE_RUN_BEHAVIOUR", "finish")
if behaviour.startswith("exit:"):
    sys.exit(int(behaviour.split(":")[1]))
if behaviour == "checkpoint-on-signal" and attempt == 0:
    deadline = time.monotonic() + 120
    while not signals and time.monotonic() < deadline:
        time.sleep(0.05)
    # Exiting now: Python restores the default handlers during interpreter shutdown, so a second stop signal
    # arriving then (Slurm's SIGTERM and launch.sh's forwarded SIGUSR1 come separately) would kill the process.
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    save()
    if rank == 0 and signals:
        run_dir = Path(sys.argv[sys.argv.index("--out") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoint.pt").write_text("stand-in checkpoint")
    sys.exit(75 if signals else 1)
'''


def load_records(records: Path, job: int | str, attempt: int) -> list[dict]:
    found = sorted((records / str(job)).glob(f"attempt{attempt}-rank*.json"))
    return sorted((json.loads(p.read_text()) for p in found), key=lambda r: r["rank"])


def wait_for_records(records: Path, job: int | str, attempt: int, count: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = load_records(records, job, attempt)
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"job {job} attempt {attempt}: {len(load_records(records, job, attempt))}/{count} ranks")


# --- static checks (no cluster) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_is_strict(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "set -euo pipefail" in text
    if script.name != "launch.sh":
        directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.M)
        for required in ("--signal=B:USR1@120", "--requeue", "--open-mode=append"):
            assert required in directives, (script.name, required)
        output = next(d for d in directives if d.startswith("--output="))
        assert "%j" in output or "%A" in output, output


@pytest.mark.parametrize("script", WRAPPERS, ids=lambda p: p.name)
def test_wrapper_asks_for_server_plus_parties(script):
    mode, parties = re.fullmatch(r"(dpfnas|fnas)_(\d+)\.sh", script.name).groups()
    text = script.read_text()
    directives = dict(re.findall(r"^#SBATCH (--[\w-]+)=(\S+)", text, flags=re.M))
    assert directives["--ntasks"] == str(int(parties) + 1)
    assert directives["--gpus"] == parties
    assert directives["--job-name"] == script.stem
    # The one parameterised launcher, told the mode (-> default config) and K (-> federation.parties).
    assert text.splitlines()[-1] == f'exec bash "$slurm_dir/launch.sh" {mode} {parties}'


def locator_block(script: Path) -> list[str]:
    """The lines of a batch script that find slurm/launch.sh (from `slurm_dir=` up to the line before `exec`)."""
    lines = script.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("slurm_dir="))
    return lines[start : start + 3]


def test_batch_scripts_share_one_locator():
    """Every script sbatch runs as a spooled copy finds launch.sh with the same lines (tested below once per
    script); a drifting copy would show up here."""
    scripts = [*WRAPPERS, SLURM_DIR / "noise_sweep.sh"]
    blocks = {script.name: locator_block(script) for script in scripts}
    assert len({tuple(block) for block in blocks.values()}) == 1, blocks
    assert "Command=" in blocks["dpfnas_8.sh"][2]


# --- a batch script's spooled copy, without a cluster -------------------------------------------------------------
# sbatch runs a copy of the script from slurmd's spool directory. These tests run such a copy with stand-ins on PATH:
# `scontrol show job` answers the job's Command= (what sbatch was given), and `srun` runs the rank command once.

FAKE_SCONTROL = """#!/usr/bin/env bash
# `scontrol show job ID` -> Command=$FAKE_COMMAND in scontrol's multi-line layout; anything else fails.
[[ $1 == show && $2 == job && -n ${FAKE_COMMAND:-} ]] || { echo "fake scontrol: no answer for: $*" >&2; exit 1; }
printf 'JobId=%s JobName=x\n   Command=%s\n   WorkDir=/nonexistent\n' "$3" "$FAKE_COMMAND"
"""
FAKE_SRUN = """#!/usr/bin/env bash
# srun --opt... CMD ARGS -> CMD ARGS as task 0.
while [[ $1 == -* ]]; do shift; done
SLURM_PROCID=0 exec "$@"
"""


@pytest.fixture
def spooled(tmp_path):
    """run(script, command=..., cwd=..., **env) -> (CompletedProcess, argv of the stand-in run or None).

    Runs a copy of `script` at <tmp>/spool/job42/slurm_script as batch job 42, with the stand-in module."""
    bin_dir, module_dir, records = tmp_path / "bin", tmp_path / "module", tmp_path / "records"
    for directory in (bin_dir, module_dir):
        directory.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (module_dir / "stand_in_run.py").write_text(STAND_IN)
    spool = tmp_path / "spool" / "job42"
    spool.mkdir(parents=True)

    def run(script: Path, cwd: Path, direct: bool = False, **extra: str) -> tuple[subprocess.CompletedProcess, list]:
        copy = script if direct else spool / "slurm_script"
        if not direct:
            copy.write_text(script.read_text())
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "MPI_FNAS_"))}
        env.pop("CONFIG", None)
        env.update(
            PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(module_dir), MPI_FNAS_MODULE="stand_in_run",
            FAKE_RUN_RECORDS=str(records), SLURM_JOB_ID="42", SLURM_JOB_NAME=script.stem, RUN_DIR=str(tmp_path / "run"),
            VENV=str(Path(sys.executable).parent.parent),
        )  # fmt: skip
        env.update(extra)
        done = subprocess.run(
            ["bash", str(copy)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        ranks = load_records(records, "42", 0)
        return done, (ranks[0]["argv"] if ranks else None)

    return run


def expected_argv(mode: str, parties: str, run_dir: Path) -> list[str]:
    config = REPO / "configs" / ("vanilla_nas.yaml" if mode == "vanilla" else f"{mode}.yaml")
    return ["--config", str(config), "--out", str(run_dir), "--set", f"federation.parties={parties}"]


@pytest.mark.parametrize("script", WRAPPERS, ids=lambda p: p.name)
def test_spooled_wrapper_finds_the_repository_from_an_absolute_command(script, spooled, tmp_path):
    """Submitted by absolute path from a directory outside the repository."""
    mode, parties = re.fullmatch(r"(dpfnas|fnas)_(\d+)\.sh", script.name).groups()
    done, argv = spooled(script, cwd=tmp_path, FAKE_COMMAND=str(script), SLURM_SUBMIT_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert argv == expected_argv(mode, parties, tmp_path / "run")


def test_spooled_wrapper_resolves_a_relative_command_against_the_submit_dir(spooled, tmp_path):
    """`cd repo/tests && sbatch --chdir=/elsewhere ../slurm/fnas_4.sh`: Command= is relative to the submit dir,
    not to the job's working directory."""
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    done, argv = spooled(
        SLURM_DIR / "fnas_4.sh", cwd=workdir, FAKE_COMMAND="../slurm/fnas_4.sh", SLURM_SUBMIT_DIR=str(REPO / "tests")
    )
    assert done.returncode == 0, done.stderr
    assert argv == expected_argv("fnas", "4", tmp_path / "run")


def test_wrapper_run_in_place_needs_no_scontrol(spooled, tmp_path):
    """`bash slurm/dpfnas_2.sh` inside salloc: the file is the original (Command= of an salloc job is (null))."""
    done, argv = spooled(
        SLURM_DIR / "dpfnas_2.sh", cwd=tmp_path, direct=True, FAKE_COMMAND="(null)", SLURM_SUBMIT_DIR=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert argv == expected_argv("dpfnas", "2", tmp_path / "run")


def test_mpi_fnas_home_overrides_the_lookup(spooled, tmp_path):
    """MPI_FNAS_HOME alone suffices: scontrol is not asked (the fake one has no answer here)."""
    done, argv = spooled(SLURM_DIR / "fnas_1.sh", cwd=tmp_path, MPI_FNAS_HOME=str(REPO), SLURM_SUBMIT_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert argv == expected_argv("fnas", "1", tmp_path / "run")


def test_unfindable_repository_fails_naming_launch_sh(spooled, tmp_path):
    """Submitted on stdin (Command=(null)) from outside the repository: a clear failure, not a wrong run."""
    done, argv = spooled(SLURM_DIR / "fnas_1.sh", cwd=tmp_path, FAKE_COMMAND="(null)", SLURM_SUBMIT_DIR=str(tmp_path))
    assert done.returncode != 0 and argv is None
    assert "launch.sh: No such file or directory" in done.stderr, done.stderr


def test_wrong_mpi_fnas_home_is_bad_input(spooled, tmp_path):
    """A wrong MPI_FNAS_HOME inside a job: the locator falls back to Command=, and launch.sh refuses it (exit 2)."""
    done, argv = spooled(
        SLURM_DIR / "fnas_1.sh", cwd=tmp_path, MPI_FNAS_HOME=str(tmp_path), FAKE_COMMAND=str(SLURM_DIR / "fnas_1.sh"),
        SLURM_SUBMIT_DIR=str(tmp_path),
    )  # fmt: skip
    assert (done.returncode, argv) == (2, None), done.stderr
    assert f"MPI_FNAS_HOME={tmp_path} is not an mpi_fnas repository" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_spooled_noise_sweep_task(spooled, tmp_path):
    """Array task 7 of 6 variances x 2 seeds: variance 1, seed 9; DP-FNAS with 4 parties."""
    done, argv = spooled(
        SLURM_DIR / "noise_sweep.sh", cwd=tmp_path, FAKE_COMMAND="slurm/noise_sweep.sh", SLURM_SUBMIT_DIR=str(REPO),
        SLURM_ARRAY_TASK_ID="7", SLURM_ARRAY_JOB_ID="41", SEEDS="8 9", RUN_ROOT=str(tmp_path / "sweep"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert argv == [
        *expected_argv("dpfnas", "4", tmp_path / "sweep" / "var1-seed9"), "--set", "seed=9",
        "--set", "privacy.noise_multiplier_w=1", "--set", "privacy.noise_multiplier_a=1",
    ]  # fmt: skip


def test_spooled_table1_task_uses_the_submitters_home(spooled, tmp_path):
    """An array task of table1.sh: MPI_FNAS_HOME comes from the submitter; the mode picks the default config."""
    done, argv = spooled(
        SLURM_DIR / "table1.sh", cwd=tmp_path, MPI_FNAS_HOME=str(REPO), TABLE1_MODE="vanilla", TABLE1_PARTIES="1",
        SEEDS="3 4", SLURM_ARRAY_TASK_ID="1", TABLE1_ROOT=str(tmp_path / "t1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert argv == [*expected_argv("vanilla", "1", tmp_path / "t1" / "vanilla-K1-seed4"), "--set", "seed=4"]


SCALING_GRID = {"SCALING_KINDS": "strong weak", "SCALING_EXCHANGES": "star collective", "SEEDS": "0 1",
                "SCALING_STEPS": "10"}


def test_spooled_scaling_tasks_run_the_points_of_python_m_mpi_fnas_scaling(spooled, tmp_path):
    """Array tasks 0..7 of K = 4: each runs the point the Python plan has at that index for K = 4, with the same
    directory and the same `--set`s after EXTRA_ARGS (strong: ceil(10/4) = 3 steps, weak: 10)."""
    from mpi_fnas.scaling import plan_grid

    points = [p for p in plan_grid([1, 4], ["star", "collective"], ["strong", "weak"], [0, 1], 10) if p.parties == 4]
    root = tmp_path / "scaling"
    for task, point in enumerate(points):
        done, argv = spooled(
            SLURM_DIR / "scaling.sh", cwd=tmp_path, MPI_FNAS_HOME=str(REPO), SCALING_K="4",
            SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_JOB_ID="41", SCALING_ROOT=str(root),
            EXTRA_ARGS="--set privacy.aggregation=secure", **SCALING_GRID,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        sets = [arg for item in point.overrides() for arg in ("--set", item)]
        assert argv == [*expected_argv("dpfnas", "4", root / point.dirname), "--set", "privacy.aggregation=secure",
                        *sets], task
    assert [p.steps for p in points] == [3, 3, 3, 3, 10, 10, 10, 10]


def test_spooled_scaling_task_skips_a_finished_point(spooled, tmp_path):
    run_dir = tmp_path / "scaling" / "strong-star-K4-seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "searched.pt").write_text("a finished search")
    done, argv = spooled(
        SLURM_DIR / "scaling.sh", cwd=tmp_path, MPI_FNAS_HOME=str(REPO), SCALING_K="4", SLURM_ARRAY_TASK_ID="0",
        SCALING_ROOT=str(tmp_path / "scaling"), **SCALING_GRID,
    )  # fmt: skip
    assert (done.returncode, argv) == (0, None), done.stderr
    assert "finished already (searched.pt): skipped" in done.stdout


def submit_scaling(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`bash slurm/scaling.sh` with a stand-in sbatch that records `SCALING_K <its arguments>` per call."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls.txt"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sbatch").write_text(f'#!/usr/bin/env bash\necho "$SCALING_K $*" >> {calls}\necho "77;cluster"\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SCALING_", "MPI_FNAS_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SCALING_ROOT=str(tmp_path / "root"), **settings)
    done = subprocess.run(["bash", str(SLURM_DIR / "scaling.sh")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_scaling_submits_one_array_per_k_sized_k_plus_1_tasks_and_k_gpus(tmp_path):
    done, calls = submit_scaling(tmp_path, SCALING_PARTIES="1 16", SEEDS="0 1 2")
    assert done.returncode == 0, done.stderr
    script = str(SLURM_DIR / "scaling.sh")
    assert calls == [  # 2 scalings x 2 exchanges x 3 seeds = 12 tasks per K
        f"1 --parsable --job-name=scaling-K1 --array=0-11 --ntasks=2 --gpus=1 {script}",
        f"16 --parsable --job-name=scaling-K16 --array=0-11 --ntasks=17 --gpus=16 {script}",
    ]
    assert done.stdout.count("-> array job 77") == 2
    assert f"python -m mpi_fnas.scaling collect {tmp_path / 'root'}" in done.stdout


@pytest.mark.parametrize(("setting", "message"), [
    ({"SCALING_EXCHANGES": "star ring"}, "scaling.sh: bad pattern 'ring' in SCALING_EXCHANGES (want star|collective)"),
    ({"SCALING_PARTIES": "2 0"}, "scaling.sh: bad K '0' in SCALING_PARTIES (want whole numbers >= 1)"),
    ({"SCALING_KINDS": "medium"}, "scaling.sh: bad scaling 'medium' in SCALING_KINDS (want strong|weak)"),
    ({"SEEDS": "x"}, "scaling.sh: bad seed 'x' in SEEDS (want whole numbers >= 0)"),
    ({"SCALING_STEPS": "0"}, "scaling.sh: SCALING_STEPS must be a whole number >= 1, got '0'"),
])
def test_scaling_refuses_a_bad_setting_before_submitting_anything(setting, message, tmp_path):
    done, calls = submit_scaling(tmp_path, **setting)
    assert (done.returncode, calls) == (2, [])
    assert done.stderr.strip() == message


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("noise_sweep.sh", "noise_sweep.sh: submit it as an array job: sbatch slurm/noise_sweep.sh"),
        ("table1.sh", "table1.sh: no slurm/launch.sh in MPI_FNAS_HOME="),
        ("scaling.sh", "scaling.sh: no slurm/launch.sh in MPI_FNAS_HOME="),
    ],
)
def test_script_started_the_wrong_way_is_bad_input(script, message, spooled, tmp_path):
    """`bash slurm/noise_sweep.sh` (not an array task) and `sbatch slurm/table1.sh` (a spooled copy, no
    MPI_FNAS_HOME): one line, exit 2."""
    done, _ = spooled(SLURM_DIR / script, cwd=tmp_path, direct=script == "noise_sweep.sh")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith(message) and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fnas"], "usage: launch.sh [MODE PARTIES], got 1 arguments: fnas"),
        (["nas", "2"], "MODE must be vanilla, fnas or dpfnas, got 'nas'"),
        (["fnas", "0"], "PARTIES must be a positive whole number, got '0'"),
        (["fnas", "2x"], "PARTIES must be a positive whole number, got '2x'"),
    ],
)
def test_launch_rejects_bad_mode_or_parties(args, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MPI_FNAS_"))}
    done = subprocess.run(
        ["bash", str(SLURM_DIR / "launch.sh"), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith(f"launch.sh: error: {message}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


BASH_SUBMITTERS = ("table1.sh", "scaling.sh")  # run with bash: they submit array jobs of themselves


def test_docs_submit_each_script_the_way_it_runs():
    """The commands in the docs' code blocks: table1.sh and scaling.sh are run with bash (they submit the array
    jobs); every other script is submitted with sbatch (`bash slurm/noise_sweep.sh` exits 2)."""
    commands = []
    for doc in (REPO / "docs" / "hpc.md", REPO / "containers" / "README.md"):
        for block in re.findall(r"^```\w*\n(.*?)^```", doc.read_text(), flags=re.M | re.S):
            commands += re.findall(r"\b(bash|sbatch)\s+(?:\S+/)?slurm/(\w+\.sh)", block)
    assert ("sbatch", "noise_sweep.sh") in commands and ("bash", "table1.sh") in commands, commands
    assert ("bash", "scaling.sh") in commands, commands
    for verb, script in commands:
        assert (verb == "bash") == (script in BASH_SUBMITTERS), f"{verb} slurm/{script}"


def test_launch_outside_slurm_forwards_usr1_through_mpirun(tmp_path):
    """Without Slurm: mpirun starts the ranks, SIGUSR1 to launch.sh reaches every rank, and the run's 75 is
    passed on (no scontrol outside a job)."""
    module_dir, records, config = tmp_path / "module", tmp_path / "records", tmp_path / "tiny.yaml"
    module_dir.mkdir()
    (module_dir / "stand_in_run.py").write_text(STAND_IN)
    config.write_text("seed: 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))}
    env.update(
        PYTHONPATH=str(module_dir), MPI_FNAS_MODULE="stand_in_run", FAKE_RUN_RECORDS=str(records),
        FAKE_RUN_BEHAVIOUR="checkpoint-on-signal", CONFIG=str(config), RUN_DIR=str(tmp_path / "run"),
        MPI_FNAS_LAUNCHER="mpirun", NTASKS="3", MPI_FNAS_HOME=str(REPO),
    )  # fmt: skip
    with subprocess.Popen(
        ["bash", str(SLURM_DIR / "launch.sh")], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as launch:
        try:
            wait_for_records(records, "nojob", 0, 3)
            launch.send_signal(signal.SIGUSR1)
            _, stderr = launch.communicate(timeout=60)
        finally:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGKILL)
    assert launch.returncode == EXIT_INTERRUPTED, stderr
    assert [r["signals"] for r in load_records(records, "nojob", 0)] == [["SIGUSR1"]] * 3
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    assert "got SIGUSR1" in stderr


# --- under the loopback cluster ----------------------------------------------------------------------------------


@pytest.fixture
def stand_in(tmp_path):
    """Submit environment with the stand-in module on PYTHONPATH; returns (env, records dir, config path)."""
    module_dir = tmp_path / "module"
    module_dir.mkdir()
    (module_dir / "stand_in_run.py").write_text(STAND_IN)
    config = tmp_path / "tiny.yaml"
    config.write_text("seed: 0\n")
    records = tmp_path / "records"

    def env(slurm_cluster, **extra: str | None) -> dict[str, str]:  # noqa: F811
        """The submit environment; a None value removes that variable. Thread/HDF5 settings are dropped so
        the job shows what launch.sh itself sets."""
        base = {k: v for k, v in slurm_cluster.env.items() if k not in ("OMP_NUM_THREADS", "HDF5_USE_FILE_LOCKING")}
        base.update(PYTHONPATH=str(module_dir), MPI_FNAS_MODULE="stand_in_run")
        base.update(FAKE_RUN_RECORDS=str(records), CONFIG=str(config))
        base.update(extra)
        return {k: v for k, v in base.items() if v is not None}

    return env, records, config


def job_output(slurm_cluster, job: int) -> str:  # noqa: F811
    path = Path(slurm_cluster.job_info(job)["StdOut"])
    return path.read_text() if path.exists() else "<no output file>"


def submit_and_wait(slurm_cluster, stand_in, cwd: Path, script: str,  # noqa: F811
                    **extra: str | None) -> tuple[int, dict[str, str]]:
    """Submit slurm/`script` from `cwd` in the stand-in's environment changed by `extra`, and wait for it to end;
    returns (job id, its scontrol record)."""
    env, _, _ = stand_in
    job = slurm_cluster.sbatch("--wait", str(SLURM_DIR / script), env=env(slurm_cluster, **extra), cwd=cwd)
    return job, slurm_cluster.job_info(job)


slurm = pytest.mark.slurm


@slurm
def test_dpfnas_8_starts_nine_ranks_with_eight_gpus(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    _, records, config = stand_in
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    job, info = submit_and_wait(slurm_cluster, stand_in, submit_dir, "dpfnas_8.sh", EXTRA_ARGS="--set search.epochs=1")
    assert info["JobState"] == "COMPLETED", job_output(slurm_cluster, job)
    ranks = load_records(records, job, 0)
    assert [r["rank"] for r in ranks] == list(range(9))
    run_dir = submit_dir / "runs" / f"dpfnas_8-{job}"  # default RUN_DIR: <submit dir>/runs/<job name>-<id>
    expected_argv = [
        "--config", str(config), "--out", str(run_dir),
        "--set", "federation.parties=8", "--set", "search.epochs=1",
    ]  # fmt: skip
    for record in ranks:
        assert record["argv"] == expected_argv
        assert record["env"]["SLURM_GPUS"] == "8"
        assert record["env"]["HDF5_USE_FILE_LOCKING"] == "FALSE"
        assert record["env"]["OMP_NUM_THREADS"] == "1"
        assert record["cwd"] == str(submit_dir)
    # The output file is named by job name and id (--output=slurm-%x-%j.out) in the submit dir.
    assert (submit_dir / f"slurm-dpfnas_8-{job}.out").exists()


def submit_checkpointing_job(slurm_cluster, stand_in, tmp_path: Path, script: str,  # noqa: F811
                             ranks: int) -> tuple[int, Path]:
    """Submit slurm/`script` (RUN_DIR tmp_path/run) with a stand-in run that checkpoints and exits 75 when asked to
    stop; returns (job id, run dir) once all `ranks` ranks of its first attempt are running."""
    env, records, _ = stand_in
    run_dir = tmp_path / "run"
    job = slurm_cluster.sbatch(
        str(SLURM_DIR / script),
        env=env(slurm_cluster, RUN_DIR=str(run_dir), FAKE_RUN_BEHAVIOUR="checkpoint-on-signal"),
        cwd=tmp_path,
    )
    wait_for_records(records, job, 0, ranks)
    return job, run_dir


def completed_after_one_requeue(slurm_cluster, job: int) -> str:  # noqa: F811
    """Waits for `job` to end, checks that it completed after exactly one requeue, and returns its output."""
    info = slurm_cluster.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
    output = job_output(slurm_cluster, job)
    assert info["JobState"] == "COMPLETED", output
    assert info["Restarts"] == "1", info
    return output


@slurm
def test_usr1_is_forwarded_then_job_requeues_and_resumes(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    _, records, config = stand_in
    job, run_dir = submit_checkpointing_job(slurm_cluster, stand_in, tmp_path, "dpfnas_8.sh", 9)
    # What an attempt SIGKILLed inside MPI leaves behind: segments named by this job's steps 0 and 1 (the run's
    # step in a first and in a restarted attempt). The restart must remove them, and nothing else.
    stale = [mpich_segment(f"{job}.0"), mpich_segment(f"{job}.1", node=1)]
    unrelated = mpich_segment(f"{job}.7")
    try:
        for path in [*stale, unrelated]:
            path.write_bytes(b"stale")
        # What --signal=B:USR1@120 does before the time limit: SIGUSR1 to the batch shell only.
        slurm_cluster.run("scancel", "--batch", "--signal=USR1", str(job))
        output = completed_after_one_requeue(slurm_cluster, job)
        assert [p.exists() for p in stale] == [False, False]
        assert unrelated.exists()
    finally:
        for path in [*stale, unrelated]:
            path.unlink(missing_ok=True)
    assert "removing stale MPICH segments" in output, output
    first = load_records(records, job, 0)
    assert [r["signals"] for r in first] == [["SIGUSR1"]] * 9, output  # every rank got it, through srun
    assert all("--out" in r["argv"] for r in first)
    second = load_records(records, job, 1)
    assert [r["rank"] for r in second] == list(range(9))
    for record in second:
        assert record["env"]["SLURM_RESTART_COUNT"] == "1"
        assert record["argv"][:4] == ["--config", str(config), "--resume", str(run_dir)]
        assert "--out" not in record["argv"]
    assert (run_dir / "checkpoint.pt").exists()
    assert f"requeueing job {job}" in output
    # --open-mode=append: the first attempt's log survives the requeue.
    assert output.count("launch.sh: job") == 2, output


@slurm
def test_scontrol_requeue_from_outside_is_not_requeued_twice(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    """`scontrol requeue` (or preemption in REQUEUE mode) sends SIGTERM to the whole job and has already requeued
    it: the run still checkpoints (exit 75), the script's own requeue is refused, and the script must see that
    the job is requeued instead of reporting a failure; the job comes back exactly once."""
    _, records, _ = stand_in
    job, run_dir = submit_checkpointing_job(slurm_cluster, stand_in, tmp_path, "fnas_2.sh", 3)
    slurm_cluster.run("scontrol", "requeue", str(job))
    output = completed_after_one_requeue(slurm_cluster, job)
    assert all(r["signals"] for r in load_records(records, job, 0)), output  # every rank was asked to stop
    assert (run_dir / "checkpoint.pt").exists()
    assert f"job {job} was already requeued by Slurm (restart 1)" in output, output
    assert "scontrol requeue failed" not in output
    assert [r["argv"][2:4] for r in load_records(records, job, 1)] == [["--resume", str(run_dir)]] * 3


@slurm
def test_checkpoint_in_run_dir_means_resume_and_relative_config_resolves(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    """A fresh job (no restart) whose RUN_DIR already holds a checkpoint resumes it; the wrapper's default
    relative CONFIG, absent from the submit dir, resolves to the repository's file."""
    _, records, _ = stand_in
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_text("earlier attempt")
    job, info = submit_and_wait(slurm_cluster, stand_in, tmp_path, "fnas_1.sh", CONFIG=None, RUN_DIR=str(run_dir))
    assert info["JobState"] == "COMPLETED", job_output(slurm_cluster, job)
    ranks = load_records(records, job, 0)
    assert len(ranks) == 2
    for record in ranks:
        assert record["argv"] == [
            "--config", str(REPO / "configs" / "fnas.yaml"), "--resume", str(run_dir), "--set", "federation.parties=1",
        ]  # fmt: skip


@slurm
def test_relative_submission_with_chdir_finds_the_repository(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    """`cd repo/tests && sbatch --chdir=<elsewhere> ../slurm/fnas_2.sh`: the job runs a spooled copy in another
    directory, and Slurm's Command= is the relative path as typed; the wrapper still finds launch.sh."""
    env, records, config = stand_in
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    run_dir = tmp_path / "run"
    job = slurm_cluster.sbatch(
        "--wait", f"--chdir={workdir}", "../slurm/fnas_2.sh",
        env=env(slurm_cluster, RUN_DIR=str(run_dir)), cwd=REPO / "tests",
    )  # fmt: skip
    info = slurm_cluster.job_info(job)
    assert info["Command"] == "../slurm/fnas_2.sh", info
    assert info["JobState"] == "COMPLETED", job_output(slurm_cluster, job)
    ranks = load_records(records, job, 0)
    assert [r["cwd"] for r in ranks] == [str(workdir)] * 3
    for record in ranks:
        assert record["argv"] == ["--config", str(config), "--out", str(run_dir), "--set", "federation.parties=2"]


@slurm
def test_failure_exit_code_is_kept_and_not_requeued(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    _, records, _ = stand_in
    job, info = submit_and_wait(slurm_cluster, stand_in, tmp_path, "fnas_1.sh", FAKE_RUN_BEHAVIOUR="exit:3")
    assert info["JobState"] == "FAILED", info
    assert info["ExitCode"] == "3:0", info
    assert info["Restarts"] == "0", info
    assert len(load_records(records, job, 0)) == 2


@slurm
def test_mpirun_launcher_inside_the_allocation(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    _, records, _ = stand_in
    job, info = submit_and_wait(slurm_cluster, stand_in, tmp_path, "fnas_2.sh", MPI_FNAS_LAUNCHER="mpirun")
    assert info["JobState"] == "COMPLETED", job_output(slurm_cluster, job)
    ranks = load_records(records, job, 0)
    assert [r["env"]["PMI_RANK"] for r in ranks] == ["0", "1", "2"]
    assert ".venv/bin/mpirun -n 3" in job_output(slurm_cluster, job)


def wait_until_no_jobs(slurm_cluster, timeout: float = 120.0) -> None:  # noqa: F811
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.strip():
            return
        time.sleep(0.5)
    raise AssertionError("jobs still queued: " + slurm_cluster.run("squeue").stdout)


@slurm
def test_table1_submits_one_sized_array_per_setting(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    env, records, _ = stand_in
    root = tmp_path / "table1"
    configs = {f"CONFIG_{mode.upper()}": str(tmp_path / f"{mode}.yaml") for mode in ("vanilla", "dpfnas")}
    for path in configs.values():
        Path(path).write_text("seed: 0\n")
    done = subprocess.run(
        ["bash", str(SLURM_DIR / "table1.sh")],
        env=env(slurm_cluster, TABLE1_SETTINGS="vanilla:1 dpfnas:2", SEEDS="3 4", TABLE1_ROOT=str(root), **configs),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"-> array job \d+", done.stdout)) == 2, done.stdout
    wait_until_no_jobs(slurm_cluster)
    seen = {}
    for job_dir in records.iterdir():
        ranks = load_records(records, int(job_dir.name), 0)
        argv = ranks[0]["argv"]
        run_dir = Path(argv[argv.index("--out") + 1])
        seen[run_dir.name] = (len(ranks), ranks[0]["env"]["SLURM_GPUS"], argv)
    assert sorted(seen) == ["dpfnas-K2-seed3", "dpfnas-K2-seed4", "vanilla-K1-seed3", "vanilla-K1-seed4"]
    for name, (nranks, gpus, argv) in seen.items():
        mode, k, seed = re.fullmatch(r"(\w+)-K(\d)-seed(\d)", name).groups()
        assert (nranks, gpus) == (int(k) + 1, k), name
        assert argv[:2] == ["--config", configs[f"CONFIG_{mode.upper()}"]]
        assert argv[argv.index("--out") + 1] == str(root / name)
        assert argv[4:] == ["--set", f"federation.parties={k}", "--set", f"seed={seed}"]


@slurm
def test_noise_sweep_maps_array_tasks_to_variance_and_seed(slurm_cluster, stand_in, tmp_path):  # noqa: F811
    env, records, _ = stand_in
    # Tasks 1 and 6 of 6 variances x 2 seeds: variance 1 with seed 5, variance 0.5 with seed 6.
    slurm_cluster.sbatch(
        "--array=1,6",
        str(SLURM_DIR / "noise_sweep.sh"),
        env=env(slurm_cluster, SEEDS="5 6", RUN_ROOT=str(tmp_path / "sweep")),
        cwd=tmp_path,
    )
    wait_until_no_jobs(slurm_cluster)
    argvs = {}
    for job_dir in records.iterdir():
        ranks = load_records(records, int(job_dir.name), 0)
        assert len(ranks) == 5 and ranks[0]["env"]["SLURM_GPUS"] == "4"
        argv = ranks[0]["argv"]
        argvs[Path(argv[argv.index("--out") + 1]).name] = argv
    assert sorted(argvs) == ["var0.5-seed6", "var1-seed5"]
    for name, seed, sigma in (("var0.5-seed6", 6, f"{math.sqrt(0.5):.12g}"), ("var1-seed5", 5, "1")):
        assert argvs[name][4:] == [
            "--set", "federation.parties=4", "--set", f"seed={seed}",
            "--set", f"privacy.noise_multiplier_w={sigma}", "--set", f"privacy.noise_multiplier_a={sigma}",
        ]  # fmt: skip
