"""The export's README.md: what the drafter was trained on and how to serve it.

Draft-token counts differ between engines: SGLang's `--speculative-num-draft-tokens` counts the
whole block (anchor included), vLLM's `num_speculative_tokens` and llama.cpp's `--spec-draft-n-max`
count the drafted tokens only (the architecture's `card(shape).serving`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import NamedTuple

from dflash_ds.network.arch_types import Serving
from dflash_ds.network.shape import DrafterShape

THINKING_ROW = re.compile(r"^\| chat template \| `enable_thinking: (true|false)`", re.M)
BENCH_HEADING = "## Acceptance by benchmark"


class TauFacts(NamedTuple):
    """The latest greedy tau of a run, for the card."""

    value: float
    prompts: str | None = None  # what it was measured on
    position_acceptance: list | None = None


def model_card(cfg: DrafterShape, *, target: str | None = None, data: str | None = None, steps: int | None = None,
               tau: TauFacts | None = None, thinking: bool | None = None) -> str:
    """Markdown for the export directory; unknown facts are shown as unknown, never guessed."""
    def known(x) -> str:
        return "unknown" if x in (None, "") else str(x)

    tau_prompts, position_acceptance = (tau.prompts, tau.position_acceptance) if tau else (None, None)

    target_arg = target or "TARGET"
    if tau is None:
        tau_line = "not measured for this export"
    else:
        tau_line = f"{tau.value:.3f} (exact offline greedy acceptance length on {known(tau_prompts)})"
    card = cfg.spec.card(cfg)
    serve = card.serving
    vllm_cfg = json.dumps({"method": serve.vllm_method, "model": "DRAFTER_DIR",
                           "num_speculative_tokens": serve.vllm_tokens})
    think = "unknown" if thinking is None else str(bool(thinking)).lower()
    kwargs = json.dumps({"enable_thinking": bool(thinking)})
    # The chat template setting goes into the serving commands only when it is known.
    vllm_tail = [] if thinking is None else [f"    --default-chat-template-kwargs '{kwargs}'"]
    sglang_note = [] if thinking is None else [f"With SGLang, send `\"chat_template_kwargs\": {kwargs}` with each "
                                               "chat request.", ""]
    llama_tail = [] if thinking is None else [f"    --chat-template-kwargs '{kwargs}'"]
    name = cfg.spec.title
    remote = cfg.spec.remote_code
    remote_name = remote.name if remote is not None else "the architecture's remote code"
    lines = [
        f"# {name} drafter",
        "",
        f"A {name} block-diffusion speculative-decoding drafter trained with dflash-ds.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{known(target)}` |",
        f"| training data | `{known(data)}` |",
        f"| optimizer steps | {known(steps)} |",
        f"| acceptance length tau | {tau_line} |",
        f"| block size | {cfg.block_size} (anchor + {cfg.block_size - 1} masks, {cfg.num_drafts} drafted tokens) |",
        f"| drafter layers | {cfg.num_hidden_layers}, hidden size {cfg.hidden_size} |",
        f"| target layers tapped | {list(cfg.target_layer_ids)} of {cfg.num_target_layers} |",
        f"| mask token id | {cfg.mask_token_id} |",
    ]
    if thinking is not None:
        lines.append(f"| chat template | `enable_thinking: {think}` (training data; evaluate and serve the same way) |")
    lines += card.rows
    lines += vllm_runner_rows(cfg, card.serving)
    if position_acceptance:
        rates = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(position_acceptance, 1))
        lines.append(f"| acceptance by draft position | {rates} |")
    lines += [
        "",
        "The drafter has no embedding and no lm_head: it uses the target's. Serve it next to the target it",
        "was trained for, with the same chat template settings as in training (`enable_thinking`: "
        f"{think}): requests rendered otherwise are drafted for text the drafter never saw, and acceptance drops.",
        "",
        "## Serving",
        "",
    ]
    lines += card.note
    if serve.sglang_algorithm is not None:  # None: SGLang does not serve it (the note says so)
        lines += [
            f"SGLang (`--speculative-num-draft-tokens` = {serve.sglang_draft_tokens}):",
            "",
            "```",
            f"python -m sglang.launch_server --model {target_arg} --speculative-algorithm {serve.sglang_algorithm} \\",
            f"    --speculative-draft-model-path DRAFTER_DIR --speculative-num-draft-tokens {serve.sglang_draft_tokens}",
            "```",
            "",
        ]
    lines += [
        f"vLLM (`num_speculative_tokens` = {serve.vllm_tokens}):",
        "",
        "```",
        f"vllm serve {target_arg} --speculative-config '{vllm_cfg}'" + (" \\" if vllm_tail else ""),
        *vllm_tail,
        "```",
        "",
        *(sglang_note if serve.sglang_algorithm is not None else []),
    ]
    if serve.llama_cpp_type is not None:  # None: llama.cpp does not load it (the note says why)
        lines += llama_cpp_lines(serve, llama_tail)
    lines += [
        "## Loading with transformers",
        "",
        "```python",
        "from transformers import AutoModel",
        "drafter = AutoModel.from_pretrained(DRAFTER_DIR, trust_remote_code=True)",
        f"hidden = drafter(noise_embedding, target_hidden, position_ids)  # see {remote_name}",
        "logits = hidden @ target.get_output_embeddings().weight.T",
        "```",
        "",
    ]
    return "\n".join(lines)


def llama_cpp_lines(serve: Serving, llama_tail: list[str]) -> list[str]:
    """The card's llama.cpp commands (`llama_tail`: the chat template arguments, when known)."""
    return [
        f"llama.cpp (`--spec-draft-n-max` = {serve.llama_cpp_draft_max}, the drafts of one block; the drafter "
        "converted with",
        "the target's directory, which gives it the tokenizer and the target's shape, and the target",
        "converted as usual):",
        "",
        "```",
        "python convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET_DIR --outfile drafter.gguf",
        "python convert_hf_to_gguf.py TARGET_DIR --outfile target.gguf",
        f"llama-server -m target.gguf -md drafter.gguf --spec-draft-n-max {serve.llama_cpp_draft_max}"
        + (" \\" if llama_tail else ""),
        *llama_tail,
        "```",
        "",
        f"llama.cpp reads the speculative type from the drafter's metadata (`--spec-type {serve.llama_cpp_type}`",
        "says it outright); its default draft length is 3.",
        "",
    ]


def vllm_runner_rows(cfg: DrafterShape, serve: Serving) -> list[str]:
    """The card's row saying which vLLM model runner serves the export: vLLM 0.32's V1 runner (its CPU
    build's only one) refuses what the architecture names and drafters that mix sliding-window and full
    attention layers (`VllmConfig._get_v1_model_runner_unsupported_features`); Model Runner V2 (GPU)
    serves them."""
    needs = [serve.vllm_v2_only] if serve.vllm_v2_only else []
    types = list(cfg.to_hf_config().get("layer_types") or [])
    if 0 < types.count("sliding_attention") < len(types):
        needs.append("drafter layers that mix sliding-window and full attention")
    if needs:
        return [f"| vLLM model runner | Model Runner V2 (GPU) for {' and '.join(needs)}; the V1 runner, the only one "
                "of vLLM's CPU build, refuses it |"]
    return ["| vLLM model runner | V1 or V2: vLLM's CPU build serves it too |"]


def card_info(recipe, steps: int, tau_report=None) -> dict:
    """model_card keyword arguments of a training run (`tau_report`: the latest eval.tau.TauReport)."""
    d = recipe.data
    info = {"target": recipe.target.path + (f" + adapter {recipe.target.adapter}" if recipe.target.adapter else ""),
            "data": d.path + (" (responses regenerated by the target)" if d.regenerate.enabled else ""),
            "steps": steps, "thinking": d.thinking}
    if tau_report is not None and tau_report.cycles:
        info["tau"] = TauFacts(tau_report.tau_mean, f"{len(tau_report.cycles)} held-out prompts from "
                                                    f"{d.eval_path or d.path + ' (last data.num_eval samples)'}",
                               tau_report.position_acceptance)
    return info


def trained_thinking(export_dir: str | os.PathLike) -> bool | None:
    """The enable_thinking an export's drafter was trained with, from its model card (None: not stated)."""
    try:
        m = THINKING_ROW.search((Path(export_dir) / "README.md").read_text())
    except OSError:
        return None
    return None if m is None else m.group(1) == "true"


def benchmark_section(rows: list[dict]) -> str:
    """Markdown: one row per benchmark set and sampling setting (eval.benchmark_table.bench_row)."""
    def pm(x, se):
        return "-" if x is None else f"{x:.2f}" + (f" ± {se:.2f}" if se is not None else "")

    lines = [BENCH_HEADING, "",
             "tau: tokens per draft/verify cycle, the target's own token included, on the target's own responses",
             "(greedy: exact; sampled: the engines' verification rule on sampled responses, ± standard error).",
             "llama.cpp and vLLM: the mean acceptance length each engine reports for the same greedy responses,",
             "counted its own way (docs/algorithm.md section 7.3 of dflash-ds: llama-server's rounds, vLLM's drafts).",
             "", "| benchmark | sampling | tau (mean) | tau (pooled) | llama.cpp | vLLM | responses | "
             "acceptance by draft position |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " ".join(f"{k}:{'-' if p is None else f'{p:.2f}'}" for k, p in enumerate(r["position_acceptance"], 1))
        lines.append(f"| {r['bench']} | {r['sampling']} | {pm(r['tau_mean'], r['tau_mean_se'])} | "
                     f"{pm(r['tau_pooled'], r['tau_pooled_se'])} | {pm(r.get('llama_server'), None)} | "
                     f"{pm(r.get('vllm'), None)} | {r['responses']} | {pos} |")
    return "\n".join(lines) + "\n"


def add_benchmarks_to_card(export_dir: str | os.PathLike, rows: list[dict]) -> None:
    """Put the benchmark table into an export's README.md (replacing an earlier one), atomically."""
    from dflash_ds.io import write_text_atomic

    card = Path(export_dir) / "README.md"
    text = card.read_text()
    if BENCH_HEADING in text:
        head, _, tail = text.partition(BENCH_HEADING)
        nxt = tail.find("\n## ")
        text = head + (tail[nxt + 1:] if nxt >= 0 else "")
    anchor = text.find("## Serving")
    section = benchmark_section(rows) + "\n"
    text = text[:anchor] + section + text[anchor:] if anchor >= 0 else text + "\n" + section
    mode = card.stat().st_mode & 0o777
    write_text_atomic(card, text)
    os.chmod(card, mode)
