#!/usr/bin/env bash
# Prepares, on this machine, what benchmarks/gpu_check.sh needs on a lent GPU machine, which reaches no package
# registry and has minutes to spend:
#   .whl/     wheels of the Python packages its image lacks (pydantic and its needs, the versions of .venv here,
#             for its CPython 3.12 on x86-64);
#   .devcheck/table-1m.pt  the 1M-ad table and its requests (synthesizing them there would take about 2 minutes;
#             kept when it exists: delete it after a change of the index's scan layout).
# Both are ignored by git: name them in the device call's carry, [".whl", ".devcheck"] (about 47 MB together).
#   bash benchmarks/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
rm -rf .whl
for package in pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
    version=$("$python" -c "import importlib.metadata as m; print(m.version('$package'))")
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$package==$version"
done
if [ ! -f .devcheck/table-1m.pt ]; then
    mkdir -p .devcheck
    "$python" -m benchmarks.kernels --ads 1000000 --tile 1 --batch 1 --storage fp16 --repeats 1 --peer-pairs 0 \
        --no-write --save-table .devcheck/table-1m.pt
fi
ls -l .whl .devcheck
