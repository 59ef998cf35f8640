"""Floor 5, training: GRPO/DAPO on TRL with the kit's engine as rollout function, presets, metrics, and AQN.
May import engine and every floor below; not evals, bench or studies (same or higher floors).
"""
