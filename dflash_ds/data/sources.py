"""Where conversations come from and where regenerated ones go: dataset loading (hub or local
files), the identity of local files for the cache fingerprint, the tokenizer, and the layout of a
regeneration's output directory (read by preparation, written by regeneration)."""

from __future__ import annotations

import json
from pathlib import Path

DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
MANIFEST = ".manifest.json"


def local_path_problem(path: str, setting: str) -> str | None:
    """One line when `path` looks like a local path (absolute, ./ ../ ~, a data-file suffix, more than
    one '/', or a first component that exists here) but does not exist: such a path must not be
    looked up on the hub (30 s of retries before the same answer). None otherwise."""
    p = Path(path).expanduser()
    if p.exists():
        return None
    first = Path(path).parts[0] if Path(path).parts else ""
    local = (p.is_absolute() or path.startswith((".", "~")) or p.suffix.lower() in DATA_SUFFIXES
             or path.count("/") > 1 or ("/" in path and Path(first).is_dir()))
    if not local:
        return None
    parent = next((q for q in p.parents if q.exists()), None)
    where = f" ({parent} exists: a typo?)" if parent is not None and str(parent) not in ("", ".", "/") else ""
    return (f"{setting}: {path} does not exist{where}; point {setting} at an existing local path (hub ids look like "
            "'org/name')")


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts))


def source_identity(path: str, split: str) -> dict | None:
    """Identity of a local dataset from file names, sizes and mtimes (None for a hub id)."""
    p = Path(path)
    if not p.exists():
        return None
    files = [{"name": str(f.relative_to(p)) if f != p else f.name, "size": f.stat().st_size,
              "mtime_ns": f.stat().st_mtime_ns} for f in _local_files(p)]
    return {"path": str(p.resolve()), "split": split, "files": files}


def load_rows(path: str, split: str, cache_dir: str | None = None, *, path_setting: str = "data.path",
              split_setting: str = "data.split"):
    """A `datasets.Dataset` from a hub id, a local .json/.jsonl/.parquet/.arrow file or a directory of
    such files (all of them, whatever their format)."""
    import datasets

    p = Path(path)
    kw = {"cache_dir": cache_dir} if cache_dir else {}
    problem = local_path_problem(path, path_setting)
    if problem:
        raise ValueError(problem)
    if p.is_file() or (p.is_dir() and not (p / "state.json").exists() and not (p / "dataset_dict.json").exists()):
        from dflash_ds.data.validate import check_local

        check_local(_local_files(p), path_setting)
    try:
        if p.is_file():
            builder = DATA_SUFFIXES.get(p.suffix.lower())
            if builder is None:
                raise ValueError(f"{path_setting}: {path} has an unsupported extension; use one of "
                                 f"{sorted(DATA_SUFFIXES)} or a directory of such files")
            ds = datasets.load_dataset(builder, data_files={"train": str(p)}, split=split, **kw)
        elif p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{split_setting}: split {split!r} not in {path} (has {sorted(ds)})")
                ds = ds[split]
        elif p.is_dir():
            files = [f for f in _local_files(p) if f.suffix.lower() in DATA_SUFFIXES]
            if not files:
                raise ValueError(f"{path_setting}: no data files ({sorted(DATA_SUFFIXES)}) in {path}")
            ds = _load_directory(p, split, kw, (path_setting, split_setting))
        else:
            ds = datasets.load_dataset(path, split=split, **kw)
    except ValueError as e:
        msg = str(e)
        if msg.startswith((path_setting, split_setting)):
            raise
        if "split" in msg.lower():
            raise ValueError(f"{split_setting}: split {split!r} does not exist in {path}: {msg}") from e
        raise ValueError(f"{path_setting}: cannot load {path!r}: {msg}") from e
    except FileNotFoundError as e:
        raise ValueError(f"{path_setting}: {path!r} is neither a local file/directory nor a dataset "
                         f"on the hub: {e}") from e
    except Exception as e:  # network, auth, malformed files, files of different formats
        mixed = _mixed_formats(p, path_setting)
        if mixed:
            raise ValueError(mixed) from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path_setting}: cannot load {path!r} (split {split!r}): "
                         f"{type(e).__name__}: {first}") from e
    if isinstance(ds, datasets.IterableDataset):
        raise ValueError(f"{path_setting}: streaming datasets are not supported")
    return ds


def directory_splits(p: Path) -> dict[str, list[Path]]:
    """The data files of directory `p` by split, as `datasets` names them: a file whose name holds a
    split's word (train.jsonl, test_cases.jsonl, eval-0.parquet: datasets' own patterns) is in that
    split, and every other data file is in "train" (datasets would drop such files as soon as one file
    names a split; here no file is left out)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    files = [f.resolve() for f in _local_files(p) if f.suffix.lower() in DATA_SUFFIXES]
    named: dict[str, list[Path]] = {}
    for name, found in DataFilesDict.from_patterns(get_data_patterns(str(p)), base_path=str(p)).items():
        kept = [f for f in map(lambda x: Path(x).resolve(), found) if f in files]
        if kept:
            named[str(name)] = kept
    placed = {f for fs in named.values() for f in fs}
    unnamed = [f for f in files if f not in placed]
    if unnamed:
        named["train"] = sorted(set(named.get("train", [])) | set(unnamed))
    return named


def _load_directory(p: Path, split: str, kw: dict, settings: tuple[str, str]):
    """The data files of directory `p` in `split` (`directory_splits`; "a+b" reads several, as in
    `datasets`), whatever their formats: `datasets` alone would read the most common extension and
    silently skip the files of the others. The files of the other splits are named in one note."""
    import datasets

    from dflash_ds.safety import say

    path_setting, split_setting = settings
    splits = directory_splits(p)
    wanted = [s.strip() for s in split.split("+")]
    missing = [s for s in wanted if s not in splits]
    if missing:
        order = sorted(splits, key=lambda name: (name != "train", name))
        listed = "; ".join(f"{name}: {', '.join(f.name for f in splits[name][:3])}"
                           f"{' ...' if len(splits[name]) > 3 else ''}" for name in order)
        raise ValueError(f"{split_setting}: split {missing[0]!r} not in {p} (its files give {listed}); set "
                         f"{split_setting} to one of {', '.join(order)}, or several joined by '+' "
                         f"(e.g. {'+'.join(order)}) to read them all")
    chosen = [f for s in wanted for f in splits[s]]
    skipped = {name: fs for name, fs in sorted(splits.items()) if name not in wanted}
    if skipped:
        listed = "; ".join(f"{', '.join(f.name for f in fs[:3])}{' ...' if len(fs) > 3 else ''} ({name})"
                           for name, fs in skipped.items())
        say(f"note: {path_setting} {p}: {split_setting} {split} reads {len(chosen)} file(s); the files of the other "
            f"splits are not read: {listed}; {split_setting}={'+'.join([*wanted, *skipped])} reads them all")
    by_builder: dict[str, list[str]] = {}
    for f in chosen:
        by_builder.setdefault(DATA_SUFFIXES[f.suffix.lower()], []).append(str(f))
    parts = [datasets.load_dataset(b, data_files={"train": fs}, split="train", **kw) for b, fs in sorted(by_builder.items())]
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets([parts[0]] + [d.cast(parts[0].features) for d in parts[1:]])
    except (ValueError, TypeError, KeyError) as exc:
        listed = "; ".join(f"{b}: {', '.join(Path(f).name for f in fs[:3])}" for b, fs in sorted(by_builder.items()))
        raise ValueError(_mixed_formats(p, path_setting) or (
            f"{path_setting}: {p} holds files of several formats whose columns differ ({listed}; "
            f"{str(exc).splitlines()[0][:160]}); convert them to one format")) from None


def _mixed_formats(p: Path, setting: str) -> str | None:
    """One line with the records of each chat format when local files mix formats that `datasets`
    cannot load as one table (files with different fields), else None."""
    from dflash_ds.data.validate import format_counts

    if not p.exists():
        return None
    try:
        counts = format_counts(_local_files(p))
    except Exception:  # noqa: BLE001 - the loader's own error is then the better message
        return None
    if len(counts) < 2:
        return None
    listed = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"{setting}: {p} mixes chat formats that cannot be loaded as one table (records: {listed}); "
            f"write each format to its own file and convert all but one (accepted: messages, conversations, "
            f"prompt + response), or keep one format per {setting}")


def release_freed_memory() -> None:
    """Hand memory freed after loading back to the system: Arrow's pool and glibc's heap keep freed
    parse buffers (about the size of a JSON file) mapped, and encode workers forked afterwards would
    each inherit them, so the resident memory would grow with the dataset."""
    import ctypes

    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if Path(path).is_dir() and not any((Path(path) / f).is_file() for f in files):
        # transformers would otherwise build some tokenizer from the config and fail later, on the data.
        raise ValueError(f"target.path: no tokenizer in {path!r} (none of {', '.join(files)}); the target directory "
                         "must hold its tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"target.path: cannot load a tokenizer from {path!r}: {type(e).__name__}: {e}") from e


def output_dir(cfg) -> Path:
    """`data.regenerate.output_dir`, or `<data.cache_dir>/regenerated` when it is empty."""
    return Path(cfg.regenerate.output_dir or Path(cfg.cache_dir) / "regenerated")


def shard_name(i: int) -> str:
    return f"part-{i:05d}.jsonl"


def check_complete(path, recipe: str = "RECIPE") -> dict:
    """The manifest of a finished regeneration; ValueError naming the setting and the command otherwise."""
    out = Path(path)
    if not (out / MANIFEST).exists():
        raise ValueError(f"data.regenerate.output_dir: {out} holds no regenerated data; run "
                         f"`python -m dflash_ds.regenerate {recipe}` first (with the same overrides; it needs the "
                         "servers in data.regenerate.urls), or set data.regenerate.enabled=false")
    manifest = json.loads((out / MANIFEST).read_text())
    missing = [i for i in range(manifest["num_shards"]) if not (out / shard_name(i)).exists()]
    if missing:
        raise ValueError(f"data.regenerate.output_dir: {out} is incomplete ({len(missing)} of "
                         f"{manifest['num_shards']} shards missing, first {shard_name(missing[0])}); rerun "
                         f"`python -m dflash_ds.regenerate {recipe}`, it resumes where it stopped")
    return manifest
