"""The Helm chart (helm/radixserve) rendered and linted by Helm's own library, and the rendered
objects validated against the Kubernetes API schemas of the version k3s runs.

What a cluster would reject (bad YAML, a wrong field, a value outside the schema) fails here.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import re
import typing

import kubernetes_validate
import pytest

from services.common import config as rs_config
from tests.deploy import helm_render as hr

K8S_VERSION = "1.34.0"  # resource.k8s.io/v1 (DRA) is GA from 1.34
GPU_MODES = ["device-plugin", "dra", "none"]
MODEL_SOURCES = ["pvc", "image", "hf"]
HF = {"repo": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "main"}


def _pod_extras(name: str) -> dict:
    return {
        "podLabels": {"team": "llm"},
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": name}},
            }
        ],
        "priorityClassName": "high",
        "extraVolumes": [{"name": "extra", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
        "initContainers": [{"name": "wait", "image": "busybox:1.36", "command": ["true"]}],
        "pdb": {"enabled": True},
    }


# The optional objects and switches of the issue's value names, all on.
OPTIONS_ON = {
    "engine": {"pdb": {"enabled": True}},
    "frontend": {"pdb": {"enabled": True}},
    "networkPolicy": {"enabled": True},
    "grafana": {"dashboard": {"enabled": True}},
    "keda": {"enabled": True},
}
MUTUAL_TLS = {"tls": {"secretName": "radixserve-tls", "clientAuth": True}}  # TCP probes
# Everything optional switched on, so every branch of every template is rendered.
EVERYTHING_ON = {
    "engine": {
        "replicas": 2,
        "runtimeClassName": "nvidia",
        "worker": {"extraArgs": ["--disable-cuda-graph"]},
        "scheduler": {"extraEnv": [{"name": "FOO", "value": "bar"}]},
        "sharedKVStore": {
            "enabled": True,
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "cache", "operator": "Exists"}],
        },
        **_pod_extras("engine"),
    },
    "config": {"hicacheRatio": 2},  # the host tier the shared KV store backs
    "tls": {"secretName": "radixserve-tls"},  # HTTPS probes (mutual TLS: MUTUAL_TLS below)
    "frontend": {
        "replicas": 2,
        "extraArgs": ["--max-model-len=512"],
        "extraEnv": [{"name": "A", "value": "b"}],
        **_pod_extras("frontend"),
    },
    "model": {
        "source": "hf",
        "servedName": "zen",
        "hf": {**HF, "tokenSecret": "hf-token"},
        "pvc": {"storageClassName": "local-path"},
        "hfCache": {"enabled": True, "existingClaim": "hf"},
    },
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "tracing": {"jaeger": {"enabled": True}},
    "gpu": {
        "mode": "dra",
        "count": 1,
        "dra": {"selectors": ['device.attributes["gpu.nvidia.com"].productName == "H100"']},
    },
    "networkPolicy": {"enabled": True, "frontend": {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}},
    "grafana": {"dashboard": {"enabled": True}},
    "keda": {"enabled": True},
    "imagePullSecrets": [{"name": "regcred"}],
}
# Kinds with no schema in the Kubernetes API (CRDs of other projects).
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "ScaledObject": "keda.sh/v1alpha1"}
# Fields the chart sets itself (ports, addresses, model, device, metrics, tracing), not via config.
CHART_FIXED = {
    "host",
    "port",
    "http_port",
    "metrics_port",
    "scheduler_addrs",
    "scheduler_control_addrs",
    "engine_dns_name",
    "engine_zmq_port",
    "engine_control_port",
    "scheduler_addr",
    "worker_addr",
    "control_port",
    "cache_events_port",
    "worker_grpc_port",
    "model_path",
    "device",
    "engine_replica",
    "enable_metrics",
    "otlp_traces_endpoint",
    "served_model_name",
    "tp_size",  # gpu.count
    "tp_rank",  # rank 0 sets these two for the ranks it starts
    "tp_store",
    "hicache_storage_dir",  # engine.hicacheStorage.mountPath
    # engine.sharedKVStore: from its Secret (env secretKeyRef), never a ConfigMap or argv
    "hicache_storage_url",
    "hicache_storage_password",
    # from Secrets (auth, internalAuth), never plain values
    "api_key",
    "admin_api_key",
    "internal_keys_dir",
    "insecure_internal",
    # tls.secretName / tls.clientAuth: the mounted Secret's files
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_ca_certs",
    # the control gRPC's TLS is not offered: the kubelet's gRPC probes of the engine pods
    # speak no TLS (the internal links are CURVE + token: internalAuth)
    "control_ssl_certfile",
    "control_ssl_keyfile",
    "control_ssl_ca_certs",
    "control_ssl_server_name",
}
PROBE_PORTS = {
    ("Deployment", "frontend"): 30000,
    ("StatefulSet", "scheduler"): 30101,
    ("StatefulSet", "worker"): 30201,
}


def _config_fields() -> dict[str, dataclasses.Field]:
    fields: dict[str, dataclasses.Field] = {}
    for cls in (rs_config.WorkerConfig, rs_config.SchedulerConfig, rs_config.FrontendConfig):
        for f in dataclasses.fields(cls):
            fields.setdefault(f.name, f)
    return fields


def _field_type(name: str) -> type:
    for cls in (rs_config.WorkerConfig, rs_config.SchedulerConfig, rs_config.FrontendConfig):
        hints = typing.get_type_hints(cls)
        if name in hints:
            return rs_config._base_type(hints[name])
    raise KeyError(name)


def _schema() -> dict:
    return json.loads((hr.CHART_DIR / "values.schema.json").read_text())


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _configmap_env(docs: list[dict], component: str = "engine") -> dict[str, str]:
    return hr.find(docs, "ConfigMap", f"-{component}-env")["data"]


def _values(mode: str, source: str) -> dict:
    model: dict = {"source": source}
    if source == "hf":
        model["hf"] = HF
    return {"gpu": {"mode": mode}, "model": model}


COMBINATIONS = [(m, s) for m in GPU_MODES for s in MODEL_SOURCES]


@pytest.mark.parametrize("mode, source", COMBINATIONS)
def test_strict_lint_is_clean_for_each_gpu_mode_and_model_source(mode: str, source: str) -> None:
    assert hr.lint(_values(mode, source)) == []
    assert hr.lint({**_values(mode, source), **OPTIONS_ON}) == []


def test_strict_lint_is_clean_with_every_option_on() -> None:
    assert hr.lint(EVERYTHING_ON) == []


@pytest.mark.parametrize(
    "values",
    [_values(m, s) for m, s in COMBINATIONS]
    + [{**_values(m, s), **OPTIONS_ON} for m, s in COMBINATIONS]
    + [EVERYTHING_ON, MUTUAL_TLS],
    ids=[f"{m}-{s}" for m, s in COMBINATIONS]
    + [f"{m}-{s}-options" for m, s in COMBINATIONS]
    + ["everything-on", "mutual-tls"],
)
def test_rendered_objects_match_the_kubernetes_schemas(values: dict) -> None:
    docs = hr.manifests(values)
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
            continue
        # strict: an unknown field (a typo, a field at the wrong level) is an error too.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 7


def test_gpu_through_dra() -> None:
    docs = hr.manifests({"gpu": {"mode": "dra"}})
    rct = hr.find(docs, "ResourceClaimTemplate")
    assert rct["apiVersion"] == "resource.k8s.io/v1"
    assert re.fullmatch(r"rs-radixserve-gpu-[0-9a-f]{8}", rct["metadata"]["name"])
    (request,) = rct["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {
        "deviceClassName": "gpu.nvidia.com",
        "allocationMode": "ExactCount",
        "count": 1,
    }
    pod = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": rct["metadata"]["name"]}
    ]
    worker = hr.container(docs, "StatefulSet", "worker")
    assert worker["resources"]["claims"] == [{"name": "gpu"}]
    assert "nvidia.com/gpu" not in worker["resources"].get("limits", {})
    assert "--device=cuda" in worker["args"]
    # The scheduler holds no tensors: it never gets the GPU.
    assert "claims" not in hr.container(docs, "StatefulSet", "scheduler")["resources"]


def test_gpu_through_the_device_plugin() -> None:
    docs = hr.manifests()  # the default mode
    assert not [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    worker = hr.container(docs, "StatefulSet", "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["limits"]["memory"] == "64Gi"  # the values' limits are kept
    assert "claims" not in worker["resources"]
    assert (
        "resourceClaims" not in hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    )


def test_gpu_count_gives_the_worker_that_many_tensor_parallel_ranks() -> None:
    one = hr.container(hr.manifests(), "StatefulSet", "worker")
    assert not [a for a in one["args"] if a.startswith("--tp-size")]
    docs = hr.manifests({"gpu": {"count": 4}})
    worker = hr.container(docs, "StatefulSet", "worker")
    assert "--tp-size=4" in worker["args"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    volumes = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]["volumes"]
    shm = next(v for v in volumes if v["name"] == "dshm")  # NCCL's buffers between ranks
    assert shm["emptyDir"]["medium"] == "Memory"


def test_no_gpu_runs_the_worker_on_cpu() -> None:
    docs = hr.manifests({"gpu": {"mode": "none"}})
    assert not [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    worker = hr.container(docs, "StatefulSet", "worker")
    assert "--device=cpu" in worker["args"]
    assert "nvidia.com/gpu" not in json.dumps(worker["resources"])


def test_frontends_find_every_engine_through_the_headless_service() -> None:
    """No engine list is rendered: the frontend re-resolves the headless Service's name, so
    `kubectl scale` changes what it routes to without touching the frontend."""
    docs = hr.manifests({"engine": {"replicas": 3}}, release="prod", namespace="llm")
    sts = hr.find(docs, "StatefulSet", "-engine")
    svc = hr.find(docs, "Service", "-engine-headless")
    assert (
        sts["spec"]["serviceName"] == svc["metadata"]["name"] == "prod-radixserve-engine-headless"
    )
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    frontend = hr.container(docs, "Deployment", "frontend")
    args = dict(a.split("=", 1) for a in frontend["args"])
    assert args["--engine-dns-name"] == "prod-radixserve-engine-headless.llm.svc.cluster.local"
    assert (args["--engine-zmq-port"], args["--engine-control-port"]) == ("30100", "30101")
    assert {p["port"] for p in svc["spec"]["ports"]} >= {30100, 30101}
    assert "--scheduler-addrs" not in args and "--scheduler-control-addrs" not in args
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    # The rendered frontend is the same for any number of engines.
    one = hr.manifests({"engine": {"replicas": 1}}, release="prod", namespace="llm")
    assert hr.container(one, "Deployment", "frontend") == frontend


def test_fixed_ports_and_flags_of_each_container() -> None:
    docs = hr.manifests()
    frontend = hr.container(docs, "Deployment", "frontend")["args"]
    scheduler = hr.container(docs, "StatefulSet", "scheduler")["args"]
    worker = hr.container(docs, "StatefulSet", "worker")["args"]
    assert {
        "--host=0.0.0.0",
        "--port=30000",
        "--http-port=30080",
        "--metrics-port=30090",
        "--model-path=/models/radixserve-zen",
    } <= set(frontend)
    assert {
        "--host=$(POD_IP)",
        "--scheduler-addr=tcp://$(POD_IP):30100",
        "--control-port=30101",
        "--metrics-port=30102",
        "--cache-events-port=30103",
        "--worker-addr=tcp://127.0.0.1:30200",
    } <= set(scheduler)
    assert {
        "--host=$(POD_IP)",
        "--worker-addr=tcp://127.0.0.1:30200",
        "--worker-grpc-port=30201",
        "--metrics-port=30202",
        "--model-path=/models/radixserve-zen",
    } <= set(worker)
    env = hr.container(docs, "StatefulSet", "scheduler")["env"]
    assert {
        "name": "RADIXSERVE_ENGINE_REPLICA",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    } in env


def test_every_flag_is_reachable_through_the_configmaps() -> None:
    """Each config field is set by the chart or is a key of `config` with the right type."""
    schema_config = _schema()["properties"]["config"]["properties"]
    fields = _config_fields()
    missing = [n for n in fields if n not in CHART_FIXED and _camel(n) not in schema_config]
    assert missing == [], f"config.py fields with no value in the chart: {missing}"
    unknown = [k for k in schema_config if re.sub(r"([A-Z])", r"_\1", k).lower() not in fields]
    assert unknown == [], f"values config keys that are no radixserve flag: {unknown}"
    json_type = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    for key, prop in schema_config.items():
        name = re.sub(r"([A-Z])", r"_\1", key).lower()
        assert prop["type"] == json_type[_field_type(name)], key
        if choices := rs_config.resolve_choices(fields[name].metadata.get("choices")):
            assert sorted(prop["enum"]) == sorted(choices), key


def test_config_values_become_env_vars_every_container_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    samples = {"boolean": True, "integer": 16, "number": 0.5, "string": None}
    schema_config = _schema()["properties"]["config"]["properties"]
    config = {
        k: p["enum"][-1] if "enum" in p else samples[p["type"]] for k, p in schema_config.items()
    }
    config["attentionBackend"] = "torch"
    config["cpuBind"] = "0-3"
    config["maxTotalTokens"] = 1_000_000  # must reach the service as 1000000, never 1e+06
    config["engineDnsServer"] = "10.43.0.10:53"
    config["routingLoadFactor"] = 1.5
    config["routingBalanceRelThreshold"] = 2.0  # >= 1, like the load factor
    config["hicacheStorageTlsCa"] = "/etc/kv-ca/ca.crt"  # needs a rediss:// URL (below)
    docs = hr.manifests({"config": config})
    services = {
        "frontend": (rs_config.FrontendConfig,),
        "engine": (rs_config.WorkerConfig, rs_config.SchedulerConfig),
    }
    for (kind, name), component in zip(PROBE_PORTS, ["frontend", "engine", "engine"], strict=True):
        cm_name = hr.find(docs, "ConfigMap", f"-{component}-env")["metadata"]["name"]
        assert hr.container(docs, kind, name)["envFrom"] == [{"configMapRef": {"name": cm_name}}]
    for component, classes in services.items():
        # What each service parses from its component's environment (no flags) is what the
        # values said, and a key reaches exactly the components that have its flag.
        with monkeypatch.context() as m:
            env = _configmap_env(docs, component)
            for var, raw in env.items():
                m.setenv(var, raw)
            if component == "engine":  # what engine.sharedKVStore's Secret would add
                m.setenv("RADIXSERVE_HICACHE_STORAGE_URL", "rediss://kv:6379/0")
            for cls in classes:
                parser = argparse.ArgumentParser()
                rs_config.add_dataclass_args(parser, cls)
                parsed = rs_config.from_args(cls, parser.parse_args([]))
                for key, value in config.items():
                    name = re.sub(r"([A-Z])", r"_\1", key).lower()
                    if hasattr(parsed, name):
                        assert getattr(parsed, name) == value, (cls.__name__, name)
            flags = {f.name for cls in classes for f in dataclasses.fields(cls)}
            for key in config:
                name = re.sub(r"([A-Z])", r"_\1", key).lower()
                assert (f"RADIXSERVE_{name.upper()}" in env) == (name in flags), (component, key)


def test_a_frontend_only_flag_does_not_restart_the_engines() -> None:
    def checksums(values: dict) -> tuple[str, str]:
        docs = hr.manifests(values)
        return tuple(  # type: ignore[return-value]
            hr.find(docs, kind, suffix)["spec"]["template"]["metadata"]["annotations"][
                "checksum/config"
            ]
            for kind, suffix in (("Deployment", "-frontend"), ("StatefulSet", "-engine"))
        )

    front, engine = checksums({})
    front2, engine2 = checksums({"config": {"routingLoadFactor": 2.0, "maxModelLen": 256}})
    assert front2 != front and engine2 == engine
    front3, engine3 = checksums({"config": {"pageSize": 16}})
    assert front3 == front and engine3 != engine
    front4, engine4 = checksums({"config": {"logLevel": "debug"}})  # both have it
    assert front4 != front and engine4 != engine


def test_pod_templates_carry_no_chart_version_label() -> None:
    docs = hr.manifests(EVERYTHING_ON)
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert "helm.sh/chart" not in labels, d["metadata"]["name"]
            assert labels.items() >= d["spec"]["selector"]["matchLabels"].items()
            assert "helm.sh/chart" in d["metadata"]["labels"]


def test_left_out_config_keeps_the_services_defaults() -> None:
    docs = hr.manifests()
    for component in ("frontend", "engine"):
        env = _configmap_env(docs, component)
        assert set(env) == {
            "RADIXSERVE_ENABLE_METRICS",
            "RADIXSERVE_OTLP_TRACES_ENDPOINT",
            "RADIXSERVE_LOG_LEVEL",
        }
        assert env["RADIXSERVE_ENABLE_METRICS"] == "true"
        assert env["RADIXSERVE_OTLP_TRACES_ENDPOINT"] == ""


def test_grpc_probes_and_a_patient_startup() -> None:
    docs = hr.manifests()
    budgets = {}
    for (kind, name), port in PROBE_PORTS.items():
        c = hr.container(docs, kind, name)
        if name == "frontend":
            # Ready = at least one engine serving; alive = the process (never restarted
            # because an engine is down).
            assert c["readinessProbe"]["grpc"] == {
                "port": port,
                "service": "radixserve.v1.Generation",
            }
            for probe in ("startupProbe", "livenessProbe"):
                assert c[probe]["grpc"] == {"port": port, "service": "liveness"}, probe
        else:
            # Ready = the engine serves (the scheduler: its worker answers); alive = the
            # process itself, so a dead worker never gets its scheduler restarted.
            assert c["readinessProbe"]["grpc"] == {"port": port}, name
            for probe in ("startupProbe", "livenessProbe"):
                assert c[probe]["grpc"] == {"port": port, "service": "liveness"}, (name, probe)
        startup = c["startupProbe"]
        budgets[name] = startup["periodSeconds"] * startup["failureThreshold"]
        assert budgets[name] >= 600, name
    assert budgets["frontend"] >= max(budgets["scheduler"], budgets["worker"])


@pytest.mark.parametrize("client_auth", [False, True])
def test_tls_secret_is_mounted_and_passed_as_the_ssl_flags(client_auth: bool) -> None:
    values = {"tls": {"secretName": "radixserve-tls", "clientAuth": client_auth}}
    assert hr.lint(values) == []
    docs = hr.manifests(values)
    c = hr.container(docs, "Deployment", "frontend")
    tls_args = [a for a in c["args"] if a.startswith("--ssl-")]
    files = ["certfile=/etc/radixserve/tls/tls.crt", "keyfile=/etc/radixserve/tls/tls.key"]
    files += ["ca-certs=/etc/radixserve/tls/ca.crt"] if client_auth else []
    assert tls_args == [f"--ssl-{f}" for f in files]
    mount = {"name": "tls", "mountPath": "/etc/radixserve/tls", "readOnly": True}
    assert mount in c["volumeMounts"]
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "radixserve-tls"
    # The kubelet's gRPC probe speaks no TLS: HTTPS probes, TCP when a client cert is needed.
    if client_auth:
        assert c["readinessProbe"]["tcpSocket"] == {"port": 30000}
    else:
        assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert "grpc" not in c["startupProbe"]
    engine = hr.container(docs, "StatefulSet", "scheduler")
    assert not any(a.startswith("--ssl-") for a in engine["args"])


def test_graceful_shutdown_budgets() -> None:
    docs = hr.manifests()
    frontend_pod = hr.find(docs, "Deployment", "-frontend")["spec"]["template"]["spec"]
    c = hr.container(docs, "Deployment", "frontend")
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep" and sleep >= 5
    # preStop, then the server's drain (--shutdown-grace-period), within the grace period.
    drain = rs_config.FrontendConfig().shutdown_grace_period
    assert frontend_pod["terminationGracePeriodSeconds"] >= sleep + drain
    engine_pod = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    # The scheduler drains for the same --shutdown-grace-period, the worker serving it.
    engine_drain = rs_config.SchedulerConfig().shutdown_grace_period
    assert engine_drain == rs_config.WorkerConfig().shutdown_grace_period == drain
    assert engine_pod["terminationGracePeriodSeconds"] >= engine_drain + 10


def test_pods_are_locked_down() -> None:
    kv_store = {"sharedKVStore": EVERYTHING_ON["engine"]["sharedKVStore"]}
    docs = hr.manifests({**EVERYTHING_ON, "engine": kv_store, "frontend": {}})
    pods = [
        d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
    ]
    pods += [d["spec"] for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 5  # frontend, engine, jaeger, kvstore, helm test
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_engine_volumes_model_and_shm() -> None:
    docs = hr.manifests()
    pod = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    pvc = hr.find(docs, "PersistentVolumeClaim", "-models")
    assert volumes["models"]["persistentVolumeClaim"] == {
        "claimName": pvc["metadata"]["name"],
        "readOnly": True,
    }
    mounts = {
        m["mountPath"]: m["name"]
        for m in hr.container(docs, "StatefulSet", "worker")["volumeMounts"]
    }
    assert mounts["/dev/shm"] == "dshm" and mounts["/models"] == "models"


@pytest.mark.parametrize("claim", ["", "kv-pages-rwx"])
def test_the_storage_tier_mounts_an_empty_dir_or_a_claim_in_the_worker(claim: str) -> None:
    storage = {"enabled": True, "mountPath": "/kv", "existingClaim": claim}
    docs = hr.manifests({"engine": {"hicacheStorage": storage}, "config": {"hicacheRatio": 2}})
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    worker = hr.container(docs, "StatefulSet", "worker")
    assert "--hicache-storage-dir=/kv" in worker["args"]
    assert {"name": "kv-pages", "mountPath": "/kv"} in worker["volumeMounts"]
    pod = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-pages")
    if claim:
        assert volume["persistentVolumeClaim"] == {"claimName": claim}
    else:
        assert volume["emptyDir"] == {"sizeLimit": "50Gi"}
    plain = hr.container(hr.manifests(), "StatefulSet", "worker")
    assert not any(a.startswith("--hicache-storage-dir") for a in plain["args"])


KV_STORE = {"engine": {"sharedKVStore": {"enabled": True}}, "config": {"hicacheRatio": 2}}


def _secret_refs(container: dict) -> dict[str, dict]:
    """A container's env entries from Secrets: name -> secretKeyRef."""
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def _worker_env(docs: list[dict]) -> dict[str, str]:
    """The worker's environment as the kubelet builds it: its ConfigMap, then its env entries
    (secretKeyRefs resolved against the rendered Secrets; a missing optional key is unset)."""
    secrets = {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d["data"].items()}
        for d in docs
        if d["kind"] == "Secret"
    }
    env = dict(_configmap_env(docs))
    for entry in hr.container(docs, "StatefulSet", "worker")["env"]:
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif ref and ref["key"] in secrets.get(ref["name"], {}):
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def test_the_shared_kv_store_the_chart_deploys(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {
        "engine": {"sharedKVStore": {"enabled": True, "maxmemory": "8gb"}},
        "config": {"hicacheRatio": 2, "hicacheStorageTtl": 3600},
        "networkPolicy": {"enabled": True},
    }
    docs = hr.manifests(values)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    deployment = hr.find(docs, "Deployment", "-kvstore")
    assert deployment["metadata"]["name"] == "rs-radixserve-kvstore"
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    (valkey,) = pod["containers"]
    assert re.fullmatch(r"valkey/valkey:\d+\.\d+\.\d+", valkey["image"])  # pinned, not latest
    args = valkey["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--maxmemory"] == "8gb" and pairs["--maxmemory-policy"] == "allkeys-lru"
    assert pairs["--save"] == "" and pairs["--appendonly"] == "no"  # a cache: nothing on disk
    assert pairs["--requirepass"] == "$(VALKEYCLI_AUTH)"  # expanded from the Secret
    ref = {"secretKeyRef": {"name": "rs-radixserve-kvstore", "key": "password"}}
    assert {"name": "VALKEYCLI_AUTH", "valueFrom": ref} in valkey["env"]
    assert "valkey-cli ping" in " ".join(valkey["readinessProbe"]["exec"]["command"])
    assert valkey["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "data", "mountPath": "/data"} in valkey["volumeMounts"]
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "data")
    service = hr.find(docs, "Service", "-kvstore")
    assert service["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    secret = _secret(docs, "-kvstore")
    password = secret["password"]
    assert len(password) == 40 and password.isalnum()
    assert secret["url"] == "redis://rs-radixserve-kvstore.ns.svc.cluster.local:6379/0"

    # The worker reads both from the Secret; the password is nowhere else, plain or encoded.
    worker = hr.container(docs, "StatefulSet", "worker")
    refs = _secret_refs(worker)
    assert refs["RADIXSERVE_HICACHE_STORAGE_URL"] == {"name": "rs-radixserve-kvstore", "key": "url"}
    assert refs["RADIXSERVE_HICACHE_STORAGE_PASSWORD"] == {
        "name": "rs-radixserve-kvstore",
        "key": "password",
    }
    rendered = json.dumps(docs)
    assert password not in rendered
    assert rendered.count(base64.b64encode(password.encode()).decode()) == 1
    assert not [a for a in worker["args"] if a.startswith("--hicache-storage")]
    for component in ("engine", "frontend"):
        env = _configmap_env(docs, component)
        assert "RADIXSERVE_HICACHE_STORAGE_URL" not in env
        assert "RADIXSERVE_HICACHE_STORAGE_PASSWORD" not in env
    scheduler = json.dumps(hr.container(docs, "StatefulSet", "scheduler"))
    assert "HICACHE_STORAGE" not in scheduler
    # ... and parses them into its config as the service would.
    with monkeypatch.context() as m:
        for var, raw in _worker_env(docs).items():
            m.setenv(var, raw)
        parser = argparse.ArgumentParser()
        rs_config.add_dataclass_args(parser, rs_config.WorkerConfig)
        cfg = rs_config.from_args(rs_config.WorkerConfig, parser.parse_args([]))
    assert (cfg.hicache_storage_url, cfg.hicache_storage_password) == (secret["url"], password)
    assert cfg.hicache_storage_ttl == 3600 and cfg.hicache_ratio == 2

    # Only this release's engine pods reach it.
    policy = hr.find(docs, "NetworkPolicy", "-kvstore")["spec"]
    assert policy["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    engine_pods = hr.find(docs, "StatefulSet", "-engine")["spec"]["selector"]["matchLabels"]
    assert policy["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": engine_pods}}],
            "ports": [{"port": 6379, "protocol": "TCP"}],
        }
    ]
    notes = hr.render(values)["radixserve/templates/NOTES.txt"]
    assert "rs-radixserve-kvstore:6379" in notes


def test_the_shared_kv_store_of_an_existing_secret() -> None:
    store = {"enabled": True, "deploy": False, "existingSecret": "kv-creds"}
    docs = hr.manifests(
        {
            "engine": {"sharedKVStore": store},
            "config": {"hicacheSize": 8},
            "networkPolicy": {"enabled": True},
        }
    )
    assert not [d for d in docs if "kvstore" in d["metadata"]["name"]]
    kubernetes_validate.validate(hr.find(docs, "StatefulSet", "-engine"), K8S_VERSION, strict=True)
    worker = hr.container(docs, "StatefulSet", "worker")
    refs = _secret_refs(worker)
    assert refs["RADIXSERVE_HICACHE_STORAGE_URL"] == {"name": "kv-creds", "key": "url"}
    # The password key may be absent (a URL that holds one, a server that takes none).
    assert refs["RADIXSERVE_HICACHE_STORAGE_PASSWORD"] == {
        "name": "kv-creds",
        "key": "password",
        "optional": True,
    }
    with pytest.raises(hr.HelmError, match="existingSecret is required"):
        hr.render({**KV_STORE, "engine": {"sharedKVStore": {**store, "existingSecret": ""}}})
    plain = hr.manifests()
    assert not [d for d in plain if "kvstore" in d["metadata"]["name"]]
    assert "HICACHE_STORAGE" not in json.dumps(hr.container(plain, "StatefulSet", "worker"))


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {
                **KV_STORE,
                "engine": {"sharedKVStore": {"enabled": True}, "hicacheStorage": {"enabled": True}},
            },
            "engine.hicacheStorage and engine.sharedKVStore are both enabled",
        ),
        ({"engine": {"sharedKVStore": {"enabled": True}}}, "set config.hicacheRatio"),
        ({**KV_STORE, "config": {"hicacheRatio": 0, "hicacheSize": 0}}, "set config.hicacheRatio"),
    ],
    ids=["with-hicache-storage", "no-host-tier", "host-tier-zero"],
)
def test_the_shared_kv_store_fails_at_install_with_a_clear_message(
    values: dict, message: str
) -> None:
    with pytest.raises(hr.HelmError, match=re.escape(message)):
        hr.render(values)


def test_existing_claim_and_image_model() -> None:
    docs = hr.manifests({"model": {"pvc": {"existingClaim": "weights"}}})
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    pod = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    assert {
        "name": "models",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    docs = hr.manifests({"model": {"source": "image"}})
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert (
        "--model-path=/opt/radixserve/models/radixserve-zen"
        in hr.container(docs, "StatefulSet", "worker")["args"]
    )


def test_tracing_to_the_bundled_jaeger_or_an_endpoint() -> None:
    docs = hr.manifests({"tracing": {"jaeger": {"enabled": True}}})
    svc = hr.find(docs, "Service", "-jaeger")
    assert {p["port"] for p in svc["spec"]["ports"]} == {4317, 4318, 16686}
    hr.find(docs, "Deployment", "-jaeger")
    assert (
        _configmap_env(docs)["RADIXSERVE_OTLP_TRACES_ENDPOINT"]
        == "rs-radixserve-jaeger.ns.svc.cluster.local:4317"
    )
    docs = hr.manifests({"tracing": {"otlpEndpoint": "otel.obs:4317", "jaeger": {"enabled": True}}})
    assert _configmap_env(docs)["RADIXSERVE_OTLP_TRACES_ENDPOINT"] == "otel.obs:4317"


def test_metrics_annotations_and_service_monitors() -> None:
    docs = hr.manifests({"metrics": {"serviceMonitor": {"enabled": True}}})
    engine = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["metadata"]["annotations"]
    assert engine["prometheus.io/scrape"] == "true" and engine["prometheus.io/port"] == "30102"
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    ports = {n: [e["port"] for e in m["spec"]["endpoints"]] for n, m in monitors.items()}
    assert ports == {
        "rs-radixserve-engine": ["sched-metrics", "work-metrics"],
        "rs-radixserve-frontend": ["metrics"],
    }
    docs = hr.manifests({"metrics": {"enabled": False}})
    assert _configmap_env(docs)["RADIXSERVE_ENABLE_METRICS"] == "false"
    assert "prometheus.io/scrape" not in json.dumps(docs)


def test_helm_test_runs_the_smoke_script_against_the_frontend() -> None:
    docs = hr.manifests({"engine": {"replicas": 2}})
    pod = hr.find(docs, "Pod", "-smoke-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "/smoke/smoke_test.py"]
    assert "--target=rs-radixserve-frontend.ns.svc.cluster.local:30000" in c["args"]
    assert "--expect-engines=2" in c["args"]
    script = hr.find(docs, "ConfigMap", "-smoke-test")["data"]["smoke_test.py"]
    assert script == (hr.CHART_DIR / "files" / "smoke_test.py").read_text()


def test_notes_tell_how_to_reach_the_server() -> None:
    notes = hr.render({"tracing": {"jaeger": {"enabled": True}}})["radixserve/templates/NOTES.txt"]
    assert "port-forward svc/rs-radixserve-frontend 30000:30000" in notes
    assert "radixserve.v1.Generation/Generate" in notes and "helm test rs" in notes
    assert "port-forward svc/rs-radixserve-jaeger 16686:16686" in notes


@pytest.mark.parametrize(
    "values, where",
    [
        ({"gpu": {"mode": "tpu"}}, "/gpu/mode"),
        ({"gpu": {"count": 0}}, "/gpu/count"),
        ({"gpu": {"count": 9}}, "/gpu/count"),  # the GPUs of one node
        ({"model": {"source": "hf"}}, "/model/hf/repo"),
        ({"model": {"hf": {"repo": "not a repo"}}}, "/model/hf/repo"),
        ({"model": {"hf": {"storage": "s3"}}}, "/model/hf/storage"),
        ({"config": {"routingLoadFactor": 0.5}}, "/config/routingLoadFactor"),
        ({"keda": {"enabled": True, "prometheus": {"serverAddress": "prom:9090"}}}, "/keda"),
        ({"networkPolicy": {"enable": True}}, "enable"),
        ({"engine": {"pdb": {"enabled": "yes"}}}, "/engine/pdb/enabled"),
        ({"config": {"radixEvictionPolicy": "fifo"}}, "/config/radixEvictionPolicy"),
        ({"config": {"schedulePolicy": "sjf"}}, "/config/schedulePolicy"),
        ({"config": {"pageSize": 0}}, "/config/pageSize"),
        ({"config": {"memFractionStatic": 1.5}}, "/config/memFractionStatic"),
        ({"config": {"maxRunningRequests": "many"}}, "/config/maxRunningRequests"),
        ({"config": {"pageSise": 16}}, "pageSise"),  # a typo is named, not ignored
        ({"engine": {"replicas": 0}}, "/engine/replicas"),
        ({"model": {"path": ""}}, "/model/path"),
        ({"model": {"source": "s3"}}, "/model/source"),
        ({"frontend": {"extraArgs": "--foo"}}, "/frontend/extraArgs"),
        ({"engine": {"sharedKVStore": {"maxmemory": "lots"}}}, "/engine/sharedKVStore/maxmemory"),
        ({"config": {"hicacheStorageTimeoutMs": 0}}, "/config/hicacheStorageTimeoutMs"),
        ({"config": {"hicacheStorageTtl": -1}}, "/config/hicacheStorageTtl"),
    ],
)
def test_bad_values_fail_at_install_with_a_clear_message(values: dict, where: str) -> None:
    with pytest.raises(hr.HelmValuesError, match=re.escape(where)):
        hr.validate_values(values)
    with pytest.raises(hr.HelmError):
        hr.render(values)  # install renders after the same check


def test_default_values_pass_the_schema() -> None:
    hr.validate_values(None)
    hr.validate_values(EVERYTHING_ON)


def test_dockerfile_targets_match_the_chart() -> None:
    stages = hr.dockerfile_targets()
    docs = hr.manifests()
    ports = {
        "frontend": ("Deployment", {30000, 30080, 30090}),
        "scheduler": ("StatefulSet", {30100, 30101, 30102, 30103}),
        "worker": ("StatefulSet", {30201, 30202}),
    }
    run_as = hr.find(docs, "StatefulSet", "-engine")["spec"]["template"]["spec"]["securityContext"][
        "runAsUser"
    ]
    for target, (kind, want_ports) in ports.items():
        stage = stages[target]
        assert stage["entrypoint"] == ["radixserve", target]
        assert stage["user"].split(":")[0] == str(run_as)  # numeric, so runAsNonRoot can check it
        assert set(stage["expose"]) == want_ports
        c = hr.container(docs, kind, target)
        assert {p["containerPort"] for p in c["ports"]} == want_ports
        assert "command" not in c  # the image's ENTRYPOINT runs, the chart adds flags
    # The light images are built without torch (the Dockerfile fails the build if it sneaks in).
    text = hr.DOCKERFILE.read_text()
    assert 'ARG WORKER_ONLY_DEPS="torch triton xgrammar"' in text
    assert '! python -c "import torch"' in text


# ---- authentication (issue 15) ---------------------------------------------------------


def _secret(docs: list[dict], suffix: str) -> dict[str, str]:
    secret = hr.find(docs, "Secret", suffix)
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def _keys_volume(docs: list[dict], kind: str) -> dict:
    pod = hr.find(docs, kind)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-keys"]
    return volume["secret"]


def test_api_key_from_a_generated_secret_reaches_the_frontend_and_helm_test() -> None:
    docs = hr.manifests()
    key = _secret(docs, "-api-key")["api-key"]
    assert len(key) == 40 and key.isalnum()
    ref = {"secretKeyRef": {"name": "rs-radixserve-api-key", "key": "api-key"}}
    env = {"name": "RADIXSERVE_API_KEY", "valueFrom": ref}
    assert env in hr.container(docs, "Deployment", "frontend")["env"]
    (smoke,) = hr.find(docs, "Pod", "-smoke-test")["spec"]["containers"]
    assert env in smoke["env"]
    rendered = json.dumps(docs)
    assert rendered.count(base64.b64encode(key.encode()).decode()) == 1  # only in the Secret
    for kind, name in (("StatefulSet", "scheduler"), ("StatefulSet", "worker")):
        assert "RADIXSERVE_API_KEY" not in json.dumps(hr.container(docs, kind, name))
    notes = hr.render()["radixserve/templates/NOTES.txt"]
    assert "secret rs-radixserve-api-key" in notes and "RADIXSERVE_API_KEY" in notes


def test_api_key_from_an_existing_secret_with_an_admin_key_or_off() -> None:
    docs = hr.manifests({"auth": {"existingSecret": "mine", "adminSecretKey": "admin"}})
    assert not [d for d in docs if d["kind"] == "Secret" and "api-key" in d["metadata"]["name"]]
    env = {e["name"]: e for e in hr.container(docs, "Deployment", "frontend")["env"]}
    ref = env["RADIXSERVE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "mine", "key": "admin"}
    assert env["RADIXSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "mine"
    docs = hr.manifests({"auth": {"enabled": False}})
    assert not [d for d in docs if d["kind"] == "Secret" and "api-key" in d["metadata"]["name"]]
    assert "RADIXSERVE_API_KEY" not in json.dumps(hr.container(docs, "Deployment", "frontend"))
    (smoke,) = hr.find(docs, "Pod", "-smoke-test")["spec"]["containers"]
    assert "env" not in smoke


def test_internal_keys_from_a_generated_seed_in_every_pod() -> None:
    docs = hr.manifests()
    seed = _secret(docs, "-internal-keys")["seed"]
    assert len(seed) == 64
    for kind in ("Deployment", "StatefulSet"):
        volume = _keys_volume(docs, kind)
        assert volume["secretName"] == "rs-radixserve-internal-keys"
        assert volume["items"] == [{"key": "seed", "path": "seed"}]
        assert volume["defaultMode"] == 0o440  # the pods' group (fsGroup), nobody else
    mount = {"name": "internal-keys", "mountPath": "/etc/radixserve/keys", "readOnly": True}
    for kind, name in (
        ("Deployment", "frontend"),
        ("StatefulSet", "scheduler"),
        ("StatefulSet", "worker"),
    ):
        c = hr.container(docs, kind, name)
        assert mount in c["volumeMounts"], name
        assert "--internal-keys-dir=/etc/radixserve/keys" in c["args"], name
        assert "--insecure-internal" not in c["args"], name


def test_internal_keys_from_a_user_secret_give_each_pod_only_its_files() -> None:
    docs = hr.manifests({"internalAuth": {"existingSecret": "rs-keys"}})
    assert not [d for d in docs if d["kind"] == "Secret" and "internal" in d["metadata"]["name"]]
    front = {i["key"] for i in _keys_volume(docs, "Deployment")["items"]}
    engine = {i["key"] for i in _keys_volume(docs, "StatefulSet")["items"]}
    assert front == {"frontend.key_secret", "scheduler.key", "control.token"}
    assert {"scheduler.key_secret", "worker.key_secret", "frontend.key", "worker.key"} <= engine
    assert not {k for k in front if k.endswith("_secret")} & engine  # no key in two pods


def test_internal_ports_bind_the_pod_ip_from_the_downward_api() -> None:
    docs = hr.manifests()
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    for name in ("scheduler", "worker"):
        c = hr.container(docs, "StatefulSet", name)
        assert pod_ip in c["env"], name
        assert not [a for a in c["args"] if "0.0.0.0" in a], name
    scheduler = hr.container(docs, "StatefulSet", "scheduler")["args"]
    assert "--scheduler-addr=tcp://$(POD_IP):30100" in scheduler
    # the worker's ZeroMQ stays on loopback: only its own scheduler reaches it
    assert "--worker-addr=tcp://127.0.0.1:30200" in scheduler


def test_network_policy_lets_only_frontends_reach_the_engines() -> None:
    docs = hr.manifests({"networkPolicy": {"enabled": True}})
    policy = hr.find(docs, "NetworkPolicy", "-engine")["spec"]
    (internal,) = [r for r in policy["ingress"] if {"port": 30100, "protocol": "TCP"} in r["ports"]]
    assert internal["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "radixserve",
                    "app.kubernetes.io/instance": "rs",
                    "app.kubernetes.io/component": "frontend",
                }
            }
        }
    ]
    opened = {p["port"] for r in policy["ingress"] for p in r["ports"]}
    assert 30200 not in opened and 30201 not in opened
