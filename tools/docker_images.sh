#!/usr/bin/env bash
# A Docker engine and local base images for docker-compose.yml and tests/test_docker_*.py, with no registry.
#
#   bash tools/docker_images.sh            # engine up (starting dockerd if none answers), images built, env written
#   docker-compose --env-file docker/local.env up --build     # then the compose demo runs unchanged
#
# 1. Engine: if `docker info` answers, that engine is used. Otherwise, as root with apt-get, it installs Debian's
#    docker.io (and debootstrap, docker-compose) when missing and starts `dockerd --ip 127.0.0.1` (published ports
#    on loopback only), logging to $CACHE/dockerd.log, its pid written to $CSL_DOCKERD_PIDFILE when that is set
#    (.ci/run stops it at its end). Not root, or no apt-get: it says why and exits 0 with no
#    env file, and the Docker tests skip, saying so (CSL_DOCKER=required turns that exit into a failure).
# 2. Base image: `debootstrap --variant=minbase` of Debian bookworm with python3, python3-venv, redis-server, a
#    venv over /usr/local (so `python` and `pip` are on PATH as in python:3.12-slim), imported with `docker import`
#    as csl-local/python:KEY, and csl-local/redis:KEY on top of it (an entrypoint that adds --protected-mode no, as
#    the official redis image does). KEY hashes this recipe: the root filesystem's tar is kept in $CACHE (default
#    /var/cache/celery-singleton-lock) and reused by later runs; the images stay in the engine between runs.
# 3. Wheels: the package's dependencies, built on the host (`pip wheel`, which reaches the index through the host's
#    pip set-up) into docker/wheels/, for the Dockerfile's offline `pip install` (PIP_OFFLINE=1).
# 4. docker/local.env: CSL_PYTHON_IMAGE, CSL_REDIS_IMAGE, CSL_PIP_OFFLINE for docker-compose (--env-file) and tests.
#
# Each step prints its wall time. Nothing here removes a container, network or volume: see tools/docker_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${CSL_DOCKER_CACHE:-/var/cache/celery-singleton-lock}
ENV_FILE=$ROOT/docker/local.env
SUITE=bookworm
PACKAGES=python3,python3-venv,redis-server,passwd
RECIPE=3  # bump when the root filesystem's customisation below changes
t0=$(date +%s.%N)

say() { printf 'docker_images: %s\n' "$*"; }
took() { awk -v a="$2" -v b="$(date +%s.%N)" -v what="$1" 'BEGIN { printf "docker_images: %-28s %6.1f s\n", what, b - a }'; }
give_up() {  # no engine can be had here: the Docker tests skip (or, when required, this fails)
    say "Docker tier unavailable: $*"
    rm -f "$ENV_FILE"
    if [ "${CSL_DOCKER:-}" = required ]; then exit 1; fi
    exit 0
}

apt_install() {  # apt_install PKG...: Debian's packages, retrying after an `apt-get update` (stale lists)
    local opts=(-o DPkg::Lock::Timeout=600 -y -q --no-install-recommends)
    DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" "$@" >"$CACHE/apt.log" 2>&1 \
        || { apt-get -o DPkg::Lock::Timeout=600 update -q >>"$CACHE/apt.log" 2>&1 \
             && DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" "$@" >>"$CACHE/apt.log" 2>&1; } \
        || give_up "apt-get install $* failed (see $CACHE/apt.log)"
}

# --- 1. engine ------------------------------------------------------------------------------------------------
t=$(date +%s.%N)
if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || give_up "no Docker engine answers and this is not root (cannot install or start dockerd)"
    command -v apt-get >/dev/null || give_up "no Docker engine answers and there is no apt-get to install one"
    mkdir -p "$CACHE"
    need=()
    command -v dockerd >/dev/null || need+=(docker.io)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || need+=(docker-compose)
    if [ ${#need[@]} -gt 0 ]; then apt_install "${need[@]}"; took "apt-get install ${need[*]}" "$t"; fi
    t=$(date +%s.%N)
    if ! docker info >/dev/null 2>&1; then
        # setsid: the engine outlives this script (later steps of the same run reuse it); only loopback ports.
        setsid dockerd --ip 127.0.0.1 >>"$CACHE/dockerd.log" 2>&1 </dev/null &
        # The caller that wants to stop the engine it caused (.ci/run, at its end) names a file for its pid.
        if [ -n "${CSL_DOCKERD_PIDFILE:-}" ]; then echo $! >"$CSL_DOCKERD_PIDFILE"; fi
        for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
        docker info >/dev/null 2>&1 || give_up "dockerd did not answer within 60 s (see $CACHE/dockerd.log)"
    fi
    took "engine start" "$t"
else
    took "engine (already running)" "$t"
fi
if ! command -v debootstrap >/dev/null || ! { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || give_up "debootstrap or docker-compose missing and not root"
    mkdir -p "$CACHE"
    t=$(date +%s.%N); apt_install debootstrap docker-compose; took "apt-get install tools" "$t"
fi
mkdir -p "$CACHE"

# --- 2. base images ---------------------------------------------------------------------------------------------
ARCH=$(dpkg --print-architecture 2>/dev/null || uname -m)
KEY=$(printf '%s\n' "$SUITE" "$PACKAGES" "$RECIPE" "$ARCH" "$(sed -n '/^# --- 2a/,/^# --- 2b/p' "$0")" \
      | sha256sum | cut -c1-12)
PY_IMAGE=csl-local/python:$KEY
REDIS_IMAGE=csl-local/redis:$KEY
TAR=$CACHE/rootfs-$KEY.tar
t=$(date +%s.%N)
if docker image inspect "$PY_IMAGE" >/dev/null 2>&1; then
    took "python image (in the engine)" "$t"
else
    if [ ! -s "$TAR" ]; then
        work=$(mktemp -d "$CACHE/rootfs-$KEY.XXXXXX")
        trap 'rm -rf "$work"' EXIT
# --- 2a: the root filesystem (this block is part of KEY) --------------------------------------------------------
        debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/root" >"$CACHE/debootstrap.log" 2>&1 \
            || give_up "debootstrap failed (see $CACHE/debootstrap.log)"
        chroot "$work/root" python3 -m venv /usr/local >>"$CACHE/debootstrap.log" 2>&1
        mkdir -p "$work/root/data"
        cat >"$work/root/usr/local/bin/redis-entrypoint" <<'SH'
#!/bin/sh
# As the official redis image: a server started with arguments but no --protected-mode answers other containers.
if [ "$1" = redis-server ]; then
    case " $* " in *" --protected-mode "*) ;; *) set -- "$@" --protected-mode no ;; esac
fi
exec "$@"
SH
        chmod 755 "$work/root/usr/local/bin/redis-entrypoint"
        rm -rf "$work"/root/var/cache/apt/archives/*.deb "$work"/root/var/lib/apt/lists/* "$work"/root/tmp/*
# --- 2b ----------------------------------------------------------------------------------------------------------
        tar -C "$work/root" -cf "$TAR.part" . && mv "$TAR.part" "$TAR"
        rm -rf "$work"; trap - EXIT
        took "debootstrap (cold)" "$t"; t=$(date +%s.%N)
    fi
    docker import --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$TAR" "$PY_IMAGE" >/dev/null
    took "python image (docker import)" "$t"
fi
t=$(date +%s.%N)
if ! docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1; then
    printf 'FROM %s\nWORKDIR /data\nENTRYPOINT ["/usr/local/bin/redis-entrypoint"]\nCMD ["redis-server"]\n' \
        "$PY_IMAGE" | docker build -q -t "$REDIS_IMAGE" - >/dev/null 2>"$CACHE/redis-build.log" \
        || give_up "building $REDIS_IMAGE failed (see $CACHE/redis-build.log)"
fi
took "redis image" "$t"

# --- 3. wheels for the offline pip install in the Dockerfile ----------------------------------------------------
t=$(date +%s.%N)
PYTHON=${PYTHON:-python3}
REQS=$("$PYTHON" - <<'PY'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
# async-timeout: redis-py needs it on Python < 3.11.3 (bookworm's is 3.11.2), which the host's pip may not see.
print("\n".join([*deps, "prometheus-client>=0.20", "setuptools>=68", "wheel", "async-timeout>=4.0.3"]))
PY
)
WKEY=$(printf '%s\n' "$REQS" | sha256sum | cut -c1-12)
WHEELS=$CACHE/wheels-$WKEY
if [ ! -f "$WHEELS/.done" ]; then
    rm -rf "$WHEELS"; mkdir -p "$WHEELS"
    printf '%s\n' "$REQS" >"$WHEELS/requirements.txt"
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check -w "$WHEELS" -r "$WHEELS/requirements.txt" \
        >"$CACHE/pip-wheel.log" 2>&1 || give_up "pip wheel failed (see $CACHE/pip-wheel.log)"
    touch "$WHEELS/.done"
fi
find docker/wheels -name '*.whl' -delete
cp "$WHEELS"/*.whl docker/wheels/
took "wheels" "$t"

# --- 4. the variables docker-compose.yml and the tests read -----------------------------------------------------
cat >"$ENV_FILE.part" <<EOF
# Written by tools/docker_images.sh: local base images (no registry) and an offline pip install.
CSL_PYTHON_IMAGE=$PY_IMAGE
CSL_REDIS_IMAGE=$REDIS_IMAGE
CSL_PIP_OFFLINE=1
EOF
mv "$ENV_FILE.part" "$ENV_FILE"
took "total" "$t0"
