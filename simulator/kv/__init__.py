"""KV-cache formats and their pool accounting (bytes from sglang_diffkv.layout)."""
