"""The one exception a bad harness input raises, naming the value and what is allowed."""

from sglang_diffkv.serving_io.errors import InputError


class BenchInputError(InputError):
    """A configuration name, rate, option or file the benchmark harness cannot accept. Traces
    and server logs (``sglang_diffkv.serving_io``) raise its base, ``InputError``."""
