#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on a GPU machine without a package index.
#
#   tools/gpu_wheels.sh                                   # into .whl/ (ignored by git)
#   FLASHINFER_VERSION=0.6.18.post1 tools/gpu_wheels.sh   # another flashinfer than the pinned one
#
# Run it where the package index is reachable, then carry the repository with its .whl/
# folder to the GPU machine. The list, with why each wheel is there, is tools/gpu_wheels.txt:
# flashinfer and the rest of the `cuda` extra, nanoqwen's dependencies, and what the test
# files import, for CPython 3.12 on manylinux x86_64. Never torch: the GPU machine's own CUDA
# build is the one to test. Each wheel comes without its needs (--no-deps), because
# resolving them would fetch torch, triton and gigabytes of optional kernel libraries;
# tools/gpu_wheels.py then checks that every need is met (by another wheel, by what a CUDA
# PyTorch image has, or left out on purpose) and that all of them fit in 64 MiB.
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=.whl
LIMIT_MIB=64
PYTHON=${PYTHON:-python3}
# The wheels' tags: the GPU machine's Python, and the manylinux levels its glibc runs.
TARGET=(--python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

requirements=$(grep -v '^\s*#' tools/gpu_wheels.txt | sed 's/#.*//; /^\s*$/d')
if [[ -n ${FLASHINFER_VERSION:-} ]]; then
    requirements=$(sed "s/^flashinfer-python==.*/flashinfer-python==$FLASHINFER_VERSION/" \
        <<<"$requirements")
fi

# Into a fresh folder, swapped in only once complete: a wheel left over from an earlier
# list would sit beside its newer version, and pip refuses to install two.
staging=$(mktemp -d "${DEST}.partial.XXXXXX")
trap 'rm -rf "$staging"' EXIT
# shellcheck disable=SC2086  # one requirement per word
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: "${TARGET[@]}" \
    --dest "$staging" $requirements

if ! "$PYTHON" tools/gpu_wheels.py "$staging" --limit-mib "$LIMIT_MIB"; then
    echo "gpu_wheels: the wheels above are incomplete or too large; $DEST left as it was" >&2
    exit 1
fi
rm -rf "$DEST"
mv "$staging" "$DEST"
echo "gpu_wheels: $(find "$DEST" -type f -name '*.whl' | wc -l) wheels in $DEST/," \
     "$(du -sh "$DEST" | cut -f1) on disk; next, on the GPU machine: tools/gpu_check.sh OUTDIR"
