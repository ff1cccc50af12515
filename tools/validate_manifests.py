"""Validate rendered Kubernetes manifests offline, custom resources included.

Built-in kinds are checked by kubernetes-validate against the Kubernetes JSON schemas. It only
warns about a kind it has no schema for, so a custom resource (KEDA's ScaledObject) would pass
unchecked: here every custom kind must have its CustomResourceDefinition vendored under
third_party/, and is validated with jsonschema against that CRD's openAPIV3Schema. Both checks
are strict, like the API server's default field validation: a field the schema does not
declare is an error (a misspelt `minReplicaCount` would otherwise be dropped without a word).

Usage: validate_manifests.py [-k KUBERNETES_VERSION] RENDERED.yaml...  (exit 1 on any error)
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]  # ships no py.typed marker
import yaml

THIRD_PARTY = Path(__file__).resolve().parents[1] / "third_party"
DEFAULT_KUBERNETES_VERSION = "1.32.0"

log = logging.getLogger("validate_manifests")

#: A parsed YAML document (a resource, a schema).
Doc = dict[str, Any]


@functools.cache
def vendored_crd_schemas() -> dict[tuple[str, str], Doc]:
    """(apiVersion, kind) -> strict openAPIV3Schema, for every CRD vendored under third_party/."""
    schemas: dict[tuple[str, str], Doc] = {}
    for path in sorted(THIRD_PARTY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                schemas[key] = strict_schema(version["schema"]["openAPIV3Schema"])
    return schemas


def strict_schema(schema: Doc) -> Doc:
    """The schema with unknown fields refused wherever the structural schema lists an object's
    properties and does not say it keeps unknown ones (the API server prunes or, with strict
    field validation, refuses them; jsonschema would accept them silently)."""
    strict = copy.deepcopy(schema)
    for node in _schema_nodes(strict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
    return strict


def _schema_nodes(node: object) -> Iterator[Doc]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schema_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schema_nodes(value)


def resource_errors(resource: Mapping[str, object], kubernetes_version: str) -> list[str]:
    """What is wrong with one resource (empty: valid)."""
    where = f"{resource.get('kind')}/{_name(resource)}"
    try:
        kubernetes_validate.validate(dict(resource), kubernetes_version, strict=True)
        return []
    except kubernetes_validate.ValidationError as error:
        return [f"{where}: {error.message} at {'/'.join(map(str, error.path))}"]
    except kubernetes_validate.SchemaNotFoundError:
        pass
    schema = vendored_crd_schemas().get((str(resource.get("apiVersion")),
                                         str(resource.get("kind"))))
    if schema is None:
        return [f"{where}: no schema for apiVersion {resource.get('apiVersion')}: neither a "
                f"built-in kind of Kubernetes {kubernetes_version} nor a CRD vendored under "
                f"{THIRD_PARTY}"]
    validator = jsonschema.Draft7Validator(schema)
    return [f"{where}: {error.message} at {'/'.join(map(str, error.absolute_path))}"
            for error in validator.iter_errors(dict(resource))]


def _name(resource: Mapping[str, object]) -> str:
    metadata = resource.get("metadata")
    return str(metadata.get("name")) if isinstance(metadata, dict) else "?"


def file_errors(path: Path, kubernetes_version: str) -> list[str]:
    errors: list[str] = []
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            errors += resource_errors(cast(Doc, doc), kubernetes_version)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--kubernetes-version", default=DEFAULT_KUBERNETES_VERSION)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = False
    for path in args.files:
        for error in file_errors(path, args.kubernetes_version):
            log.error("%s: %s", path, error)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
