"""deploy/k8s/: every manifest validated (strict) against the Kubernetes schemas that ship inside
the kubernetes-validate package (offline), and the wiring checked: selectors, ports, probes, the
ConfigMap variables the args use, secrets, scrape annotations, and every container's args through
the real argument parsers."""
from __future__ import annotations

import glob
import os
import re

import kubernetes_validate
import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(REPO, "deploy", "k8s")
# The oldest Kubernetes the manifests support (gRPC probes are GA from 1.27) and the newest the
# installed kubernetes-validate knows.
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
TOKENS = {"client_token", "worker_token", "gateway_token"}


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path) as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


DOCS = manifests()
BY_KIND: dict[str, dict[str, dict]] = {}
for _, _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], {})[_doc["metadata"]["name"]] = _doc
WORKLOADS = {**BY_KIND["StatefulSet"], **BY_KIND["Deployment"]}
CONFIG = BY_KIND["ConfigMap"]["minipaged-config"]["data"]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_names(c: dict) -> set[str]:
    names = {e["name"] for e in c.get("env", [])}
    for src in c.get("envFrom", []):
        names |= set(BY_KIND["ConfigMap"][src["configMapRef"]["name"]]["data"])
    return names


def expand(args: list[str], c: dict) -> list[str]:
    """Kubernetes' $(VAR) expansion with the ConfigMap's values (pod fields get placeholders)."""
    values = {**CONFIG, "POD_IP": "10.0.0.7", "NODE_NAME": "node-a"}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def parse(args: list[str]):
    assert args[:2] == ["python", "-m"], args
    module, argv = args[2], args[3:]
    if module == "metadata_service":
        from metadata_service.__main__ import build_parser
    elif module == "worker":
        from worker.__main__ import build_parser
    elif module == "gateway":
        if not os.path.isdir(os.path.join(REPO, "gateway")):
            pytest.skip("gateway/ is not in this tree yet")
        from gateway.__main__ import build_parser  # type: ignore[import-not-found]
    else:
        raise AssertionError(module)
    return build_parser().parse_args(argv)


# ------------------------------------------------------------------ schemas

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_schema_strict(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)   # raises ValidationError with the path


def test_schema_validation_catches_mistakes():
    """The validator is live: a misspelt field and a wrong type are refused."""
    bad = yaml.safe_load(yaml.safe_dump(WORKLOADS["metadata"]))
    container(bad)["readinessProbe"]["grcp"] = container(bad)["readinessProbe"].pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(WORKLOADS["metadata"]))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest():
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    files = {os.path.basename(p) for p in glob.glob(os.path.join(K8S, "*.yaml"))} - {"kustomization.yaml"}
    assert set(k["resources"]) == files
    assert {d["metadata"].get("namespace") for _, d in DOCS if d["kind"] != "Namespace"} == {"minipaged"}
    # kustomize's `images` match by name whatever the tag: a newTag would give an image used with two
    # tags (cpu for the service, cuda for the workers) one tag, GPU workers the CPU image
    tags: dict[str, set] = {}
    for _, d in DOCS:
        for c in (d.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
            name, _, tag = c["image"].partition(":")
            tags.setdefault(name, set()).add(tag)
    assert tags["minipaged-qwen"] == {"cpu", "cuda"}
    for entry in k.get("images") or []:
        assert "newTag" not in entry or len(tags.get(entry["name"], ())) <= 1, entry


# ------------------------------------------------------------------ wiring

def test_metadata_is_a_statefulset_with_the_job_store_on_a_claim():
    sts = BY_KIND["StatefulSet"]["metadata"]
    assert sts["spec"]["replicas"] == 1          # one owner of the block tables and the SQLite store
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    c = container(sts)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert claim["metadata"]["name"] == "jobs" and mounts["jobs"] == "/data"
    args = parse(expand(c["args"], c))
    assert args.db.startswith("/data/") and args.host == "0.0.0.0"
    assert (args.port, args.worker_port, args.metrics_port) == (50051, 50052, 9100)
    service_ports = {p["port"] for svc in ("metadata", "metadata-workers") for p in BY_KIND["Service"][svc]["spec"]["ports"]}
    assert service_ports == {args.port, args.worker_port}
    assert sts["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    assert sts["spec"]["serviceName"] in BY_KIND["Service"]


def test_one_gpu_deployment_per_stage_tiling_the_layers():
    stages = sorted(n for n in BY_KIND["Deployment"] if n.startswith("worker-stage"))
    assert stages == ["worker-stage0", "worker-stage1"]
    ranges = []
    for name in stages:
        c = container(WORKLOADS[name])
        args = parse(expand(c["args"], c))
        assert args.device == "cuda" and args.metadata == "metadata-workers:50052"
        assert args.advertise_address == f"10.0.0.7:{args.port}"       # its own pod IP
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 1
        ranges.append(tuple(int(x) for x in args.layers.split(":")))
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous


def test_probes_on_the_grpc_health_services():
    for name, service in (("metadata", "minipaged.v1.MetadataService"), ("worker-stage0", "minipaged.v1.WorkerService"),
                          ("worker-stage1", "minipaged.v1.WorkerService")):
        c = container(WORKLOADS[name])
        port = int(flag(expand(c["args"], c), "--port"))
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}, name   # readiness
        assert c["livenessProbe"]["grpc"] == {"port": port}, name                        # "" = liveness
        assert c["startupProbe"]["grpc"] == {"port": port}, name
    gw = container(WORKLOADS["gateway"])
    assert gw["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in gw["livenessProbe"]   # /health is readiness: a lost chain must not restart it


def test_services_select_pods_and_name_their_ports():
    for name, svc in BY_KIND["Service"].items():
        sel = svc["spec"]["selector"]
        targets = [w for w in WORKLOADS.values()
                   if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert targets, name
        for port in svc["spec"]["ports"]:
            for w in targets:
                assert port["targetPort"] in {p["name"] for p in container(w)["ports"]}, (name, port)
    # the metadata service is ready only after workers register through this service
    assert BY_KIND["Service"]["metadata-workers"]["spec"]["publishNotReadyAddresses"] is True
    ingress = BY_KIND["Ingress"]["gateway"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "gateway" and backend["port"]["name"] in {
        p["name"] for p in BY_KIND["Service"]["gateway"]["spec"]["ports"]}


def test_every_variable_the_args_use_is_defined():
    for name, w in WORKLOADS.items():
        c = container(w)
        used = set(re.findall(r"\$\((\w+)\)", " ".join(c["args"])))
        assert used <= env_names(c), (name, used - env_names(c))


def test_tokens_only_from_the_secret():
    for name, w in WORKLOADS.items():
        c = container(w)
        files = {e["name"]: e["value"] for e in c.get("env", []) if e["name"].endswith("_FILE")}
        assert files, name
        assert not any(e["name"] in ("MINIPAGED_TOKEN", "MINIPAGED_WORKER_TOKEN", "MINIPAGED_METADATA_TOKEN")
                       for e in c.get("env", [])), name
        assert not any(a.startswith("--token") or a.startswith("--worker-token") for a in c["args"]), name
        (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "tokens"]
        assert vol["secret"]["secretName"] == "minipaged-tokens"
        keys = {i["path"] for i in vol["secret"]["items"]}
        assert keys <= TOKENS
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tokens")
        assert {os.path.relpath(v, mount) for v in files.values()} == keys, name   # each mounted file is used


def test_scrape_annotations_match_the_metrics_ports():
    for name, w in WORKLOADS.items():
        ann = w["spec"]["template"]["metadata"]["annotations"]
        c = container(w)
        port = int(ann["prometheus.io/port"])
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", name
        assert port in {p["containerPort"] for p in c["ports"]}, name
        args = expand(c["args"], c)
        assert port == int(flag(args, "--metrics-port" if "--metrics-port" in args else "--port")), name


def test_network_policies_open_only_declared_ports():
    policies = BY_KIND["NetworkPolicy"]
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for name, pol in policies.items():
        if name == "default-deny-ingress":
            continue
        sel = pol["spec"]["podSelector"]["matchLabels"]
        pods = [w for w in WORKLOADS.values() if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        declared = {p["containerPort"] for w in pods for p in container(w)["ports"]}
        opened = {p["port"] for rule in pol["spec"]["ingress"] for p in rule["ports"]}
        assert pods and opened == declared, (name, opened, declared)


def test_graceful_stop_and_hardening():
    from worker.__main__ import SHUTDOWN_GRACE_S
    for name, w in WORKLOADS.items():
        spec = w["spec"]["template"]["spec"]
        c = container(w)
        grace = parse(expand(c["args"], c)).grace if name == "metadata" else SHUTDOWN_GRACE_S
        if name != "gateway":
            assert grace + 5 <= spec["terminationGracePeriodSeconds"], name
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, name


def test_gateway_args():
    c = container(WORKLOADS["gateway"])
    args = expand(c["args"], c)
    assert flag(args, "--metadata") == "metadata:50051" and flag(args, "--host") == "0.0.0.0"
    parse(args)   # skips until gateway/ exists
