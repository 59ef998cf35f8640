#!/usr/bin/env bash
# GPU runs of `qerl bench train` for #18 (random-weight Qwen2.5-7B, H100).
# Part "trainer": batch 8, 256 + 2048, LoRA r32, modes lora/nvfp4/qerl: the trainer phase with the NVFP4
#   backward on the FP4 kernel path (kernels/fp4_gemm.fp4_grad_input), against bf16 LoRA, same run.
# Parts "spread-start" / "spread-poll": the spread of the trainer phase (7B lora and nvfp4, batch 8, 6 steps, two
#   processes each) that earlier runs saw as bimodal for lora (4.43 / 2.66 / 4.40 s), in the background.
# Part "preset-MODE": the qwen2.5-7b-gsm8k preset's own settings (16 x 8 completions of <= 4096 tokens, micro-batch 8,
#   128 rollout rows, rank 32) for 3 steps, μ = 1 (the preset's 4 repeats the same micro-batches: same peak, 4x the
#   trainer phase, which would not fit one 10-minute device call).
# Run on the device machine from the repository root: bash dev/sweeps/train_step_gpu.sh PART..., carrying .whl.
# The presets' 8-bit AdamW and the NF4 base need bitsandbytes: .whl and .whl_bnb together pass the 64 MiB a call
# carries, so a call before it carries .whl_bnb alone and runs `bash dev/sweeps/train_step_gpu.sh bnb`
# (installs it into /tmp/site_bnb, which stays while the machine is held). The trainer takes its tokenizer from the
# embedded model: calls carrying .gguf_a1, .gguf_a2, .gguf_b1 alone copy their quarter (`cp .gguf_XN/p /tmp/qerl/`
# under the names p1, p2, p3), then the call with .gguf_b2 and .whl runs part "gguf" first.
set -euo pipefail
if [ "${1:-}" = bnb ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_bnb .whl_bnb/*.whl 2>&1 | tail -2
  ls /tmp/site_bnb; exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/site_bnb:$PWD
GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] && export QERL_GGUF=$GGUF
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for part in "$@"; do
  case $part in
    gguf)
      cat /tmp/qerl/p1 /tmp/qerl/p2 /tmp/qerl/p3 .gguf_b2/p > "$GGUF"
      echo "$(cat .gguf_b2/sha256)  $GGUF" | sha256sum -c
      export QERL_GGUF=$GGUF
      python3 -m qerl_lib prepare-model | tail -2 ;;
    trainer)
      python3 -m qerl_lib bench train --models qwen2.5-7b --modes lora,nvfp4,qerl --batches 8 \
        --json "$OUT/train_7b_fp4_backward.json" ;;
    spread-start)  # the trainer phase's spread: 7B lora and nvfp4, batch 8, 6 steps, two processes each, in the
      # background (longer than one call); `spread-poll` waits for it and copies what it has to $OUT
      mkdir -p /tmp/bg2 && cp -r qerl_lib data pyproject.toml /tmp/bg2/
      (cd /tmp/bg2 && nohup setsid bash -c 'for run in a b; do python3 -m qerl_lib bench train --models qwen2.5-7b \
        --modes lora,nvfp4 --batches 8 --steps 6 --json /tmp/bg2/train_7b_spread_$run.json; done > /tmp/bg2/log.txt 2>&1;
        touch /tmp/bg2/done' > /dev/null 2>&1 &)
      echo started ;;
    spread-poll)
      end=$((SECONDS + 540))
      while [ ! -f /tmp/bg2/done ] && [ $SECONDS -lt $end ]; do sleep 10; done
      cp /tmp/bg2/*.json /tmp/bg2/log.txt "$OUT"/ 2>/dev/null || true
      tail -n 8 /tmp/bg2/log.txt; [ -f /tmp/bg2/done ] && echo done || echo "still running" ;;
    preset-*)
      python3 -m qerl_lib bench train --models qwen2.5-7b --modes "${part#preset-}" --preset-settings \
        --num-iterations 1 --steps 3 --json "$OUT/train_7b_preset_${part#preset-}.json" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
