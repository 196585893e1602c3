"""A small kustomize for the offline tests: `build(dir)` renders a kustomization the way `kustomize build`
(and `kubectl apply -k`) does, for the subset of fields k8s/ uses: resources (files and kustomization
directories), components, configMapGenerator (files, without the name hash), JSON6902 patches with a
target, and namespace. Any other field, a strategic-merge patch, a patch whose target matches nothing or a
file outside its kustomization's directory is refused rather than ignored, so the manifests cannot come to
rely on something this renderer does not do. Resource order is not kustomize's (it sorts by kind).

    python -m tests.k8s.kustomize k8s/overlays/cpu-dev     # prints the rendered YAML documents
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
FIELDS = {
    "Kustomization": {"apiVersion", "kind", "resources", "components", "namespace", "patches", "configMapGenerator"},
    "Component": {"apiVersion", "kind", "resources", "patches"},
}
API_VERSIONS = {"Kustomization": "kustomize.config.k8s.io/v1beta1", "Component": "kustomize.config.k8s.io/v1alpha1"}
PATCH_FIELDS = {"path", "target"}
TARGET_FIELDS = {"group", "version", "kind", "name"}
GENERATOR_FIELDS = {"name", "files", "options"}
GENERATOR_OPTIONS = {"disableNameSuffixHash", "labels", "annotations"}
CLUSTER_SCOPED = {"Namespace", "Node", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass", "IngressClass", "RuntimeClass", "APIService",
                  "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "CSIDriver", "CSINode",
                  "VolumeAttachment"}


class KustomizeError(ValueError):
    """The kustomization is invalid, or uses something this renderer does not implement."""


def build(directory: str | Path) -> list[dict]:
    """The rendered resources of the kustomization in `directory`."""
    return _build(Path(directory), "Kustomization", [])


def _load_kustomization(directory: Path, kind: str) -> dict:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            doc = yaml.safe_load((directory / name).read_text()) or {}
            break
    else:
        raise KustomizeError(f"{directory}: no kustomization file")
    if doc.get("kind", "Kustomization") != kind or doc.get("apiVersion") != API_VERSIONS[kind]:
        raise KustomizeError(f"{directory}: expected kind {kind} with apiVersion {API_VERSIONS[kind]}")
    unknown = set(doc) - FIELDS[kind]
    if unknown:
        raise KustomizeError(f"{directory}: fields not supported here: {sorted(unknown)}")
    return doc


def _inside(directory: Path, relative: str) -> Path:
    """A file of the kustomization: kustomize's default load restrictor refuses files outside its root."""
    path = (directory / relative).resolve()
    if directory.resolve() not in path.parents:
        raise KustomizeError(f"{directory}: {relative} is outside the kustomization's directory")
    if not path.is_file():
        raise KustomizeError(f"{directory}: {relative} is not a file")
    return path


def _build(directory: Path, kind: str, accumulated: list[dict]) -> list[dict]:
    """Kustomize's order: resources, then components (each adds its resources and patches everything so far),
    then generators, then transformers (patches, namespace). A component works on `accumulated`."""
    doc = _load_kustomization(directory, kind)
    resources = accumulated
    for entry in doc.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources += _build(path, "Kustomization", [])
        else:
            resources += [d for d in yaml.safe_load_all(_inside(directory, entry).read_text()) if d is not None]
    for entry in doc.get("components", []):
        resources = _build(directory / entry, "Component", resources)
    for generator in doc.get("configMapGenerator", []):
        resources.append(_config_map(directory, generator))
    for patch in doc.get("patches", []):
        _patch(directory, patch, resources)
    if "namespace" in doc:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource.setdefault("metadata", {})["namespace"] = doc["namespace"]
    _check_unique(directory, resources)
    return resources


def _config_map(directory: Path, generator: dict) -> dict:
    unknown = set(generator) - GENERATOR_FIELDS
    options = generator.get("options", {})
    if unknown or set(options) - GENERATOR_OPTIONS:
        raise KustomizeError(f"{directory}: configMapGenerator fields not supported here: "
                             f"{sorted(unknown | (set(options) - GENERATOR_OPTIONS))}")
    if options.get("disableNameSuffixHash") is not True:
        raise KustomizeError(f"{directory}: configMapGenerator {generator.get('name')}: set options.disableNameSuffixHash "
                             "(this renderer does not compute kustomize's name hash)")
    data = {}
    for entry in generator.get("files", []):
        key, _, relative = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = _inside(directory, relative).read_text()
    metadata = {"name": generator["name"]}
    for field in ("labels", "annotations"):
        if field in options:
            metadata[field] = dict(options[field])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _matches(resource: dict, target: dict) -> bool:
    group, _, version = resource.get("apiVersion", "").rpartition("/")
    wanted = {"group": group, "version": version, "kind": resource.get("kind"),
              "name": resource.get("metadata", {}).get("name")}
    return all(wanted[field] == value for field, value in target.items())


def _patch(directory: Path, patch: dict, resources: list[dict]) -> None:
    if set(patch) != PATCH_FIELDS or set(patch["target"]) - TARGET_FIELDS:
        raise KustomizeError(f"{directory}: a patch here is {{path, target: {{{', '.join(sorted(TARGET_FIELDS))}}}}}, "
                             f"got {patch}")
    ops = yaml.safe_load(_inside(directory, patch["path"]).read_text())
    if not isinstance(ops, list):
        raise KustomizeError(f"{directory}: {patch['path']} is not a JSON6902 patch (a list of operations); "
                             "strategic-merge patches are not supported here")
    targets = [i for i, r in enumerate(resources) if _matches(r, patch["target"])]
    if not targets:
        raise KustomizeError(f"{directory}: the target of {patch['path']} matches no resource: {patch['target']}")
    for i in targets:
        resources[i] = apply_json6902(resources[i], ops, f"{directory / patch['path']}")


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"not a JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], where: str) -> Any:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise KustomizeError(f"{where}: no {part!r} on the way to /{'/'.join(parts)}") from None
    return node


def apply_json6902(document: dict, ops: list[dict], where: str = "patch") -> dict:
    """RFC 6902 add, replace and remove (what kustomize's JSON6902 patches do) on a copy of `document`."""
    doc = copy.deepcopy(document)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        parent, last = _parent(doc, parts, where), parts[-1]
        value = copy.deepcopy(op.get("value"))
        if kind not in ("add", "replace", "remove"):
            raise KustomizeError(f"{where}: op {kind!r} is not supported here")
        if isinstance(parent, list):
            if kind == "add" and last == "-":
                parent.append(value)
                continue
            try:
                index = int(last)
            except ValueError:
                raise KustomizeError(f"{where}: {last!r} is not a list index") from None
            if not 0 <= index <= len(parent) - (kind != "add"):
                raise KustomizeError(f"{where}: index {index} out of range at {op['path']}")
            if kind == "add":
                parent.insert(index, value)
            elif kind == "replace":
                parent[index] = value
            else:
                del parent[index]
        elif isinstance(parent, dict):
            if kind != "add" and last not in parent:
                raise KustomizeError(f"{where}: {op['path']} does not exist ({kind} needs it)")
            if kind == "remove":
                del parent[last]
            else:
                parent[last] = value
        else:
            raise KustomizeError(f"{where}: {op['path']}: the parent is not an object or a list")
    return doc


def _check_unique(directory: Path, resources: list[dict]) -> None:
    seen = set()
    for r in resources:
        key = (r.get("apiVersion", "").rpartition("/")[0], r.get("kind"), r.get("metadata", {}).get("namespace"),
               r.get("metadata", {}).get("name"))
        if key in seen:
            raise KustomizeError(f"{directory}: two resources with the id {key}")
        seen.add(key)


if __name__ == "__main__":
    print(yaml.safe_dump_all(build(sys.argv[1]), sort_keys=False), end="")
