"""The one exception a bad harness input raises, naming the value and what is allowed."""


class BenchInputError(ValueError):
    """A configuration name, rate, option or file the benchmark harness cannot accept."""
