#!/usr/bin/env bash
# Builds the llama backend the way llama.cpp's own release builds ship the CPU backend:
# ggml as loadable modules (GGML_BACKEND_DL), one CPU backend per instruction-set level
# (GGML_CPU_ALL_VARIANTS' recipes), the best one for the running CPU picked at load time by
# ggml's score function (flashdraft/targets/cpu_backend.py calls ggml_backend_load_all_from_path).
#
# usage: scripts/build_llama.sh PYTHON VERSION [VARIANT ...]
#   1. pip builds llama-cpp-python VERSION (the binding, libllama, libggml, libggml-base) with a
#      baseline x86-64 CPU backend (no SIMD beyond SSE2): the fallback every x86-64 CPU runs;
#   2. the same sources' CPU variants (default: haswell alderlake skylakex icelake zen4) are
#      built with CMake and copied beside it in llama_cpp/lib.
# Before building, the patches in scripts/llama-patches/ are applied to the vendored llama.cpp
# (fa-split-kv-env.patch: GGML_CPU_FA_SPLIT_KV=0 keeps one query row's flash attention on one
# thread, so one-token steps on every thread equal verify rows; docs/performance.md, "Threads").
# Not built: sapphirerapids (the only variant with AMX code, which crashed in
# ggml_backend_amx_mul_mat, llama.cpp #20824); an AMX CPU gets zen4 (AVX512-BF16/VNNI/VBMI).
# The older AVX-only levels (sse42, sandybridge, ivybridge, piledriver) fall back to x64, and
# cannonlake / cascadelake / cooperlake to skylakex or icelake: each variant costs ~35 s of
# 2-core build time (docs/performance.md, "CPU backend variants").
set -euo pipefail
py=$1; version=$2; shift 2
variants=${*:-haswell alderlake skylakex icelake zen4}
jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
say() { echo "[build llama.cpp $(( $(date +%s) - start ))s] $*"; }

say "fetching llama-cpp-python $version's sources"
"$py" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src=$work/llama_cpp_python-$version
patches=$(cd "$(dirname "$0")" && pwd)/llama-patches
for p in "$patches"/*.patch; do
  (cd "$src/vendor/llama.cpp" && git apply -p1 "$p") || { echo "error: $p does not apply to llama-cpp-python $version"; exit 1; }
  say "applied $(basename "$p")"
done

common="-DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
 -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
baseline="-DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_BMI2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF \
 -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"
say "step 1/2: the binding and libllama with the baseline CPU backend (pip, ~3 min on 2 cores; -v shows the compiler)"
CMAKE_ARGS="-DLLAVA_BUILD=OFF $common $baseline" CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
  "$py" -m pip install -q --no-cache-dir --force-reinstall --no-deps "$src"
# its Python dependencies (diskcache, jinja2, ...): pip installs what is missing and leaves the
# build just made in place (--force-reinstall above would otherwise reinstall numpy and the rest)
"$py" -m pip install -q "llama-cpp-python==$version"

lib=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llama_cpp'); \
print(pathlib.Path(list(s.submodule_search_locations)[0]) / 'lib')")
say "step 2/2: CPU variants $variants (~35 s each on 2 cores)"
# shellcheck disable=SC2086
cmake -S "$src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_CPU_ALL_VARIANTS=ON -DLLAMA_BUILD_COMMON=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
  -DCMAKE_INSTALL_RPATH='$ORIGIN' $common > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
for v in $variants; do
  cmake --build "$work/build" --target "ggml-cpu-$v" -j "$jobs" > "$work/build-$v.log" 2>&1 \
    || { tail -30 "$work/build-$v.log"; exit 1; }
  cp "$work/build/bin/libggml-cpu-$v.so" "$lib/"
  say "  built libggml-cpu-$v.so"
done
say "done: $(ls "$lib" | grep -c 'libggml-cpu') CPU backends in $lib"
