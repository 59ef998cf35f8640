#!/usr/bin/env bash
# GPU run of `qerl bench rollout --engines kit,vllm` for #17: the kit's engine and vLLM 0.24 on the same random-weight
# Qwen2.5-7B checkpoints, prompts, adapters and lengths, one after the other on one H100.
# Set-up (../shared/gpu/vllm/README.md): `bash ../shared/gpu/vllm/prepare.sh` here fills .vl1 ... .vl7 (56 MiB each,
# which with this tree's ~24 MB pass the 64 MiB a call carries), then `bash dev/sweeps/vllm_peer_gpu.sh split` here
# packs the wheels into one tar cut into 30 MiB parts .vlp00, .vlp01, ... (this tree is ~33 MB of a call's 64 MiB).
# On the device, one call right after another
# while the machine is held:
#   carry .vlpNN alone, run `bash dev/sweeps/vllm_peer_gpu.sh vl NN`        (NN = 00, 01, ... as `split` listed)
#   carry .whl, run `bash dev/sweeps/vllm_peer_gpu.sh install start` (or `install start-r16`: the short set;
#   `install start-h200`: the short set's NVFP4 rows and the uneven workload, section 152;
#   `install start-nf4`: NVFP4 against QLoRA's NF4 in both engines, after bitsandbytes is assembled, see start-nf4)
#   then `bash dev/sweeps/vllm_peer_gpu.sh poll 560` until it prints "done" (results come back under $OUT).
# "start" runs the three benchmarks in the background (the whole run is longer than one 10-minute call):
#   1. nvfp4, batch 8/32/64/128, LoRA rank 0/16, 256 + 1024, fixed lengths, kit then vLLM;
#   2. nvfp4 + r16, the gsm8k-like workload (256 prompts, lengths up to 1024) on 64 rows: kit static and continuous,
#      vLLM (which schedules continuously by itself);
#   3. as 1 with bf16 weights;
# then merges them into one results document.
set -euo pipefail
BG=/tmp/bg
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
launch() {  # start the job whose commands come on stdin, detached (PYTHONPATH: $1, default /tmp/site:/tmp/kit)
  mkdir -p "$BG" /tmp/vw
  { printf '%s\n' 'set -uo pipefail' 'cd /tmp/kit' "export PYTHONPATH=${1:-/tmp/site:/tmp/kit} PYTHONUNBUFFERED=1" \
      'nvidia-smi --query-gpu=name,memory.total --format=csv > /tmp/bg/gpu.txt'
    cat; echo 'touch /tmp/bg/done'; } > "$BG/run.sh"
  (nohup setsid bash "$BG/run.sh" > "$BG/run_log.txt" 2>&1 &)
  echo started
}
while [ $# -gt 0 ]; do
  case $1 in
    split)  # here, after ../shared/gpu/vllm/prepare.sh
      stage=$(mktemp -d); cp .vl?/* "$stage"/
      (cd "$stage" && cat vlpart.? > "$(cat vllm.name)" && echo "$(cat vllm.sha256)  $(cat vllm.name)" | sha256sum -c &&
        tar cf vl.tar ./*.whl && split -b 30M -d -a 2 vl.tar vlp.)
      rm -rf .vlp?*; for f in "$stage"/vlp.??; do mkdir ".vlp${f##*.}"; mv "$f" ".vlp${f##*.}/p"; done
      last=$(ls -d .vlp?? | tail -1); sha256sum "$stage/vl.tar" | cut -d' ' -f1 > "$last/sha256"; rm -rf "$stage"
      grep -qxF "/.vlp*/" "$(git rev-parse --git-dir)/info/exclude" || echo "/.vlp*/" >> "$(git rev-parse --git-dir)/info/exclude"
      du -sh .vlp?? ;;
    vl)
      mkdir -p /tmp/vl && cp ".vlp$2/p" "/tmp/vl/p$2" && { [ ! -f ".vlp$2/sha256" ] || cp ".vlp$2/sha256" /tmp/vl/sha256; }
      ls /tmp/vl; shift ;;
    install)  # every part sent; the last one brought the tar's sha256
      cat /tmp/vl/p?? > /tmp/vl/vl.tar && echo "$(cat /tmp/vl/sha256)  /tmp/vl/vl.tar" | sha256sum -c &&
        (cd /tmp/vl && tar xf vl.tar && rm vl.tar p?? &&
         python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite ./*.whl 2>&1 | tail -2)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
      mkdir -p /tmp/kit && cp -r qerl_lib data pyproject.toml /tmp/kit/ ;;
    start-r16)  # the short set (dev/LOG.md section 37, run 7): NVFP4 + r16 at batch 8/32/64/128, kit then vLLM; the
      # kit's bf16 + r16 at batch 32/64 (the NVFP4 / bf16 ratio); then the merge
      launch <<'EOF'
common=(--models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 --no-hf-baseline)
python3 -m qerl_lib bench rollout "${common[@]}" --engines kit,vllm --vllm-pythonpath /tmp/vsite:/tmp/site \
  --vllm-workdir /tmp/vw --weights nvfp4 --batch 8,32,64,128 --lora-rank 16 \
  --json /tmp/bg/vllm_fixed_nvfp4_r16.json > /tmp/bg/log_fixed_nvfp4.txt 2>&1
python3 -m qerl_lib bench rollout "${common[@]}" --weights bf16 --batch 32,64 --lora-rank 16 \
  --json /tmp/bg/kit_fixed_bf16_r16.json > /tmp/bg/log_fixed_bf16.txt 2>&1
python3 -m qerl_lib bench rollout --merge /tmp/bg/vllm_fixed_nvfp4_r16.json /tmp/bg/kit_fixed_bf16_r16.json \
  --json /tmp/bg/merged.json > /tmp/bg/table.txt 2>&1
EOF
      ;;
    start-h200)  # dev/LOG.md section 152: the kit and vLLM 0.24 in one run on an H200 (they have met there only at
      # batch 8, section 54): NVFP4 + r16 at batch 8/32/64/128, 256 + 1024; then the gsm8k-like workload on 64 rows
      # (kit static and continuous, vLLM); then the merge
      launch <<'EOF'
python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 --no-hf-baseline \
  --engines kit,vllm --vllm-pythonpath /tmp/vsite:/tmp/site --vllm-workdir /tmp/vw \
  --weights nvfp4 --batch 8,32,64,128 --lora-rank 16 --json /tmp/bg/vllm_fixed_nvfp4_r16.json > /tmp/bg/log_fixed_nvfp4.txt 2>&1
python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 --no-hf-baseline \
  --engines kit,vllm --vllm-pythonpath /tmp/vsite:/tmp/site --vllm-workdir /tmp/vw \
  --weights nvfp4 --batch 64 --lora-rank 16 --workload gsm8k-like --prompts 256 --scheduling static,continuous \
  --json /tmp/bg/vllm_uneven_nvfp4_r16.json > /tmp/bg/log_uneven.txt 2>&1
python3 -m qerl_lib bench rollout --merge /tmp/bg/vllm_fixed_nvfp4_r16.json /tmp/bg/vllm_uneven_nvfp4_r16.json \
  --json /tmp/bg/merged.json > /tmp/bg/table.txt 2>&1
EOF
      ;;
    start-h200-large)  # dev/LOG.md section 153: 14B then 32B, NVFP4 + LoRA r32, batch 8, 256 + 2048, kit then vLLM
      launch <<'EOF'
python3 -m qerl_lib bench rollout --models qwen2.5-14b --prompt-len 256 --gen-len 2048 --repeats 2 --no-hf-baseline \
  --engines kit,vllm --vllm-pythonpath /tmp/vsite:/tmp/site --vllm-workdir /tmp/vw \
  --weights nvfp4 --batch 8 --lora-rank 32 --json /tmp/bg/vllm_14b_nvfp4_r32.json > /tmp/bg/log_14b.txt 2>&1
python3 -m qerl_lib bench rollout --models qwen2.5-32b --prompt-len 256 --gen-len 2048 --repeats 2 --no-hf-baseline \
  --engines kit,vllm --vllm-pythonpath /tmp/vsite:/tmp/site --vllm-workdir /tmp/vw \
  --weights nvfp4 --batch 8 --lora-rank 32 --json /tmp/bg/vllm_32b_nvfp4_r32.json > /tmp/bg/log_32b.txt 2>&1
python3 -m qerl_lib bench rollout --merge /tmp/bg/vllm_14b_nvfp4_r32.json /tmp/bg/vllm_32b_nvfp4_r32.json \
  --json /tmp/bg/merged.json > /tmp/bg/table.txt 2>&1
EOF
      ;;
    start-nf4)  # dev/LOG.md section 53: the paper's Fig. 1 setting (7B, batch 8, 256 + 2048, LoRA r0 / r16), NVFP4 and
      # QLoRA's NF4 base in both engines. Needs bitsandbytes first: `gpu_job.sh part .bnb0`, `part .bnb1`, then
      # `bash dev/sweeps/gpu_job.sh assemble` (into /tmp/site_bnb) before `install start-nf4`.
      launch /tmp/site:/tmp/kit:/tmp/site_bnb <<'EOF'
python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 2048 --repeats 2 --no-hf-baseline \
  --engines kit,vllm --vllm-pythonpath /tmp/vsite:/tmp/site:/tmp/site_bnb --vllm-workdir /tmp/vw \
  --weights nvfp4,nf4 --batch 8 --lora-rank 0,16 --json /tmp/bg/vllm_nf4_b8.json > /tmp/bg/log_nf4.txt 2>&1
python3 -m qerl_lib bench rollout --merge /tmp/bg/vllm_nf4_b8.json --json /tmp/bg/merged.json > /tmp/bg/table.txt 2>&1
EOF
      ;;
    start)
      launch <<'EOF'
common=(--models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 --engines kit,vllm
        --vllm-pythonpath /tmp/vsite:/tmp/site --vllm-workdir /tmp/vw)
python3 -m qerl_lib bench rollout "${common[@]}" --weights nvfp4 --batch 8,32,64,128 --lora-rank 0,16 \
  --json /tmp/bg/vllm_fixed_nvfp4.json > /tmp/bg/log_fixed_nvfp4.txt 2>&1
python3 -m qerl_lib bench rollout "${common[@]}" --weights nvfp4 --batch 64 --lora-rank 16 --workload gsm8k-like \
  --prompts 256 --scheduling static,continuous --json /tmp/bg/vllm_uneven_nvfp4.json > /tmp/bg/log_uneven.txt 2>&1
python3 -m qerl_lib bench rollout "${common[@]}" --weights bf16 --batch 8,32,64,128 --lora-rank 0,16 \
  --json /tmp/bg/vllm_fixed_bf16.json > /tmp/bg/log_fixed_bf16.txt 2>&1
python3 -m qerl_lib bench rollout --merge /tmp/bg/vllm_*.json --json /tmp/bg/merged.json > /tmp/bg/table.txt 2>&1
EOF
      ;;
    poll)
      end=$((SECONDS + $2)); shift
      while [ ! -f "$BG/done" ] && [ $SECONDS -lt $end ]; do sleep 10; done
      cp "$BG"/*.json "$BG"/*.txt "$OUT"/ 2>/dev/null || true
      tail -n 5 "$BG"/log_*.txt || true
      [ -f "$BG/done" ] && echo done || echo "still running" ;;
    *) echo "unknown part $1"; exit 2 ;;
  esac
  shift
done
