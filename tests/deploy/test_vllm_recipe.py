"""replicas/vllm/serve.sh hands `vllm serve` exactly the flags of the reference recipe, and the
compose file and the Kubernetes manifest use the very same flags."""

from __future__ import annotations

import json
from pathlib import Path

from tests.deploy.manifests import (
    COMPOSE_FILE,
    K8S_GPU_DIR,
    REPO,
    compose_interpolate,
    k8s_documents,
    load_yaml,
    vllm_serve_argv,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "topic": "kv-events",
}
# The flags of ../shared/reference/vllm.md, "Real deployment recipe", in order.
RECIPE = [
    "--port", "8000",
    "--enable-prefix-caching",
    "--enable-chunked-prefill",
    "--max-num-batched-tokens", "8192",
    "--max-num-seqs", "256",
    "--enable-prompt-tokens-details",
]  # fmt: skip


def _split(argv: list[str]) -> tuple[list[str], dict[str, object]]:
    """argv without the --kv-events-config pair, and that config parsed."""
    i = argv.index("--kv-events-config")
    return argv[:i] + argv[i + 2 :], json.loads(argv[i + 1])


def test_serve_sh_runs_vllm_serve_with_the_recipe_flags(tmp_path: Path) -> None:
    argv = vllm_serve_argv(tmp_path)
    rest, kv = _split(argv)
    assert rest == ["serve", MODEL, *RECIPE]
    assert kv == KV_EVENTS


def test_serve_sh_takes_model_ports_and_extra_flags(tmp_path: Path) -> None:
    argv = vllm_serve_argv(
        tmp_path,
        ["Qwen/Qwen2.5-7B-Instruct", "--tensor-parallel-size", "2"],
        env={"PORT": "8001", "KV_EVENTS_PORT": "5600", "MAX_NUM_SEQS": "128"},
    )
    rest, kv = _split(argv)
    assert rest[:2] == ["serve", "Qwen/Qwen2.5-7B-Instruct"]
    assert rest[rest.index("--port") + 1] == "8001"
    assert rest[rest.index("--max-num-seqs") + 1] == "128"
    assert rest[-2:] == ["--tensor-parallel-size", "2"]
    assert kv["endpoint"] == "tcp://*:5600"


def test_compose_vllm_services_use_the_serve_sh_flags(tmp_path: Path) -> None:
    expected = vllm_serve_argv(tmp_path)
    services = compose_interpolate(load_yaml(COMPOSE_FILE))["services"]
    vllm = {name: svc for name, svc in services.items() if "vllm/vllm-openai" in svc["image"]}
    assert len(vllm) >= 1
    for svc in vllm.values():
        assert [*svc["entrypoint"], *svc["command"]] == ["vllm", *expected]


def test_k8s_vllm_deployment_uses_the_serve_sh_flags(tmp_path: Path) -> None:
    expected = vllm_serve_argv(tmp_path)
    containers = [
        c
        for _, doc in k8s_documents(K8S_GPU_DIR)
        if doc["kind"] in ("Deployment", "StatefulSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("vllm/vllm-openai")
    ]
    assert len(containers) == 1
    assert [*containers[0]["command"], *containers[0]["args"]] == ["vllm", *expected]


def test_readme_documents_every_flag() -> None:
    readme = (REPO / "replicas" / "vllm" / "README.md").read_text(encoding="utf-8")
    for flag in [*(a for a in RECIPE if a.startswith("--")), "--kv-events-config"]:
        assert flag in readme, flag
    assert '"enable_kv_cache_events": true' in readme
