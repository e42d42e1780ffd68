#!/usr/bin/env bash
# Regenerates the DPNAS tables (docs/dpnas.md says how; the last measurement is in docs/log/benchmarks.md):
# two of DPNAS' findings (Cheng et al. 2021) measured on the
# DPNAS space (space.kind: dpnas, 5 nodes, stages 8/16/32) on synthetic-shapes (16x16), small and short enough for a
# 2-core VM. Every trained network is trained the same way: augmentation only (a given genotype, no search), DP
# (mode dpfnas) with ONE party holding all the data (plain DP-SGD, as the paper trains), σ calibrated so that
# ε = $EPSILON at δ = 1e-5 (privacy.target_epsilon), the run's own test split.
#   1. The activation and pooling finding (paper Tables 6 and 7): the paper's CIFAR-10 cell (Fig. 4c, as released)
#      with every conv's activation replaced by one activation (act-<name>), as published (cell-dpnasnet: its max
#      pools), and with every max pool replaced by an average pool (pool-avg).
#   2. DP-aware search (paper Fig. 3b): search with DP-FNAS and with FNAS (K = 4 parties, the same seeds and steps;
#      search-<mode>), then train both found cells under the same DP budget (train-<mode>; a cell cut off from its
#      input is not trainable and is reported as such), and the argmax of the same alphas without none, every edge
#      kept (train-<mode>-nonone).
#   scripts/dpnas_tables.sh [OUT_DIR]        (default runs/dpnas-tables)
#   scripts/dpnas_tables.sh --summarize OUT_DIR
# Each run writes OUT_DIR/<arm>-seed<s>/search.h5 (its output in <arm>-seed<s>.out, and <arm>-seed<s>.done once it
# succeeded); a done run is skipped and an unfinished one redone, so an interrupted table is finished by running the
# script again. The tables (markdown: mean ± std over seeds, the paper's value, the verdict;
# the op histograms of the found cells) are printed at the end from the logs alone.
# Environment: PYTHON, MPIRUN (default: the project's .venv), SEEDS (default "0 1 2"), JOBS (runs at a time,
# default 2), EPSILON (default 3).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # python, mpirun, DPNASNET, table_args, run_once, run_in_background
read -r -a seeds <<< "${SEEDS:-0 1 2}"
jobs=${JOBS:-2}
epsilon=${EPSILON:-3}

summarize() {
  "$python" - "$1" <<'EOF'
import math
import sys
from pathlib import Path

import numpy as np

from mpi_fnas.runlog import read_run
from mpi_fnas.space.dpnas import PRIMITIVES, DpnasGenotype

root = Path(sys.argv[1])
runs: dict[str, list[dict]] = {}
for log in sorted(root.glob("*-seed*/search.h5")):
    arm, seed = log.parent.name.rsplit("-seed", 1)
    run = read_run(log)
    aug = run["augment"]
    done = run["status"] == "finished" and (arm.startswith("search-") or (aug is not None and aug["status"] == "finished"))
    if not done:
        print(f"skipped (not finished): {log}", file=sys.stderr)
        continue
    row = {"seed": int(seed), "genotype": run["final_genotype"] or (aug["genotype"] if aug else ""),
           "wall": run["cost"]["wall_seconds"] if arm.startswith("search-") else aug["cost"]["wall_seconds"]}
    if aug is not None:
        row.update(acc=float(aug["test_acc"]), params=int(aug["params"]),
                   eps=float(np.max(aug["privacy"]["epsilon"][-1])) if aug["privacy"] is not None else math.nan)
    if run["privacy"] is not None and len(run["privacy"]["epsilon"]):
        row["search_eps"] = float(np.max(run["privacy"]["epsilon"][-1]))
    runs.setdefault(arm, []).append(row)


def stats(arm: str) -> tuple[float, float, int, list[float]]:
    acc = [100 * r["acc"] for r in sorted(runs.get(arm, []), key=lambda r: r["seed"])]
    if not acc:
        return math.nan, math.nan, 0, []
    return float(np.mean(acc)), float(np.std(acc, ddof=1)) if len(acc) > 1 else math.nan, len(acc), acc


def verdict(better: str, worse: str) -> str:
    """'better > worse' in test accuracy: reproduced when the difference of the means exceeds twice its standard
    error (sqrt(s1²/n1 + s2²/n2)), contradicted below minus twice, else within noise."""
    m1, s1, n1, _ = stats(better)
    m2, s2, n2, _ = stats(worse)
    if n1 < 2 or n2 < 2:
        return "n/a (fewer than 2 seeds)"
    diff, se = m1 - m2, math.sqrt(s1**2 / n1 + s2**2 / n2)
    word = "reproduced" if diff > 2 * se else "not reproduced (opposite, beyond 2 SE)" if diff < -2 * se else \
        "not reproduced (within 2 SE)"
    return f"{word}: Δ = {diff:+.1f} pp ± {se:.1f} (SE)"


def cell(arm: str) -> str:
    m, s, n, acc = stats(arm)
    if n == 0:
        return "— | — | —"
    per_seed = " / ".join(f"{a:.1f}" for a in acc)
    eps = np.mean([r["eps"] for r in runs[arm]])
    return f"{m:.1f} ± {s:.1f} | {per_seed} | {eps:.2f}"


print("### Experiment 1: one fixed cell, one activation (or pooling) everywhere, trained under DP\n")
print("| arm | paper (CIFAR-10, ε = 3) | test acc % here, mean ± std | per seed | ε (worst party) |")
print("|---|---|---|---|---|")
paper = {"act-selu": "68.06 (only SELU)", "act-relu": "66.36 (only ReLU)", "act-tanh": "65.31 (only Tanh)",
         "act-sigmoid": "58.09 (only Sigmoid)", "act-linear": "66.81 (only Linear)",
         "act-hardtanh": "64.80 (only Hardtanh)", "cell-dpnasnet": "68.33 (DPNASNet = only MaxPool)",
         "pool-avg": "68.47 (only AvgPool)"}
for arm, value in paper.items():
    print(f"| {arm} | {value} | {cell(arm)} |")
print()
print("| claim (paper) | verdict here |")
print("|---|---|")
for better, worse in (("act-selu", "act-relu"), ("act-relu", "act-tanh"), ("act-tanh", "act-sigmoid"),
                      ("act-selu", "act-tanh"), ("act-selu", "act-linear")):
    print(f"| {better[4:]}-only > {worse[4:]}-only | {verdict(better, worse)} |")
best = max((stats(a)[0], a) for a in paper if a.startswith("act-") and stats(a)[2])
print(f"| selu-only is the best activation | {'reproduced' if best[1] == 'act-selu' else 'not reproduced'}: "
      f"highest mean here is {best[1][4:]} ({best[0]:.1f} %) |")
worst = min((stats(a)[0], a) for a in paper if a.startswith("act-") and stats(a)[2])
print(f"| sigmoid-only is the worst activation | {'reproduced' if worst[1] == 'act-sigmoid' else 'not reproduced'}: "
      f"lowest mean here is {worst[1][4:]} ({worst[0]:.1f} %) |")
m_max, s_max, n_max, _ = stats("cell-dpnasnet")
m_avg, s_avg, n_avg, _ = stats("pool-avg")
if n_max > 1 and n_avg > 1:
    diff, se = m_avg - m_max, math.sqrt(s_max**2 / n_max + s_avg**2 / n_avg)
    word = "reproduced" if abs(diff) <= 2 * se else "not reproduced"
    print(f"| max pool ≈ avg pool on this cell (Table 7: avg − max = +0.14 pp) | {word}: avg − max = {diff:+.1f} pp ± "
          f"{se:.1f} (SE) |")

print("\n### Experiment 2: cells found by DP-FNAS and by FNAS (K = 4), each trained under the same DP budget\n")
searches = {mode: sorted(runs.get(f"search-{mode}", []), key=lambda r: r["seed"]) for mode in ("dpfnas", "fnas")}
for mode, rows in searches.items():
    for r in rows:
        r["cell"] = DpnasGenotype.from_string(r["genotype"])
print("| search | seeds searched | trainable found cells (the space's rule) | found cell trained under DP: test acc %, "
      "mean ± std | per seed | ε of training | argmax without none, trained under DP: test acc % | per seed | "
      "ε of the DP search (worst party) | search wall, mean |")
print("|---|---|---|---|---|---|---|---|---|---|")
for mode, rows in searches.items():
    search_eps = [r["search_eps"] for r in rows if "search_eps" in r]
    eps_text = f"{np.mean(search_eps):.2f}" if search_eps else "— (not private)"
    wall = f"{np.mean([r['wall'] for r in rows]):.0f} s" if rows else "—"
    trainable = sum(r["cell"].connected for r in rows)
    nonone = cell(f"train-{mode}-nonone").rsplit(" | ", 1)[0]
    print(f"| {mode} | {len(rows)} | {trainable} of {len(rows)} | {cell(f'train-{mode}')} | {nonone} | {eps_text} | "
          f"{wall} |")
for mode, rows in searches.items():
    cut = [str(r["seed"]) for r in rows if not r["cell"].connected]
    if cut:
        all_none = all(set(r["cell"].ops) == {"none"} for r in rows if not r["cell"].connected)
        print(f"\n{mode}: the found cell of seed(s) {', '.join(cut)} has no path from its input, so it is not trainable "
              f"(refused){'; every edge is none' if all_none else ''}", end="")
print("\n")
print(f"DP search finds a better cell for DP training (paper Fig. 3b), the space's rule: "
      f"{verdict('train-dpfnas', 'train-fnas')}")
print(f"\nThe same, argmax without none: {verdict('train-dpfnas-nonone', 'train-fnas-nonone')}")

print("\n#### Op histograms of the found cells (edges per op, summed over seeds; 15 edges per cell)\n")
nonone_cells = {mode: [DpnasGenotype.from_string(r["genotype"]) for r in runs.get(f"train-{mode}-nonone", [])]
                for mode in searches}
print("| op | dpfnas: the space's rule | fnas: the space's rule | dpfnas: argmax without none | "
      "fnas: argmax without none | dpfnas: mean softmax weight | fnas: mean softmax weight |")
print("|---|---|---|---|---|---|---|")
counts = {mode: {op: sum(r["cell"].op_counts()[op] for r in rows) for op in PRIMITIVES}
          for mode, rows in searches.items()}
counts_nonone = {mode: {op: sum(c.op_counts()[op] for c in cells) for op in PRIMITIVES}
                 for mode, cells in nonone_cells.items()}
weights = {}
for mode, rows in searches.items():
    finals = [read_run(root / f"search-{mode}-seed{r['seed']}" / "search.h5")["alphas"]["normal"][-1] for r in rows]
    weights[mode] = np.mean(finals, axis=(0, 1)) if finals else np.full(len(PRIMITIVES), np.nan)
for k, op in enumerate(PRIMITIVES):
    print(f"| {op} | {counts['dpfnas'][op]} | {counts['fnas'][op]} | {counts_nonone['dpfnas'][op]} | "
          f"{counts_nonone['fnas'][op]} | {weights['dpfnas'][k]:.3f} | {weights['fnas'][k]:.3f} |")
negative = ("conv_3x3_selu", "conv_3x3_tanh", "conv_3x3_linear", "conv_3x3_hardtanh")
for label, table in (("the space's rule", counts), ("argmax without none", counts_nonone)):
    for mode in searches:
        convs = sum(n for op, n in table[mode].items() if op.startswith("conv_3x3_"))
        keep = sum(table[mode][op] for op in negative)
        share = f"{100 * keep / convs:.0f} %" if convs else "n/a"
        print(f"\n{mode} search, {label}: {keep} of {convs} conv edges ({share}) use an activation that keeps "
              "negative values (SELU, Tanh, linear, Hardtanh; not ReLU, Sigmoid)", end="")
print("\n\nFound cells (the space's rule):")
for mode, rows in searches.items():
    for r in rows:
        print(f"- {mode}, seed {r['seed']}: `{r['genotype']}`")
print("\nArgmax without none:")
for mode in searches:
    for r in sorted(runs.get(f"train-{mode}-nonone", []), key=lambda r: r["seed"]):
        print(f"- {mode}, seed {r['seed']}: `{r['genotype']}`")
EOF
}

table_args dpnas_tables.sh runs/dpnas-tables "$@"

space=(space.kind=dpnas space.nodes=5 "space.stage_channels=[8, 16, 32]" data.image_size=16
       runtime.threads_per_rank=1 runtime.progress=off checkpoint.every_steps=0)
# Training under DP, one party: plain DP-SGD on 8,000 examples (its train and validation shards), expected batch 256,
# 4 epochs (125 steps): short and data-poor enough that the architecture shows (16,000 examples and 3 epochs put the
# published cell at 94 %).
train=("${space[@]}" mode=dpfnas federation.parties=1 data.train_size=8000 augment.epochs=4 augment.batch_size=256
       augment.lr=0.5 augment.clip=1.0 augment.weight_decay=0 privacy.delta=1.0e-5 privacy.target_epsilon="$epsilon")
# The searches: K = 4 parties, 8,000 examples each (4,000 train + 4,000 validation), 6 epochs of 10 steps, the
# architecture's Adam at a_lr 0.01 (instead of 3e-3) so that 60 steps move the alphas visibly.
search=("${space[@]}" data.train_size=32000 federation.parties=4 search.epochs=6 search.steps_per_epoch=10
        search.batch_size=16 search.a_lr=0.01 augment.epochs=0 privacy.delta=1.0e-5)

run() {  # run DIR RANKS KEY=VALUE...: one job in the background (at most $jobs at a time)
  run_in_background "$out/$1" "${@:2}"
}

for s in "${seeds[@]}"; do   # experiment 2's searches first: their cells are trained below
  for mode in dpfnas fnas; do run "search-$mode-seed$s" 5 "${search[@]}" seed="$s" mode="$mode"; done
done
for s in "${seeds[@]}"; do   # experiment 1
  for act in selu relu tanh sigmoid linear hardtanh; do
    run "act-$act-seed$s" 2 "${train[@]}" seed="$s" \
      augment.genotype="$(sed -E "s/conv_3x3_[a-z]+/conv_3x3_$act/g" <<< "$DPNASNET")"
  done
  run "cell-dpnasnet-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="$DPNASNET"
  run "pool-avg-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="${DPNASNET//max_pool_3x3/avg_pool_3x3}"
done
wait
for s in "${seeds[@]}"; do   # experiment 2's trainings: the found cells, as experiment 1 trains
  for mode in dpfnas fnas; do
    log=$out/search-$mode-seed$s/search.h5
    [ -e "$out/search-$mode-seed$s.done" ] || { echo "no finished search: $log"; continue; }
    # The found cell (the space's rule: argmax with none), whether it can be trained, and the same alphas' argmax
    # without none (every edge kept), which compares the two searches' op preferences when the rule cuts a cell off.
    read -r found connected nonone < <("$python" - "$log" <<'PY'
import sys

import numpy as np

from mpi_fnas.runlog import read_run
from mpi_fnas.space.dpnas import PRIMITIVES, DpnasGenotype, derive_dpnas_genotype

run = read_run(sys.argv[1])
found = DpnasGenotype.from_string(run["final_genotype"])
weights = np.array(run["alphas"]["normal"][-1], dtype=np.float64)
weights[:, PRIMITIVES.index("none")] = -1.0  # below every softmax weight: never the argmax
print(found.to_string(), int(found.connected), derive_dpnas_genotype(weights, found.nodes).to_string())
PY
)
    if [ "$connected" = 1 ]; then
      run "train-$mode-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="$found"
    else
      echo "not trainable (no path from the cell input, refused): the cell of $log"
    fi
    run "train-$mode-nonone-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="$nonone"
  done
done
wait
summarize "$out"
