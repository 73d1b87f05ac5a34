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
# SHARD/SHARDS (default 0/1) splits the seeds, seed % SHARDS == SHARD, so that one sweep per
# core runs side by side on the same RUNS, each G's seeds advancing together:
#
#     scripts/estimators_sweep.sh /work/runs-estimators 0/2    # seeds 0, 2, 4, 6
#     scripts/estimators_sweep.sh /work/runs-estimators 1/2    # seeds 1, 3, 5, 7
#
# RUNS (default runs/) is run.output_dir. Every shard holds one lock on RUNS for its SHARD
# and SHARDS: a second sweep of the same shard stops at once. Shards of different SHARDS
# counts would overlap; run all of one count.
set -u
cd "$(dirname "$0")/.."
runs=$(realpath -m "${1:-runs}")
shard_spec=${2:-0/1}
shard=${shard_spec%/*}
shards=${shard_spec#*/}
[[ "$shard" =~ ^[0-9]+$ && "$shards" =~ ^[1-9][0-9]*$ && "$shard" -lt "$shards" ]] \
  || { echo "SHARD/SHARDS must be two integers with 0 <= SHARD < SHARDS, not '$shard_spec'"; exit 2; }
python=${PYTHON:-python}
arms=(GRPO Dr.GRPO RLOO James-Stein "prompt history" "prompt history+Phi")
mkdir -p "$runs"
lock="$runs/.estimators-sweep-$shard-of-$shards.lock"
exec 9>"$lock"
flock -n 9 || { echo "another sweep holds $lock"; exit 1; }
for group_size in 2 4 8 16; do
  for seed in 0 1 2 3 4 5 6 7; do
    (( seed % shards == shard )) || continue
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
