"""Small bundled request traces (package data). See ATTRIBUTION.md for sources and licences;
``simulator.workload.bundled`` loads them by name."""
