"""Metrics with SGLang bench_serving's definitions, time series and SLO goodput."""
