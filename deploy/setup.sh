#!/usr/bin/env bash
# Installs the Debian 12 packages ltrain needs to build, run and test. Idempotent: it calls apt-get
# only when a package is missing.
#   deploy/setup.sh           build and run (compiler, CMake, gRPC, protobuf, yaml-cpp, CLI11, SQLite, LibTorch, Gloo,
#                             PCRE2, nlohmann-json, ICU, simdjson, zstd, zlib, libmicrohttpd)
#   deploy/setup.sh --tests   also what the tests use: GoogleTest, systemd (systemd-analyze checks
#                             deploy/systemd), iproute2 (network namespaces), Slurm and munge (a real
#                             Slurm with two fake nodes), Python (the benchmarks, the JSON schema
#                             check), dpkg-dev (the Debian package), promtool (/metrics' lint)
set -euo pipefail

packages=(
  g++ cmake ninja-build ccache pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libyaml-cpp-dev libcli11-dev libsqlite3-dev
  libxxhash-dev          # XXH3-64, the checksums of checkpoint shards
  libpcre2-dev nlohmann-json3-dev   # tokenizers: pre-tokenizer regexes, tokenizer.json
  libicu-dev             # tokenizers' NFC normalizer (Qwen's tokenizer.json)
  libsimdjson-dev libzstd-dev zlib1g-dev   # data prepare: JSON Lines, zstd and gzip corpora
  libmicrohttpd-dev      # the HTTP side: /metrics and the dashboard (--http-listen), HTTPS through GnuTLS
  libsentencepiece-dev   # SentencePiece .model tokenizers
  openssl libtorch-dev libgloo-dev
  libopenblas0-pthread   # an optimised BLAS for LibTorch on CPU: about 10x the reference BLAS
  base-files             # the licence texts the quickstart trains on
)
if [[ "${1:-}" == "--tests" ]]; then
  packages+=(libgtest-dev libgmock-dev systemd iproute2 slurmd slurmctld slurm-client munge python3
             python3-jsonschema    # checks -o json against docs/json-schema.json
             sentencepiece         # spm_train: the SentencePiece test's model
             python3-torch         # `ltrain run`: a DDP script over Gloo, as torchrun would run it
             chromium              # the dashboard, read by a headless browser
             etcd-server etcd-client   # several coordinators on one etcd state (--state etcd://...), its TLS and users
             curl sqlite3          # the security suite: HTTPS to the dashboard, reading state.db as another user
             prometheus            # promtool check metrics on what /metrics serves
             debootstrap           # a Debian 12 root for the container image's test
             zstd time             # data prepare's tests: zstd corpora, peak memory (GNU time)
             dpkg-dev)             # dpkg-shlibdeps: the Debian package's dependencies (cpack)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: every package is installed"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
