"""Floor 3, models: the NVFP4Linear layer and fused groups, compressed-tensors checkpoints, loading, LoRA,
the embedded SmolLM2. May import kernels, quant, the ground floor and the utilities.
"""
