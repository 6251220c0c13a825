#!/usr/bin/env python3
"""Render and check Engram Service's deployment files (k8s/ and docker-compose.yml), for CI.

Subcommands:

  build DIR           Render the kustomization in DIR to stdout (YAML stream), like `kustomize build`.
  compare DIR FILE    Render DIR and compare with FILE, the output of a real kustomize: same objects
                      (order ignored). Keeps this renderer honest wherever a real kustomize exists.
  check FILE [--expect-gpu | --expect-no-gpu] [--require-tags]
                      Checks on a rendered stream that kubernetes-validate cannot make: the KEDA
                      ScaledObject (a CRD, so no schema there) against a schema written here with its
                      cross-references (target Deployment, Redis Service, queue consumed by the
                      target), references to ConfigMaps/Secrets and their keys, selectors, security
                      contexts, resources, probes, and the ENGRAM_* settings against service/config.py.
  split FILE BUILTIN CRDS
                      Write the objects of built-in kinds and the others (CRDs) to two files.
  check-compose FILE  Checks on `docker-compose config` output: ENGRAM_* settings, API keys, the GPU
                      reservation, the CPU profile, health checks behind `service_healthy`, pinned images.
  selftest            The renderer's own tests (hash names checked against kustomize 5.5.0).

The renderer supports exactly the kustomize features k8s/ uses, and refuses everything else
(so it never renders something silently wrong): `resources` (files and kustomization
directories), `namespace`, `labels` (includeSelectors: false, no includeTemplates), `images`
(newName, newTag, digest), `configMapGenerator` / `secretGenerator` (envs, literals, type,
behavior create/merge/replace; content-hash name suffix and reference fix-up, as kustomize does
at the top level), `patches` (strategic-merge patches by path or inline, matched by kind and name;
`$patch: delete` of a whole object). Transformers run in kustomize's order: patches, namespace,
labels, images.

Runs with the project's venv (PyYAML; jsonschema and kubernetes-validate for `check`).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)
from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "images",
    "configMapGenerator",
    "secretGenerator",
    "patches",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "APIService",
    "IngressClass",
    "RuntimeClass",
    "CSIDriver",
    "VolumeAttachment",
}
# kustomize's legacy output order (api/resid/gvk.go): these kinds first, in this order, then the
# rest by group/version/kind, then these last.
ORDER_FIRST = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
# Strategic-merge keys of the lists k8s/ patches (from the Kubernetes API's patchMergeKey); other
# lists are replaced whole, as they are for `tolerations`, `command`, `args`.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
BUILTIN_GROUPS = {
    "",
    "apps",
    "batch",
    "autoscaling",
    "policy",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "scheduling.k8s.io",
    "coordination.k8s.io",
    "discovery.k8s.io",
    "node.k8s.io",
    "admissionregistration.k8s.io",
    "apiextensions.k8s.io",
    "certificates.k8s.io",
    "events.k8s.io",
    "flowcontrol.apiserver.k8s.io",
    "resource.k8s.io",
}


class RenderError(Exception):
    """Something the renderer cannot (or must not) render."""


# ---------------------------------------------------------------- YAML helpers


def load_docs(text: str, where: str) -> list[dict[str, Any]]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError(f"{where}: not valid YAML: {exc}") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise RenderError(f"{where}: a document is not a mapping")
    return docs


def dump_docs(docs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(d, sort_keys=True, default_flow_style=False, width=100) for d in docs)


def kind_of(obj: dict[str, Any]) -> str:
    return str(obj.get("kind", ""))


def name_of(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def ns_of(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("namespace")


def group_of(obj: dict[str, Any]) -> str:
    api = str(obj.get("apiVersion", ""))
    return api.split("/")[0] if "/" in api else ""


def ident(obj: dict[str, Any]) -> str:
    ns = ns_of(obj)
    return f"{kind_of(obj)}/{name_of(obj)}" + (f" (namespace {ns})" if ns else "")


# ---------------------------------------------------------------- content hash (kustomize api/hasher)


def _go_json(value: Any) -> str:
    """``encoding/json.Marshal`` of maps and strings: sorted keys, no spaces, HTML-escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for raw, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, esc)
    return text


def content_hash(obj: dict[str, Any]) -> str:
    """kustomize's name suffix for a generated ConfigMap or Secret (api/hasher, kustomize 5.x).

    The encoding is kustomize's own, quirks included: it looks the name up as the single key
    ``metadata/name``, which never exists, so the name always enters as ``""``; a field that is
    absent enters as ``""``, a present one as its JSON value; binaryData (ConfigMap) and stringData
    (Secret) only when present.
    """
    kind = kind_of(obj)
    if kind not in {"ConfigMap", "Secret"}:
        raise RenderError(f"cannot hash a {kind}")
    encoded: dict[str, Any] = {"kind": kind, "name": "", "data": obj["data"] if "data" in obj else ""}
    extra = "binaryData" if kind == "ConfigMap" else "stringData"
    if isinstance(obj.get(extra), dict):
        encoded[extra] = obj[extra]
    if kind == "Secret":
        encoded["type"] = obj.get("type", "")
    digest = hashlib.sha256(_go_json(encoded).encode()).hexdigest()
    return digest[:10].translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


# ---------------------------------------------------------------- generators


def _inside(root: Path, rel: str, what: str) -> Path:
    path = (root / rel).resolve()
    if path != root.resolve() and root.resolve() not in path.parents:
        raise RenderError(f"{what} {rel!r} lies outside {root} (kustomize's load restrictor refuses it)")
    if not path.is_file():
        raise RenderError(f"{what} {rel!r} does not exist in {root}")
    return path


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (kustomize's env files): blank and ``#`` lines skipped, values verbatim."""
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.lstrip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise RenderError(f"{path}:{number}: not KEY=VALUE (taking values from the environment is not supported)")
        key, value = line.split("=", 1)
        if not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
            raise RenderError(f"{path}:{number}: invalid key {key!r}")
        if key in out:
            raise RenderError(f"{path}:{number}: key {key!r} repeated")
        out[key] = value
    return out


def encode_base64(value: str) -> str:
    """kyaml's encoding of Secret data: base64, cut into lines of 70 characters, each ending in a
    newline once there is more than one line (Kubernetes' decoder ignores the newlines)."""
    encoded = base64.b64encode(value.encode()).decode()
    if len(encoded) // 70 + 1 == 1:
        return encoded
    return "".join(encoded[i : i + 70] + "\n" for i in range(0, len(encoded), 70))


def generate(spec: dict[str, Any], kind: str, root: Path) -> tuple[dict[str, Any], str]:
    """One generated ConfigMap or Secret (without its hash) and its behavior."""
    unknown = set(spec) - {"name", "envs", "literals", "type", "behavior", "namespace"}
    if unknown:
        raise RenderError(f"{kind} generator {spec.get('name')!r}: unsupported fields {sorted(unknown)}")
    if not spec.get("name"):
        raise RenderError(f"{kind} generator without a name")
    data: dict[str, str] = {}
    for rel in spec.get("envs") or []:
        for key, value in read_env_file(_inside(root, rel, "env file")).items():
            if key in data:
                raise RenderError(f"{kind} {spec['name']}: key {key!r} defined twice")
            data[key] = value
    for literal in spec.get("literals") or []:
        if "=" not in literal:
            raise RenderError(f"{kind} {spec['name']}: literal {literal!r} is not KEY=VALUE")
        key, value = literal.split("=", 1)
        if key in data:
            raise RenderError(f"{kind} {spec['name']}: key {key!r} defined twice")
        data[key] = value
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}}
    if spec.get("namespace"):
        obj["metadata"]["namespace"] = spec["namespace"]
    if kind == "Secret":
        obj["type"] = spec.get("type", "Opaque")
        data = {k: encode_base64(v) for k, v in data.items()}
    elif "type" in spec:
        raise RenderError(f"ConfigMap generator {spec['name']}: `type` is for Secrets")
    if data:  # kustomize leaves `data` out of an empty generated object
        obj["data"] = data
    behavior = spec.get("behavior", "create")
    if behavior not in {"create", "merge", "replace"}:
        raise RenderError(f"{kind} {spec['name']}: unknown behavior {behavior!r}")
    return obj, behavior


# ---------------------------------------------------------------- strategic merge patch


def _merge(base: Any, patch: Any, field: str, smp: bool, where: str) -> Any:
    if isinstance(patch, dict):
        if "$patch" in patch or any(k.startswith("$") for k in patch):
            raise RenderError(f"{where}: patch directive inside {field!r} is not supported")
        if not isinstance(base, dict):
            return {k: v for k, v in patch.items() if v is not None}
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value, key, smp, where)
            else:
                out[key] = _merge(None, value, key, smp, where)
        return out
    if isinstance(patch, list):
        key = MERGE_KEYS.get(field) if smp else None
        if key is None or not isinstance(base, list):
            return [_merge(None, item, field, smp, where) if isinstance(item, dict) else item for item in patch]
        out = list(base)
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"{where}: an item of {field!r} lacks its merge key {key!r}")
            for index, existing in enumerate(out):
                if isinstance(existing, dict) and existing.get(key) == item[key]:
                    out[index] = _merge(existing, item, field + "[]", smp, where)
                    break
            else:
                out.append(_merge(None, item, field + "[]", smp, where))
        return out
    return patch


def apply_patch(resources: list[dict[str, Any]], patch: dict[str, Any], where: str) -> list[dict[str, Any]]:
    directive = patch.get("$patch")
    body = {k: v for k, v in patch.items() if k != "$patch"}
    matches = [
        i
        for i, r in enumerate(resources)
        if kind_of(r) == kind_of(body)
        and name_of(r) == name_of(body)
        and str(r.get("apiVersion", "")).split("/")[0] == str(body.get("apiVersion", "")).split("/")[0]
        and (ns_of(body) is None or ns_of(body) == ns_of(r))
    ]
    if len(matches) != 1:
        raise RenderError(f"{where}: patch for {ident(body)} matches {len(matches)} objects, not one")
    index = matches[0]
    if directive == "delete":
        return resources[:index] + resources[index + 1 :]
    if directive is not None:
        raise RenderError(f"{where}: unsupported patch directive {directive!r}")
    # Built-in kinds merge lists by their merge keys; CRDs get JSON merge patch semantics, as in kustomize.
    smp = group_of(body) in BUILTIN_GROUPS
    merged = _merge(copy.deepcopy(resources[index]), body, "", smp, where)
    return resources[:index] + [merged] + resources[index + 1 :]


# ---------------------------------------------------------------- transformers


def set_namespace(resources: list[dict[str, Any]], namespace: str) -> None:
    for r in resources:
        if kind_of(r) not in CLUSTER_SCOPED:
            r.setdefault("metadata", {})["namespace"] = namespace


def add_labels(resources: list[dict[str, Any]], entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        unknown = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
        if unknown or entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise RenderError("labels: only `pairs` with includeSelectors: false (and no includeTemplates) is supported")
        for r in resources:
            labels = r.setdefault("metadata", {}).setdefault("labels", {})
            labels.update({str(k): str(v) for k, v in (entry.get("pairs") or {}).items()})


def _split_image(image: str) -> tuple[str, str, str]:
    """``name[:tag][@digest]`` -> (name, tag, digest); a registry port is not a tag."""
    digest = ""
    if "@" in image:
        image, digest = image.split("@", 1)
    tag = ""
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        image, tag = image[:colon], image[colon + 1 :]
    return image, tag, digest


def set_images(resources: list[dict[str, Any]], entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        unknown = set(entry) - {"name", "newName", "newTag", "digest"}
        if unknown or not entry.get("name"):
            raise RenderError(f"images: unsupported entry {entry}")

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in {"containers", "initContainers"} and isinstance(value, list):
                    for container in value:
                        if isinstance(container, dict) and isinstance(container.get("image"), str):
                            container["image"] = retag(container["image"])
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    def retag(image: str) -> str:
        name, tag, digest = _split_image(image)
        for entry in entries:
            if entry["name"] == name:
                name = entry.get("newName") or name
                if entry.get("digest"):
                    return f"{name}@{entry['digest']}"
                if entry.get("newTag") is not None:
                    tag, digest = str(entry["newTag"]), ""
                break
        return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")

    visit(resources)


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec") or {}
    kind = kind_of(obj)
    if kind == "Pod":
        return [spec]
    if kind == "CronJob":
        return [((((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}).get("spec") or {})]
    if kind in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController"}:
        return [((spec.get("template") or {}).get("spec") or {})]
    return []


def _refs(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(kind, holder, field) of every ConfigMap/Secret name reference in a pod spec."""
    out: list[tuple[str, dict[str, Any], str]] = []
    for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                out.append(("ConfigMap", source["configMapRef"], "name"))
            if "secretRef" in source:
                out.append(("Secret", source["secretRef"], "name"))
        for var in container.get("env") or []:
            value_from = var.get("valueFrom") or {}
            if "configMapKeyRef" in value_from:
                out.append(("ConfigMap", value_from["configMapKeyRef"], "name"))
            if "secretKeyRef" in value_from:
                out.append(("Secret", value_from["secretKeyRef"], "name"))
    for volume in pod.get("volumes") or []:
        if "configMap" in volume:
            out.append(("ConfigMap", volume["configMap"], "name"))
        if "secret" in volume:
            out.append(("Secret", volume["secret"], "secretName"))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                out.append(("ConfigMap", source["configMap"], "name"))
            if "secret" in source:
                out.append(("Secret", source["secret"], "name"))
    for secret in pod.get("imagePullSecrets") or []:
        out.append(("Secret", secret, "name"))
    return out


GENERATED = "__render_kustomize_generated__"  # marks generated objects until their names get hashes


def add_hashes(resources: list[dict[str, Any]]) -> None:
    """Suffix generated objects' names with their content hash and fix the references to them."""
    renamed: dict[tuple[str, str | None, str], str] = {}
    for r in resources:
        if r.pop(GENERATED, False):
            new = f"{name_of(r)}-{content_hash(r)}"
            renamed[(kind_of(r), ns_of(r), name_of(r))] = new
            r["metadata"]["name"] = new
    for r in resources:
        for pod in _pod_specs(r):
            for kind, holder, field in _refs(pod):
                new = renamed.get((kind, ns_of(r), holder.get(field)))
                if new:
                    holder[field] = new


def legacy_sort(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        kind = kind_of(r)
        if kind in ORDER_FIRST:
            rank: tuple[Any, ...] = (0, ORDER_FIRST.index(kind))
        elif kind in ORDER_LAST:
            rank = (2, ORDER_LAST.index(kind))
        else:
            api = str(r.get("apiVersion", ""))
            rank = (1, group_of(r), api.split("/")[-1], kind)
        return (*rank, ns_of(r) or "", name_of(r))

    return sorted(resources, key=key)


# ---------------------------------------------------------------- build


def _kustomization(directory: Path) -> tuple[Path, dict[str, Any]]:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            docs = load_docs(path.read_text(), str(path))
            if len(docs) != 1:
                raise RenderError(f"{path}: expected one document")
            return path, docs[0]
    raise RenderError(f"{directory}: no kustomization.yaml")


def _accumulate(directory: Path, stack: tuple[Path, ...]) -> list[dict[str, Any]]:
    directory = directory.resolve()
    if directory in stack:
        raise RenderError(f"{directory}: cycle in resources")
    path, kust = _kustomization(directory)
    unknown = set(kust) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{path}: unsupported kustomization fields {sorted(unknown)}")
    if kust.get("kind", "Kustomization") != "Kustomization":
        raise RenderError(f"{path}: only kind Kustomization is supported")

    resources: list[dict[str, Any]] = []
    for entry in kust.get("resources") or []:
        target = (directory / entry).resolve()
        if target.is_dir():
            resources += _accumulate(target, (*stack, directory))
        else:
            resources += load_docs(_inside(directory, entry, "resource").read_text(), str(target))

    def find(kind: str, name: str) -> int | None:
        hits = [i for i, r in enumerate(resources) if r.get(GENERATED) and kind_of(r) == kind and name_of(r) == name]
        return hits[0] if hits else None

    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in kust.get(field) or []:
            obj, behavior = generate(spec, kind, directory)
            index = find(kind, name_of(obj))
            if behavior == "create":
                if index is not None or any(kind_of(r) == kind and name_of(r) == name_of(obj) for r in resources):
                    raise RenderError(f"{path}: {kind} {name_of(obj)} already exists (use behavior: merge or replace)")
                obj[GENERATED] = True
                resources.append(obj)
                continue
            if index is None:
                raise RenderError(f"{path}: {kind} {name_of(obj)} to {behavior} was not generated by a base")
            existing = resources[index]
            data = {**(existing.get("data") or {}), **(obj.get("data") or {})} if behavior == "merge" else obj.get("data")
            existing.pop("data", None)
            if data:
                existing["data"] = data

    for number, entry in enumerate(kust.get("patches") or [], start=1):
        unknown = set(entry) - {"path", "patch"}
        if unknown or ("path" in entry) == ("patch" in entry):
            raise RenderError(f"{path}: patch {number}: give exactly one of path/patch (targets, options unsupported)")
        where = f"{path} patch {number}"
        text = _inside(directory, entry["path"], "patch").read_text() if "path" in entry else entry["patch"]
        docs = load_docs(text, where)
        if len(docs) != 1:
            raise RenderError(f"{where}: one document per patch (kustomize 5.5 crashes on several deletions in one)")
        if not isinstance(docs[0].get("metadata"), dict) or "kind" not in docs[0]:
            raise RenderError(f"{where}: not a strategic-merge patch (JSON 6902 patches are unsupported)")
        resources = apply_patch(resources, docs[0], where)

    if kust.get("namespace"):
        set_namespace(resources, str(kust["namespace"]))
    add_labels(resources, kust.get("labels") or [])
    set_images(resources, kust.get("images") or [])
    return resources


def build(directory: Path) -> list[dict[str, Any]]:
    resources = _accumulate(Path(directory), ())
    add_hashes(resources)
    seen: dict[tuple[str, str, str | None, str], int] = {}
    for r in resources:
        key = (group_of(r), kind_of(r), ns_of(r), name_of(r))
        if key in seen:
            raise RenderError(f"{ident(r)} is defined twice")
        seen[key] = 1
    return legacy_sort(resources)


# ---------------------------------------------------------------- compare with a real kustomize


def canonical(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {f"{group_of(d)}/{ident(d)}": json.dumps(d, sort_keys=True, indent=1) for d in docs}


def compare(directory: Path, other: Path) -> int:
    ours = canonical(build(directory))
    theirs = canonical(load_docs(other.read_text(), str(other)))
    problems = [f"only in kustomize's output: {k}" for k in sorted(set(theirs) - set(ours))]
    problems += [f"only in ours: {k}" for k in sorted(set(ours) - set(theirs))]
    for key in sorted(set(ours) & set(theirs)):
        if ours[key] != theirs[key]:
            import difflib

            diff = difflib.unified_diff(
                theirs[key].splitlines(), ours[key].splitlines(), "kustomize", "ours", lineterm="", n=2
            )
            problems.append(f"{key} differs:\n" + "\n".join(diff))
    for problem in problems:
        print(f"render_kustomize compare {directory}: {problem}", file=sys.stderr)
    if not problems:
        print(f"render_kustomize: {directory}: identical to kustomize's output ({len(ours)} objects)")
    return 1 if problems else 0


# ---------------------------------------------------------------- checks on a rendered stream


def _scaledobject_schema() -> dict[str, Any]:
    """keda.sh/v1alpha1 ScaledObject (KEDA 2.x CRD), strict: unknown fields are errors."""
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    behavior = {
        "$ref": "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"
    }
    meta = {"$ref": "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    count = {"type": "integer", "minimum": 0}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": meta,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": {"type": "string", "minLength": 1},
                            "envSourceContainerName": {"type": "string"},
                        },
                    },
                    "pollingInterval": count,
                    "cooldownPeriod": count,
                    "initialCooldownPeriod": count,
                    "idleReplicaCount": count,
                    "minReplicaCount": count,
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "fallback": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["failureThreshold", "replicas"],
                        "properties": {
                            "failureThreshold": count,
                            "replicas": count,
                            "behavior": {"type": "string"},
                        },
                    },
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"name": {"type": "string"}, "behavior": behavior},
                            },
                            "scalingModifiers": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "formula": {"type": "string"},
                                    "target": {"type": "string"},
                                    "activationTarget": {"type": "string"},
                                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                },
                            },
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string", "minLength": 1},
                                "name": {"type": "string"},
                                "metadata": string_map,
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "useCachedMetrics": {"type": "boolean"},
                                "authenticationRef": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["name"],
                                    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
            },
        },
    }


REDIS_TRIGGER_KEYS = {
    "address",
    "host",
    "port",
    "addressFromEnv",
    "hostFromEnv",
    "portFromEnv",
    "usernameFromEnv",
    "passwordFromEnv",
    "listName",
    "listLength",
    "activationListLength",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
}


def _validate_crds(docs: list[dict[str, Any]], errors: list[str]) -> None:
    import jsonschema
    from kubernetes_validate import utils as kv
    from referencing import Registry, Resource

    definitions = kv.schema_contents(
        f"kubernetes-json-schema/v{kv.latest_version()}-local-strict/_definitions.json", kv.latest_version()
    )
    registry = Resource.from_contents(definitions) @ Registry()
    validator = jsonschema.Draft202012Validator(_scaledobject_schema(), registry=registry)
    for doc in docs:
        if group_of(doc) in BUILTIN_GROUPS:
            continue
        if (doc.get("apiVersion"), kind_of(doc)) != ("keda.sh/v1alpha1", "ScaledObject"):
            errors.append(f"{ident(doc)}: {doc.get('apiVersion')} has no schema here (only keda.sh/v1alpha1 ScaledObject)")
            continue
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in error.absolute_path)
            errors.append(f"{ident(doc)}: {path}: {error.message}")


def _by(docs: list[dict[str, Any]], kind: str) -> dict[tuple[str | None, str], dict[str, Any]]:
    return {(ns_of(d), name_of(d)): d for d in docs if kind_of(d) == kind}


def _queues(deployment: dict[str, Any]) -> set[str]:
    """The queues the worker in a Deployment consumes (``engram-service worker --queues a,b``)."""
    for container in _pod_specs(deployment)[0].get("containers") or []:
        argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        if "worker" in argv:
            if "--queues" in argv and argv.index("--queues") + 1 < len(argv):
                return set(argv[argv.index("--queues") + 1].split(","))
            return {"gpu", "cpu"}  # the CLI's default
    return set()


def _check_scaledobjects(docs: list[dict[str, Any]], errors: list[str]) -> None:
    deployments = _by(docs, "Deployment")
    services = _by(docs, "Service")
    hpa_targets = {
        (ns_of(d), ((d.get("spec") or {}).get("scaleTargetRef") or {}).get("name"))
        for d in docs
        if kind_of(d) == "HorizontalPodAutoscaler"
    }
    for so in docs:
        if kind_of(so) != "ScaledObject":
            continue
        spec = so.get("spec") or {}
        target_ref = spec.get("scaleTargetRef") or {}
        if target_ref.get("kind", "Deployment") != "Deployment":
            errors.append(f"{ident(so)}: only Deployment targets are checked here")
            continue
        target = deployments.get((ns_of(so), target_ref.get("name")))
        if target is None:
            errors.append(f"{ident(so)}: scaleTargetRef names no Deployment {target_ref.get('name')!r} in this namespace")
            continue
        if (ns_of(so), target_ref.get("name")) in hpa_targets:
            errors.append(
                f"{ident(so)}: Deployment {target_ref.get('name')} is also the target of an HPA (KEDA makes its own)"
            )
        if "replicas" in (target.get("spec") or {}):
            errors.append(
                f"{ident(so)}: Deployment {target_ref.get('name')} sets spec.replicas, which fights KEDA on every apply"
            )
        low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            errors.append(f"{ident(so)}: minReplicaCount {low} > maxReplicaCount {high}")
        consumed = _queues(target)
        for trigger in spec.get("triggers") or []:
            if trigger.get("type") != "redis":
                errors.append(f"{ident(so)}: trigger type {trigger.get('type')!r} is not checked here (only redis)")
                continue
            meta = trigger.get("metadata") or {}
            unknown = set(meta) - REDIS_TRIGGER_KEYS
            if unknown:
                errors.append(f"{ident(so)}: unknown redis trigger metadata {sorted(unknown)}")
            if not meta.get("listName"):
                errors.append(f"{ident(so)}: redis trigger without listName")
            elif meta["listName"] not in consumed:
                errors.append(
                    f"{ident(so)}: scales on queue {meta['listName']!r}, which {target_ref.get('name')} "
                    f"does not consume (it consumes {sorted(consumed)})"
                )
            for key in ("listLength", "activationListLength", "databaseIndex", "port"):
                if key in meta and not str(meta[key]).isdigit():
                    errors.append(f"{ident(so)}: redis trigger {key} {meta[key]!r} is not a non-negative integer")
            if not any(meta.get(k) for k in ("address", "host", "addressFromEnv", "hostFromEnv")):
                errors.append(f"{ident(so)}: redis trigger needs address, host, addressFromEnv or hostFromEnv")
            address = meta.get("address")
            if address:
                host, _, port = address.rpartition(":")
                match = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc(\.cluster\.local)?", host)
                if not port.isdigit():
                    errors.append(f"{ident(so)}: redis address {address!r} is not host:port")
                elif match:
                    # KEDA's operator resolves the name from its own namespace: it must be fully qualified.
                    service = services.get((match.group(2), match.group(1)))
                    ports = {p.get("port") for p in ((service or {}).get("spec") or {}).get("ports") or []}
                    if service is None or int(port) not in ports:
                        errors.append(f"{ident(so)}: redis address {address!r} names no Service port in this render")
                elif "." not in host:
                    errors.append(
                        f"{ident(so)}: redis address {address!r} must be the Service's full DNS name "
                        f"(KEDA's operator runs in another namespace)"
                    )


def _check_references(docs: list[dict[str, Any]], errors: list[str]) -> None:
    objects = {(kind_of(d), ns_of(d), name_of(d)): d for d in docs}
    pods = [(d, p) for d in docs for p in _pod_specs(d)]
    for owner, pod in pods:
        for kind, holder, field in _refs(pod):
            target = objects.get((kind, ns_of(owner), holder.get(field)))
            if target is None:
                if not holder.get("optional"):
                    errors.append(
                        f"{ident(owner)}: refers to {kind} {holder.get(field)!r}, not in this render "
                        f"(a generated name not rewritten?)"
                    )
                continue
            if "key" in holder:
                keys = set(target.get("data") or {}) | set(target.get("stringData") or {})
                if holder["key"] not in keys:
                    errors.append(f"{ident(owner)}: {kind} {holder.get(field)} has no key {holder['key']!r}")
        volumes = {v.get("name") for v in pod.get("volumes") or []}
        for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            for mount in container.get("volumeMounts") or []:
                if mount.get("name") not in volumes:
                    errors.append(
                        f"{ident(owner)}: container {container.get('name')} mounts unknown volume {mount.get('name')!r}"
                    )
            for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
                probe = container.get(probe_name) or {}
                port = (probe.get("httpGet") or {}).get("port")
                names = {p.get("name") for p in container.get("ports") or []}
                if isinstance(port, str) and port not in names:
                    errors.append(f"{ident(owner)}: {probe_name} uses unknown port name {port!r}")

    def selected(selector: dict[str, str], namespace: str | None) -> list[dict[str, Any]]:
        return [
            d
            for d in docs
            if ns_of(d) == namespace
            and _pod_specs(d)
            and selector.items()
            <= ((((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}).items()
        ]

    for d in docs:
        spec = d.get("spec") or {}
        if kind_of(d) == "Service":
            targets = selected(spec.get("selector") or {}, ns_of(d))
            if not targets:
                errors.append(f"{ident(d)}: its selector matches no pod template")
            for port in spec.get("ports") or []:
                target_port = port.get("targetPort")
                if isinstance(target_port, str):
                    names = {
                        p.get("name")
                        for t in targets
                        for c in _pod_specs(t)[0].get("containers") or []
                        for p in c.get("ports") or []
                    }
                    if target_port not in names:
                        errors.append(f"{ident(d)}: targetPort {target_port!r} is no container port name of its pods")
        elif kind_of(d) in {"PodDisruptionBudget", "Deployment"}:
            match = (spec.get("selector") or {}).get("matchLabels") or {}
            if not match or not selected(match, ns_of(d)):
                errors.append(f"{ident(d)}: its selector matches no pod template")
        elif kind_of(d) == "HorizontalPodAutoscaler":
            ref = spec.get("scaleTargetRef") or {}
            if (ref.get("kind"), ns_of(d), ref.get("name")) not in objects:
                errors.append(f"{ident(d)}: scaleTargetRef {ref.get('kind')}/{ref.get('name')} is not in this render")


def _check_pods(docs: list[dict[str, Any]], errors: list[str], expect_gpu: bool | None, require_tags: bool) -> None:
    gpu_workloads = []
    for d in docs:
        for pod in _pod_specs(d):
            pod_sc = pod.get("securityContext") or {}
            if (pod_sc.get("seccompProfile") or {}).get("type") not in {"RuntimeDefault", "Localhost"}:
                errors.append(f"{ident(d)}: pod securityContext.seccompProfile must be RuntimeDefault")
            if pod.get("automountServiceAccountToken") is not False:
                errors.append(
                    f"{ident(d)}: automountServiceAccountToken should be false (no pod here talks to the API server)"
                )
            for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                where = f"{ident(d)} container {container.get('name')}"
                sc = container.get("securityContext") or {}
                if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
                    errors.append(f"{where}: runAsNonRoot is not set")
                if sc.get("allowPrivilegeEscalation") is not False:
                    errors.append(f"{where}: allowPrivilegeEscalation must be false")
                if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                    errors.append(f"{where}: capabilities must drop ALL")
                if sc.get("readOnlyRootFilesystem") is not True:
                    errors.append(f"{where}: readOnlyRootFilesystem must be true")
                resources = container.get("resources") or {}
                for section in ("requests", "limits"):
                    for resource in ("cpu", "memory"):
                        if resource not in (resources.get(section) or {}):
                            errors.append(f"{where}: no {section}.{resource}")
                image = str(container.get("image", ""))
                name, tag, digest = _split_image(image)
                if require_tags and (not (tag or digest) or tag == "latest"):
                    errors.append(f"{where}: image {image!r} needs an explicit tag or digest (not latest)")
                gpus = [(resources.get(s) or {}).get("nvidia.com/gpu") for s in ("requests", "limits")]
                if any(gpus):
                    gpu_workloads.append(name_of(d))
                    if (resources.get("limits") or {}).get("nvidia.com/gpu") is None:
                        errors.append(f"{where}: nvidia.com/gpu must be in limits (extended resources are limit-driven)")
                    if not pod.get("tolerations") or not pod.get("nodeSelector"):
                        errors.append(f"{where}: a GPU pod needs tolerations and a nodeSelector for the GPU nodes")
        if kind_of(d) == "Deployment" and name_of(d) == "engram-api":
            container = (_pod_specs(d)[0].get("containers") or [{}])[0]
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                if ((container.get(probe) or {}).get("httpGet") or {}).get("path") != path:
                    errors.append(f"{ident(d)}: {probe} must GET {path}")
    if expect_gpu is True and "engram-worker" not in gpu_workloads:
        errors.append("expected the Deployment engram-worker to request nvidia.com/gpu")
    if expect_gpu is False and gpu_workloads:
        errors.append(f"expected no GPU requests, found them in {sorted(set(gpu_workloads))}")


def _settings_errors(env: dict[str, str], where: str) -> list[str]:
    """ENGRAM_* keys must be settings of service/config.py, and the values must validate."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from service.config import Settings

    fields = {f"ENGRAM_{name.upper()}" for name in Settings.model_fields}
    errors = [
        f"{where}: {key} is no setting of service/config.py (known: {', '.join(sorted(fields))})"
        for key in sorted(env)
        if key.startswith("ENGRAM_") and key not in fields
    ]
    saved = {k: v for k, v in os.environ.items() if k.startswith("ENGRAM_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("ENGRAM_")})
        try:
            Settings()
        except Exception as exc:  # pydantic's ValidationError, or a validator's ValueError
            errors.append(f"{where}: the settings do not validate: {exc}")
    finally:
        for key in [k for k in os.environ if k.startswith("ENGRAM_")]:
            del os.environ[key]
        os.environ.update(saved)
    if env.get("ENGRAM_API_KEYS") is not None:
        from service.api.auth import parse_api_keys

        try:
            parse_api_keys(env["ENGRAM_API_KEYS"])
        except ValueError as exc:
            errors.append(f"{where}: ENGRAM_API_KEYS: {exc}")
    return errors


def _check_settings(docs: list[dict[str, Any]], errors: list[str]) -> None:
    objects = {(kind_of(d), ns_of(d), name_of(d)): d for d in docs}
    for d in docs:
        for pod in _pod_specs(d):
            for container in pod.get("containers") or []:
                env: dict[str, str] = {}
                for source in container.get("envFrom") or []:
                    for kind, ref in (("ConfigMap", source.get("configMapRef")), ("Secret", source.get("secretRef"))):
                        target = objects.get((kind, ns_of(d), (ref or {}).get("name")))
                        data = (target or {}).get("data") or {}
                        if kind == "Secret":
                            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
                        env.update(data)
                for var in container.get("env") or []:
                    if "value" in var:
                        env[var["name"]] = str(var["value"])
                if any(k.startswith("ENGRAM_") for k in env):
                    errors.extend(_settings_errors(env, f"{ident(d)} container {container.get('name')}"))


def check(path: Path, expect_gpu: bool | None, require_tags: bool) -> int:
    docs = load_docs(path.read_text(), str(path))
    errors: list[str] = []
    _validate_crds(docs, errors)
    _check_scaledobjects(docs, errors)
    _check_references(docs, errors)
    _check_pods(docs, errors, expect_gpu, require_tags)
    _check_settings(docs, errors)
    for error in errors:
        print(f"ERROR {path}: {error}", file=sys.stderr)
    if not errors:
        crds = sum(1 for d in docs if group_of(d) not in BUILTIN_GROUPS)
        print(f"render_kustomize check: {path}: {len(docs)} objects OK ({crds} ScaledObject(s) against the KEDA schema)")
    return 1 if errors else 0


def split(path: Path, builtin: Path, crds: Path) -> int:
    docs = load_docs(path.read_text(), str(path))
    builtin.write_text(dump_docs([d for d in docs if group_of(d) in BUILTIN_GROUPS]))
    crds.write_text(dump_docs([d for d in docs if group_of(d) not in BUILTIN_GROUPS]))
    return 0


# ---------------------------------------------------------------- docker-compose checks


def check_compose(path: Path) -> int:
    config = load_docs(path.read_text(), str(path))[0]
    services: dict[str, Any] = config.get("services") or {}
    errors: list[str] = []
    for name in ("api", "worker", "worker-cpu", "redis", "minio", "minio-init", "flower"):
        if name not in services:
            errors.append(f"service {name!r} is missing")
    for name, service in services.items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        env = {k: "" if v is None else str(v) for k, v in env.items()}
        if any(k.startswith("ENGRAM_") for k in env):
            errors.extend(_settings_errors(env, f"service {name}"))
        if "build" not in service:
            image = str(service.get("image", ""))
            _, tag, digest = _split_image(image)
            if not (tag or digest) or tag == "latest":
                errors.append(f"service {name}: image {image!r} is not pinned to a version")
        for dependency, condition in (service.get("depends_on") or {}).items():
            condition = (condition or {}).get("condition") if isinstance(condition, dict) else None
            if condition == "service_healthy" and not (services.get(dependency) or {}).get("healthcheck"):
                errors.append(f"service {name}: waits for {dependency} to be healthy, which has no healthcheck")
            if condition not in {"service_healthy", "service_completed_successfully"}:
                errors.append(f"service {name}: depends_on {dependency} without a health/completion condition")
        devices = ((((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")) or []
        if name == "worker":
            gpu = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
            if not gpu or gpu[0].get("count") != 1:
                errors.append(
                    "service worker: needs a reservation of one nvidia GPU (deploy.resources.reservations.devices)"
                )
        elif devices:
            errors.append(f"service {name}: reserves devices; only the GPU worker should")
        if name == "worker-cpu" and service.get("profiles") != ["cpu"]:
            errors.append("service worker-cpu: must be in the profile cpu")
        if name in {"api", "worker", "worker-cpu", "redis", "minio"} and not service.get("healthcheck"):
            errors.append(f"service {name}: no healthcheck")
    for error in errors:
        print(f"ERROR {path}: {error}", file=sys.stderr)
    if not errors:
        print(f"render_kustomize check-compose: {path}: {len(services)} services OK")
    return 1 if errors else 0


# ---------------------------------------------------------------- self-test


def selftest() -> int:
    import tempfile

    failures: list[str] = []

    def expect(label: str, got: Any, want: Any) -> None:
        if got != want:
            failures.append(f"{label}: got {got!r}, want {want!r}")

    # Names produced by kustomize 5.5.0 (kubectl 1.32) for the same generators.
    cm = lambda name, data: {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}  # noqa: E731
    expect("hash x", content_hash(cm("x", {"a": "b"})), "4h2mbtbbt6")
    expect("hash html", content_hash(cm("html", {"q": "<a&b> é ü", "z": "1"})), "cc2t9f274d")
    expect(
        "hash empty", content_hash({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "empty"}}), "6ct58987ht"
    )
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s"},
        "type": "Opaque",
        "data": {"k": base64.b64encode(b"v").decode()},
    }
    expect("hash secret", content_hash(secret), "ftgtgc4t9f")
    tls = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "t"},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": base64.b64encode(b"abc").decode(), "tls.key": base64.b64encode(b"def").decode()},
    }
    expect("hash tls", content_hash(tls), "td2b65gdb7")

    expect("base64 short", encode_base64("v"), "dg==")
    # Secret data and names from kustomize 5.5.0 for 51, 52 and 60 times "a".
    for count, want, suffix in (
        (51, "YWFh" * 17, "c5bbm2mmtb"),
        (52, "YWFh" * 17 + "YQ\n==\n", "bfkbm5k456"),
        (60, "YWFh" * 17 + "YW\nFhYWFhYWFh\n", "g82g4f4tfh"),
    ):
        encoded = encode_base64("a" * count)
        expect(f"base64 of {count}", encoded, want)
        expect(
            f"hash of {count}",
            content_hash(
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": f"s{count}"},
                    "type": "Opaque",
                    "data": {"k": encoded},
                }
            ),
            suffix,
        )

    expect("split image", _split_image("registry:5000/a/b:1.2@sha256:ff"), ("registry:5000/a/b", "1.2", "sha256:ff"))
    expect("split image no tag", _split_image("registry:5000/a/b"), ("registry:5000/a/b", "", ""))

    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": {"gpu": "true"},
                    "tolerations": [{"key": "g"}],
                    "containers": [
                        {
                            "name": "w",
                            "image": "img",
                            "command": ["a", "b"],
                            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                            "resources": {"limits": {"cpu": "1", "nvidia.com/gpu": 1}},
                        },
                        {"name": "side", "image": "other:1"},
                    ],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
                }
            }
        },
    }
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": None,
                    "tolerations": None,
                    "containers": [
                        {
                            "name": "w",
                            "command": ["c"],
                            "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                            "resources": {"limits": {"nvidia.com/gpu": None, "memory": "1Gi"}},
                        }
                    ],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}],
                }
            }
        },
    }
    [merged] = apply_patch([copy.deepcopy(deployment)], patch, "selftest")
    pod = merged["spec"]["template"]["spec"]
    expect("smp removes nodeSelector", "nodeSelector" in pod, False)
    expect("smp removes tolerations", "tolerations" in pod, False)
    expect("smp keeps other containers", [c["name"] for c in pod["containers"]], ["w", "side"])
    expect("smp replaces command", pod["containers"][0]["command"], ["c"])
    expect(
        "smp merges env by name",
        pod["containers"][0]["env"],
        [{"name": "A", "value": "1"}, {"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
    )
    expect("smp deletes a map key", pod["containers"][0]["resources"], {"limits": {"cpu": "1", "memory": "1Gi"}})
    expect("smp merges volumes", pod["volumes"], [{"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}])
    expect("smp leaves its input alone", deployment["spec"]["template"]["spec"]["nodeSelector"], {"gpu": "true"})

    crd = {
        "apiVersion": "example.com/v1",
        "kind": "Thing",
        "metadata": {"name": "t"},
        "spec": {"items": [{"name": "a", "x": 1}], "n": 1},
    }
    [merged_crd] = apply_patch(
        [crd],
        {
            "apiVersion": "example.com/v1",
            "kind": "Thing",
            "metadata": {"name": "t"},
            "spec": {"items": [{"name": "a", "y": 2}]},
        },
        "selftest",
    )
    expect("crd lists are replaced", merged_crd["spec"], {"items": [{"name": "a", "y": 2}], "n": 1})
    expect(
        "delete",
        apply_patch(
            [crd, deployment],
            {"$patch": "delete", "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}},
            "selftest",
        ),
        [crd],
    )
    try:
        apply_patch([crd], {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "nope"}}, "selftest")
        failures.append("a patch without a target must fail")
    except RenderError:
        pass

    images = [copy.deepcopy(deployment)]
    set_images(images, [{"name": "img", "newName": "reg/img", "newTag": "2"}, {"name": "other", "digest": "sha256:aa"}])
    expect(
        "images", [c["image"] for c in images[0]["spec"]["template"]["spec"]["containers"]], ["reg/img:2", "other@sha256:aa"]
    )

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "base").mkdir()
        (root / "overlay").mkdir()
        (root / "base" / "kustomization.yaml").write_text(
            "namespace: ns\nresources: [d.yaml]\nconfigMapGenerator:\n- name: cfg\n  envs: [c.env]\n"
            "labels:\n- pairs: {team: a}\n  includeSelectors: false\n"
        )
        (root / "base" / "c.env").write_text("# comment\nA=1\n\nB=two=2\n")
        (root / "base" / "d.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": "d"},
                    "spec": {
                        "selector": {"matchLabels": {"app": "d"}},
                        "template": {
                            "metadata": {"labels": {"app": "d"}},
                            "spec": {
                                "containers": [{"name": "c", "image": "img", "envFrom": [{"configMapRef": {"name": "cfg"}}]}]
                            },
                        },
                    },
                }
            )
        )
        (root / "overlay" / "kustomization.yaml").write_text(
            "resources: [../base]\nconfigMapGenerator:\n- name: cfg\n  behavior: merge\n  literals: [A=3]\n"
            "images:\n- name: img\n  newTag: v1\n"
        )
        out = build(root / "overlay")
        [config] = [d for d in out if kind_of(d) == "ConfigMap"]
        [dep] = [d for d in out if kind_of(d) == "Deployment"]
        expect("merged data", config["data"], {"A": "3", "B": "two=2"})
        expect("hashed name", name_of(config), "cfg-" + content_hash({**config, "metadata": {"name": "cfg"}}))
        expect(
            "reference fixed",
            dep["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"],
            name_of(config),
        )
        expect("namespace", [ns_of(d) for d in out], ["ns", "ns"])
        expect("labels not on templates", dep["spec"]["template"]["metadata"]["labels"], {"app": "d"})
        expect("labels on objects", dep["metadata"]["labels"], {"team": "a"})
        expect("image tag", dep["spec"]["template"]["spec"]["containers"][0]["image"], "img:v1")
        (root / "overlay" / "kustomization.yaml").write_text("resources: [../base]\nreplicas: [{name: d, count: 2}]\n")
        try:
            build(root / "overlay")
            failures.append("an unsupported kustomization field must fail")
        except RenderError:
            pass
        (root / "overlay" / "kustomization.yaml").write_text("resources: [../base/d.yaml]\n")
        try:
            build(root / "overlay")
            failures.append("a resource file outside the kustomization must fail")
        except RenderError:
            pass

    for failure in failures:
        print(f"render_kustomize selftest: FAIL {failure}", file=sys.stderr)
    if not failures:
        print("render_kustomize selftest: all checks passed")
    return 1 if failures else 0


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    try:
        if command == "build" and len(args) == 1:
            sys.stdout.write(dump_docs(build(Path(args[0]))))
            return 0
        if command == "compare" and len(args) == 2:
            return compare(Path(args[0]), Path(args[1]))
        if command == "check" and args:
            flags = set(args[1:])
            if flags - {"--expect-gpu", "--expect-no-gpu", "--require-tags"}:
                raise RenderError(f"unknown flags {sorted(flags)}")
            expect_gpu = True if "--expect-gpu" in flags else False if "--expect-no-gpu" in flags else None
            return check(Path(args[0]), expect_gpu, "--require-tags" in flags)
        if command == "split" and len(args) == 3:
            return split(Path(args[0]), Path(args[1]), Path(args[2]))
        if command == "check-compose" and len(args) == 1:
            return check_compose(Path(args[0]))
        if command == "selftest" and not args:
            return selftest()
    except RenderError as exc:
        print(f"render_kustomize: {exc}", file=sys.stderr)
        return 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
