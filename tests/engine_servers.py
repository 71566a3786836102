"""Real `python -m engine.serve` processes on loopback ports: the remote backends of the
multi-backend tests, which kill and restart them."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from served_app import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]


class EngineServer:
    def __init__(self, model: str, log_dir: pathlib.Path, num_gpu_blocks: int = 128, num_cpu_blocks: int = 64) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"engine-{self.port}.log"
        self.options = ["--num-gpu-blocks", str(num_gpu_blocks), "--num-cpu-blocks", str(num_cpu_blocks)]
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> EngineServer:
        return self.launch().wait_serving(timeout)

    def launch(self) -> EngineServer:
        """The process, started; `wait_serving` waits for it (several launched first start together)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "engine.serve", "--model", self.model, "--served-model-name", "tiny",
                 "--port", str(self.port), *self.options], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_serving(self, timeout: float = 90.0) -> EngineServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine.serve on {self.port} exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"engine.serve on {self.port} did not answer /health within {timeout} s")

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients, as when a machine dies."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def running_requests(self) -> int:
        stats = httpx.get(f"{self.url}/v1/kv_cache", timeout=5).json()
        return stats["running"] + stats["waiting"] + stats["swapped"]

    def finished(self, reason: str) -> float:
        """How many requests this server has ended with `reason` ("stop", "length", "abort", "error"),
        from its /metrics' vllm:request_success_total."""
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=5).text):
            for sample in family.samples:
                if sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == reason:
                    return sample.value
        return 0.0
