"""Floor 5, benchmarks: GEMM and rollout timings with provenance, fixed-width tables and JSON.
May import engine and every floor below; not train, evals or studies.
"""
