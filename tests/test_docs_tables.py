"""A user page's tables say how things are now: a measured table on README.md or docs/*.md (not docs/log/) is
generated from the runs' summaries, never typed.

A Markdown table row with a cell that reads "± <number>" (a mean ± its spread over seeds: a measurement) may stand
only inside a block that ``python -m mpi_fnas.report.results write`` writes (``<!-- results: … -->`` …
``<!-- /results -->``, ``<!-- tuning: … -->`` … ``<!-- /tuning -->``) or in a fenced code block. A typed
measurement goes, dated, to docs/log/benchmarks.md, and the page links to it. A table a page keeps because it is
computed, not measured (the noise sweep's ε, the cost model's cluster-scale table), is recomputed here with the
project's own code.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from mpi_fnas.federation.job_plan import plan_assignments
from mpi_fnas.federation.topology import COLLECTIVE, STAR
from mpi_fnas.privacy.shard_ledger import party_deltas
from mpi_fnas.report.cost_model import Link, StepCosts, predict_step, rank0_link_values, strong_scaling_efficiency
from mpi_fnas.sweep import LogReleases, SweepPoint, load_sweep, point_config
from mpi_fnas.sweep.composition import compose_pool

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "docs" / "log"
USER_PAGES = [ROOT / "README.md",
              *sorted(p for p in (ROOT / "docs").rglob("*.md") if LOG not in p.parents)]

#: (page, section heading) → why a typed "±" row may stay there. Keep it empty where possible.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/report.md", "Example"): "what `python -m mpi_fnas.report` prints for real runs, shown as its output",
}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
OPEN_MARK = re.compile(r"^<!-- (results|tuning): [\w.-]+ -->$")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$")
TABLE_ROW = re.compile(r"^ {0,3}\|")  # four spaces in would be an indented code block
SPREAD = re.compile(r"±\s*\d")  # a number's spread; a header's "mean ± SE" names a column and measures nothing


def typed_rows(text: str) -> list[tuple[int, str, str]]:
    """(line number, section heading, row) of every table row of `text` with a cell reading "± <number>", outside
    fenced code and outside the generated blocks."""
    found = []
    fence = ""  # the open fence's characters, "" outside code
    mark = ""  # the open generated block's kind, "" outside one
    section = ""
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = ""
            continue
        if opening:
            fence = opening.group(1)
            continue
        if mark:
            mark = "" if line.strip() == f"<!-- /{mark} -->" else mark
            continue
        if (marked := OPEN_MARK.match(line.strip())) is not None:
            mark = marked.group(1)
            continue
        if (heading := HEADING.match(line)) is not None:
            section = heading.group(1)
        elif TABLE_ROW.match(line) and any(SPREAD.search(cell) for cell in re.split(r"(?<!\\)\|", line)):
            found.append((number, section, line.strip()))
    return found


def test_the_scan_finds_typed_rows_and_skips_generated_blocks_and_code() -> None:
    text = "\n".join([
        "# Page", "a mean ± SE in prose", "", "| arm | acc, mean ± SE |", "|---|---|", "| a | 0.9 ± 0.1 |",
        "<!-- results: private-28 -->", "| b | 0.8 ± 0.1 |", "<!-- /results -->",
        "<!-- tuning: private-28 -->", "| c | 0.7 ± 0.1 |", "<!-- /tuning -->",
        "```", "| d | 0.6 ± 0.1 |", "```", "~~~~md", "| e | 0.5 ± 0.1 |", "```", "~~~~",
        "    | f | 0.4 ± 0.1 |", "## Later", "| g | 1 | 0.3 ± 0.2 |",
    ])
    assert typed_rows(text) == [(6, "Page", "| a | 0.9 ± 0.1 |"), (22, "Later", "| g | 1 | 0.3 ± 0.2 |")]


def _offences() -> tuple[list[str], set[tuple[str, str]]]:
    """The rows the rule refuses, and the allowances some row used."""
    offences, used = [], set()
    for page in USER_PAGES:
        name = page.relative_to(ROOT).as_posix()
        for number, section, row in typed_rows(page.read_text(encoding="utf-8")):
            if (name, section) in ALLOWED:
                used.add((name, section))
            else:
                offences.append(f"{name}:{number} ({section}): {row[:100]}")
    return offences, used


def test_user_pages_hold_no_typed_measured_table() -> None:
    assert len(USER_PAGES) > 10 and not any(LOG in page.parents for page in USER_PAGES)
    offences, _ = _offences()
    assert not offences, ("a measured table on a user page is generated (mpi_fnas.report.results); move these rows, "
                          "dated, to docs/log/benchmarks.md and link to them:\n" + "\n".join(offences))


def test_every_allowance_is_still_needed() -> None:
    _, used = _offences()
    assert set(ALLOWED) <= used, f"allowances no row needs any more: {sorted(set(ALLOWED) - used)}"


# --- the noise sweep's ε on docs/benchmarks.md: computed, so recomputed ------------------------------------------

SWEEP_CONFIG = ROOT / "configs" / "dpfnas_noise_sweep.yaml"


def _printed_sweep_epsilons() -> tuple[list[str], list[str]]:
    """The header cells and the ε cells of the table "What the shipped configs/dpfnas_noise_sweep.yaml spends"."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    header = re.search(r"^\| σ² \| (.+) \|$\n^\|[-|]+\|$\n^\| ε \| (.+) \|$", text, re.M)
    assert header is not None, "docs/benchmarks.md: the sweep's ε table is gone or changed shape"
    return header.group(1).split(" | "), header.group(2).split(" | ")


@functools.cache
def _shard_sizes(seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every party's (train sizes, validation sizes) as the sweep's plan gives them at `seed` (σ does not enter)."""
    cfg = point_config(load_sweep(SWEEP_CONFIG)[0], SweepPoint(1.0, seed))
    assignments = plan_assignments(cfg, cfg.federation.parties)
    return tuple(len(a.train_indices) for a in assignments), tuple(len(a.val_indices) for a in assignments)


def _releases(variance: float, seed: int, pool: str) -> LogReleases:
    """What one point of the shipped sweep releases, as its log would record it: the config's σ, each party's
    sample rates from its planned shards, its default δ, every planned step charged."""
    cfg = point_config(load_sweep(SWEEP_CONFIG)[0], SweepPoint(variance, seed))
    train, val = _shard_sizes(seed)
    k, batch, steps = len(train), cfg.search.batch_size, cfg.search.epochs * cfg.search.steps_per_epoch
    noise = cfg.privacy
    return LogReleases(
        log=f"var{variance:g}-seed{seed}/search.h5", data_pool=pool, placement=f"seed {seed}",
        sample_rate_train=tuple(batch / n for n in train), sample_rate_val=tuple(batch / n for n in val),
        noise_multiplier_w=(noise.noise_multiplier_w,) * k, noise_multiplier_a=(noise.noise_multiplier_a,) * k,
        delta=tuple(party_deltas(train, val, cfg.privacy.delta)), releases=(steps,) * k, exact=True)


def test_the_noise_sweeps_epsilon_table_is_what_the_accountant_gives() -> None:
    """Every printed ε agrees with mpi_fnas.sweep's own composition to the digits printed: one run alone per
    variance, one seed's six variances composed, and all 18 points composed as if the seeds re-partitioned one
    dataset (the worst case over placements). About 10 s of CPU: the PLD compositions."""
    base, spec = load_sweep(SWEEP_CONFIG)
    assert base.search.w_optimizer == "sgd"  # one W release per step, as the LogReleases above say
    heads, printed = _printed_sweep_epsilons()
    variances = [float(head) for head in heads[:-2]]
    assert tuple(variances) == spec.variances and len(spec.seeds) == 3, "the table's columns follow the config"
    seed = spec.seeds[0]
    computed = [compose_pool("one point", [_releases(v, seed, "one point")]).epsilon for v in variances]
    computed.append(compose_pool("one seed", [_releases(v, seed, "one seed") for v in variances]).epsilon)
    every_point = [_releases(v, s, "cifar10") for v in variances for s in spec.seeds]
    computed.append(compose_pool("cifar10", every_point).epsilon)
    for head, text, value in zip(heads, printed, computed, strict=True):
        assert agrees(text, value), f"σ² {head}: printed {text}, computed {value:.4f}"


# --- the cost model's cluster-scale figures on docs/hpc.md: computed, so recomputed -----------------------------

HPC = ROOT / "docs" / "hpc.md"
SCALING_HEADER = ("| K | star: step (s) | star: values on rank 0's link | star: efficiency | collective: step (s) | "
                  "collective: values on rank 0's link | collective: efficiency |")
#: The inputs the page states, not the model's: a GPU party's step (no GPU was measured) and the CPU party's private
#: step the bench measured on this machine, both in seconds.
STATED_GPU_STEP, MEASURED_CPU_STEP = 0.05, 0.355


def printed_scaling_rows(text: str) -> list[list[str]]:
    """The cells of every body row of `text`'s table under SCALING_HEADER ("Modelled at cluster scale")."""
    lines = text.splitlines()
    assert SCALING_HEADER in lines, "docs/hpc.md: the cluster-scale table is gone or its header changed"
    rows = []
    for line in lines[lines.index(SCALING_HEADER) + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def agrees(printed: str, value: float) -> bool:
    """`value` rounds to `printed` (a number with optional thousands commas): within half its last printed digit."""
    number = printed.replace(",", "")
    return abs(value - float(number)) <= 0.5 * 10 ** -len(number.partition(".")[2]) + 1e-9


@functools.cache
def _darts_default_sizes() -> tuple[int, int]:
    """(n_W, n_A) of configs/darts_default.yaml's supernet, as the scaling study counts a run's releases."""
    from mpi_fnas.config import load_config
    from mpi_fnas.scaling.sizes import release_sizes

    return release_sizes(load_config(ROOT / "configs" / "darts_default.yaml").to_yaml())


def scaling_mismatches(rows: list[list[str]], costs: StepCosts, link: Link) -> list[str]:
    """Each printed cell of `rows` that the cost model does not give, under secure aggregation, a core per rank."""
    bad = []
    for k, *cells in rows:
        computed = []
        for exchange in (STAR, COLLECTIVE):
            step = predict_step(costs, int(k), link, int(k) + 1, exchange, secure=True).total
            computed += [step, rank0_link_values(costs.num_w, costs.num_a, int(k), exchange, secure=True),
                         strong_scaling_efficiency(costs, int(k), link, exchange, secure=True)]
        bad += [f"K = {k}, column {column + 2}: printed {text}, computed {value:,.4f}"
                for column, (text, value) in enumerate(zip(cells, computed, strict=True)) if not agrees(text, value)]
    return bad


def test_the_cluster_scale_table_is_what_the_cost_model_gives() -> None:
    """Every cell of docs/hpc.md's "Modelled at cluster scale" table agrees, to the digits printed, with
    mpi_fnas.report.cost_model at the inputs the page states: rank 0's link at 10 Gbit/s, secure aggregation, a core
    or GPU per rank, configs/darts_default.yaml's network, and a party step of 0.05 s that is stated, not measured.
    The page's n_W + n_A is recounted from the config's supernet."""
    text = HPC.read_text(encoding="utf-8")
    num_w, num_a = _darts_default_sizes()
    assert f"n_W = {num_w:,} weights, n_A = {num_a} architecture values" in text
    assert f"n_W + n_A = {num_w + num_a:,} values" in text
    rows = printed_scaling_rows(text)
    assert [int(row[0]) for row in rows] == [8, 32, 64, 128, 256, 512, 1024]
    costs = StepCosts(STATED_GPU_STEP, server_seconds=0.0, message_seconds=0.0, num_w=num_w, num_a=num_a)
    assert not (bad := scaling_mismatches(rows, costs, Link.parse("10gbit"))), "\n".join(bad)


def test_the_cost_models_figures_around_it_are_what_it_gives() -> None:
    """The prose's model figures on docs/hpc.md, from the CPU party's private step the bench measured there (0.355 s,
    an input, stated on the page): K = 8's efficiency in the star at 1 Gbit/s, 100 and 15 Mbit/s; K = 8's step at
    100 Mbit/s in the star and with collectives; and that this step makes every efficiency of the table higher."""
    text = " ".join(HPC.read_text(encoding="utf-8").split())  # sentences wrap across lines
    num_w, num_a = _darts_default_sizes()
    cpu = StepCosts(MEASURED_CPU_STEP, server_seconds=0.0, message_seconds=0.0, num_w=num_w, num_a=num_a)
    assert f"t_step {MEASURED_CPU_STEP} s" in text and f"{MEASURED_CPU_STEP} s here for the private step" in text
    efficiencies = re.search(r"the model gives (\d+) % at K = 8 on 1 Gbit/s, (\d+) % on 100 Mbit/s and (\d+) % on "
                             r"15 Mbit/s", text)
    assert efficiencies is not None, "docs/hpc.md: the strong-scaling sentence changed shape"
    for printed, rate in zip(efficiencies.groups(), ("1gbit", "100mbit", "15mbit"), strict=True):
        value = 100 * strong_scaling_efficiency(cpu, 8, Link.parse(rate))
        assert agrees(printed, value), f"{rate}: printed {printed} %, computed {value:.2f} %"
    steps = re.search(r"K = 8 a step of ([\d.]+) s in the star and ([\d.]+) s with collectives", text)
    assert steps is not None, "docs/hpc.md: the 100 Mbit/s step sentence changed shape"
    for printed, exchange in zip(steps.groups(), (STAR, COLLECTIVE), strict=True):
        value = predict_step(cpu, 8, Link.parse("100mbit"), 9, exchange, secure=True).total
        assert agrees(printed, value), f"{exchange}: printed {printed} s, computed {value:.4f} s"
    gpu = StepCosts(STATED_GPU_STEP, server_seconds=0.0, message_seconds=0.0, num_w=num_w, num_a=num_a)
    for k in (8, 32, 64, 128, 256, 512, 1024):
        for exchange in (STAR, COLLECTIVE):
            assert (strong_scaling_efficiency(cpu, k, Link.parse("10gbit"), exchange, secure=True)
                    > strong_scaling_efficiency(gpu, k, Link.parse("10gbit"), exchange, secure=True))
