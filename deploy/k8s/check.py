#!/usr/bin/env python3
"""Offline checks of deploy/k8s (no cluster needed): YAML parses, required fields are present, and the
pieces agree with each other and with cifpool's configuration.

    python3 deploy/k8s/check.py

Schema validation is separate: `pip install kubernetes-validate` and run
`kubernetes-validate --strict deploy/k8s/{deployment,service,pdb,configmap,secret.example}.yaml`
(CRD kinds, ServiceMonitor and PrometheusRule, are not in its schemas). Needs PyYAML.
"""

import pathlib
import re
import sys
import tomllib

import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
errors: list[str] = []


def err(msg: str) -> None:
    errors.append(msg)


def load(name: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((HERE / name).read_text(encoding="utf-8")) if d is not None]
    for d in docs:
        if d.get("kind") == "Kustomization":  # a kustomize file, not an object: no metadata
            continue
        for field in ("apiVersion", "kind", "metadata"):
            if field not in d:
                err(f"{name}: {d.get('kind', '?')} lacks {field}")
        if not d.get("metadata", {}).get("name"):
            err(f"{name}: {d.get('kind', '?')} lacks metadata.name")
    return docs


def humantime_seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = 0.0
    for num, unit in re.findall(r"(\d+)\s*(ms|s|m|h|d)", text):
        total += int(num) * units[unit]
    return total


def main() -> int:
    kust = load("kustomization.yaml")[0]
    for res in kust.get("resources", []):
        if not (HERE / res).is_file():
            err(f"kustomization.yaml lists {res}, which does not exist")
    if "secret.example.yaml" in kust.get("resources", []):
        err("kustomization.yaml must not apply secret.example.yaml (placeholders)")

    (dep,) = load("deployment.yaml")
    (svc,) = load("service.yaml")
    (pdb,) = load("pdb.yaml")
    (cm,) = load("configmap.yaml")
    secrets = {d["metadata"]["name"]: d for d in load("secret.example.yaml")}
    (sm,) = load("servicemonitor.yaml")
    (rule,) = load("prometheusrule.yaml")
    (scaled,) = load("keda-scaledobject.yaml")

    # KEDA: scales this deployment, on a metric cifpool exports, within bounds that keep the PDB drainable.
    ss = scaled["spec"]
    if ss["scaleTargetRef"]["name"] != dep["metadata"]["name"]:
        err("keda-scaledobject.yaml does not scale the cifpool deployment")
    lo, hi = ss.get("minReplicaCount", 0), ss.get("maxReplicaCount", 0)
    if not 1 <= lo <= hi:
        err("keda-scaledobject.yaml needs 1 <= minReplicaCount <= maxReplicaCount")
    if pdb["spec"].get("minAvailable", 0) >= lo:
        err("pdb.minAvailable must stay below keda minReplicaCount, or a scaled-in deployment cannot be drained")
    for t in ss["triggers"]:
        if "cifpool_queue_oldest_pending_age_seconds" not in t.get("metadata", {}).get("query", ""):
            err("every keda trigger should scale on cifpool_queue_oldest_pending_age_seconds")

    spec = dep["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    sel = spec["selector"]["matchLabels"]
    if not sel.items() <= labels.items():
        err("deployment selector does not match its pod labels")
    if spec.get("replicas") != 3:
        err("deployment.replicas should be 3")
    ru = spec["strategy"]["rollingUpdate"]
    if ru.get("maxUnavailable") != 0:
        err("rollingUpdate.maxUnavailable should be 0")
    for name, obj in (("service", svc["spec"]["selector"]), ("pdb", pdb["spec"]["selector"]["matchLabels"])):
        if not obj.items() <= labels.items():
            err(f"{name} selector does not select the deployment's pods")
    if pdb["spec"].get("minAvailable") != 2:
        err("pdb.minAvailable should be 2")
    if not sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items():
        err("servicemonitor selector does not select the service")

    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if ports.get("http") != 8080:
        err("container port http must be 8080")
    if [p["name"] for p in svc["spec"]["ports"]] != ["http"]:
        err("service must expose the named port http")
    ep = sm["spec"]["endpoints"][0]
    if (ep.get("port"), ep.get("path"), ep.get("interval")) != ("http", "/metrics", "15s"):
        err("servicemonitor must scrape port http, /metrics, every 15s")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        got = c.get(probe, {}).get("httpGet", {})
        if got.get("path") != path or got.get("port") not in ("http", 8080):
            err(f"{probe} must GET {path} on the http port")

    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    if not (psc.get("runAsNonRoot") or csc.get("runAsNonRoot")):
        err("runAsNonRoot is not set")
    if not csc.get("readOnlyRootFilesystem"):
        err("readOnlyRootFilesystem is not set")
    if csc.get("capabilities", {}).get("drop") != ["ALL"]:
        err("capabilities must drop ALL")
    if csc.get("allowPrivilegeEscalation") is not False:
        err("allowPrivilegeEscalation must be false")
    for kind in ("requests", "limits"):
        if not {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})):
            err(f"resources.{kind} must set cpu and memory")

    env = {e["name"]: e for e in c.get("env", [])}
    for var, secret_name in (("CIFPOOL_DATABASE__URL", "cifpool"), ("CIFPOOL_SECURITY__ADMIN_TOKEN", "cifpool")):
        ref = env.get(var, {}).get("valueFrom", {}).get("secretKeyRef")
        if not ref:
            err(f"{var} must come from a secretKeyRef")
            continue
        if ref["name"] != secret_name or ref["key"] not in secrets.get(ref["name"], {}).get("stringData", {}):
            err(f"{var}: secret {ref['name']}/{ref['key']} is not in secret.example.yaml")
    for var, want in (("CIFPOOL_CONFIG", "/etc/cifpool/cifpool.toml"),
                      ("CIFPOOL_SECURITY__MASTER_KEY_FILE", "/run/secrets/cifpool-master-key"),
                      ("CIFPOOL_SERVER__LISTEN", "0.0.0.0:8080")):
        if env.get(var, {}).get("value") != want:
            err(f"{var} should be {want}")

    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    cfg = mounts.get("/etc/cifpool")
    if not cfg or vols[cfg["name"]].get("configMap", {}).get("name") != cm["metadata"]["name"]:
        err("the ConfigMap must be mounted at /etc/cifpool")
    key = mounts.get("/run/secrets/cifpool-master-key")
    if not key:
        err("the master key must be mounted at /run/secrets/cifpool-master-key")
    else:
        kv = vols[key["name"]].get("secret", {})
        items = {i["path"]: i["key"] for i in kv.get("items", [])}
        src_key = items.get(key.get("subPath", ""))
        if kv.get("secretName") not in secrets or src_key not in secrets[kv["secretName"]].get("stringData", {}):
            err("the master-key volume does not match secret.example.yaml")

    # Secrets: placeholders only.
    for name, s in secrets.items():
        for k, v in {**s.get("stringData", {}), **s.get("data", {})}.items():
            if "PLACEHOLDER" not in str(v):
                err(f"secret.example.yaml {name}/{k} does not look like a placeholder")

    # The production config: valid TOML, the values the deployment relies on.
    conf = tomllib.loads(cm["data"]["cifpool.toml"])
    if conf["server"]["listen"] != "0.0.0.0:8080":
        err("configmap: server.listen must be 0.0.0.0:8080")
    if conf["log"]["format"] != "json":
        err("configmap: log.format should be json")
    if "url" in conf.get("database", {}) or "admin_token" in conf.get("security", {}):
        err("configmap: secrets must not be in the ConfigMap")
    if sorted(p["name"] for p in conf["pools"]) != ["business", "individual"]:
        err("configmap: pools should be individual and business")
    for pname, p in conf["queue"]["providers"].items():
        if p["kind"] != "http" or not str(p.get("url", "")).startswith(("http://", "https://")):
            err(f"configmap: provider {pname} must be kind http with a url")
        if humantime_seconds(p["timeout"]) >= humantime_seconds(conf["queue"]["lease"]):
            err(f"configmap: provider {pname} timeout must be shorter than queue.lease")
    grace = humantime_seconds(conf["server"]["shutdown_grace"])
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_s = float(pre[1]) if len(pre) == 2 and pre[0] == "sleep" else 0.0
    tgps = pod.get("terminationGracePeriodSeconds", 30)
    if tgps <= pre_s + grace + 3:
        err(f"terminationGracePeriodSeconds {tgps} must exceed preStop {pre_s}s + shutdown_grace {grace}s + 3s")

    # The PrometheusRule must carry exactly alerts.yml's groups.
    src = yaml.safe_load((ROOT / "config/prometheus/alerts.yml").read_text(encoding="utf-8"))["groups"]
    norm = lambda gs: [[{**r, "expr": " ".join(str(r["expr"]).split())} for r in g["rules"]] for g in gs]  # noqa: E731
    if norm(rule["spec"]["groups"]) != norm(src):
        err("prometheusrule.yaml differs from config/prometheus/alerts.yml: run gen-prometheusrule.py")

    for e in errors:
        print("FAIL:", e)
    print(f"deploy/k8s: {'OK' if not errors else f'{len(errors)} problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
