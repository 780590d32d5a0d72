#!/usr/bin/env bash
# Downloads, on a Debian 12 machine, the Debian packages the ltrain binaries build against besides
# LibTorch, CUDA and NCCL (gRPC, protobuf, abseil, yaml-cpp, CLI11, SQLite, Gloo, xxHash, GoogleTest, PCRE2,
# nlohmann-json, simdjson, zstd, libmicrohttpd),
# into DIR (default .deps/debs). Carry DIR to a GPU host that has PyTorch but not these, and
# `source deploy/gpu-env.sh` there: it unpacks them into /opt/deps (never into /). docs/install.md
# has the whole GPU build.
set -euo pipefail
dir=${1:-.deps/debs}
mkdir -p "$dir"
cd "$dir"
apt-get download \
  libgrpc++-dev libgrpc++1.51 libgrpc29 libgrpc-dev protobuf-compiler-grpc \
  libprotobuf-dev libprotobuf32 libprotoc32 libprotoc-dev protobuf-compiler \
  libabsl-dev libabsl20220623 libre2-9 libre2-dev libc-ares2 libc-ares-dev \
  libyaml-cpp-dev libyaml-cpp0.7 libcli11-dev libgtest-dev libgmock-dev googletest \
  libssl-dev libssl3 zlib1g-dev libsqlite3-dev libsqlite3-0 libxxhash-dev libxxhash0 \
  libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200 \
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 nlohmann-json3-dev \
  libmicrohttpd-dev libmicrohttpd12 \
  libsimdjson-dev libsimdjson14 libzstd-dev libzstd1
echo "gpu-deps: $(ls ./*.deb | wc -l) packages in $(pwd)"
