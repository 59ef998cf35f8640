"""Floor 1, the tasks: problem generators and loaders (arithmetic levels, GSM8K), answer extraction, rewards
and the verifier. Ground floor: may import only the utilities (errors, io, paths).
"""
