#!/usr/bin/env bash
# The container image of deploy/container, built and run as far as this machine goes without Docker:
# a Debian 12 root made by debootstrap (minbase, the nearest to debian:12-slim: no apt lists, the
# image's apt sources), in which the Dockerfile's own instructions run, read from the file (ARG, COPY
# of the package cpack makes from BUILD_DIR, each RUN as `/bin/sh -c`, USER, WORKDIR, ENTRYPOINT), so
# that the test exercises the recipe and not a copy of it. Then, as the image's user, in its WORKDIR,
# through its ENTRYPOINT, the quickstart: `data prepare`, then `launch` of the installed recipe (60 of
# its steps), which must end SUCCEEDED. deploy/container/ltrain.def must install the same package with the same
# commands as the Dockerfile's first RUN.
#
# Everything after the package runs in a private mount and PID namespace (unshare), with /proc, /sys
# (read-only), a minimal /dev with a 64 MB /dev/shm as Docker gives, and the host's network, /etc/hosts
# and resolv.conf, as `docker run --network host` (the quickstart uses loopback). The namespace's
# mounts and processes end with it; the root is removed on exit, also on failure.
#
# Needs root, the Debian mirror (that of /etc/apt/sources.list.d/debian.sources), a few minutes and
# about 1.5 GB in $TMPDIR (the root is 1.3 GB: Debian's LibTorch pulls OpenCV and FFmpeg); installs
# debootstrap with apt-get when it is missing.
#   container_test.sh BUILD_DIR
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
say() { echo "container test: $*"; }
fail() { say "FAILED: $*"; exit 1; }
trap 'fail "line $LINENO: $BASH_COMMAND exited non-zero"' ERR
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
squeeze() { tr -s '[:space:]' ' ' <<<"$1" | sed 's/^ //; s/ $//'; }
self=$(readlink -f "${BASH_SOURCE[0]}")
source_dir=$(cd "$(dirname "$self")/../.." && pwd)
dockerfile=$source_dir/deploy/container/Dockerfile
definition=$source_dir/deploy/container/ltrain.def
# The environment of a Dockerfile's RUN and of `docker run`, besides HOME.
docker_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# The URIs of the host's deb822 source whose Suites name $1 (empty when there is none).
host_mirror() {
  awk -v suite="$1" 'BEGIN { RS = "" } {
      uri = ""; ok = 0; n = split($0, line, "\n")
      for (i = 1; i <= n; i++) {
        if (line[i] ~ /^URIs:/) { split(line[i], f, " "); uri = f[2] }
        if (line[i] ~ /^Suites:/) { m = split(line[i], s, " "); for (j = 2; j <= m; j++) if (s[j] == suite) ok = 1 }
      }
      if (ok && uri != "") { print uri; exit }
    }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true
}

# ---- Inside the namespace: the root, the Dockerfile's instructions in it, the quickstart. ----
if [[ ${1:-} == --in-namespace ]]; then
  work=$2
  source "$work/plan.sh"  # ops, entrypoint, mirror, security_mirror (from below)
  root=$work/root context=$work/context

  say "debootstrap --variant=minbase bookworm from $mirror"
  t=$(now)
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -n 30 "$work/debootstrap.log"; fail "debootstrap did not make the Debian 12 root (its log above)"; }
  # As debian:12-slim comes: its apt sources, no package lists (a RUN must `apt-get update`).
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
  t_debootstrap=$(took "$t")
  say "debootstrap: $t_debootstrap"

  # What a container sees: its own /proc (this PID namespace), /sys read-only, a minimal /dev, and
  # with the host's network the host's /etc/hosts and resolv.conf.
  mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
  mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
  mount -t tmpfs -o nosuid,mode=755,size=65536k tmpfs "$root/dev"
  for node in null zero full random urandom tty; do
    touch "$root/dev/$node"
    mount --bind "/dev/$node" "$root/dev/$node"
  done
  mkdir "$root/dev/shm"
  mount -t tmpfs -o nosuid,nodev,noexec,size=65536k shm "$root/dev/shm"
  ln -s /proc/self/fd "$root/dev/fd"
  ln -s /proc/self/fd/0 "$root/dev/stdin"
  ln -s /proc/self/fd/1 "$root/dev/stdout"
  ln -s /proc/self/fd/2 "$root/dev/stderr"
  for f in hosts resolv.conf; do
    rm -f "$root/etc/$f"
    cp -L "/etc/$f" "$root/etc/$f"
  done

  # in_root USER WORKDIR COMMAND...: as Docker runs a RUN or a container: that user's uid, gid and
  # home from the root's /etc/passwd, a clean environment, in WORKDIR.
  in_root() {
    local user=$1 dir=$2 ids uid gid home
    shift 2
    ids=$(awk -F: -v u="$user" '$1 == u || $3 == u { print $3, $4, $6; exit }' "$root/etc/passwd")
    [[ -n $ids ]] || fail "USER $user: no such user in the image's /etc/passwd"
    read -r uid gid home <<<"$ids"
    chroot --userspec="$uid:$gid" --groups="$gid" "$root" /usr/bin/env -i PATH="$docker_path" HOME="$home" \
      /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$dir" "$@"
  }

  say "the Dockerfile's instructions in the root"
  t=$(now)
  user=root dir=/
  for op in "${ops[@]}"; do
    kind=${op%%$'\t'*} a=${op#*$'\t'}
    case $kind in
      COPY)
        target=$root${a#*$'\t'} a=${a%%$'\t'*}
        [[ $target == */ ]] && target+=$(basename "$a")
        install -D -m 644 "$context/$a" "$target" ;;
      RUN)
        say "RUN $(squeeze "$a")"
        in_root "$user" "$dir" /bin/sh -c "$a" >>"$work/install.log" 2>&1 ||
          { tail -n 30 "$work/install.log"; fail "RUN exited non-zero (its output above): $a"; } ;;
      USER) user=$a ;;
      WORKDIR) dir=$a; mkdir -p "$root$dir" ;;
    esac
  done
  missing=$(in_root root / ldd /usr/bin/ltrain /usr/bin/ltrain-worker /usr/bin/ltrain-exec | grep "not found" || true)
  [[ -z $missing ]] || { echo "$missing"; fail "libraries missing in the image after the install"; }
  t_install=$(took "$t")
  say "install: $t_install ($(du -sh --one-file-system "$root" | cut -f1) root)"

  say "the quickstart as the image's user $user in $dir: ${entrypoint[*]} ..."
  t=$(now)
  as_image() { in_root "$user" "$dir" "${entrypoint[@]}" "$@"; }
  as_image --version || fail "ltrain --version does not run in the image"
  as_image data prepare --input /usr/share/common-licenses --output /tmp/data --overwrite ||
    fail "ltrain data prepare exited non-zero in the image"
  code=0
  # 60 of its 300 steps: the image's binaries, recipe and user at work, not the quickstart's training
  # (ReadmeTest runs that whole).
  as_image launch /usr/share/ltrain/recipes/quickstart.yaml --set data.path=/tmp/data --set training.steps=60 2>&1 |
    tee "$work/launch.log" ||
    code=$?
  (( code == 0 )) || fail "ltrain launch of the quickstart exited $code in the image"
  grep -q "job SUCCEEDED" "$work/launch.log" || fail "the quickstart did not print 'job SUCCEEDED'"
  t_quickstart=$(took "$t")
  say "quickstart: $t_quickstart"
  say "ok: Debian 12 root + the Dockerfile's instructions; quickstart SUCCEEDED as $user" \
    "(debootstrap $t_debootstrap, install $t_install, quickstart $t_quickstart)"
  exit 0
fi

# ---- Outside: checks, the package, the Dockerfile read into a plan, then the namespace. ----
[[ $# -eq 1 && -d $1 ]] || { echo "usage: container_test.sh BUILD_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd)
[[ $(id -u) -eq 0 ]] || fail "needs root (debootstrap, mount namespaces, chroot): run it with sudo"
for tool in unshare chroot cpack dpkg-deb; do
  command -v "$tool" >/dev/null || fail "$tool is not installed"
done
if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
    fail "apt-get install debootstrap failed"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/ltrain-container.XXXXXX")
ns_pid=''
cleanup() {
  local code=$?
  set +e
  trap - ERR
  # unshare ignores SIGTERM and SIGINT while it waits; killed, it takes the namespace with it
  # (--kill-child): every process in it, and so its mounts.
  if [[ -n $ns_pid ]] && kill -0 "$ns_pid" 2>/dev/null; then
    kill -KILL "$ns_pid"
    wait "$ns_pid" 2>/dev/null
  fi
  if grep -q " $work/" /proc/self/mountinfo; then
    say "FAILED: mounts under $work outlived the namespace; left in place: $(grep " $work/" /proc/self/mountinfo | cut -d' ' -f5 | tr '\n' ' ')"
    exit 1
  fi
  rm -rf --one-file-system "$work"
  exit "$code"
}
trap cleanup EXIT
trap 'fail "interrupted (SIGINT)"' INT
trap 'fail "interrupted (SIGTERM)"' TERM

t=$(now)
say "building the package from $build"
(cd "$build" && cpack -G DEB -B "$work/context" >"$work/cpack.log" 2>&1) || { cat "$work/cpack.log"; fail "cpack -G DEB"; }
debs=("$work"/context/ltrain_*_amd64.deb)
[[ ${#debs[@]} -eq 1 && -f ${debs[0]} ]] || fail "cpack made no single ltrain_*_amd64.deb: ${debs[*]}"
deb=$(basename "${debs[0]}")
say "$deb, $(du -h "${debs[0]}" | cut -f1), in $(took "$t")"

# The Dockerfile, instruction by instruction (continuations joined, comments dropped, as Docker reads
# it). Only what it uses is understood; anything else fails here, to be taught to this test.
instructions=() line=''
while IFS= read -r raw || [[ -n $raw ]]; do
  [[ $raw =~ ^[[:space:]]*(#|$) ]] && continue
  if [[ $raw =~ ^(.*)\\[[:space:]]*$ ]]; then line+="${BASH_REMATCH[1]} "; continue; fi
  instructions+=("$line$raw") line=''
done <"$dockerfile"
declare -A build_args=()
ops=() entrypoint=() base='' copied=() first_run=''
for instruction in "${instructions[@]}"; do
  read -r keyword rest <<<"$instruction"
  for name in "${!build_args[@]}"; do
    rest=${rest//"\${$name}"/${build_args[$name]}}
  done
  case ${keyword^^} in
    FROM) base=$rest ;;
    ARG)
      [[ $rest =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.+)$ ]] || fail "Dockerfile: ARG $rest has no default"
      build_args[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]} ;;
    COPY)
      read -r src dest extra <<<"$rest"
      [[ -z $extra && $src != --* && $dest == /* ]] || fail "Dockerfile: COPY $rest: this test copies one file to an absolute path"
      [[ -f $work/context/$src ]] ||
        fail "the Dockerfile copies $src, but cpack made $deb: update ARG LTRAIN_DEB there and %files in ltrain.def"
      copied=("$src" "$dest")
      ops+=("COPY"$'\t'"$src"$'\t'"$dest") ;;
    RUN)
      [[ $rest != \[* ]] || fail "Dockerfile: RUN in exec form is not understood by this test"
      [[ -n $first_run ]] || first_run=$rest
      ops+=("RUN"$'\t'"$rest") ;;
    USER)
      [[ $rest != *:* ]] || fail "Dockerfile: USER $rest: this test takes a user name or uid only"
      ops+=("USER"$'\t'"$rest") ;;
    WORKDIR)
      [[ $rest == /* ]] || fail "Dockerfile: WORKDIR $rest is not absolute"
      ops+=("WORKDIR"$'\t'"$rest") ;;
    ENTRYPOINT)
      [[ $rest =~ ^\[(.*)\]$ ]] || fail "Dockerfile: ENTRYPOINT $rest is not in exec form"
      IFS=',' read -r -a words <<<"${BASH_REMATCH[1]}"
      entrypoint=()
      for w in "${words[@]}"; do
        w=$(squeeze "$w")
        [[ $w =~ ^\"(.*)\"$ ]] || fail "Dockerfile: ENTRYPOINT word $w is not a JSON string"
        entrypoint+=("${BASH_REMATCH[1]}")
      done ;;
    *) fail "Dockerfile: $keyword is not understood by this test (teach it, or keep the recipe to FROM, ARG, COPY, RUN, USER, WORKDIR, ENTRYPOINT)" ;;
  esac
done
[[ $base == debian:12-slim ]] || fail "the Dockerfile builds FROM $base; this test makes a Debian 12 root for debian:12-slim"
[[ ${#copied[@]} -eq 2 && -n $first_run && ${#entrypoint[@]} -gt 0 ]] ||
  fail "the Dockerfile needs a COPY of the package, a RUN and an ENTRYPOINT"

# The Apptainer definition: the same base, the same package at the same place, %post = the first RUN.
def_from=$(sed -n 's/^From:[[:space:]]*//p' "$definition" | head -n 1)
def_bootstrap=$(sed -n 's/^Bootstrap:[[:space:]]*//p' "$definition" | head -n 1)
[[ $def_bootstrap == docker && $def_from == "$base" ]] ||
  fail "ltrain.def bootstraps from '$def_bootstrap' '$def_from', the Dockerfile FROM $base"
section() { awk -v s="%$1" '/^%/ { on = ($1 == s); next } on' "$definition"; }
read -r def_src def_dest <<<"$(section files | grep -v '^[[:space:]]*$' | head -n 1)"
[[ $(basename "${def_src:-none}") == "$deb" && $def_dest == "${copied[1]}" ]] ||
  fail "ltrain.def's %files copies '$def_src' to '$def_dest'; cpack made $deb, the Dockerfile copies it to ${copied[1]}"
def_post=$(squeeze "$(section post | sed 's/\\[[:space:]]*$//')")
[[ $def_post == "$(squeeze "$first_run")" ]] ||
  fail "ltrain.def's %post is not the Dockerfile's install RUN: '$def_post' vs '$(squeeze "$first_run")'"
say "ltrain.def: the same base, package and install as the Dockerfile"

mirror=$(host_mirror bookworm)
security_mirror=$(host_mirror bookworm-security)
{
  declare -p ops entrypoint
  printf 'mirror=%q security_mirror=%q\n' "${mirror:-http://deb.debian.org/debian}" \
    "${security_mirror:-http://deb.debian.org/debian-security}"
} >"$work/plan.sh"

# No network namespace: the image's processes use the host's loopback, as with --network host.
unshare --mount --pid --fork --kill-child --propagation private -- bash "$self" --in-namespace "$work" &
ns_pid=$!
code=0
wait "$ns_pid" || code=$?
ns_pid=''
(( code == 0 )) || { (( code == 1 )) && exit 1; fail "the namespace ended with status $code"; }
