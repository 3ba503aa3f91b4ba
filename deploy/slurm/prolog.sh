#!/bin/sh
# Slurm TaskProlog: ask the central autobatch service for the job's plan before each task starts
# (docs/deploy.md, "Central mode"). slurm.conf:  TaskProlog=/etc/slurm/autobatch-prolog.sh
#
# A TaskProlog's stdout lines `export NAME=value` become the task's environment (slurm.conf(5),
# TaskProlog), so the trainer reads AUTOBATCH_MICRO_BATCH_SIZE, AUTOBATCH_GRADIENT_ACCUMULATION_STEPS,
# AUTOBATCH_PLAN_SOURCE (measured or predicted)... The job says what to plan:
#   sbatch --export=ALL,AUTOBATCH_MODEL_FINGERPRINT=9c1e5b0f7a3d2e48,AUTOBATCH_EFFECTIVE_BATCH_SIZE=1024 ...
# A job that names no model is left alone. The plan is for this node's card (nvidia-smi's name
# of the first GPU, or AUTOBATCH_CARD) and node; the world size is the job's task count. The
# whole plan is also kept in $AUTOBATCH_PLAN_DIR/plan-<job id>.env for the job's own scripts.
# When the service cannot answer, the task starts without a plan (a warning on stderr and
# AUTOBATCH_PLAN_ERROR set): a prolog that fails would fail the task or drain the node.
set -u

[ -n "${AUTOBATCH_MODEL_FINGERPRINT:-}" ] || exit 0
: "${AUTOBATCH_CENTRAL_URL:=http://autobatch-central:8000}"
: "${AUTOBATCH_PLAN_DIR:=/tmp}"
card="${AUTOBATCH_CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null)}"
plan_file="$AUTOBATCH_PLAN_DIR/plan-${SLURM_JOB_ID:-0}.env"

if ! error=$(autobatch plan \
        --service "$AUTOBATCH_CENTRAL_URL" \
        --model-fingerprint "$AUTOBATCH_MODEL_FINGERPRINT" \
        ${card:+--card "$card"} \
        --node "${SLURMD_NODENAME:-$(hostname)}" \
        --effective-batch-size "${AUTOBATCH_EFFECTIVE_BATCH_SIZE:?set AUTOBATCH_EFFECTIVE_BATCH_SIZE}" \
        --world-size "${SLURM_NTASKS:-1}" \
        --output "$plan_file" 2>&1 >/dev/null); then
    echo "autobatch prolog: no plan for job ${SLURM_JOB_ID:-?}: $error" >&2
    echo "export AUTOBATCH_PLAN_ERROR=1"
    exit 0
fi
# Slurm takes each value up to the end of the line, quotes included: print them unquoted.
sed -n "s/^export \([A-Z_]*\)='\(.*\)'\$/export \1=\2/p; s/^export \([A-Z_]*\)=\([^']*\)\$/export \1=\2/p" "$plan_file"
echo "export AUTOBATCH_PLAN_FILE=$plan_file"
