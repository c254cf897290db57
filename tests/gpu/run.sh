#!/usr/bin/env bash
# The CUDA paths in one short run (a few minutes on 1 to 8 GPUs); prints PASS / FAIL / SKIP
# per line and exits non-zero when anything failed.
#   bash tests/gpu/run.sh                            # with the course's .venv (make install)
#   PY=python3 PYTHONPATH=. bash tests/gpu/run.sh    # any python3 with torch (no venv needed)
# Needs torch with CUDA, numpy and matplotlib; not nbgrader, not the course's checks or grader;
# torchvision only for resnet18 (without it the trainer and bench runs use the cnn, said so).
# Checks: NCCL process group and all_reduce; fp16 autocast + GradScaler (an inf step skipped,
# unscale_ before clipping); nn.SyncBatchNorm against ddp_lab.syncbn (forward, input and
# weight gradients, running stats; unequal batches per rank with 2+ GPUs); nn.DataParallel
# against one device; the trainer (NCCL, fp16, --sync-bn, clipping) on every GPU and bf16 on
# one; the trainer's samples/s against make bench's plain DDP reference on 1 GPU and on all.
# With one GPU the multi-rank parts run as a world of one (said in their lines).
# GPU_STEP_TIMEOUT (default 300) bounds each step; GPU_BENCH_PAIRS (default 2) the bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
STEP=${GPU_STEP_TIMEOUT:-300}
if ! command -v "$PY" > /dev/null; then
  echo "FAIL no Python at $PY: run make install, or PY=python3 PYTHONPATH=. bash tests/gpu/run.sh"
  exit 1
fi
# what this Python has (one line), and the model the trainer and bench runs use
read -r NGPU MODEL < <($PY tests/gpu/checks.py --preflight) || {
  echo "FAIL $PY cannot import torch and ddp_lab (see above)"
  exit 1
}
echo "gpu checks: $NGPU GPU(s); $(nvidia-smi -L 2> /dev/null | head -n 4 | tr '\n' ' ')"
if [ "${NGPU:-0}" -lt 1 ]; then echo "FAIL no CUDA GPU visible"; exit 1; fi
status=0
run() { timeout --kill-after=10 "$STEP" "$@"; }
TORCHRUN=($PY -m torch.distributed.run --standalone --nproc_per_node="$NGPU")
run $PY tests/gpu/checks.py || status=1
# NCCL world of every GPU (2 GPUs or more also exercise the synchronising path of SyncBN).
run "${TORCHRUN[@]}" tests/gpu/nccl_checks.py || status=1
OUT=$(mktemp -d)
TRAIN=(--model "$MODEL" --batch-size 128 --max-steps 60 --train-size 20000 --no-progress)
if run "${TORCHRUN[@]}" -m ddp_lab.train "${TRAIN[@]}" --amp fp16 --sync-bn \
    --clip-grad-norm 1.0 --out "$OUT/fp16" > "$OUT/log" 2>&1; then
  $PY - "$OUT/fp16" << 'PYEOF'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
c = s["config"]
print(f"PASS trainer {c['model']} fp16 sync-bn on {s['world_size']} GPU(s), backend {s['backend']}: "
      f"{s['samples_per_s']:.0f} samples/s, final loss {s['final_loss']:.3f}")
PYEOF
else
  echo "FAIL trainer fp16 sync-bn on every GPU:"; tail -n 20 "$OUT/log"; status=1
fi
run $PY -m ddp_lab.train "${TRAIN[@]}" --amp bf16 --out "$OUT/bf16" > "$OUT/log2" 2>&1 \
  && echo "PASS trainer single process bf16 on cuda" \
  || { echo "FAIL trainer bf16:"; tail -n 20 "$OUT/log2"; status=1; }
# --profile on CUDA: every rank's trace holds the trainer's ranges and CUDA kernels
if run "${TORCHRUN[@]}" -m ddp_lab.train "${TRAIN[@]}" --max-steps 12 --profile "$OUT/prof" \
    --out "$OUT/prof-run" > "$OUT/log4" 2>&1; then
  $PY - "$OUT/prof" "$NGPU" << 'PYEOF'
import json, sys
from ddp_lab.profiling import PHASES, PREFIX, trace_path
for rank in range(int(sys.argv[2])):
    events = json.load(open(trace_path(sys.argv[1], rank)))["traceEvents"]
    names = {e.get("name", "") for e in events}
    kernels = sum(e.get("cat") == "kernel" for e in events)
    missing = [p for p in PHASES if PREFIX + p not in names]
    assert not missing and kernels, f"rank {rank}: missing {missing}, {kernels} CUDA kernels"
print(f"PASS --profile on {sys.argv[2]} GPU(s): every rank's trace has the ranges and "
      f"CUDA kernels ({kernels} on the last rank)")
PYEOF
  [ $? -eq 0 ] || status=1
else
  echo "FAIL trainer --profile on every GPU:"; tail -n 20 "$OUT/log4"; status=1
fi
# make bench's throughput pairs: the plain DDP reference and the trainer, interleaved
NPROCS=(1); [ "$NGPU" -gt 1 ] && NPROCS+=("$NGPU")
if timeout --kill-after=10 $((STEP * 2)) $PY -m ddp_lab.bench --only throughput \
    --model "$MODEL" --batch-size 128 --steps 60 --pairs "${GPU_BENCH_PAIRS:-2}" \
    --nprocs "${NPROCS[@]}" --out "$OUT/bench" > "$OUT/log3" 2>&1; then
  grep -E "trainer / reference|trainer [0-9]+ / 1" "$OUT/log3" | sed 's/^ddp_lab.bench: /PASS bench: /'
else
  echo "FAIL bench (trainer vs plain DDP):"; tail -n 20 "$OUT/log3"; status=1
fi
rm -rf "$OUT"
echo "gpu checks: $([ $status -eq 0 ] && echo all passed || echo SOME FAILED)"
exit $status
