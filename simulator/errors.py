"""The one exception type users see: a bad input, named with the value and what is allowed."""

from sglang_diffkv.serving_io.errors import InputError


class SimulatorInputError(InputError):
    """A trace row, spec, option or setting the simulator cannot accept. Traces and server
    logs (``sglang_diffkv.serving_io``) raise its base, ``InputError``: catch that one to
    report every bad input."""
