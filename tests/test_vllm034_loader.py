"""Every architecture's tiny export against what vLLM 0.34.0's loader takes (tests/fixtures/
vllm034_loader_rules.json): the registry names (the export's and, under method dflash, the name
EAGLEConfig renames it to), the speculator its model class declares and the method that must name it,
the dflash_config and top-level keys the classes read, the block layout against the served token count,
and what the loader refuses; the 0.32 checks of the same exports are tests/test_engine_vllm.py's. The
rule checker names every breach, and each rule kind is shown to fail on a mutated config."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_ds.config import load_recipe
from dflash_ds.export import save_drafter
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape
from dflash_ds.resolve.drafter import drafter_shape
from tests.llama_cpp import ROOT

RULES = json.loads((Path(__file__).parent / "fixtures" / "vllm034_loader_rules.json").read_text())
TARGET = ROOT / "assets" / "tiny-target"
# Each architecture's tiny recipe; LiLiCorr also with DFlash2's block convolution (the paired keys).
EXPORTS = {"dflash": ("tiny", ()), "dflash2": ("tiny-dflash2", ()), "dspark": ("tiny-dspark", ()),
           "lilicorr": ("tiny-lilicorr", ()),
           "lilicorr-conv": ("tiny-lilicorr", ("drafter.lilicorr.block_conv_kernel_size=2",
                                               "drafter.lilicorr.block_conv_group_size=16")),
           "xpress": ("tiny-xpress", ())}
TYPES = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "list": lambda v: isinstance(v, list)}


def rename(arch: str) -> str:
    """The architecture EAGLEConfig asks the registry for under method dflash."""
    r = RULES["rename_under_dflash"]
    if arch.startswith(r["keep_prefix"]) or arch.endswith(r["keep_suffix"]) or arch in r["keep"]:
        return arch
    return r["else"].format(arch=arch)


def asked(config: dict, method: str) -> list[str]:
    """Every name the registry is asked for: the export's, and its rename when method dflash wraps it."""
    names = list(config.get("architectures") or [])
    return names + [rename(a) for a in names if method == "dflash" and rename(a) != a]


def key_breaches(where: str, section: dict, rules: dict) -> list[str]:
    out = []
    for key, rule in rules.items():
        if key not in section and "default" not in rule:
            out.append(f"{where}.{key} missing (read without a default)")
            continue
        value = section.get(key, rule.get("default"))
        if "type" in rule and not TYPES[rule["type"]](value):
            out.append(f"{where}.{key} = {value!r} is not {rule['type']}")
        if "equals" in rule and value != rule["equals"]:
            out.append(f"{where}.{key} = {value!r}, the loader needs {rule['equals']!r}")
        if "power_of_two_max" in rule and not (0 < value <= rule["power_of_two_max"] and value & (value - 1) == 0):
            out.append(f"{where}.{key} = {value!r} is not a power of two <= {rule['power_of_two_max']}")
        if "pair" in rule and bool(value) != bool(section.get(rule["pair"], 0)):
            out.append(f"{where}.{key} without {where}.{rule['pair']}")
    return out


def breaches(name: str, config: dict, method: str, tokens: int) -> list[str]:
    """What vLLM 0.34's loader refuses in an export of architecture `name` served with `method` and
    `tokens` = num_speculative_tokens, one line per rule broken (empty: it loads)."""
    rules = RULES["architectures"][name]
    out = []
    if config.get("architectures") != rules["architectures"]:
        out.append(f"architectures {config.get('architectures')} is not {rules['architectures']}")
    out += [f"the registry has no {a}" for a in asked(config, method) if a not in rules["registry"]]
    if method != rules["base_method"]:  # the declared speculator's method is the only one accepted
        out.append(f"method {method!r}, the model class declares {rules['speculator_config_class']} "
                   f"(base_method {rules['base_method']!r})")
    dflash = config.get("dflash_config") or {}
    out += key_breaches("dflash_config", dflash, rules.get("dflash_config", {}))
    out += key_breaches("top_level", config, rules.get("top_level", {}))
    sections = {"dflash_config": dflash, "top_level": config}
    out += [f"{r['in']}.{r['key']} = {r['value']!r} is refused" for r in rules["refused"]
            if sections[r["in"]].get(r["key"]) == r["value"]]
    out += [f"{r['in']}.{r['key']} present" for r in rules["absent"] if r["key"] in sections[r["in"]]]
    # fill_in: the anchor's slot plus N drafting slots; anchor_first: N slots, all drafting.
    block = dflash.get("block_size", config.get("block_size"))
    queries = tokens + (1 if rules["layout"] == "fill_in" else 0)
    if queries != block:
        out.append(f"{rules['layout']} block of {queries} query slots at num_speculative_tokens {tokens}, "
                   f"trained block {block}")
    if rules.get("num_speculative_tokens_below_block") and not 1 <= tokens < block:
        out.append(f"num_speculative_tokens {tokens} not in [1, block_size)")
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """name -> (config.json, tensor names, the card's vLLM method and num_speculative_tokens)."""
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(TARGET)
    out = {}
    for name, (recipe, overrides) in EXPORTS.items():
        torch.manual_seed(0)
        drafter = DFlashDrafter(drafter_shape(target, load_recipe(ROOT / "recipes" / f"{recipe}.yaml", overrides).drafter))
        path = save_drafter(drafter, tmp_path_factory.mktemp("vllm034") / name, dtype=torch.float32)
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        serve = drafter.config.spec.card(drafter.config).serving
        out[name] = (json.loads((Path(path) / "config.json").read_text()), names, serve.vllm_method, serve.vllm_tokens)
    return out


def arch(name: str) -> str:
    return name.split("-")[0]


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_every_export_is_what_vllm_034_loads(exports, name):
    config, names, method, tokens = exports[name]
    assert breaches(arch(name), config, method, tokens) == []
    rules = RULES["architectures"][arch(name)]
    # The registry resolves every name asked to the model class that declares the rules' speculator.
    assert {rules["registry"][a][1] for a in asked(config, method)} == {rules["registry"][config["architectures"][0]][1]}
    # 0.34 changed the weight mapping only for speculators-format names; the exports carry none.
    assert not {n for n in names if n.split(".")[0] in ("midlayer", "encoder")}
    if arch(name) == "dspark" and config["enable_confidence_head"]:  # 0.34 builds the head and drops nothing
        assert {"confidence_head.proj.weight", "confidence_head.proj.bias"} <= names


def test_the_dspark_export_keeps_sample_from_anchor_out_of_dflash_config(exports):
    """The key vLLM's DFlash speculator refuses there, while the project still reads an export written
    with it (before this rule)."""
    config = exports["dspark"][0]
    assert "sample_from_anchor" not in config["dflash_config"] and config["sample_from_anchor"] is True
    older = copy.deepcopy(config)
    older["dflash_config"]["sample_from_anchor"] = True
    assert DrafterShape.from_hf_config(older) == DrafterShape.from_hf_config(config)


def mutated(config: dict, where: str, key: str, value) -> dict:
    """A copy of `config` with `key` set to `value` (None: removed) at the top level or in dflash_config."""
    out = copy.deepcopy(config)
    section = out if where == "top_level" else out["dflash_config"]
    if value is None:
        section.pop(key, None)
    else:
        section[key] = value
    return out


# (architecture, where, key, value, method or None for the card's, tokens delta, words of the breach)
MUTATIONS = [
    ("dspark", "dflash_config", "sample_from_anchor", True, None, 0, "dflash_config.sample_from_anchor = True is refused"),
    ("dspark", "top_level", "sample_from_anchor", False, None, 0, "top_level.sample_from_anchor = False"),
    ("dspark", "top_level", "markov_rank", None, None, 0, "top_level.markov_rank missing"),
    ("dspark", "top_level", "block_size", 7, "dflash", 0, "method 'dflash'"),
    ("dflash", "top_level", "architectures", ["Qwen3DFlashDrafter"], None, 0, "the registry has no DFlashQwen3DFlashDrafter"),
    ("dflash", "dflash_config", "sample_from_anchor", True, None, 0, "is refused"),
    ("dflash", "top_level", "block_size", 8, None, 1, "fill_in block of 9 query slots"),
    ("dflash2", "dflash_config", "selector_rank", None, None, 0, "dflash_config.selector_rank missing"),
    ("dflash2", "top_level", "no_rope_layers", [0], None, 0, "top_level.no_rope_layers present"),
    ("lilicorr", "dflash_config", "lilicorr_candidate_topk", 3, None, 0, "not a power of two"),
    ("lilicorr", "dflash_config", "lilicorr_enabled", False, None, 0, "lilicorr_enabled = False"),
    ("lilicorr", "dflash_config", "conv_kernel_size", 2, None, 0, "conv_kernel_size without dflash_config.conv_group_size"),
    ("lilicorr", "top_level", "draft_vocab_size", 512, None, 0, "draft_vocab_size present"),
    ("lilicorr", "top_level", "block_size", 4, None, 1, "not in [1, block_size)"),
    ("xpress", "top_level", "sample_from_anchor", True, None, 0, "top_level.sample_from_anchor = True"),
    ("xpress", "top_level", "block_size", 8, "dspark", 0, "method 'dspark'"),
]


@pytest.mark.parametrize("case", MUTATIONS, ids=[f"{m[0]}-{m[2]}-{m[4] or ''}" for m in MUTATIONS])
def test_a_mutated_config_is_refused_by_the_rule_naming_it(exports, case):
    name, where, key, value, method, delta, words = case
    config, _, card_method, tokens = exports[name]
    assert breaches(name, config, card_method, tokens) == []  # the unmutated export passes
    found = breaches(name, mutated(config, where, key, value), method or card_method, tokens + delta)
    assert any(words in b for b in found), found


def test_the_rename_rule_is_eagleconfigs():
    """Names kept under method dflash: a DFlash prefix or suffix and LiLiCorr's; every other is renamed,
    which is why XPress is registered under both names and DSpark is served under its own method."""
    assert [rename(a) for a in ("DFlashDraftModel", "DFlash2DraftModel", "LiLiCorrDraftModel", "Qwen3XPressModel",
                                "Qwen3DSparkModel")] == \
        ["DFlashDraftModel", "DFlash2DraftModel", "LiLiCorrDraftModel", "DFlashQwen3XPressModel", "DFlashQwen3DSparkModel"]
    assert "DFlashQwen3DSparkModel" not in RULES["architectures"]["dspark"]["registry"]
    assert {a: r["vllm_method"] == r["base_method"] for a, r in RULES["architectures"].items()} == \
        dict.fromkeys(RULES["architectures"], True)
