#!/usr/bin/env bash
# The measurements that need an NVIDIA GPU (figures in docs/h100.md were taken on a machine with
# an H100 80GB HBM3 by these stages), in stages that each fit in ten minutes:
#   bash scripts/gpu-checks.sh quick     # every figure of the training-step targets in under
#                                        # nine minutes: the PyTorch anchor (eager and compiled),
#                                        # then `small`'s step, launches, memory and per-op
#                                        # profile (bytes, FLOPs, fraction of the device's limits)
#                                        # on CUDA (every preset) and wgpu (two)
#   bash scripts/gpu-checks.sh correct   # conformance (CUDA, wgpu/Vulkan), resident step plans
#   bash scripts/gpu-checks.sh cuda      # the CUDA conformance suite, matmul benchmarks (from
#                                        # f32 and prepared operands; every split-bf16 path
#                                        # alone and the tuner's choice), the PyTorch anchors
#   bash scripts/gpu-checks.sh bench     # wgpu matmul benchmarks (the weight gradients' shapes
#                                        # split-K and not) and the PyTorch anchors
#   bash scripts/gpu-checks.sh again     # after a change to the step: its tests, then both
#                                        # backends' steps, wgpu's bias gradients summed
#                                        # apart too, no anchor (under eight minutes)
#   bash scripts/gpu-checks.sh wgrad     # the weight gradients' matmuls on wgpu, tuned (split-K)
#                                        # and not, beside cuBLAS (under three minutes)
#   bash scripts/gpu-checks.sh tune      # a full autotune, and matrix-vector shapes
#   bash scripts/gpu-checks.sh train     # report, training on both backends, PyTorch anchor
#   bash scripts/gpu-checks.sh steps     # PyTorch anchor; step time, tokens/s, peak memory and
#                                        # the per-op profile of every preset on both backends
#                                        # (bench train; attention fused and unfused, the CUDA
#                                        # step as a graph)
#   bash scripts/gpu-checks.sh dist      # NCCL and MPI's host buffers on one rank against the
#                                        # plain step, their sums overlapped with the backward
#                                        # pass and not (NCCL needs libnccl.so.2 on
#                                        # LD_LIBRARY_PATH, e.g. torch's wheel); two MPI ranks on
#                                        # the one GPU where mpirun is there
#   bash scripts/gpu-checks.sh gpt2      # GPT-2 124M (`--config gpt2`, batch 8 x 1024 tokens) at
#                                        # bf16-mixed: PyTorch eager and compiled, then step time,
#                                        # tokens/s and peak memory on CUDA and wgpu, and the
#                                        # batch of 64 in 8 micro-batches (under five minutes)
#   bash scripts/gpu-checks.sh parity    # step for step with PyTorch on `small`, 100 steps:
#                                        # the anchor under torch.autocast("cuda") writes its
#                                        # init, batches and losses; CUDA and wgpu train from
#                                        # them (needs torch, numpy and safetensors)
#
# The PyTorch comparisons are scripts/anchors/*.py (they need torch with CUDA). Where the GPU
# machine has no Rust toolchain, build on another x86-64 Linux machine and bring the binaries:
#   cargo build --release
#   cargo test --release --test conformance --test train --test model --test coop \
#     --test autotune --test op_parity --no-run   # then copy the executables it names
#     (target/release/deps/conformance-*, ...) to .bin/conformance, .bin/train, .bin/model,
#     .bin/coop, .bin/autotune and .bin/op_parity
# and, where the machine has no Vulkan loader, Debian's libvulkan1 .deb in .gl/ (unpacked below).
# Every step has its own time limit, so one that hangs costs only itself; all output lands in
# $OUT (or ./gpu-checks when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:-correct}"
out="${OUT:-gpu-checks}"
mkdir -p "$out"
source scripts/gpu-env.sh
m=./target/release/mantissa
# run SECONDS CMD...: one step, limited, logged (with its exit status) to $out/log.txt.
run() {
    local limit=$1; shift
    echo "== [$(date +%T)] $*" | tee -a "$out/log.txt"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$out/log.txt"
    echo "== exit ${PIPESTATUS[0]}" | tee -a "$out/log.txt"
}
case "$stage" in
quick)
    run 20 nvidia-smi
    run 30 $m info
    OUT="$out" STEPS=80 run 100 python3 scripts/anchors/torch_gpt.py
    run 120 $m bench train --config small --backends cuda --precision 32-true,bf16-mixed,16-mixed,bf16-true --warmup 3 --steps 20 --profile --json "$out/bench-train-cuda.json"
    # The tuner's search capped at 6 s a shape class (split-K adds candidates to the weight
    # gradients'), so that three presets fit the stage.
    MANTISSA_TUNE_SECONDS=6 run 200 $m bench train --config small --backends wgpu --precision 32-true,bf16-mixed,16-mixed --warmup 3 --steps 10 --profile --json "$out/bench-train-wgpu.json"
    # The step's kernels on this driver, where the test executables came along (.bin/, see the
    # header): fused attention (SIMT and cooperative), arenas and epilogues in resident plans on
    # both backends, the cooperative-matrix kernels and split-K's fixed-order sums.
    [ -x .bin/train ] && run 100 .bin/train fused_attention resident arena --test-threads 1
    [ -x .bin/coop ] && run 45 .bin/coop --test-threads 1
    [ -x .bin/autotune ] && run 30 .bin/autotune split_k --test-threads 1
    ;;
correct)
    run 20 nvidia-smi
    run 60 $m info
    if [ -x .bin/conformance ]; then
        [ "${ONLY:-}" = wgpu ] || run 150 .bin/conformance cuda:: --test-threads 1
        run 200 .bin/conformance wgpu --test-threads 1
    fi
    # Users' models: a built model learning on the device, every preset the test names.
    [ -x .bin/model ] && run 60 .bin/model a_built_model_learns ${ONLY:+--skip cuda} --test-threads 1
    if [ -x .bin/train ]; then
        run 120 .bin/train resident loss_falls fused_attention_ops ${ONLY:+--skip cuda} --test-threads 1
        # The 16-bit presets with every tensor stored as f32, beside their coded matmul inputs above.
        MANTISSA_ACTIVATIONS=f32 run 120 $m bench train --config small --backends cuda --precision bf16-mixed,16-mixed --warmup 3 --steps 20 --json "$out/bench-train-f32-stored.json"
        # The CUDA step replayed as a CUDA graph (opt-in) against the host interpreter.
        [ "${ONLY:-}" = wgpu ] || MANTISSA_CUDA_GRAPH=on run 120 .bin/train cuda::resident cuda::a_timed --test-threads 1
    fi
    ;;
cuda)
    [ -x .bin/conformance ] && MANTISSA_CUDA_SPLIT=gemms run 120 .bin/conformance cuda:: --test-threads 1
    # From f32 operands (conversion included) and from operands already in their format (the
    # GEMM alone, against PyTorch's same-dtype GEMM below).
    run 180 $m bench matmul --sizes 4096,8192 --algorithms all --operands all --backends cuda --reps 10 --json "$out/bench-cuda.json"
    # Split-bf16 takes the fastest of its candidates per shape class (the bench's variant column
    # above names it): the per-level cuBLAS GEMMs, bf16x3 as one K-tripled GEMM (K up to 4096),
    # x6/x9's level 0 as partial sums (where their planes fit: 4096, and a long K over a small
    # C), and the fused kernel; each alone here, with its conformance.
    for path in fused tripled partials; do
        [ -x .bin/conformance ] && MANTISSA_CUDA_SPLIT=$path run 60 .bin/conformance cuda::matmul_random --test-threads 1
    done
    MANTISSA_CUDA_SPLIT=fused run 80 $m bench matmul --sizes 4096,8192 --algorithms bf16x3,bf16x6,bf16x9 --backends cuda --reps 10 --json "$out/bench-cuda-fused.json"
    MANTISSA_CUDA_SPLIT=gemms run 80 $m bench matmul --sizes 4096,8192,1024x1024x16384 --algorithms bf16x3,bf16x6,bf16x9 --operands all --backends cuda --reps 10 --json "$out/bench-cuda-gemms.json"
    MANTISSA_CUDA_SPLIT=tripled run 40 $m bench matmul --sizes 4096 --algorithms bf16x3 --operands all --backends cuda --reps 10 --json "$out/bench-cuda-tripled.json"
    MANTISSA_CUDA_SPLIT=partials run 60 $m bench matmul --sizes 4096,1024x1024x16384 --algorithms bf16x6,bf16x9 --operands all --backends cuda --reps 10 --json "$out/bench-cuda-partials.json"
    # fp8 through cuBLASLt's fp8 GEMM (opt-in: outside the contract on an H100), beside the
    # default f16 path above; its conformance shows where it breaks.
    MANTISSA_CUDA_FP8=cublaslt run 60 $m bench matmul --sizes 4096,8192 --algorithms e4m3,e4m3-e5m2 --operands all --backends cuda --reps 10 --json "$out/bench-cuda-fp8-lt.json"
    [ -x .bin/conformance ] && MANTISSA_CUDA_FP8=cublaslt run 60 .bin/conformance cuda::matmul_random --test-threads 1
    run 120 python3 scripts/anchors/torch_matmul.py
    ;;
bench)
    # fast tuning: on cooperative matrices the default, the published designs' staged blocks
    # (prefetched, 128x128, 256x128), then the default's neighbours, up to 20 s a shape class.
    run 270 $m bench matmul --sizes 4096,8192 --algorithms all --backends wgpu --reps 10 --json "$out/bench-wgpu.json"
    MANTISSA_WGSL_CHECKS=on run 60 $m bench matmul --sizes 4096 --algorithms f32,bf16x3 --backends wgpu --reps 5 --json "$out/bench-checked.json"
    MANTISSA_COOP=off run 60 $m bench matmul --sizes 4096 --algorithms f16,bf16,bf16x3 --backends wgpu --reps 5 --json "$out/bench-simt.json"
    # The training step's weight-gradient shapes (long K, few output tiles): split-K among the
    # tuner's candidates (docs/wgpu.md, "Split-K"), against the unsplit default tile.
    run 120 $m bench matmul --sizes 384x1152x16384,384x1536x16384,1536x384x16384 --algorithms f32,bf16,f16 --backends wgpu --reps 10 --json "$out/bench-wgpu-wgrad.json"
    MANTISSA_AUTOTUNE=off run 60 $m bench matmul --sizes 384x1152x16384,384x1536x16384,1536x384x16384 --algorithms f32,bf16,f16 --backends wgpu --reps 10 --json "$out/bench-wgpu-wgrad-default.json"
    run 120 python3 scripts/anchors/torch_matmul.py
    ;;
again)
    # After a change to the step, in under eight minutes: the tests of what changed (CUDA graphs
    # replayed against the interpreter, fused attention and the cooperative tiles, SIMT tiles
    # on a cooperative-matrix device), then both backends' steps with their measured choices
    # (no anchor: set them against the last `quick` on the same kind of machine).
    run 10 nvidia-smi -L
    [ -x .bin/train ] && MANTISSA_CUDA_GRAPH=on run 60 .bin/train cuda::resident --test-threads 1
    [ -x .bin/train ] && run 30 .bin/train cuda::fused_attention_ops --test-threads 1
    [ -x .bin/coop ] && run 40 .bin/coop every_coop_block simt_tiles --test-threads 1
    # Products rounded in the matmul's store and bias adds stored as codes there, the
    # update's held state, attention's biases.
    [ -x .bin/coop ] && run 40 .bin/coop a_product_rounded a_bias_add_into_codes --test-threads 1
    [ -x .bin/autotune ] && run 40 .bin/autotune a_product_rounded a_bias_add_into_codes --test-threads 1
    [ -x .bin/conformance ] && run 40 .bin/conformance cuda::train_ops wgpu::train_ops --test-threads 1
    [ -x .bin/op_parity ] && run 30 .bin/op_parity matches_pytorch --test-threads 1
    MANTISSA_TUNE_SECONDS=6 run 230 $m bench train --config small --backends wgpu --precision 32-true,bf16-mixed,16-mixed --warmup 3 --steps 10 --profile --json "$out/bench-train-wgpu.json"
    # The bias gradients by column sums of their own, against the run above (summed in the
    # weight gradients' matmuls): the default's measured check (tiles cached by the run above).
    MANTISSA_BIAS_GRAD_IN_MATMUL=off run 90 $m bench train --config small --backends wgpu --precision 32-true,bf16-mixed --warmup 2 --steps 5 --profile --json "$out/bench-train-wgpu-bias-separate.json"
    run 60 $m bench train --config small --backends cuda --precision 32-true,bf16-mixed,16-mixed,bf16-true --warmup 3 --steps 20 --json "$out/bench-train-cuda.json"
    ;;
wgrad)
    # The weight gradients' shapes (long K, few output tiles) and one square size, the tuner's
    # choice (split-K among its candidates) against the unsplit default tile, beside cuBLAS
    # through PyTorch: the matmul half of `bench` in under three minutes.
    OUT="$out" run 40 python3 scripts/anchors/torch_matmul.py 4096
    MANTISSA_TUNE_SECONDS=6 run 70 $m bench matmul --sizes 384x1152x16384,1536x384x16384,4096 --algorithms f32,bf16,f16 --backends wgpu,cuda --reps 10 --json "$out/bench-wgpu-wgrad.json"
    MANTISSA_AUTOTUNE=off run 50 $m bench matmul --sizes 384x1152x16384,1536x384x16384,4096 --algorithms f32,bf16,f16 --backends wgpu --reps 10 --json "$out/bench-wgpu-wgrad-default.json"
    ;;
tune)
    MANTISSA_AUTOTUNE=full run 300 $m bench matmul --sizes 4096,8192 --algorithms f32,f16,bf16x3 --backends wgpu --reps 5 --json "$out/bench-tuned.json"
    MANTISSA_WGSL_CHECKS=on MANTISSA_AUTOTUNE=full run 200 $m bench matmul --sizes 4096 --algorithms f32,f16,bf16x3 --backends wgpu --reps 5 --json "$out/bench-tuned-checked.json"
    run 120 python3 scripts/anchors/torch_matmul.py
    run 60 $m bench matmul --sizes 8192x1x8192 --algorithms f32,e4m3 --backends wgpu,cuda --reps 10 --json "$out/bench-matvec.json"
    ;;
train)
    run 240 $m report --backends all --sizes 256,1000x700x1500 --train-steps 100 --out "$out/report"
    run 150 $m train --config small --precision 32-true,bf16-mixed,16-mixed,bf16-true --steps 300 --eval-interval 100 --backend cuda --out "$out/train-cuda"
    run 150 $m train --config small --precision 32-true,bf16-mixed,16-mixed,bf16-true --steps 300 --eval-interval 100 --backend wgpu --out "$out/train-wgpu"
    run 120 python3 scripts/anchors/torch_gpt.py
    ;;
steps)
    # The anchor first: the stage may run past a ten-minute call, and the extras come last.
    run 120 python3 scripts/anchors/torch_gpt.py
    run 300 $m bench train --config small --backends cuda,wgpu --warmup 3 --steps 20 --profile --json "$out/bench-train.json"
    # CUDA's attention each way named, beside auto's choice above (its JSON: both ways' times).
    run 120 $m bench train --config small --backends cuda --attention unfused --warmup 3 --steps 20 --profile --json "$out/bench-train-unfused.json"
    run 120 $m bench train --config small --backends cuda --attention fused --warmup 3 --steps 20 --json "$out/bench-train-fused.json"
    # The CUDA step replayed as a CUDA graph (MANTISSA_CUDA_GRAPH=on), beside the launches above.
    MANTISSA_CUDA_GRAPH=on run 120 $m bench train --config small --backends cuda --precision 32-true,bf16-mixed,16-mixed,bf16-true --warmup 3 --steps 20 --json "$out/bench-train-graph.json"
    # wgpu's fused attention kernels (attention.wgsl) named, beside auto's choice above.
    run 240 $m bench train --config small --precision 32-true,bf16-mixed --backends wgpu --attention fused --warmup 3 --steps 20 --json "$out/bench-train-wgpu-fused.json"
    ;;
dist)
    run 60 $m info
    run 150 $m train --config small --precision 32-true --steps 50 --eval-interval 50 --backend cuda --reducer nccl --out "$out/nccl"
    # NCCL's bucket sums on their own stream beside the backward pass (the default), against one
    # sum after the pass: the same losses, and the step times side by side.
    run 150 $m train --config small --precision 32-true --steps 50 --eval-interval 50 --backend cuda --reducer nccl --overlap-reduction off --out "$out/nccl-after"
    [ -x .bin/train ] && run 120 .bin/train nccl_overlapped overlapped_reduction --test-threads 1
    run 150 $m train --config small --precision 32-true --steps 50 --eval-interval 50 --backend cuda --out "$out/alone"
    # MPI's host buffers on one rank: each bucket copied to page-locked memory and back while
    # the pass runs on, against one sum after the pass (losses equal to the runs above).
    run 150 $m train --config small --precision 32-true --steps 50 --eval-interval 50 --backend cuda --reducer mpi --out "$out/mpi"
    run 150 $m train --config small --precision 32-true --steps 50 --eval-interval 50 --backend cuda --reducer mpi --overlap-reduction off --out "$out/mpi-after"
    # Two ranks on the one GPU through MPI's host path (NCCL refuses two ranks on one device):
    # each rank half of the batch, the losses those of "alone" up to f32 summation order. Needs
    # mpirun on the machine and a binary built with `--features mpi`.
    if command -v mpirun >/dev/null; then
        run 300 mpirun --allow-run-as-root --oversubscribe -np 2 $m train --config small --precision 32-true --steps 50 --eval-interval 50 --backend cuda --reducer mpi --out "$out/mpi-2-ranks"
    else
        echo "dist: no mpirun here: the two-rank check on one GPU is skipped" | tee -a "$out/log.txt"
    fi
    ;;
gpt2)
    run 20 nvidia-smi
    CONFIG=gpt2 STEPS=30 OUT="$out" run 150 python3 scripts/anchors/torch_gpt.py
    run 150 $m bench train --config gpt2 --backends cuda,wgpu --precision bf16-mixed --warmup 2 --steps 8 --json "$out/bench-train-gpt2.json"
    # The global batch of 64 sequences in 8 micro-batches of 8 (the memory of one): a step is
    # eight backward passes and one update; its losses are the batch run whole's.
    # (Its checkpoint, 1.4 GiB, stays out of $out.)
    run 100 $m train --config gpt2 --backend cuda --precision bf16-mixed --batch 64 --grad-accum 8 --steps 5 --eval-interval 5 --eval-batches 1 --out /tmp/gpt2-accum
    cp /tmp/gpt2-accum/train.json "$out/train-gpt2-accum.json" 2>/dev/null
    # Its step time, tokens/s and peak (the work of a step of eight micro-batches).
    run 90 $m bench train --config gpt2 --backends cuda --precision bf16-mixed --batch 64 --grad-accum 8 --warmup 1 --steps 3 --json "$out/bench-train-gpt2-accum.json"
    ;;
parity)
    p="$out/parity"
    run 300 python3 scripts/anchors/torch_step_parity.py --config small --steps 100 --device cuda --out "$p" --presets 32-true,bf16-mixed,16-mixed,bf16-true
    for b in cuda wgpu; do
        for preset in 32-true bf16-mixed 16-mixed bf16-true; do
            eps=1e-8; [ "$preset" = bf16-true ] && eps=1e-4
            run 150 $m train --config small --precision $preset --adam-eps $eps --steps 100 --eval-interval 100 --backend $b \
                --init "$p/parity_small_init.safetensors" --batches "$p/parity_small_batches.npy" --out "$p/$b-$preset"
        done
    done
    run 30 python3 scripts/anchors/torch_step_parity.py --config small --out "$p" --compare "$p"/*-*/train.json
    ;;
*) echo "unknown stage '$stage' (quick, again, correct, cuda, bench, wgrad, tune, train, steps, dist, gpt2, parity)" >&2; exit 2 ;;
esac
