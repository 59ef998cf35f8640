"""Floor 2, the GPU kernels: the NVFP4 x bf16 GEMMs (Triton, and CUDA mma.sync for small M), their launch
rules, and programmatic dependent launch. May import quant and the utilities.
"""
