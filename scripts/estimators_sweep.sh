#!/usr/bin/env bash
# The estimator sweep of docs/estimators.md: six arms (GRPO; Dr.GRPO, its baseline without
# the std; RLOO; James-Stein; the prompt history; the prompt history with HA-DW's Phi), 8
# seeds, G = 2, 4, 8, 16, on the synthetic task as it is (152 prompts, each recurring
# every 2-3 steps) and with a pool of 5000 prompts (each seen about 2.6 times in 200 steps
# of 64, as a large dataset's prompts are).
#
# One run at a time, one thread, at the lowest priority (the machine is shared), in the
# order the tables need them: G = 2, then 4, 8, 16; within a G, seed by seed, both tasks
# and every arm, so each arm has paired seeds early. Rerun it to continue: compare.py
# reuses every finished run (checking its fingerprint) and resumes an interrupted one.
#
#     nohup scripts/estimators_sweep.sh /work/runs-estimators > /work/runs-estimators/sweep.log 2>&1 &
#
# RUNS (default runs/) is run.output_dir; a second sweep on the same RUNS stops at once.
set -u
cd "$(dirname "$0")/.."
runs=$(realpath -m "${1:-runs}")
python=${PYTHON:-python}
arms=(GRPO Dr.GRPO RLOO James-Stein "prompt history" "prompt history+Phi")
mkdir -p "$runs"
exec 9>"$runs/.estimators-sweep.lock"
flock -n 9 || { echo "another sweep holds $runs/.estimators-sweep.lock"; exit 1; }
for group_size in 2 4 8 16; do
  for seed in 0 1 2 3 4 5 6 7; do
    for task in recurring rare; do
      pool=()
      [ "$task" = rare ] && pool=(--set data.prompt_pool=5000)
      echo "== $(date -u +%FT%TZ) G=$group_size seed=$seed task=$task"
      OMP_NUM_THREADS=1 nice -n 19 "$python" trainer/tools/compare.py \
          --name "estimators-sweep/$task/group_size-$group_size" --seeds "$seed" --variants "${arms[@]}" \
          --set rollout.group_size="$group_size" --set run.output_dir="$runs" --set run.threads=1 \
          --set run.progress=false "${pool[@]}" \
        || echo "== FAILED G=$group_size seed=$seed task=$task (rerun the sweep to retry)"
    done
  done
done
echo "== $(date -u +%FT%TZ) sweep done"
