"""The serving format of a DFlash drafter (docs/algorithm.md section 6), written and read back.

An export is a directory with `config.json` and `model.safetensors` that SGLang
(`--speculative-algorithm DFLASH`) and vLLM (`"method": "dflash"`) load as is. The tensor names
carry no prefix, and there is no `embed_tokens` and no `lm_head`: the drafter borrows both from
the target at serving time.

It also holds the architecture's transformers remote code (its spec's `remote_code`: DFlash's
`modeling_dflash.py`, self-contained, from dflash_ds/architectures/dflash/, and each other published
architecture's own file from its package beside it) with an `auto_map`
in config.json, so `AutoModel.from_pretrained(dir, trust_remote_code=True)` loads it, and a
README.md model card. `model_type` stays "qwen3": without trust_remote_code (SGLang, vLLM)
transformers keeps reading it as a Qwen3Config exactly as before. Files are 0644 and the
directory 0755 whatever the umask or the staging directory's mode: exports are shared.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_ds.architectures import class_names
from dflash_ds.export.card import model_card
from dflash_ds.io import replace_dir_atomic, write_text_atomic
from dflash_ds.network.drafter import DFlashDrafter
from dflash_ds.network.shape import DrafterShape

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
FILE_MODE, DIR_MODE = 0o644, 0o755

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

_FIX = "pass the directory written by dflash_ds export (drafter.init_from / --drafter)"


def expected_shapes(cfg: DrafterShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the export and its shape, derived from the config alone (`DrafterShape.tensors`).

    Independent of `DFlashDrafter` on purpose: a module whose parameters drift from the serving
    layout must fail `save_drafter`, not produce a file the engines misread.
    """
    return {name: t.shape for name, t in cfg.tensors().items()}


def _check_tensors(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str | None:
    """A sentence describing how `shapes` differs from `expected`, or None when they agree."""
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = sorted(n for n in set(shapes) & set(expected) if tuple(shapes[n]) != tuple(expected[n]))
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if extra:
        problems.append(f"unexpected tensors {_few(extra)}")
    if wrong:
        problems.append(
            "wrong shapes " + _few([f"{n} {tuple(shapes[n])} (expected {tuple(expected[n])})" for n in wrong])
        )
    return "; ".join(problems) or None


def _few(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def is_export(path: Path) -> bool:
    """Whether `path` holds a DFlash drafter export (its config.json names a DFlash architecture)."""
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(set(class_names()) & set(config.get("architectures") or []))


class ExportWriteError(OSError):
    """Writing the export failed (its cause is `__cause__`: safetensors' SafetensorError on a full
    disk, torch's RuntimeError, an OSError); the previous export, if any, is untouched."""


def save_drafter(drafter: DFlashDrafter, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                 card: dict | None = None, num_anchors: int | None = None) -> Path:
    """Write `drafter` as a serving export into `out_dir`, atomically.

    `card`: keyword arguments of `model_card.model_card` (target, data, steps, tau, ...).
    `num_anchors`: the training's blocks per row, written as config.json's `num_anchors` (DeepSpec's
    DSpark config class requires it; the engines ignore it).

    An existing export at `out_dir` is replaced only once the new one is complete (see
    `dflash_ds.io.replace_dir_atomic`). Returns the export path.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype} is not supported; use one of {list(_DTYPE_NAMES.values())}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not is_export(out_dir))):
        raise ValueError(
            f"export path {out_dir} exists and is not a DFlash drafter export; refusing to replace it: "
            "choose an empty or new directory for the export"
        )

    cfg = drafter.config
    state = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in drafter.state_dict().items()}
    problem = _check_tensors({n: tuple(t.shape) for n, t in state.items()}, expected_shapes(cfg))
    if problem is not None:
        raise RuntimeError(f"drafter state_dict does not match the serving layout (docs/algorithm.md section 6): {problem}")
    config = dict(cfg.to_hf_config())
    # Serving engines pick the weight dtype from here when started with dtype "auto".
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    if num_anchors is not None:
        config["num_anchors"] = int(num_anchors)
    remote = cfg.spec.remote_code
    if remote is not None:
        config["auto_map"] = dict(remote.auto_map)

    # Staged next to out_dir and moved into place only when complete: a crash mid-save never
    # leaves a half-written drafter where a serving engine (or a resume) would pick it up.
    try:
        with replace_dir_atomic(out_dir) as tmp:
            # Tensors that share storage (tied weights) would be refused by safetensors; clone makes
            # each one own its bytes.
            save_file({n: t.clone() for n, t in state.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            written = [WEIGHTS_NAME, CONFIG_NAME, CARD_NAME]
            if remote is not None:
                shutil.copyfile(remote.source, tmp / remote.name)
                written.append(remote.name)
                for source in remote.beside:
                    shutil.copyfile(source, tmp / source.name)
                    written.append(source.name)
            (tmp / CARD_NAME).write_text(model_card(cfg, **(card or {})))
            for name in written:
                os.chmod(tmp / name, FILE_MODE)
            os.chmod(tmp, DIR_MODE)  # mkdtemp creates 0700
    except Exception as exc:  # noqa: BLE001  a failed write is the disk's (or the folder's), whatever raised it
        raise ExportWriteError(str(exc)) from exc
    return out_dir


def write_card(out_dir: str | os.PathLike, **card) -> None:
    """Rewrite the model card of an existing export (e.g. once the final tau is known), atomically."""
    out_dir = Path(out_dir)
    cfg = DrafterShape.from_hf_config(read_export_config(out_dir))
    write_text_atomic(out_dir / CARD_NAME, model_card(cfg, **card))
    os.chmod(out_dir / CARD_NAME, FILE_MODE)


def read_export_config(path: str | os.PathLike) -> dict:
    """config.json of an export, after checking the directory is a DFlash drafter at all."""
    path = Path(path)
    prefix = f"{path} is not a DFlash drafter export"
    if not path.is_dir():
        raise ValueError(f"{prefix}: no such directory; {_FIX}")
    if not (path / CONFIG_NAME).is_file():
        raise ValueError(f"{prefix}: {CONFIG_NAME} is missing; {_FIX}")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except ValueError as e:
        raise ValueError(f"{prefix}: {CONFIG_NAME} is not valid JSON ({e}); {_FIX}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{prefix}: {CONFIG_NAME} is not a JSON object; {_FIX}")
    if not set(class_names()) & set(config.get("architectures") or []):
        known = " or ".join(f"[{n!r}]" for n in class_names())
        raise ValueError(
            f"{prefix}: {CONFIG_NAME} architectures is {config.get('architectures')!r}, "
            f"not {known} (a target model directory?); {_FIX}"
        )
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{prefix}: {CONFIG_NAME} lacks dflash_config; {_FIX}")
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dflash:
            raise ValueError(f"{prefix}: {CONFIG_NAME} dflash_config lacks {key}; {_FIX}")
    if not (path / WEIGHTS_NAME).is_file():
        raise ValueError(f"{prefix}: {WEIGHTS_NAME} is missing; {_FIX}")
    return config


def load_drafter(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    shape: DrafterShape | None = None,
) -> DFlashDrafter:
    """Read an export written by `save_drafter` (or any SGLang/vLLM-loadable DFlash or DFlash2 drafter).

    `dtype=None` keeps the stored dtype, so a save/load round trip is bit-exact. With `shape` (a
    run's, already compared with the export's config by `run.check_init_from`) the module is built
    from it, so a run's drafter and its later exports derive from the run's shape alone.
    """
    path = Path(path)
    config = read_export_config(path)
    try:
        cfg = DrafterShape.from_hf_config(config) if shape is None else shape
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid DFlash drafter export: {CONFIG_NAME} is incomplete ({e}); {_FIX}") from None

    with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    problem = _check_tensors({n: tuple(t.shape) for n, t in state.items()}, expected_shapes(cfg))
    if problem is not None:
        raise ValueError(
            f"{path} is not a valid DFlash drafter export: {WEIGHTS_NAME} does not match {CONFIG_NAME}: "
            f"{problem}; {_FIX}"
        )
    dtypes = {t.dtype for t in state.values()}
    if dtype is None:
        if len(dtypes) != 1:
            raise ValueError(f"{path}: {WEIGHTS_NAME} mixes dtypes {sorted(map(str, dtypes))}; pass dtype= explicitly")
        dtype = dtypes.pop()

    # Built on the meta device: a 1.7B drafter's random init would cost more than the load.
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    # Every tensor the module holds comes from the file; a buffer would be left uninitialised.
    assert not list(drafter.buffers()), "DFlashDrafter grew buffers that load_drafter does not restore"
    drafter.load_state_dict({n: t.to(device=device, dtype=dtype) for n, t in state.items()}, strict=True, assign=True)
    return drafter.eval()


def load_backbone(path: str | os.PathLike, shape: DrafterShape, *, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> DFlashDrafter:
    """A drafter of `shape` whose backbone (every tensor outside its architecture's heads) is that of the
    export at `path`, of another architecture (`DrafterShape.backbone_from`, already checked by
    `run.check_init_from`), and whose heads start fresh, from the current torch seed. The export's own
    heads (a DFlash2 selector) are left behind."""
    exported = load_drafter(path, dtype=dtype).state_dict()
    drafter = DFlashDrafter(shape).to(dtype)
    heads = tuple(f"{name}." for name in drafter.head_names)
    backbone = {n: t for n, t in drafter.state_dict().items() if not n.startswith(heads)}
    missing = [n for n, t in backbone.items() if n not in exported or exported[n].shape != t.shape]
    if missing:
        raise ValueError(f"{path}: its backbone lacks {missing[0]} {tuple(backbone[missing[0]].shape)} of the recipe's "
                         f"drafter ({len(missing)} tensors in all); {_FIX}")
    drafter.load_state_dict({n: exported[n] for n in backbone}, strict=False)
    return drafter.to(device)
