"""Floor 5, evaluation: pass@k with confidence intervals, policy entropy, lm-evaluation-harness glue.
May import engine and every floor below; not train, bench or studies.
"""
