"""Floor 6, the analyses behind the notebooks and the README's tables (quantization error, kernel roofline, AQN
noise, entropy, rollout scheduling, the claim sweeps and their table, the training-step benchmark, the results
tables).
May import train, evals, bench and every floor below.
"""
