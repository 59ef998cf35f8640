"""Floor 1, the number formats: NVFP4 (bit-exact with compressed-tensors) and the formats it is compared with
(MXFP4, NF4). May import only the utilities (errors, io, paths).
"""
