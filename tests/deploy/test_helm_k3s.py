"""The chart read as an operator installing on k3s with one GPU, then scaling (issue 16):
GPU defaults, the model download, names, disruption budgets, network policy, the Grafana
dashboard and KEDA. Rendered by Helm's own library (tests/deploy/helm_render.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.deploy import helm_render as hr

HF = {"repo": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "a1b2c3d"}


def _pod(docs: list[dict], kind: str) -> dict:
    suffix = "-engine" if kind == "StatefulSet" else "-frontend"
    return hr.find(docs, kind, suffix)["spec"]["template"]["spec"]


def _init(pod: dict, name: str) -> dict:
    (c,) = [c for c in pod.get("initContainers", []) if c["name"] == name]
    return c


# ---- GPU ---------------------------------------------------------------------------------


def test_device_plugin_is_the_default_with_the_nvidia_runtime_class() -> None:
    docs = hr.manifests()
    pod = _pod(docs, "StatefulSet")
    assert pod["runtimeClassName"] == "nvidia"
    assert hr.container(docs, "StatefulSet", "worker")["resources"]["limits"]["nvidia.com/gpu"] == 1
    notes = hr.render()["radixserve/templates/NOTES.txt"]
    assert 'runtimeClassName "nvidia"' in notes and 'engine.runtimeClassName=""' in notes
    # Nodes whose default runtime is nvidia already, DRA (CDI) and CPU need no class.
    for values in (
        {"engine": {"runtimeClassName": ""}},
        {"gpu": {"mode": "dra"}},
        {"gpu": {"mode": "none"}},
    ):
        assert "runtimeClassName" not in _pod(hr.manifests(values), "StatefulSet")
    pod = _pod(
        hr.manifests({"gpu": {"mode": "dra"}, "engine": {"runtimeClassName": "x"}}), "StatefulSet"
    )
    assert pod["runtimeClassName"] == "x"


def test_dra_without_the_api_fails_at_install_with_a_clear_message(tmp_path: Path) -> None:
    """Helm's offline capabilities include resource.k8s.io/v1; a cluster without it is played
    by a copy of the chart that asks for an API nobody serves."""
    chart = tmp_path / "radixserve"
    shutil.copytree(hr.CHART_DIR, chart)
    sts = chart / "templates" / "engine-statefulset.yaml"
    text = sts.read_text()
    check = '.Capabilities.APIVersions.Has "resource.k8s.io/v1"'
    assert text.count(check) == 1
    sts.write_text(text.replace(check, '.Capabilities.APIVersions.Has "resource.k8s.io/v0gone"'))
    with pytest.raises(hr.HelmError, match=r"gpu\.mode=dra needs the resource\.k8s\.io/v1 API"):
        hr.render({"gpu": {"mode": "dra"}}, chart_dir=chart)
    hr.render({"gpu": {"mode": "device-plugin"}}, chart_dir=chart)  # the way out it names


def test_the_claim_template_is_named_by_its_spec() -> None:
    """Its spec is immutable: a changed spec gets a new name, so `helm upgrade` can apply it."""

    def claim(values: dict) -> tuple[str, str]:
        docs = hr.manifests({"gpu": {"mode": "dra", **values}})
        name = hr.find(docs, "ResourceClaimTemplate")["metadata"]["name"]
        (ref,) = _pod(docs, "StatefulSet")["resourceClaims"]
        return name, ref["resourceClaimTemplateName"]

    plain, ref = claim({})
    assert plain == ref
    selected, ref = claim({"dra": {"selectors": ['device.attributes["x"].y == "z"']}})
    assert selected == ref and selected != plain
    assert claim({}) == (plain, plain)  # stable across renders


# ---- the model ---------------------------------------------------------------------------


def test_hf_model_is_downloaded_by_the_engines_into_their_own_volumes() -> None:
    docs = hr.manifests({"model": {"source": "hf", "hf": {**HF, "tokenSecret": "hf"}}})
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    sts = hr.find(docs, "StatefulSet", "-engine")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "models"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod = sts["spec"]["template"]["spec"]
    fetch = _init(pod, "fetch-model")
    assert fetch["command"] == ["python", "/fetch/fetch_model.py"]
    assert fetch["args"] == [
        "--repo=Qwen/Qwen2.5-0.5B-Instruct",
        "--revision=a1b2c3d",
        "--dest=/models/Qwen2.5-0.5B-Instruct",
    ]
    assert fetch["image"].startswith("radixserve/worker:")
    assert {"name": "models", "mountPath": "/models"} in fetch["volumeMounts"]
    token = {e["name"]: e for e in fetch["env"]}["HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    worker = hr.container(docs, "StatefulSet", "worker")
    assert "--model-path=/models/Qwen2.5-0.5B-Instruct" in worker["args"]  # model id: its name
    mount = {m["name"]: m for m in worker["volumeMounts"]}["models"]
    assert mount["readOnly"] is True
    assert "models" not in {v["name"] for v in pod["volumes"]}  # the claim template's
    script = hr.find(docs, "ConfigMap", "-fetch-model")["data"]["fetch_model.py"]
    assert script == (hr.CHART_DIR / "files" / "fetch_model.py").read_text()


def test_the_frontend_downloads_only_the_tokenizer_and_never_mounts_the_engines_volume() -> None:
    for model in (
        {"source": "hf", "hf": HF},
        {"source": "pvc", "hf": HF},  # weights on the PVC, tokenizer from the Hub
    ):
        docs = hr.manifests({"model": model})
        pod = _pod(docs, "Deployment")
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"] == {"name": "models", "emptyDir": {}}
        fetch = _init(pod, "fetch-model")
        assert "--tokenizer-only" in fetch["args"]
        assert fetch["image"].startswith("radixserve/frontend:")
        args = hr.container(docs, "Deployment", "frontend")["args"]
        path = "Qwen2.5-0.5B-Instruct" if model["source"] == "hf" else "radixserve-zen"
        assert f"--model-path=/models/{path}" in args  # the engines' path: the same model id
        assert f"--dest=/models/{path}" in fetch["args"]
    # pvc with no repo: the frontend mounts the claim read-only (RWX, or one node).
    pod = _pod(hr.manifests(), "Deployment")
    claim = {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"]
    assert claim["readOnly"] is True and "initContainers" not in pod


def test_hf_model_in_an_empty_dir() -> None:
    docs = hr.manifests({"model": {"source": "hf", "hf": {**HF, "storage": "emptyDir"}}})
    sts = hr.find(docs, "StatefulSet", "-engine")
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}


def _fetch_module():
    spec = importlib.util.spec_from_file_location(
        "fetch_model", hr.CHART_DIR / "files" / "fetch_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fetch_script_downloads_once_per_revision(tmp_path: Path, monkeypatch) -> None:
    fetch = _fetch_module()
    calls: list[tuple[str, bool]] = []

    def fake_download(args, dest: Path) -> None:
        calls.append((args.revision, args.tokenizer_only))
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(fetch, "download", fake_download)
    dest = tmp_path / "models" / "m"
    base = ["--repo=org/m", f"--dest={dest}"]
    assert fetch.main([*base, "--revision=r1", "--tokenizer-only"]) == 0
    assert fetch.main([*base, "--revision=r1", "--tokenizer-only"]) == 0  # there: skipped
    assert fetch.main([*base, "--revision=r1"]) == 0  # the weights are still missing
    assert fetch.main([*base, "--revision=r1", "--tokenizer-only"]) == 0  # whole covers it
    assert fetch.main([*base, "--revision=r2"]) == 0  # a new revision
    assert calls == [("r1", True), ("r1", False), ("r2", False)]
    marker = json.loads((dest / fetch.MARKER).read_text())
    assert marker == {"repo": "org/m", "revision": "r2", "tokenizer_only": False}


# ---- names, rollout, disruption ------------------------------------------------------------


def test_names_fit_in_dns_labels_for_a_long_release_name() -> None:
    release = "a-very-long-release-name-that-someone-typed-in-full"
    docs = hr.manifests({"model": {"source": "hf", "hf": HF}, "gpu": {"mode": "dra"}}, release)
    for d in docs:
        assert len(d["metadata"]["name"]) <= 63, d["metadata"]["name"]
    headless = hr.find(docs, "Service", "-engine-headless")["metadata"]["name"]
    sts = hr.find(docs, "StatefulSet", "-engine")
    # Pods get the controller-revision-hash label <statefulset>-<10 chars>, and claims
    # models-<statefulset>-<ordinal>.
    assert len(sts["metadata"]["name"]) + 11 <= 63
    assert len(f"models-{sts['metadata']['name']}-99") <= 63
    assert headless.endswith("-engine-headless") and len(headless) <= 63


def test_disruption_budgets_are_opt_in() -> None:
    assert not [d for d in hr.manifests() if d["kind"] == "PodDisruptionBudget"]
    docs = hr.manifests(
        {
            "engine": {"pdb": {"enabled": True}},
            "frontend": {"pdb": {"enabled": True, "minAvailable": 1}},
        }
    )
    engine = hr.find(docs, "PodDisruptionBudget", "-engine")
    frontend = hr.find(docs, "PodDisruptionBudget", "-frontend")
    assert engine["spec"]["maxUnavailable"] == 1 and frontend["spec"]["minAvailable"] == 1
    for pdb, kind in ((engine, "StatefulSet"), (frontend, "Deployment")):
        workload = hr.find(docs, kind, pdb["metadata"]["name"][len("rs-radixserve") :])
        assert pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]


def test_pod_placement_and_extras_reach_both_workloads() -> None:
    extras = {
        "podLabels": {"team": "llm"},
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
            }
        ],
        "priorityClassName": "inference",
        "extraVolumes": [{"name": "certs", "secret": {"secretName": "c"}}],
        "extraVolumeMounts": [{"name": "certs", "mountPath": "/certs"}],
        "initContainers": [{"name": "warm", "image": "busybox:1.36"}],
    }
    docs = hr.manifests({"engine": extras, "frontend": extras, "model": {"source": "hf", "hf": HF}})
    for kind, main in (("StatefulSet", "worker"), ("Deployment", "frontend")):
        workload = hr.find(docs, kind, "-engine" if kind == "StatefulSet" else "-frontend")
        template = workload["spec"]["template"]
        assert template["metadata"]["labels"]["team"] == "llm"
        assert "team" not in workload["spec"]["selector"]["matchLabels"]
        pod = template["spec"]
        assert pod["priorityClassName"] == "inference"
        assert pod["topologySpreadConstraints"] == extras["topologySpreadConstraints"]
        assert {"name": "certs", "secret": {"secretName": "c"}} in pod["volumes"]
        assert [c["name"] for c in pod["initContainers"]] == ["fetch-model", "warm"]
        mounts = hr.container(docs, kind, main)["volumeMounts"]
        assert {"name": "certs", "mountPath": "/certs"} in mounts


# ---- security --------------------------------------------------------------------------------


def test_network_policy_lets_only_frontends_reach_the_engines() -> None:
    # On by default; off on request (a CNI without NetworkPolicy, Prometheus elsewhere).
    assert len([d for d in hr.manifests() if d["kind"] == "NetworkPolicy"]) == 2
    off = hr.manifests({"networkPolicy": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
    peers = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    docs = hr.manifests(
        {
            "networkPolicy": {
                "enabled": True,
                "metrics": {"namespaces": ["obs", "prom"]},
                "frontend": {"from": peers},
            }
        }
    )
    engine = hr.find(docs, "NetworkPolicy", "-engine")
    sts = hr.find(docs, "StatefulSet", "-engine")
    frontend_pods = hr.find(docs, "Deployment", "-frontend")["spec"]["selector"]["matchLabels"]
    assert engine["spec"]["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert engine["spec"]["policyTypes"] == ["Ingress"]
    internal, metrics = engine["spec"]["ingress"]
    assert internal["from"] == [{"podSelector": {"matchLabels": frontend_pods}}]
    assert {p["port"] for p in internal["ports"]} == {30100, 30101, 30103}
    selector = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["obs", "prom"]}
    assert metrics["from"] == [{"namespaceSelector": {"matchExpressions": [selector]}}]
    assert {p["port"] for p in metrics["ports"]} == {30102, 30202}
    front = hr.find(docs, "NetworkPolicy", "-frontend")
    public, scrape = front["spec"]["ingress"]
    assert public["from"] == peers and {p["port"] for p in public["ports"]} == {30000, 30080}
    assert {p["port"] for p in scrape["ports"]} == {30090}
    docs = hr.manifests({"networkPolicy": {"enabled": True, "metrics": {"namespaces": []}}})
    _, scrape = hr.find(docs, "NetworkPolicy", "-frontend")["spec"]["ingress"]
    assert scrape["from"] == [{"podSelector": {}}]  # this namespace only


# ---- observability and autoscaling ---------------------------------------------------------


def test_grafana_dashboard_configmap_for_the_sidecar() -> None:
    assert not [d for d in hr.manifests() if d["metadata"]["name"].endswith("-dashboard")]
    docs = hr.manifests({"grafana": {"dashboard": {"enabled": True}}})
    cm = hr.find(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["radixserve.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Cache hit rate (cumulative)", "Time to first token", "Inter-token latency"} <= titles
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert any("radixserve:cache_hit_rate" in e for e in exprs)  # per batch
    assert any("radixserve:num_queue_reqs" in e for e in exprs)
    assert any("radixserve:token_usage" in e for e in exprs)
    assert all(re.search(r"radixserve:[a-z_]+", e) for e in exprs)


def test_keda_scales_the_engines_on_the_waiting_queue() -> None:
    docs = hr.manifests({"keda": {"enabled": True, "maxReplicas": 3}})
    so = hr.find(docs, "ScaledObject", "-engine")
    sts = hr.find(docs, "StatefulSet", "-engine")
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": sts["metadata"]["name"],
    }
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"].startswith("sum(radixserve:num_queue_reqs{")
    assert so["spec"]["maxReplicaCount"] == 3
    assert "replicas" not in sts["spec"]  # KEDA's, or every upgrade would reset it


def test_notes_say_how_engines_are_found_and_how_the_model_arrives() -> None:
    notes = hr.render({"model": {"source": "hf", "hf": HF}})["radixserve/templates/NOTES.txt"]
    assert "rs-radixserve-engine-headless.ns.svc.cluster.local" in notes
    assert "kubectl scale statefulset/rs-radixserve-engine" in notes
    assert "Qwen/Qwen2.5-0.5B-Instruct@a1b2c3d" in notes and "-c fetch-model" in notes
