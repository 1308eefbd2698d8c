"""The one exception a bad serving input raises: a trace row, a server log, a probe record or
an option, named with the value and what is allowed. The simulator's
(``simulator.errors.SimulatorInputError``) and the bench harness's
(``sglang_diffkv.bench.errors.BenchInputError``) input errors are its subclasses, so a
command catching this one reports every bad input in one line."""


class InputError(ValueError):
    """A trace, log, record or option that the serving tools cannot accept."""
