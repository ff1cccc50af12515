#!/usr/bin/env bash
# Render every kustomization under k8s/ (the base and each overlay) and validate the result
# offline against the Kubernetes 1.32 schemas, strictly (unknown fields are errors).
# Needs kubectl (for `kubectl kustomize`) and kubernetes-validate (the project's dev extra).
# Exits non-zero on the first rendering or validation error.
set -euo pipefail

KUBERNETES_VERSION="${KUBERNETES_VERSION:-1.32.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

validate="kubernetes-validate"
if [[ -x "$root/.venv/bin/kubernetes-validate" ]]; then
  validate="$root/.venv/bin/kubernetes-validate"
fi
for tool in kubectl "$validate"; do
  command -v "$tool" >/dev/null || { echo "check_k8s: $tool not found" >&2; exit 2; }
done

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
  if "$validate" --strict --quiet -k "$KUBERNETES_VERSION" "$out"; then
    echo "check_k8s: ok   $name ($(grep -c '^kind:' "$out") resources)"
  else
    echo "check_k8s: FAIL $name: schema validation failed" >&2
    status=1
  fi
done
exit "$status"
