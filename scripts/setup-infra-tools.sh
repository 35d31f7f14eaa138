#!/usr/bin/env bash
# Installs and builds what the deployment files (infra/, docs/how-to/deploy.md) need, idempotently; a
# second run only checks. Run by scripts/setup.sh; safe to run on its own.
#   bubblewrap               the code-reward sandbox (apt-get, only as root and only if missing)
#   helm v3.22.0             built from the Go module proxy into $BIN (~/.cache/rlstream/bin)
#   compose-config           infra/tools/compose-config (compose-spec's loader) into $BIN
#   prometheus               Debian's package, unpacked (no root, no service) into $BIN
#   kubernetes-validate      into the project's virtualenv (offline Kubernetes schema checks)
#   the Kafbat UI serde      infra/kafbat-serde -> target/plugin (Kafbat's filePath) and target/cli-lib
# A step whose toolchain is missing (go, mvn, apt-get/root) is reported and skipped; the tests that
# need its output then skip and say why. --strict makes any skipped or failed step an error.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${RLSTREAM_VENV:-$ROOT/.venv}
BIN=${RLSTREAM_CACHE:-$HOME/.cache/rlstream}/bin
HELM_VERSION=v3.22.0
KUBERNETES_VALIDATE=1.37.0
PROMETHEUS_DEB=2.42.0+ds-5+deb12u1
STRICT=0
[ "${1:-}" = "--strict" ] && STRICT=1
mkdir -p "$BIN"
say() { printf '\033[1m[infra-tools]\033[0m %s\n' "$*"; }
problems=()
skip() { say "SKIPPED $1: $2"; problems+=("$1"); }
stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

# --- bubblewrap ------------------------------------------------------------------------------
if command -v bwrap >/dev/null; then
  say "bubblewrap: $(bwrap --version)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "installing bubblewrap (apt-get)"
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; } >/dev/null; then
    say "bubblewrap: $(bwrap --version)"
  else
    skip bubblewrap "apt-get install failed"
  fi
else
  skip bubblewrap "not installed and cannot apt-get (need root); the code sandbox falls back to rlimits + namespaces"
fi

# --- helm ------------------------------------------------------------------------------------
# Linked as helm's own release build is (the -X flags of its Makefile): its exact version, and the
# Kubernetes version that `helm template` and `helm lint` assume without a cluster, i.e. the one of
# the client-go it is built with (v0.37 -> 1.37 for helm v3.22.0). A plain `go install` leaves that
# default at 1.20, which the chart's `kubeVersion: >=1.28.0-0` refuses. The stamp names the build
# recipe, so a helm built the old way is rebuilt.
HELM_STAMP="$HELM_VERSION release-ldflags"
helm_ldflags() {  # prints the -ldflags value, from helm's go.mod in the module cache
  local gomod minor
  gomod=$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
  minor=$(sed -n 's|^[[:space:]]*k8s.io/client-go v0\.\([0-9][0-9]*\)\..*|\1|p' "$gomod" 2>/dev/null)
  [ -n "$minor" ] || return 1
  local v=helm.sh/helm/v3
  echo "-X $v/internal/version.version=$HELM_VERSION -X $v/pkg/chartutil.k8sVersionMajor=1" \
    "-X $v/pkg/chartutil.k8sVersionMinor=$minor -X $v/pkg/lint/rules.k8sVersionMajor=1" \
    "-X $v/pkg/lint/rules.k8sVersionMinor=$minor"
}
if [ -x "$BIN/helm" ] && [ "$(cat "$BIN/.helm.version" 2>/dev/null)" = "$HELM_STAMP" ]; then
  say "helm $HELM_VERSION: $BIN/helm"
elif command -v go >/dev/null; then
  say "building helm $HELM_VERSION from the Go module proxy (a few minutes, once)"
  if ldflags=$(helm_ldflags) && GOBIN="$BIN" go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"; then
    echo "$HELM_STAMP" >"$BIN/.helm.version"
    say "helm $HELM_VERSION: $BIN/helm"
  else
    skip helm "go install failed"
  fi
else
  skip helm "go not found (install Go 1.24+)"
fi

# --- compose-config --------------------------------------------------------------------------
src=infra/tools/compose-config
want=$(stamp_of $src/go.mod $src/go.sum $src/main.go)
if [ -x "$BIN/compose-config" ] && [ "$(cat "$BIN/.compose-config.stamp" 2>/dev/null)" = "$want" ]; then
  say "compose-config: $BIN/compose-config"
elif command -v go >/dev/null; then
  say "building compose-config ($src)"
  if (cd $src && GOBIN="$BIN" go install .); then
    echo "$want" >"$BIN/.compose-config.stamp"
  else
    skip compose-config "go install failed"
  fi
else
  skip compose-config "go not found"
fi

# --- prometheus ------------------------------------------------------------------------------
# `apt-get download` needs no root; the binary is static. The scrape test (tests/test_prometheus.py)
# runs it against infra/prometheus.yml.
if [ -x "$BIN/prometheus" ] && [ "$(cat "$BIN/.prometheus.version" 2>/dev/null)" = "$PROMETHEUS_DEB" ]; then
  say "prometheus $PROMETHEUS_DEB: $BIN/prometheus"
elif command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
  say "unpacking Debian's prometheus $PROMETHEUS_DEB into $BIN"
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download -q "prometheus=$PROMETHEUS_DEB" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get download -q prometheus >/dev/null 2>&1; }) \
      && dpkg -x "$tmp"/prometheus_*.deb "$tmp/x" && cp "$tmp/x/usr/bin/prometheus" "$BIN/prometheus"; then
    echo "$PROMETHEUS_DEB" >"$BIN/.prometheus.version"
    say "prometheus: $("$BIN/prometheus" --version 2>&1 | head -1)"
  else
    skip prometheus "apt-get download failed"
  fi
  rm -rf "$tmp"
else
  skip prometheus "apt-get/dpkg not found"
fi

# --- kubernetes-validate ---------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  skip kubernetes-validate "no virtualenv at $VENV (run scripts/setup.sh)"
elif "$VENV/bin/python" -c 'import kubernetes_validate' 2>/dev/null; then
  say "kubernetes-validate: installed"
elif "$VENV/bin/python" -m pip install -q "kubernetes-validate==$KUBERNETES_VALIDATE"; then
  say "kubernetes-validate $KUBERNETES_VALIDATE installed"
else
  skip kubernetes-validate "pip install failed"
fi

# --- Kafbat UI serde plugin ------------------------------------------------------------------
serde=infra/kafbat-serde
want=$(stamp_of $serde/pom.xml $(find $serde/src -type f | sort))
if [ -f $serde/target/.stamp ] && [ "$(cat $serde/target/.stamp)" = "$want" ]; then
  say "kafbat serde: $serde/target/plugin"
elif command -v mvn >/dev/null; then
  say "building the Kafbat UI serde plugin ($serde, Maven; jars cached in ~/.m2)"
  if mvn -B -q -Dstyle.color=never -f $serde/pom.xml clean package; then
    echo "$want" >$serde/target/.stamp
    say "kafbat serde: $serde/target/plugin"
  else
    skip kafbat-serde "mvn package failed"
  fi
else
  skip kafbat-serde "mvn not found"
fi

if [ ${#problems[@]} -gt 0 ]; then
  say "not available: ${problems[*]} (tests that need them skip)"
  [ "$STRICT" = 1 ] && exit 1
fi
exit 0
