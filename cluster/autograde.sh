#!/bin/bash
# Grade the whole course on a SLURM cluster:
#   bash cluster/autograde.sh TASKS [sbatch options for the array, e.g. --partition=cpu]
# plans TASKS tasks (whole students each), submits them as a job array (cluster/autograde.sbatch)
# and a merge job that runs when they have all ended and imports their grades into the course
# gradebook (grading/gradebook.db), then writes grading/integrity.csv. Run from the course root.
set -euo pipefail
TASKS=${1:?usage: bash cluster/autograde.sh TASKS [sbatch options]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${DDP_LAB_PYTHON:-.venv/bin/python}
mkdir -p grading/array
"$PY" -m ddp_lab.grading.array ${DDP_LAB_SCRATCH:+--scratch "$DDP_LAB_SCRATCH"} plan --tasks "$TASKS"
n=$("$PY" -c 'import json; print(len(json.load(open("grading/array/plan.json"))["tasks"]))')
array=$(sbatch --parsable --array="0-$((n - 1))" "$@" "$HERE/autograde.sbatch")
merge=$(sbatch --parsable --dependency="afterany:${array%%;*}" --job-name=ddp-lab-merge \
    --output=grading/array/merge-%j.log \
    --wrap "$PY -m ddp_lab.grading.array ${DDP_LAB_SCRATCH:+--scratch $DDP_LAB_SCRATCH} merge")
echo "autograde: array job ${array%%;*} ($n tasks), merge job ${merge%%;*}"
