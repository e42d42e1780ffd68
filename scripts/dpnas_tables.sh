#!/usr/bin/env bash
# Regenerates the tables of docs/dpnas.md (issue 11): two of DPNAS' findings (Cheng et al. 2021) measured on the
# DPNAS space (space.kind: dpnas, 5 nodes, stages 8/16/32) on synthetic-shapes (16x16), small and short enough for a
# 2-core VM. Every trained network is trained the same way: augmentation only (a given genotype, no search), DP
# (mode dpfnas) with ONE party holding all the data (plain DP-SGD, as the paper trains), σ calibrated so that
# ε = $EPSILON at δ = 1e-5 (privacy.target_epsilon), the run's own test split.
#   1. The activation and pooling finding (paper Tables 6 and 7): the paper's CIFAR-10 cell (Fig. 4c, as released)
#      with every conv's activation replaced by one activation (act-<name>), as published (cell-dpnasnet: its max
#      pools), and with every max pool replaced by an average pool (pool-avg).
#   2. DP-aware search (paper Fig. 3b): search with DP-FNAS and with FNAS (K = 4 parties, the same seeds and steps;
#      search-<mode>), then train both found cells under the same DP budget (train-<mode>).
#   scripts/dpnas_tables.sh [OUT_DIR]        (default runs/dpnas-tables)
#   scripts/dpnas_tables.sh --summarize OUT_DIR
# Each run writes OUT_DIR/<arm>-seed<s>/search.h5; a run whose log exists is skipped, so an interrupted table is
# finished by running the script again. The tables (markdown: mean ± std over seeds, the paper's value, the verdict;
# the op histograms of the found cells) are printed at the end from the logs alone.
# Environment: PYTHON, MPIRUN (default: the project's .venv), SEEDS (default "0 1 2"), JOBS (runs at a time,
# default 2), EPSILON (default 3).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}
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
                      ("act-selu", "act-tanh")):
    print(f"| {better[4:]}-only > {worse[4:]}-only | {verdict(better, worse)} |")
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
print("| search | seeds | found cell trained under DP: test acc %, mean ± std | per seed | ε of training | "
      "ε of the DP search (worst party) | search wall, mean |")
print("|---|---|---|---|---|---|---|")
for mode in ("dpfnas", "fnas"):
    searches = runs.get(f"search-{mode}", [])
    search_eps = [r["search_eps"] for r in searches if "search_eps" in r]
    eps_text = f"{np.mean(search_eps):.2f}" if search_eps else "— (not private)"
    wall = f"{np.mean([r['wall'] for r in searches]):.0f} s" if searches else "—"
    print(f"| {mode} | {stats(f'train-{mode}')[2]} | {cell(f'train-{mode}')} | {eps_text} | {wall} |")
print(f"\nDP search finds a better cell for DP training (paper Fig. 3b): {verdict('train-dpfnas', 'train-fnas')}")

print("\n#### Op histogram of the found cells (edges per op, summed over seeds; 15 edges per cell)\n")
print("| op | " + " | ".join(f"{mode} search" for mode in ("dpfnas", "fnas")) + " |")
print("|---|---|---|")
counts = {mode: {op: 0 for op in PRIMITIVES} for mode in ("dpfnas", "fnas")}
for mode in counts:
    for r in runs.get(f"search-{mode}", []):
        for op, n in DpnasGenotype.from_string(r["genotype"]).op_counts().items():
            counts[mode][op] += n
for op in PRIMITIVES:
    print(f"| {op} | {counts['dpfnas'][op]} | {counts['fnas'][op]} |")
negative = ("conv_3x3_selu", "conv_3x3_tanh", "conv_3x3_linear", "conv_3x3_hardtanh")
for mode in counts:
    convs = sum(n for op, n in counts[mode].items() if op.startswith("conv_3x3_"))
    keep = sum(counts[mode][op] for op in negative)
    share = f"{100 * keep / convs:.0f} %" if convs else "n/a"
    print(f"\n{mode} search: {keep} of {convs} conv edges ({share}) use an activation that keeps negative values "
          "(SELU, Tanh, linear, Hardtanh; not ReLU, Sigmoid)", end="")
print("\n\nFound cells:")
for mode in counts:
    for r in sorted(runs.get(f"search-{mode}", []), key=lambda r: r["seed"]):
        print(f"- {mode}, seed {r['seed']}: `{r['genotype']}`")
EOF
}

if [ "${1:-}" = "--summarize" ]; then summarize "${2:?usage: dpnas_tables.sh --summarize OUT_DIR}"; exit 0; fi
out=${1:-runs/dpnas-tables}
mkdir -p "$out"

# The paper's CIFAR-10 cell (Fig. 4c) as the authors released it, in our string form (docs/dpnas.md).
dpnasnet="dpnas=conv_3x3_selu@0|max_pool_3x3@0,conv_3x3_selu@1|conv_3x3_tanh@0,max_pool_3x3@1,none@2|\
conv_3x3_selu@0,none@1,none@2,skip_connect@3|conv_3x3_selu@0,conv_3x3_selu@1,conv_3x3_tanh@2,max_pool_3x3@3,\
conv_3x3_tanh@4"
space=(space.kind=dpnas space.nodes=5 "space.stage_channels=[8, 16, 32]" data.image_size=16
       runtime.threads_per_rank=1 runtime.progress=off checkpoint.every_steps=0)
# Training under DP, one party: plain DP-SGD on 16,000 examples (its train and validation shards), B = 256.
train=("${space[@]}" mode=dpfnas federation.parties=1 data.train_size=16000 augment.epochs=3 augment.batch_size=256
       augment.lr=0.5 augment.clip=1.0 augment.weight_decay=0 privacy.delta=1e-5 privacy.target_epsilon="$epsilon")
# The searches: K = 4 parties, 8,000 examples each (4,000 train + 4,000 validation), 4 epochs of 10 steps.
search=("${space[@]}" data.train_size=32000 federation.parties=4 search.epochs=4 search.steps_per_epoch=10
        search.batch_size=16 augment.epochs=0 privacy.delta=1e-5)

run() {  # run DIR RANKS KEY=VALUE...: one job in the background (at most $jobs at a time)
  local dir=$out/$1; local ranks=$2; shift 2
  if [ -e "$dir/search.h5" ]; then echo "exists, skipped: $dir"; return; fi
  local sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  ( "$mpirun" -n "$ranks" "$python" -m mpi_fnas.run --out "$dir" "${sets[@]}" > "$dir.out" 2>&1 \
      || echo "FAILED (exit $?): $dir, see $dir.out" ) &
}

for s in "${seeds[@]}"; do   # experiment 2's searches first: their cells are trained below
  for mode in dpfnas fnas; do run "search-$mode-seed$s" 5 "${search[@]}" seed="$s" mode="$mode"; done
done
for s in "${seeds[@]}"; do   # experiment 1
  for act in selu relu tanh sigmoid linear hardtanh; do
    run "act-$act-seed$s" 2 "${train[@]}" seed="$s" \
      augment.genotype="$(sed -E "s/conv_3x3_[a-z]+/conv_3x3_$act/g" <<< "$dpnasnet")"
  done
  run "cell-dpnasnet-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="$dpnasnet"
  run "pool-avg-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="${dpnasnet//max_pool_3x3/avg_pool_3x3}"
done
wait
for s in "${seeds[@]}"; do   # experiment 2's trainings: the found cells, as experiment 1 trains
  for mode in dpfnas fnas; do
    log=$out/search-$mode-seed$s/search.h5
    found=$("$python" -c "import sys; from mpi_fnas.runlog import read_run; print(read_run(sys.argv[1])['final_genotype'])" "$log")
    run "train-$mode-seed$s" 2 "${train[@]}" seed="$s" augment.genotype="$found"
  done
done
wait
summarize "$out"
