#!/usr/bin/env bash
# Render every kustomization under k8s/ (the base and each overlay) and validate the result
# offline, strictly (unknown fields are errors): built-in kinds against the Kubernetes 1.32
# schemas (kubernetes-validate), custom kinds (KEDA's ScaledObject) against the CRDs vendored
# under third_party/ (jsonschema); a kind with neither is an error. See tools/validate_manifests.py.
# Needs kubectl (for `kubectl kustomize`) and the project's dev extra (kubernetes-validate).
# Exits non-zero if any kustomization fails to render or validate.
set -euo pipefail

KUBERNETES_VERSION="${KUBERNETES_VERSION:-1.32.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

python="python3"
if [[ -x "$root/.venv/bin/python" ]]; then
  python="$root/.venv/bin/python"
fi
command -v kubectl >/dev/null || { echo "check_k8s: kubectl not found" >&2; exit 2; }

rendered="$(mktemp -d)"
trap 'rm -rf "$rendered"' EXIT

status=0
for dir in "$root"/k8s/base "$root"/k8s/overlays/*/; do
  name="$(basename "$dir")"
  out="$rendered/$name.yaml"
  if ! kubectl kustomize "$dir" >"$out"; then
    echo "check_k8s: FAIL $name: kubectl kustomize failed" >&2
    status=1
    continue
  fi
  if "$python" "$root/tools/validate_manifests.py" -k "$KUBERNETES_VERSION" "$out"; then
    echo "check_k8s: ok   $name ($(grep -c '^kind:' "$out") resources)"
  else
    echo "check_k8s: FAIL $name: schema validation failed" >&2
    status=1
  fi
done
exit "$status"
