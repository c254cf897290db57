#!/usr/bin/env bash
# The CUDA paths in one short run (a few minutes on one GPU). Needs `make install` first.
#   bash tests/gpu/run.sh            # every check; prints PASS / FAIL / SKIP per line
# Checks: NCCL process group and all_reduce; fp16 autocast + GradScaler (skip-on-inf, unscale
# before clip); nn.SyncBatchNorm vs ddp_lab.syncbn; nn.DataParallel equals the one-device
# gradient; the trainer on every GPU (NCCL, fp16, sync-bn) with its samples/s next to make bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
echo "gpu checks: $NGPU GPU(s); $(nvidia-smi -L 2>/dev/null | head -n 4 | tr '\n' ' ')"
if [ "$NGPU" -lt 1 ]; then echo "FAIL no CUDA GPU visible"; exit 1; fi
status=0
$PY tests/gpu/checks.py || status=1
# NCCL world of every GPU (2 GPUs or more also exercise the synchronising path of SyncBN).
$PY -m torch.distributed.run --standalone --nproc_per_node="$NGPU" tests/gpu/nccl_checks.py || status=1
OUT=$(mktemp -d)
if $PY -m torch.distributed.run --standalone --nproc_per_node="$NGPU" -m ddp_lab.train \
    --model resnet18 --batch-size 128 --max-steps 60 --train-size 20000 --amp fp16 \
    --sync-bn --clip-grad-norm 1.0 --out "$OUT" --no-progress > "$OUT/log" 2>&1; then
  $PY - "$OUT" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
print(f"PASS trainer resnet18 fp16 sync-bn on {s['world_size']} GPU(s), backend {s['backend']}: "
      f"{s['samples_per_s']:.0f} samples/s, final loss {s['final_loss']:.3f}")
PYEOF
else
  echo "FAIL trainer on GPU:"; tail -n 20 "$OUT/log"; status=1
fi
$PY -m ddp_lab.train --model resnet18 --batch-size 128 --max-steps 60 --train-size 20000 \
    --amp bf16 --out "$OUT/bf16" --no-progress > "$OUT/log2" 2>&1 \
  && echo "PASS trainer single process bf16 on cuda" \
  || { echo "FAIL trainer bf16:"; tail -n 20 "$OUT/log2"; status=1; }
rm -rf "$OUT"
echo "gpu checks: $([ $status -eq 0 ] && echo all passed || echo SOME FAILED)"
exit $status
