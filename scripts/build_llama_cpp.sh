#!/usr/bin/env bash
# Builds the llama.cpp baseline that `pdserve bench quant` runs side by side with pdserve:
# llama-bench and llama-batched-bench from the vendored sources of the llama-cpp-python sdist
# (PyPI is the only source reachable here), one build per instruction set.
#
#   bash scripts/build_llama_cpp.sh [DIR] [avx512|avx2|all]
#
# DIR/cbuild/bin       this CPU's AVX-512 and VNNI options, set one by one from /proc/cpuinfo,
#                      AMX off. Not GGML_NATIVE: -march=native compiles ggml's AMX path in
#                      whatever the GGML_AMX_* options say, and on Xeon VMs that report AMX it
#                      died (SIGILL on one, SIGSEGV in ggml_backend_amx_mul_mat on another).
# DIR/cbuild-avx2/bin  GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C only, every AVX-512/VNNI/AMX option off.
# About 20 minutes per build on 2 cores.
set -euo pipefail
DIR=${1:-/work/llama-build}
WHICH=${2:-all}
VERSION=0.3.36
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d src ]; then
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
    mkdir -p src
    tar -xzf "llama_cpp_python-$VERSION.tar.gz" -C src --strip-components=1
fi
SRC="$DIR/src/vendor/llama.cpp"
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF)
TARGETS=(--target llama-bench llama-batched-bench)
if [ "$WHICH" = all ] || [ "$WHICH" = avx512 ]; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo) "
    has() { [[ $flags == *" $1 "* ]] && echo ON || echo OFF; }
    cmake -S "$SRC" -B cbuild "${COMMON[@]}" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512bw)" \
        -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" \
        -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)" \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    cmake --build cbuild -j "$(nproc)" "${TARGETS[@]}"
fi
if [ "$WHICH" = all ] || [ "$WHICH" = avx2 ]; then
    cmake -S "$SRC" -B cbuild-avx2 "${COMMON[@]}" -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
        -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
        -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    cmake --build cbuild-avx2 -j "$(nproc)" "${TARGETS[@]}"
fi
ls -1 "$DIR"/cbuild*/bin/llama-bench
