#!/usr/bin/env bash
# One background job on the device machine, from the repository root, carrying .whl (the machine goes back
# 30 s after a call ends, so long work runs detached and is polled):
#   bash dev/sweeps/gpu_job.sh start 'python3 -m pytest -q -m cuda tests/x.py > $OUT/x.log 2>&1; python3 dev/sweeps/y.py > $OUT/y.log 2>&1'
#   bash dev/sweeps/gpu_job.sh poll 560    # waits up to 560 s; what is done so far comes back as $OUT/job.tgz
# Before a job, check its qerl commands here on the CPU: .venv/bin/python dev/sweeps/check_job.py SCRIPT.sh
# The commands run in a copy of the tree with PYTHONPATH set and OUT pointing at the job's output folder;
# device.txt (nvidia-smi) is written first. Poll again at once until it prints FINISHED.
# `qerl bench train` also needs bitsandbytes (the presets' 8-bit AdamW) and the embedded model (its tokenizer); with
# this tree (~25 MB) neither fits one call beside .whl, so they travel in parts of <= 24 MB:
#   here, once:   bash dev/sweeps/gpu_job.sh parts          (.bnb0 .bnb1 from .whl_bnb; .gguf_a1 ... .gguf_b2 from
#                                                            .gguf_a/.gguf_b, each a folder with one file p)
#   there, one call per part, carrying that folder alone:   bash dev/sweeps/gpu_job.sh part .bnb0   (... .gguf_b2)
#   then the job's commands begin with
#     bash dev/sweeps/gpu_job.sh assemble && export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
#   (assemble checks the sha256s, installs bitsandbytes into /tmp/site_bnb, writes the GGUF, runs prepare-model;
#   with only the two .bnb parts sent, it installs bitsandbytes alone).
# Random-weight runs need only the embedded model's tokenizer, not its weights: `bash dev/sweeps/gpu_job.sh tokcache`
# here writes .tokcache (3.4 MB, the converted folder without model.safetensors); carry it with .bnb0 or .bnb1 and
# start the job's commands with `export QERL_CACHE=$PWD/.tokcache` instead of sending the four GGUF parts.
# The whole CUDA suite (~9.5 min on an H200, dev/LOG.md 101): with the two .bnb parts and .tokcache as above,
#   python3 -m pytest -m cuda tests/ --ignore=tests/test_hygiene.py   (that CPU-only file needs nbformat, absent there)
set -euo pipefail
OUT=${OUT:-/tmp/out}
JOB=/tmp/job
case "${1:-}" in
  start)
    rm -rf $JOB && mkdir -p $JOB/out && cp -r . $JOB/tree
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    printf '%s\n' "$2" > $JOB/commands.sh
    cd $JOB/tree
    (nohup setsid bash -c "export PYTHONPATH=/tmp/site:$JOB/tree PYTHONUNBUFFERED=1 OUT=$JOB/out
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $JOB/out/device.txt
      bash $JOB/commands.sh; echo done > $JOB/out/DONE" > $JOB/nohup.log 2>&1 &)
    echo started ;;
  poll)
    end=$((SECONDS + ${2:-560}))
    while [ ! -f $JOB/out/DONE ] && [ $SECONDS -lt $end ]; do sleep 10; done
    # one tarball of everything so far (the device tool brings back a limited number of files), DONE beside it
    mkdir -p "$OUT" && tar czf "$OUT/job.tgz" -C $JOB/out . && { [ ! -f $JOB/out/DONE ] || cp $JOB/out/DONE "$OUT"/; }
    for f in $JOB/out/*.log; do [ -f "$f" ] && { echo "== $(basename $f)"; tail -4 "$f"; }; done
    [ -f $JOB/out/DONE ] && echo FINISHED || echo RUNNING ;;
  parts)  # here
    rm -rf .bnb0 .bnb1 && mkdir .bnb0 .bnb1
    whl=$(ls .whl_bnb/bitsandbytes-*.whl) && tmp=$(mktemp -d) && split -b 22M -d -a 1 "$whl" "$tmp/p."
    mv "$tmp/p.0" .bnb0/p && mv "$tmp/p.1" .bnb1/p && basename "$whl" > .bnb1/name && sha256sum "$whl" | cut -d' ' -f1 > .bnb1/sha256
    for half in a b; do
      src=$(ls .gguf_$half/part*) && rm -rf .gguf_${half}1 .gguf_${half}2 && mkdir .gguf_${half}1 .gguf_${half}2
      split -n 2 -d -a 1 "$src" "$tmp/g." && mv "$tmp/g.0" .gguf_${half}1/p && mv "$tmp/g.1" .gguf_${half}2/p
    done
    cp .gguf_b/sha256 .gguf_b2/sha256 && rm -rf "$tmp"
    for d in .bnb0 .bnb1 .gguf_a1 .gguf_a2 .gguf_b1 .gguf_b2; do
      grep -qxF "/$d/" "$(git rev-parse --git-dir)/info/exclude" || echo "/$d/" >> "$(git rev-parse --git-dir)/info/exclude"
    done
    du -sh .bnb? .gguf_?? ;;
  tokcache)  # here: the converted embedded folder without its weights (the tokenizer of random-weight runs)
    src=$(.venv/bin/python -c "from qerl_lib.models.embedded import prepare_embedded_model as p; print(p(quiet=True))")
    dst=.tokcache/models/$(basename "$src") && rm -rf .tokcache && mkdir -p "$dst"
    find "$src" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$dst"/ \;
    grep -qxF "/.tokcache/" "$(git rev-parse --git-dir)/info/exclude" || echo "/.tokcache/" >> "$(git rev-parse --git-dir)/info/exclude"
    du -sh .tokcache ;;
  part)  # there, carrying folder $2 alone
    mkdir -p /tmp/parts && cp "$2/p" "/tmp/parts/${2#.}" && for f in name sha256; do [ -f "$2/$f" ] && cp "$2/$f" "/tmp/parts/${2#.}.$f"; done
    ls /tmp/parts ;;
  assemble)  # there, after every part
    P=/tmp/parts; whl="/tmp/parts/$(cat $P/bnb1.name)"
    cat $P/bnb0 $P/bnb1 > "$whl" && echo "$(cat $P/bnb1.sha256)  $whl" | sha256sum -c
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_bnb "$whl" 2>&1 | tail -2
    [ -f $P/gguf_a1 ] || { echo "no GGUF parts: bitsandbytes only"; exit 0; }  # e.g. an NF4 rollout needs no tokenizer
    mkdir -p /tmp/qerl && G=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
    cat $P/gguf_a1 $P/gguf_a2 $P/gguf_b1 $P/gguf_b2 > $G && echo "$(cat $P/gguf_b2.sha256)  $G" | sha256sum -c
    QERL_GGUF=$G python3 -m qerl_lib prepare-model 2>&1 | tail -1 ;;
  *) echo "usage: $0 start '<commands>' | poll [seconds] | parts | part FOLDER | assemble" >&2; exit 2 ;;
esac
