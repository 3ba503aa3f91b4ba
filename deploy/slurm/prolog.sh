#!/bin/sh
# Slurm TaskProlog: ask the central autobatch service for the job's plan before each task starts
# (docs/deploy.md, "Central mode"). slurm.conf:  TaskProlog=/etc/slurm/autobatch-prolog.sh
#
# A TaskProlog's stdout lines `export NAME=value` become the task's environment (slurm.conf(5),
# TaskProlog), so the trainer reads AUTOBATCH_MICRO_BATCH_SIZE, AUTOBATCH_GRADIENT_ACCUMULATION_STEPS,
# AUTOBATCH_PLAN_SOURCE (cached or predicted), AUTOBATCH_PROFILE_MATCH (measured or predicted),
# AUTOBATCH_ACTIVATION_CHECKPOINTING (the mode the micro-batch needs: train with it)...
# The job says what to plan:
#   sbatch --export=ALL,AUTOBATCH_MODEL_FINGERPRINT=9c1e5b0f7a3d2e48,AUTOBATCH_EFFECTIVE_BATCH_SIZE=1024 ...
# A job that names no model is left alone. The plan is for this node's card (nvidia-smi's name
# of the first GPU, or AUTOBATCH_CARD) and node. The world size is the library's reading of the
# step (`autobatch launcher --slurm-task-ranks gpus`, docs/launchers.md): one rank per GPU a task
# holds, so one task per GPU and one torchrun per node both count every GPU; a job whose tasks
# start another number of ranks says so with AUTOBATCH_JOB_WORLD_SIZE.
# The whole plan is also kept in $AUTOBATCH_PLAN_DIR/plan-<job id>.env for the job's own scripts:
# every task writes its own temporary file and renames it there, so tasks never share a file
# half written. When the service cannot answer, the task starts without a plan (a warning on
# stderr and AUTOBATCH_PLAN_ERROR set): a prolog that fails would fail the task or drain the node.
set -u

[ -n "${AUTOBATCH_MODEL_FINGERPRINT:-}" ] || exit 0
: "${AUTOBATCH_CENTRAL_URL:=http://autobatch-central:8000}"
: "${AUTOBATCH_PLAN_DIR:=/tmp}"
job="${SLURM_JOB_ID:-0}"
card="${AUTOBATCH_CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null)}"
plan_file="$AUTOBATCH_PLAN_DIR/plan-$job.env"

no_plan() {
    echo "autobatch prolog: no plan for job $job: $1" >&2
    echo "export AUTOBATCH_PLAN_ERROR=1"
    exit 0
}

if [ -n "${AUTOBATCH_JOB_WORLD_SIZE:-}" ]; then
    world_size="$AUTOBATCH_JOB_WORLD_SIZE"
elif ! world_size=$(autobatch launcher --slurm-task-ranks gpus --world-size 2>&1); then
    no_plan "$world_size; in a TaskProlog, the job gives it as AUTOBATCH_JOB_WORLD_SIZE=N"
fi
partial=$(mktemp "$AUTOBATCH_PLAN_DIR/.plan-$job.XXXXXX" 2>&1) || no_plan "$partial"

keep() {
    # mktemp made it 0600; the job's scripts read it. A rename replaces the file whole, so tasks
    # of one job that finish together leave one complete plan (the same plan).
    if chmod 644 "$partial" && mv -f "$partial" "$plan_file"; then
        echo "export AUTOBATCH_PLAN_FILE=$plan_file"
    else
        echo "autobatch prolog: the plan is not kept in $plan_file" >&2
        rm -f "$partial"
    fi
}

# A plan decided at submission (deploy/slurm/job_submit.lua: AUTOBATCH_PLAN_AT=submit and the
# plan's variables, named in AUTOBATCH_PLAN_VARIABLES, in the job's environment) is the job's
# plan: kept in the file as it is, not asked again (a profile published since changes nothing),
# unless this step runs another number of ranks than it was planned for.
if [ "${AUTOBATCH_PLAN_AT:-}" = submit ] && [ -n "${AUTOBATCH_PLAN_VARIABLES:-}" ]; then
    if [ "${AUTOBATCH_WORLD_SIZE:-}" = "$world_size" ]; then
        for name in $(echo "$AUTOBATCH_PLAN_VARIABLES" | tr ',' ' ') AUTOBATCH_PLAN_AT; do
            case "$name" in *[!A-Z0-9_]*) continue ;; esac
            eval "value=\${$name-}"
            case "$value" in
                *[!A-Za-z0-9_.,:/+-]*) value="'$(printf '%s' "$value" | sed "s/'/'\\\\''/g")'" ;;
            esac
            echo "export $name=$value"
        done > "$partial"
        keep
        exit 0
    fi
    echo "autobatch prolog: the plan decided at submission is for ${AUTOBATCH_WORLD_SIZE:-?} ranks and this step runs $world_size: planning again" >&2
    echo "export AUTOBATCH_PLAN_AT=task"
fi
if ! error=$(autobatch plan \
        --service "$AUTOBATCH_CENTRAL_URL" \
        --model-fingerprint "$AUTOBATCH_MODEL_FINGERPRINT" \
        ${card:+--card "$card"} \
        --node "${SLURMD_NODENAME:-$(hostname)}" \
        --effective-batch-size "${AUTOBATCH_EFFECTIVE_BATCH_SIZE:?set AUTOBATCH_EFFECTIVE_BATCH_SIZE}" \
        --world-size "$world_size" \
        --output "$partial" 2>&1 >/dev/null); then
    rm -f "$partial"
    no_plan "$error"
fi
# Slurm takes each value up to the end of the line, quotes included: print them unquoted.
sed -n "s/^export \([A-Z_]*\)='\(.*\)'\$/export \1=\2/p; s/^export \([A-Z_]*\)=\([^']*\)\$/export \1=\2/p" "$partial"
keep
