"""Small bundled request traces (package data). See ATTRIBUTION.md for sources and licences;
``sglang_diffkv.serving_io.bundled`` loads them by name."""
