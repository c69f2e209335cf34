"""The three services started exactly as their containers would start them, on loopback.

Commands, flags and environment come from the rendered Helm chart (gpu.mode=none) and the
Dockerfile's ENTRYPOINTs; only what a laptop cannot have is replaced: cluster DNS names (the
engines' headless Service name the frontend resolves included) and 0.0.0.0 become 127.0.0.1,
fixed ports become free ones, /models/ becomes the repo's models/.
The frontend and scheduler run with torch and triton made unimportable, as in their images.
Then the kubelet's gRPC probes, one Generate over gRPC, the `helm test` pod's script and
the Prometheus ports are checked.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from radixserve.v1 import generation_pb2, generation_pb2_grpc
from services.cli.serve import healthy
from services.common.config import DEFAULT_MODEL_PATH
from tests.deploy import helm_render as hr
from tests.server_util import free_port

MODEL_DIR = Path(DEFAULT_MODEL_PATH)
VENV_BIN = Path(sys.executable).parent
RELEASE, NAMESPACE = "rs", "ns"
# Every port the chart fixes (values.yaml documents them).
CHART_PORTS = (30000, 30080, 30090, 30100, 30101, 30102, 30200, 30201, 30202)
# Kept small: on CPU the default KV pool is 30% of RAM, too much for a shared test machine.
VALUES = {"gpu": {"mode": "none"}, "config": {"maxTotalTokens": 4096, "maxRunningRequests": 8}}
# What each container runs in: which Dockerfile target, and whether its image has torch.
CONTAINERS = {
    "worker": ("StatefulSet", True),
    "scheduler": ("StatefulSet", False),
    "frontend": ("Deployment", False),
}
POD_NAMES = {
    "StatefulSet": f"{RELEASE}-radixserve-engine-0",
    "Deployment": f"{RELEASE}-radixserve-frontend-abc12",
}
BOOT_TIMEOUT_S = 240.0
KEYS_MOUNT = "/etc/radixserve/keys"


@dataclass
class Localizer:
    """Rewrites cluster addresses, ports and paths of the manifests to this machine's."""

    ports: dict[int, int]
    keys_dir: str = ""

    def __call__(self, text: str) -> str:
        text = re.sub(r"[a-z0-9.-]+\.svc\.cluster\.local", "127.0.0.1", text)
        text = text.replace("$(POD_IP)", "127.0.0.1")  # the pod's IP (downward API)
        text = text.replace(KEYS_MOUNT, self.keys_dir)  # the internal keys' Secret
        text = text.replace("0.0.0.0", "127.0.0.1")  # tests bind loopback only
        text = re.sub(r"(?<![\w/])/models/", str(MODEL_DIR.parent) + "/", text)
        return re.sub(
            r"\b(" + "|".join(map(str, self.ports)) + r")\b",
            lambda m: str(self.ports[int(m[1])]),
            text,
        )


def _secret_data(docs: list[dict], name: str) -> dict[str, str]:
    """A rendered Secret's values, decoded (what the kubelet hands the container)."""
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def _env_of(
    c: dict, configmap: dict[str, str], pod_name: str, local: Localizer, docs: list[dict]
) -> dict[str, str]:
    env = {k: local(v) for k, v in configmap.items()}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = local(e["value"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = _secret_data(docs, ref["name"])[ref["key"]]
        elif source == {"fieldRef": {"fieldPath": "status.podIP"}}:
            env[e["name"]] = "127.0.0.1"
        else:
            assert source == {"fieldRef": {"fieldPath": "metadata.name"}}, e
            env[e["name"]] = pod_name
    return env


def _write_internal_keys(docs: list[dict], folder: Path) -> str:
    """The internal keys' Secret as the files the pods mount (the chart's: one seed)."""
    folder.mkdir(mode=0o700)
    for name, value in _secret_data(docs, f"{RELEASE}-radixserve-internal-keys").items():
        (folder / name).write_text(value)
    return str(folder)


def _base_env(home: Path, has_torch: bool, blocker: Path) -> dict[str, str]:
    """A container's environment starts nearly empty (what the image's ENV sets)."""
    env = {
        "PATH": f"{VENV_BIN}:/usr/bin:/bin",
        "HOME": str(home),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "LANG": "C.UTF-8",
    }
    if not has_torch:
        env["PYTHONPATH"] = str(blocker)
    return env


def _write_torch_blocker(folder: Path) -> Path:
    """sitecustomize that makes torch/triton absent, as in the frontend and scheduler images
    (importlib.util.find_spec returns None for a None entry of sys.modules)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\nfor _name in ('torch', 'triton'):\n    sys.modules[_name] = None\n"
    )
    return folder


@dataclass
class Stack:
    docs: list[dict]
    local: Localizer
    procs: dict[str, subprocess.Popen]
    logs: dict[str, Path]
    env: dict[str, dict[str, str]]
    cwd: Path

    def port(self, chart_port: int) -> int:
        return self.local.ports[chart_port]

    def output(self) -> str:
        return "\n".join(
            f"----- {n} -----\n{p.read_text(errors='replace')[-4000:]}"
            for n, p in self.logs.items()
        )


def _start(stack_dir: Path) -> Stack:
    assert MODEL_DIR.is_dir(), (
        f"the default model {MODEL_DIR} is missing (scripts/train_default_model.py makes it)"
    )
    docs = hr.manifests(VALUES, release=RELEASE, namespace=NAMESPACE)
    local = Localizer(
        {p: free_port() for p in CHART_PORTS}, _write_internal_keys(docs, stack_dir / "keys")
    )
    configmaps = {
        kind: hr.find(docs, "ConfigMap", suffix)["data"]
        for kind, suffix in (("StatefulSet", "-engine-env"), ("Deployment", "-frontend-env"))
    }
    stages = hr.dockerfile_targets()
    blocker = _write_torch_blocker(stack_dir / "no-torch")
    stack = Stack(docs, local, {}, {}, {}, stack_dir)
    for name, (kind, has_torch) in CONTAINERS.items():
        c = hr.container(docs, kind, name)
        entry = stages[name]["entrypoint"]
        argv = [str(VENV_BIN / entry[0]), *entry[1:], *map(local, c.get("args", []))]
        env = {
            **_base_env(stack_dir / f"home-{name}", has_torch, blocker),
            **_env_of(c, configmaps[kind], POD_NAMES[kind], local, docs),
        }
        (stack_dir / f"home-{name}").mkdir(exist_ok=True)
        stack.logs[name] = stack_dir / f"{name}.log"
        stack.env[name] = env
        with open(stack.logs[name], "w") as log:
            # Like the kubelet, start every container at once: no ordering is promised.
            stack.procs[name] = subprocess.Popen(
                argv,
                env=env,
                cwd=stack_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    return stack


def _stop(stack: Stack) -> None:
    for proc in stack.procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in stack.procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _probe_ok(addr: str) -> bool:
    return healthy(addr, timeout=2)


def _probe_addrs(stack: Stack) -> dict[str, str]:
    def probe_port(kind: str, name: str) -> int:
        return hr.container(stack.docs, kind, name)["startupProbe"]["grpc"]["port"]

    return {
        name: f"127.0.0.1:{stack.port(probe_port(kind, name))}"
        for name, (kind, _) in CONTAINERS.items()
    }


def _wait_started(stack: Stack) -> None:
    pending = _probe_addrs(stack)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while pending:
        dead = {n: p.returncode for n, p in stack.procs.items() if p.poll() is not None}
        if dead:
            raise AssertionError(f"container process exited: {dead}\n{stack.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"startup probes still failing for {sorted(pending)}\n{stack.output()}"
            )
        pending = {n: a for n, a in pending.items() if not _probe_ok(a)}
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = _start(tmp_path_factory.mktemp("containers"))
    try:
        _wait_started(s)
        yield s
    finally:
        _stop(s)


def test_every_startup_probe_passes_and_the_processes_stay_up(stack: Stack) -> None:
    for name, addr in _probe_addrs(stack).items():
        assert _probe_ok(addr), f"{name} probe at {addr}\n{stack.output()}"
    assert {n: p.poll() for n, p in stack.procs.items()} == dict.fromkeys(CONTAINERS)


def test_generate_through_the_frontend(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.port(30000)}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            text="Hello", sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0)
        )
        key = stack.env["frontend"]["RADIXSERVE_API_KEY"]  # from the chart's Secret
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = [("authorization", f"Bearer {key}")]
        replies = list(stub.Generate(request, timeout=120, metadata=metadata))
    tokens = [t for r in replies for t in r.token_ids]
    last = replies[-1]
    assert 1 <= len(tokens) <= 4 and last.completion_tokens == len(tokens), stack.output()
    assert last.finish_reason in ("length", "stop") and last.prompt_tokens >= 1


def test_the_helm_test_pod_passes(stack: Stack) -> None:
    pod = hr.find(stack.docs, "Pod", "-smoke-test")
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "/smoke/smoke_test.py"]
    script = hr.CHART_DIR / "files" / "smoke_test.py"
    # The test pod runs in the frontend image: no torch there either.
    run = subprocess.run(
        [str(VENV_BIN / "python"), str(script), *map(stack.local, c["args"])],
        env=stack.env["frontend"],
        cwd=stack.cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{stack.output()}"
    assert "smoke test passed" in run.stdout


@pytest.mark.parametrize(
    "name, chart_port", [("frontend", 30090), ("scheduler", 30102), ("worker", 30202)]
)
def test_metrics_port_from_the_chart_serves_prometheus(
    stack: Stack, name: str, chart_port: int
) -> None:
    url = f"http://127.0.0.1:{stack.port(chart_port)}/metrics"
    try:
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with no_proxy.open(url, timeout=10) as reply:
            body = reply.read().decode()
    except OSError as e:
        raise AssertionError(f"{name}: no /metrics on the chart's port ({url}): {e}") from e
    assert "# TYPE" in body
