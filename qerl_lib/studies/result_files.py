"""What each entry of ``results/`` holds: the one place those descriptions live (results/README.md's "what" column,
rendered by ``studies/headline.results_index``; a test keeps this list and the folder equal)."""

from __future__ import annotations

RESULT_FILES = {
    "gemm_h100_v5.json": "NVFP4 x BF16 GEMM vs cuBLAS bf16 on every Qwen2.5-7B/32B projection shape, M = 1...4096, "
                         "forward (x @ W^T) and backward (dy @ W) layouts (`path`: the CUDA mma.sync kernel at M <= 8, "
                         "the Gluon kernels at 25-128 rows (the producer-warp one on most shapes at 32 and 64 rows), "
                         "the producer-warp Gluon kernel on gate/up at M = 256 "
                         "and 1024 and on down at 256, Triton's fragment kernel at the other small sizes, dequantize + cuBLAS elsewhere "
                         "and for the backward layout); every output checked against the oracle. Notebook 03; "
                         "`figures/03_gemm_speedup.png`, `figures/03_gemm_bandwidth.png`",
    "rollout_h100.json": "rollout engine: engine vs `transformers.generate` (SmolLM2 bf16, batch 64, "
                         "256 + 512 tokens); bf16 vs NVFP4 on Qwen2.5-7B/32B shapes (batch 8, 256 + 2048 tokens); 7B at "
                         "bf16 and NVFP4 at LoRA rank 0/16/64 with the engine's LoRA kernels (`kernels/lora.py`; 2026-11-28, "
                         "dev/LOG.md section 41, `dev/runs/lora_one_launch_h100_2026-11-28/run3/`); three runs merged. "
                         "Notebook 03; `figures/03_rollout.png`",
    "rollout_vllm_h100.json": "the kit's engine and vLLM 0.24.0 (Marlin FP4, punica LoRA, CUDA graphs; version in the "
                              "rows' `backend`, logs in `dev/runs/fp4_wgmma_mid_h100_2026-11-25/engine_vllm/`) one after "
                              "the other on the same random-weight Qwen2.5-7B checkpoints, prompts and adapters (`--engines "
                              "kit,vllm`): bf16 and NVFP4, LoRA rank 0/16, batch 8/32/64/128, 256 + 1024 tokens; and "
                              "NVFP4 + r16 on 256 GSM8K-like completions of <= 1024 tokens over 64 rows (kit static "
                              "and continuous, vLLM); three runs merged (2026-11-25: the kit's NVFP4 rows predate the "
                              "producer kernel at decode sizes, see `rollout_vllm_r16_h100.json`)",
    "rollout_r16_h100.json": "the kit's engine alone, NVFP4 and bf16 with LoRA r16 in one process, batch 32/64, "
                             "256 + 1024 tokens, with every NVFP4 GEMM of the decode step a PDL launch (dev/LOG.md "
                             "section 40; `ab_1_1.json` in `dev/runs/producer_pdl_h100_2026-11-28/`)",
    "rollout_vllm_r16_h100.json": "the kit's engine and vLLM 0.24.0 in one run, as `rollout_vllm_h100.json`, with the "
                                  "decode-size producer kernel (dev/LOG.md section 37): NVFP4 + LoRA r16 at batch "
                                  "8/32/64/128, kit and vLLM; the kit's bf16 + r16 at batch 32/64; 256 + 1024 tokens "
                                  "(logs in `dev/runs/vllm_r16_h100_2026-11-27/`)",
    "rollout_14b_h100.json": "bf16 vs NVFP4 on Qwen2.5-14B shapes, LoRA rank 0 and 32, batch 8, 256 + 2048 tokens "
                             "(2026-11-28, dev/LOG.md section 41, `dev/runs/lora_one_launch_h100_2026-11-28/run3/`; summary "
                             "recomputed by `--merge`)",
    "gemm_marlin_peer_h200.json": "the forward FP4 GEMM at M = 1024 and 4096 on the Qwen2.5-7B projection shapes: "
                                  "cuBLAS bf16, the kit's `fp4_linear` and vLLM 0.24's Marlin FP4, one process, each "
                                  "output checked against the kit's oracle (dev/LOG.md section 55, "
                                  "`dev/runs/marlin_peer_h200_2026-11-28/`)",
    "rollout_vllm_h200.json": "the kit's engine and vLLM 0.24.0 one after the other on the same random-weight "
                              "checkpoints, prompts and adapters (`--engines kit,vllm`) on an H200: Qwen2.5-7B NVFP4 + "
                              "LoRA r16 at batch 8/32/64/128, 256 + 1024 tokens; 256 GSM8K-like completions of <= 1024 "
                              "tokens over 64 rows (kit static and continuous, vLLM); Qwen2.5-14B and 32B NVFP4 + r32 "
                              "at batch 8, 256 + 2048 (dev/LOG.md sections 152-153, "
                              "`dev/runs/vllm_peer_h200_2026-11-30/`); two runs merged",
    "rollout_nf4_h200.json": "NVFP4 against QLoRA's base (bitsandbytes NF4), random-weight Qwen2.5-7B: batch 8, "
                             "256 + 2048 tokens, LoRA rank 0/16, in the kit's engine and in vLLM 0.24 in one run "
                             "(dev/LOG.md section 54, `dev/runs/vllm_nf4_h200_2026-11-28/`); batch 32, 256 + 1024, "
                             "r16, the kit's engine (section 50, `dev/runs/nf4_rollout_h200_2026-11-28/`)",
    "rollout_lora_merge_h200.json": "bf16 + LoRA rank 16/64 on random-weight Qwen2.5-7B with the adapters merged into "
                                    "engine-owned weight copies (`RolloutEngine(lora_merge=True)`, `engine/merged.py`) "
                                    "and unmerged, with the rank-0 row, one process per batch, one repeat per row: "
                                    "batch 8, 256 + 2048; batch 32, 256 + 1024 (dev/LOG.md sections 58-61, "
                                    "`dev/runs/lora_merge_h200_2026-11-28/kernel_dot/`)",
    "train_step_merge_h200.json": "`qerl bench train` at 7B and 14B, batch 8, 256 + 2048 tokens, LoRA r32: modes qerl "
                                  "and lora, lora's rollout with the adapters merged (`--rollout-lora-merge`) and "
                                  "unmerged, the KV cache remappable (`engine/remap.py`), one run, three measured steps "
                                  "per case (dev/LOG.md section 107, `dev/runs/train_remap_h200_2026-11-29/`); and the "
                                  "7B GSM8K preset's own step, qerl and lora merged, one measured step each (section 68, "
                                  "`dev/runs/preset_step_h200_2026-11-28/`); and data parallel: 7B qerl, batch 16 "
                                  "and 64 in 2 groups, on one and on two GPUs of a 2-GPU H200 machine, the KV cache "
                                  "remappable, two measured steps per case (section 111, "
                                  "`dev/runs/two_gpu_remap_h200x2_2026-11-29/`); and the 32B step at batch 2, qerl "
                                  "and lora, two measured steps each (section 108, "
                                  "`dev/runs/train_32b_h200_2026-11-29/`); and Tab. 3's batch-2 step at 7B and 14B, "
                                  "qerl and lora, two measured steps each (section 111); and the 32B step at batch "
                                  "8, qerl and lora, two measured steps each (section 118, "
                                  "`dev/runs/tab3_tab8_h200x2_2026-11-29/`); and Tab. 3's batch-4 step at 7B and "
                                  "14B, qerl and lora, five measured steps each (section 118, "
                                  "`dev/runs/b4_rerun_h200x2_2026-11-29/`); eight runs merged by "
                                  "`dev/sweeps/merge_train_merge_h200.py`",
    "rollout_h200.json": "bf16 vs NVFP4 on Qwen2.5-7B/32B shapes, batch 8, 256 + 2048 tokens; engine vs "
                         "`transformers.generate`, SmolLM2 bf16, batch 64, 256 + 512 tokens; the 7B GSM8K preset's "
                         "rollout phase (128 rows, 256 + 4096, LoRA r32: NVFP4, bf16 merged and unmerged; dev/LOG.md "
                         "section 64, `dev/runs/preset_rollout_h200_2026-11-28/`); three runs merged",
    "rollout_step_breakdown_h200.json": "where a 7B decode step's time goes (kernel time per category, idle time, "
                                        "kernels per step) at 256/1280/2240 cached tokens, NVFP4 and bf16; profiled "
                                        "before programmatic dependent launch and the Triton glue kernels (dev/LOG.md). "
                                        "Notebook 03",
    "entropy_study_cuda.json": "entropy study: SmolLM2 in BF16/NVFP4/MXFP4/NF4 on 512 GSM8K test problems, 4 samples "
                               "each, AQN σ sweep on NVFP4. Notebook 06; `figures/06_entropy_study_h200.png`",
    "claims.json": "the claims table: each training claim of the paper ((a) entropy, (b) base formats, (c) QeRL vs "
                   "LoRA and QLoRA, (d) AQN, (e) schedules, LR stability) with the paper's number, the kit's "
                   "measurement, its CI and a verdict, built from `claims/` by `qerl claims`. Notebook 07; README",
    "claims/": "one JSON per claim block (b, c, d, e, lr): every run with its endpoints, per-arm means with 95% CIs, "
               "the pre-registered paired comparisons, per-step curves, the sweep spec, GPU and versions "
               "(`qerl claims --export` from the sweep folders in `dev/runs/claims/`). Notebook 07; "
               "`figures/07_*.png`",
    "train_step_h100.json": "one GRPO step through the real trainer (`qerl bench train`): random-weight Qwen2.5-7B "
                            "(lora, qlora, nvfp4, qerl; batch 8), 14B (lora, qlora, qerl; batch 8) and 32B (qerl; "
                            "batch 2) shapes, 256 + 2048 tokens, LoRA r32, gradient checkpointing, and the 7B GSM8K "
                            "preset's own settings (lora, qlora, qerl; batch 128, `--preset-settings`, μ = 1); "
                            "rollout, training and step seconds, peak memory, the paper's number beside; merged by "
                            "`dev/sweeps/merge_train_step.py` from two runs (the 32B row predates the engine's LoRA "
                            "kernels)",
    "calibration.json": "the expression task's calibration for the claim sweeps: the untrained SmolLM2's pass@1 "
                        "and share of mixed-reward groups of 8 per (base, level, temperature), 128 training problems "
                        "each, and the setting the pre-registered rule chose (`qerl_lib/studies/calibration.py`, "
                        "`docs/claims_plan.md`)",
    "train_smollm2_qerl_h200/": "a 100-step GRPO run in mode qerl (preset smollm2-arith): `metrics.jsonl` (one line "
                                "per step), `summary.json`, `run.json` (resolved config); "
                                "`figures/05_training_h200.png` via `qerl plot-run`",
}
