"""The small kustomize the manifest tests render with: kustomize's semantics for what it supports, and a
refusal for everything else."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.k8s.kustomize import KustomizeError, apply_json6902, build

KUSTOMIZATION = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
COMPONENT = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component"}


def write(directory: Path, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            (directory / name).write_text(content)
        elif isinstance(content, list) and not (content and "op" in content[0]):  # resources: one document each
            (directory / name).write_text(yaml.safe_dump_all(content))
        else:
            (directory / name).write_text(yaml.safe_dump(content))
    return directory


def deployment(name: str = "web") -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "x:1"}]}}}}


def test_json6902_add_replace_remove_and_append():
    doc = {"a": {"b": [1, 2, 3], "c/d": 1, "e~f": 2}}
    out = apply_json6902(doc, [
        {"op": "add", "path": "/a/b/-", "value": 4},
        {"op": "add", "path": "/a/b/0", "value": 0},
        {"op": "replace", "path": "/a/b/1", "value": 10},
        {"op": "remove", "path": "/a/b/2"},
        {"op": "replace", "path": "/a/c~1d", "value": 5},
        {"op": "remove", "path": "/a/e~0f"},
        {"op": "add", "path": "/a/new", "value": {"x": 1}},
    ])
    assert out == {"a": {"b": [0, 10, 3, 4], "c/d": 5, "new": {"x": 1}}}
    assert doc == {"a": {"b": [1, 2, 3], "c/d": 1, "e~f": 2}}  # the input is not changed


@pytest.mark.parametrize("op", [
    {"op": "replace", "path": "/a/missing", "value": 1},
    {"op": "remove", "path": "/a/b/3"},
    {"op": "add", "path": "/nowhere/x", "value": 1},
    {"op": "move", "from": "/a", "path": "/b"},
    {"op": "add", "path": "a/b", "value": 1},
])
def test_json6902_refuses_what_kustomize_would_fail_on(op):
    with pytest.raises(KustomizeError):
        apply_json6902({"a": {"b": [1, 2, 3]}}, [op])


def test_overlay_over_a_base_with_a_component_generator_patch_and_namespace(tmp_path):
    write(tmp_path / "base", {"kustomization.yaml": {**KUSTOMIZATION, "resources": ["app.yaml"],
                                                     "configMapGenerator": [{"name": "dash", "files": ["d/x.json"],
                                                                             "options": {"disableNameSuffixHash": True,
                                                                                         "labels": {"l": "1"}}}]},
                              "app.yaml": [deployment()], "d/x.json": '{"a": 1}'})
    write(tmp_path / "comp", {"kustomization.yaml": {**COMPONENT, "resources": ["db.yaml"],
                                                     "patches": [{"path": "patch.yaml",
                                                                  "target": {"kind": "Deployment", "name": "web"}}]},
                              "db.yaml": [deployment("db"), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}],
                              "patch.yaml": [{"op": "add", "path": "/metadata/labels", "value": {"with": "db"}}]})
    overlay = write(tmp_path / "overlay", {
        "kustomization.yaml": {**KUSTOMIZATION, "namespace": "prod", "resources": ["../base"], "components": ["../comp"],
                               "patches": [{"path": "patch.yaml", "target": {"group": "apps", "version": "v1",
                                                                             "kind": "Deployment", "name": "web"}}]},
        "patch.yaml": [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "x:2"}]})
    out = {(r["kind"], r["metadata"]["name"]): r for r in build(overlay)}
    web = out[("Deployment", "web")]
    assert web["spec"]["template"]["spec"]["containers"][0]["image"] == "x:2"
    assert web["metadata"] == {"name": "web", "labels": {"with": "db"}, "namespace": "prod"}  # the component patched the base
    assert out[("Deployment", "db")]["metadata"]["namespace"] == "prod"
    assert "namespace" not in out[("Namespace", "ns")]["metadata"]  # cluster-scoped
    assert out[("ConfigMap", "dash")] == {"apiVersion": "v1", "kind": "ConfigMap", "data": {"x.json": '{"a": 1}'},
                                          "metadata": {"name": "dash", "labels": {"l": "1"}, "namespace": "prod"}}


@pytest.mark.parametrize("kustomization, files, message", [
    ({"commonLabels": {"a": "b"}}, {}, "not supported"),
    ({"patches": [{"path": "p.yaml", "target": {"kind": "Deployment", "name": "web"}}]},
     {"p.yaml": {"metadata": {"labels": {"a": "b"}}}}, "strategic-merge"),
    ({"patches": [{"path": "p.yaml", "target": {"kind": "Deployment", "name": "nope"}}]},
     {"p.yaml": [{"op": "add", "path": "/x", "value": 1}]}, "matches no resource"),
    ({"patches": [{"path": "p.yaml", "target": {"kind": "Deployment", "labelSelector": "a=b"}}]},
     {"p.yaml": [{"op": "add", "path": "/x", "value": 1}]}, "a patch here is"),
    ({"configMapGenerator": [{"name": "c", "files": ["app.yaml"]}]}, {}, "disableNameSuffixHash"),
    ({"resources": ["../outside.yaml"]}, {}, "outside"),
    ({"resources": ["app.yaml", "again.yaml"]}, {"again.yaml": [deployment()]}, "two resources"),
])
def test_what_it_does_not_do_is_refused(tmp_path, kustomization, files, message):
    (tmp_path / "outside.yaml").write_text(yaml.safe_dump(deployment("x")))
    root = write(tmp_path / "k", {"kustomization.yaml": {**KUSTOMIZATION, "resources": ["app.yaml"], **kustomization},
                                  "app.yaml": [deployment()], **files})
    with pytest.raises(KustomizeError, match=message):
        build(root)
