#!/usr/bin/env bash
# The GPU checks and figures this README lists as pending, for a lent one-GPU machine whose
# python3 already has a CUDA torch, transformers and lightning (nothing can be downloaded there).
#
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_pending.sh tests onegpu   # 389 s on an H100, tests cut at 170 s (now 260)
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_pending.sh tests compile
#   bash benchmarks/gpu_pending.sh lightning checkpoint
#
# Parts: tests (every gpu-marked test: CUDA backend conformance, engine parity on one GPU, the
# planner's peak against max_memory_allocated, the allocator headroom, memory after dropped
# models), onegpu (2 and 4 ranks on the one GPU through "cuda+gloo": conformance, every strategy
# and feature against the one-process run, block.compile(), torch's CUDA sanitizer), compile (bench_step GPT-2-medium bf16, shardkit vs
# FSDP2, eager and inductor), lightning (Trainer: DDP vs Lightning's FSDPStrategy vs shardkit),
# checkpoint (sync vs background save stall with pinned staging), optstep (the optimizer step on
# local tensors vs DTensor's dispatch vs plain tensors, 2 ranks on the GPU; GPT-2-medium's whole step
# vs FSDP2 and DDP on one GPU). Each part has its own time
# limit so one that hangs leaves the others their turn; logs go to $OUT (or /tmp/gpu-out).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=python3

if ! $PY -c "import shardkit_backends" 2>/dev/null; then
    # The package as users get it (a built wheel, not the checkout), torch left as it is.
    $PY -m pip install -q --no-deps --no-build-isolation --no-index . > "$OUT/install.log" 2>&1 \
        || { cat "$OUT/install.log"; exit 1; }
fi
{
    echo "commit ${COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch, transformers, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__, 'lightning', lightning.__version__)"
    nproc
} | tee -a "$OUT/machine.txt"

part() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)"
    local began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - began)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

for what in "$@"; do
    case $what in
    tests)
        part tests 260 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 250 -s \
            tests/test_cuda_backend.py tests/test_sharding_gpu.py tests/test_replicate.py \
            tests/test_planner_gpu.py tests/test_lifetimes.py ;;
    onegpu)
        part onegpu 150 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 140 -s \
            -k "not sanitiz" tests/test_one_gpu_ranks.py
        part sanitizer 150 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 140 -s \
            -k "sanitiz" tests/test_one_gpu_ranks.py ;;
    compile)
        part compile 200 $PY benchmarks/bench_step.py --model gpt2-medium --device cuda --dtype bf16 \
            --nproc 1 --batch 8 --seq 512 --warmup 3 --chunk 3 --steps 12 \
            --modes shardkit-full,fsdp2 --compile inductor --no-isolated \
            --profile /tmp/gpu-prof --profile-steps 2 --json "$OUT/compile.json" ;;
    lightning)
        part lightning 130 $PY benchmarks/bench_lightning.py --model gpt2-small --accelerator cuda \
            --devices 1 --batch 8 --seq 512 --steps 10 --strategies ddp,fsdp,shardkit ;;
    checkpoint)
        part checkpoint 90 $PY benchmarks/bench_checkpoint.py --backend cuda --nproc 1 \
            --model gpt2-small --batch 8 --seq 512 --saves 2 --interval 30 --json "$OUT/checkpoint.json" ;;
    optstep)  # issue 53: the optimizer step on the GPU (host-bound), and the whole step vs peers
        part optstep-local 200 $PY benchmarks/bench_optimizer_step.py --backend cuda+gloo --nproc 2 \
            --models mlp104 gpt2-medium --optimizers adamw adamw-fused sgd-momentum \
            --variants plain shardkit shardkit-dispatch --rounds 5 --steps 5
        part optstep-whole 200 $PY benchmarks/bench_step.py --model gpt2-medium --device cuda --dtype bf16 \
            --nproc 1 --batch 8 --seq 512 --warmup 3 --chunk 3 --steps 12 \
            --modes shardkit-full,fsdp2,ddp --no-isolated --json "$OUT/optstep-whole.json" ;;
    *) echo "unknown part $what (tests, onegpu, compile, lightning, checkpoint, optstep)"; exit 2 ;;
    esac
done
