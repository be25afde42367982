#!/usr/bin/env bash
# Wheels for the Python packages the GPU machine's image lacks, for its Python 3.12 on x86-64:
# DeepSpeed (a pure-Python wheel built here from its sdist, ops compiled there at first use) and
# its missing dependencies, bitsandbytes (CUDA 13 kernels included), jsonargparse (the CLI
# tests), torchao (FP8 training: its wheel is abi3 and takes torch >= 2.11, the image's), and
# peft with what it imports beyond transformers' own dependencies, accelerate and psutil (part
# 7's LoRA; peft and accelerate are pure Python, psutil an abi3 wheel).
# Versions are the ones installed here, so the GPU run uses what the tests passed with.
#
#   bash benchmarks/gpu/wheels.sh [DIR]      # default DIR: .whl (keep it out of git)
#
# On the GPU machine, before the suite:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"

version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done

binary=(
  "bitsandbytes==$(version bitsandbytes)"
  "pydantic==$(version pydantic)"
  "pydantic-core==$(version pydantic-core)"
  "annotated-types==$(version annotated-types)"
  "typing-inspection==$(version typing-inspection)"
  "typing-extensions==$(version typing-extensions)"
  "hjson==$(version hjson)"
  "jsonargparse==$(version jsonargparse)"
  "docstring-parser==$(version docstring-parser)"
  "typeshed-client==$(version typeshed-client)"
  "torchao==$(version torchao)"
  "peft==$(version peft)"
  "accelerate==$(version accelerate)"
  "psutil==$(version psutil)"
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dir" "${binary[@]}"
# DeepSpeed publishes only an sdist; its wheel is pure Python (ops are built at first use)
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$dir" "deepspeed==$(version deepspeed)"
ls -la "$dir"
du -sh "$dir"
