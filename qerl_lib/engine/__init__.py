"""Floor 4, the rollout engine: static KV cache, the decode forward, attention, fused glue kernels, LoRA in
the step, sampling. May import models and every floor below.
"""
