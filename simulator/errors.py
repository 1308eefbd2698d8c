"""The one exception type users see: a bad input, named with the value and what is allowed."""


class SimulatorInputError(ValueError):
    """A trace row, spec, option or setting the simulator cannot accept."""
