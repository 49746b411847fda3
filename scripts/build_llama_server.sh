#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp sources vendored in the pinned
# llama-cpp-python sdist (the same sources the llama backend runs), for the bench peers
# llama-server, llama-server-lookup and llama-server-dflash.
#
# usage: scripts/build_llama_server.sh PYTHON VERSION "CMAKE ARGS"
# result: ${FLASHDRAFT_CACHE:-~/.cache/flashdraft}/llama-server/VERSION/bin/llama-server
# The binary is static (BUILD_SHARED_LIBS=OFF) so it does not pick up another libllama.
set -euo pipefail
py=$1; version=$2; cmake_args=$3
cache=${FLASHDRAFT_CACHE:-$HOME/.cache/flashdraft}/llama-server/$version
bin=$cache/bin/llama-server
if [ -x "$bin" ]; then echo "llama-server already built: $bin"; exit 0; fi
start=$(date +%s)
mkdir -p "$cache"
src=$cache/src/llama_cpp_python-$version/vendor/llama.cpp
if [ ! -f "$src/CMakeLists.txt" ]; then
  "$py" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$cache/src"
  tar -xzf "$cache/src/llama_cpp_python-$version.tar.gz" -C "$cache/src"
fi
# no web UI (it would be fetched over the network), no HTTPS, no curl: a loopback bench peer
# shellcheck disable=SC2086
cmake -S "$src" -B "$cache/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  $cmake_args
cmake --build "$cache/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
mkdir -p "$cache/bin"
cp "$cache/build/bin/llama-server" "$bin"
echo "built $bin in $(( $(date +%s) - start )) s"
