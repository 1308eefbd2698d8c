"""Traces: the internal schema, loaders for public formats, generators and the Mooncake writer."""

from simulator.workload.schema import Trace, TraceRequest

__all__ = ["Trace", "TraceRequest"]
