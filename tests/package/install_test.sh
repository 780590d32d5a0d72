#!/usr/bin/env bash
# The Debian package, as a cluster admin would use it: built by cpack from this build, installed
# with apt-get (which pulls the Debian libraries it needs), then the quickstart trained with the
# installed /usr/bin/ltrain and nothing from the build tree. The package is removed at the end.
#   install_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
say() { echo "package test: $*"; }
if [[ $(id -u) -ne 0 ]] && ! sudo -n true 2>/dev/null; then
  say "FAILED: installing a package needs root or password-less sudo"
  exit 1
fi
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo -n"
if dpkg-query -W -f='${Status}' ltrain 2>/dev/null | grep -q "install ok installed"; then
  say "FAILED: a package named ltrain is installed already; this test would replace it (remove it first)"
  exit 1
fi
work=$(mktemp -d)
trap '$sudo apt-get remove -y -qq ltrain >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

say "building the package"
(cd "$build" && cpack -G DEB -B "$work/pkg" >"$work/cpack.log" 2>&1) || { cat "$work/cpack.log"; exit 1; }
deb=$(ls "$work"/pkg/ltrain_*_amd64.deb)
say "$(basename "$deb"), $(du -h "$deb" | cut -f1)"
depends=$(dpkg-deb -f "$deb" Depends)
say "depends: $depends"
for lib in libgrpc++ libprotobuf libyaml-cpp libsqlite3 libtorch; do
  grep -q "$lib" <<<"$depends" || { say "FAILED: the package does not depend on $lib"; exit 1; }
done

say "installing it with apt-get"
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$deb" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; exit 1; }
for f in /usr/bin/ltrain /usr/bin/ltrain-worker /usr/share/ltrain/recipes/quickstart.yaml; do
  [[ -e $f ]] || { say "FAILED: $f is not installed"; exit 1; }
done
if ldd /usr/bin/ltrain /usr/bin/ltrain-worker | grep -q "not found"; then
  ldd /usr/bin/ltrain /usr/bin/ltrain-worker | grep "not found"
  say "FAILED: libraries missing"
  exit 1
fi

say "the quickstart with the installed ltrain (from $work, not the build tree)"
cd "$work"
export LTRAIN_HOME=$work/home PATH=/usr/bin:/bin
unset LTRAIN_WORKER_BIN LTRAIN_COORDINATOR
/usr/bin/ltrain --version
/usr/bin/ltrain data prepare --input /usr/share/common-licenses/* --output "$work/data"
/usr/bin/ltrain launch /usr/share/ltrain/recipes/quickstart.yaml --set data.path="$work/data" \
  --set training.steps=30 --set training.log_every=10 -q | tee "$work/launch.log"
grep -q "job SUCCEEDED" "$work/launch.log" || { say "FAILED: the quickstart did not succeed"; exit 1; }
/usr/bin/ltrain status quickstart-1 | grep -q "SUCCEEDED"
say "ok: installed with apt-get, trained the quickstart, removed"
