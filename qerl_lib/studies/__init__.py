"""Floor 6, the analyses behind the notebooks (quantization error, kernel roofline, AQN noise, entropy).
May import train, evals, bench and every floor below.
"""
