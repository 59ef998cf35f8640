"""Errors a user can fix. Raised anywhere in the kit, printed by the CLI as one line.

Messages name the problem *and the fix* ("... pass --data path/to/test.jsonl").
`UserError` subclasses `ValueError` so library callers can catch it the usual way.
"""


class UserError(ValueError):
    """Bad input with a known fix; the CLI prints it as a single line, no traceback."""


class TrainingDiverged(UserError):
    """A training run's trainable weights became non-finite; it stopped there (``step``), no checkpoint
    or adapter of the broken weights was written. Sweeps record such a run as diverged."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step
