"""Where records come from: planning an input into shard specs, and reading them back.

`plan_input(path, per_shard)` lists the records of a file or directory and cuts the
global record order into shard specs (JSON-able dicts), so record i always lands in
shard i // per_shard: the basis of resumable collection. `read_spec(spec)` yields
`(index, where, raw)` for one shard; `raw` is the parsed JSON value (a dict, or a list
for a bare list of messages), or a `Quarantine` for a record that is not JSON/UTF-8.

Inputs: `.jsonl` / `.json` / `.traj.json` / `.traj`, `.parquet`, a directory of those
(searched recursively, sorted), or an HF `datasets` directory written by `save_to_disk`.
Whether a JSON file holds one value per line or one document (pretty-printed or not) is
read from its content, not its name; a document that is a list of records (a ShareGPT
dump) yields each record, any other document (a list of messages or of OpenHands
events included) is one record.
"""

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, Tuple

from dlite.data.formats.errors import Quarantine
from dlite.data.formats.messages import looks_like_messages
from dlite.data.formats.openhands import looks_like_events

HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
JSON_SUFFIXES = (".jsonl", ".json", ".traj")


# ---------------------------------------------------------------- planning

def _kind(p: Path):
    if p.name.endswith(JSON_SUFFIXES):
        return "json"
    return "parquet" if p.name.endswith(".parquet") else None


def _sources(path: Path, skip_other: bool = False) -> List[Tuple[str, Path]]:
    if path.is_file():
        if _kind(path) is None:
            raise ValueError(f"--input: {path} is not .jsonl/.json/.traj(.json)/.parquet")
        return [(_kind(path), path)]
    if not path.is_dir():
        raise FileNotFoundError(f"--input: no such file or directory {path}")
    if any((path / m).exists() for m in HF_MARKERS):
        return [("hf", path)]
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if not any(_kind(p) for p in files):
        raise ValueError(f"--input: no .jsonl/.json/.traj(.json)/.parquet files under {path}")
    # Any other file is one quarantined record (`not_a_trajectory_file`), never silently
    # ignored, unless the user said to skip them (data.skip_other_files).
    return [(_kind(p) or "other", p) for p in files if _kind(p) or not skip_other]


def _jsonl_index(path: Path):
    """Byte offsets and 1-based line numbers of the non-blank lines, and the file size."""
    offs, nums, pos = [], [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                offs.append(pos)
                nums.append(lineno)
            pos += len(line)
    return offs, nums, pos


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def _is_lines(p: Path) -> bool:
    """One JSON value per line? Yes when one of the first two non-blank lines parses on
    its own (a pretty-printed document's first lines never do; a JSONL file whose first
    line is broken still has a good second one). A one-line file is one document,
    except that `.jsonl` keeps its line numbers."""
    first: list = []
    with open(p, "rb") as f:
        for line in f:
            if line.strip():
                first.append(line)
                if len(first) == 2:
                    break
    if len(first) < 2:
        return not first or p.name.endswith(".jsonl")
    return _parses(first[0]) or _parses(first[1])


@lru_cache(maxsize=2)
def _document(path: str, size: int) -> Tuple[Tuple[str, object], ...]:
    """(where, raw) of each record of a one-document JSON file (`size` keys the cache)."""
    p = Path(path)
    doc = _parse(p.read_bytes(), p.name)
    if isinstance(doc, list) and doc and not looks_like_messages(doc) \
            and not looks_like_events(doc) and all(isinstance(r, dict) for r in doc):
        return tuple((f"{p.name}#{i}", r) for i, r in enumerate(doc))
    return ((p.name, doc),)


@lru_cache(maxsize=4)
def _hf_dataset(path: str):
    import datasets
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise ValueError(f"--input: {path} holds splits {sorted(ds)}; give one split's dir")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds


def _open_source(kind: str, p: Path):
    """(reader kind, number of records, cut(a, b) -> a JSON-able item reading records
    [a, b), identity). JSON files read as "jsonl" (a value per line) or "traj" (one
    document), the names the plans of earlier versions used."""
    if kind == "json" and _is_lines(p):
        offs, nums, size = _jsonl_index(p)
        ends = offs[1:] + [size]
        return "jsonl", len(offs), \
            lambda a, b: ["jsonl", str(p), offs[a], ends[b - 1], nums[a]], size
    if kind == "json":
        size = p.stat().st_size
        return "traj", len(_document(str(p), size)), lambda a, b: ["traj", str(p), a, b], size
    if kind == "other":
        return kind, 1, lambda a, b: ["other", str(p)], p.stat().st_size
    if kind == "parquet":
        import pyarrow.parquet as pq
        n = pq.ParquetFile(p).metadata.num_rows
        return kind, n, lambda a, b: ["parquet", str(p), a, b], p.stat().st_size
    n = len(_hf_dataset(str(p)))
    return kind, n, lambda a, b: ["hf", str(p), a, b], n


def plan_input(path: str, per_shard: int, skip_other: bool = False) -> Tuple[List[dict], List[list]]:
    """Shard specs `{"shard", "first_index", "count", "items"}` covering every record in
    order, and the sources' identity `[kind, path, size]` (for the resume check). In a
    directory, files that are not trajectories are quarantined unless `skip_other`."""
    specs, items, index, identity = [], [], 0, []

    def close(count):
        specs.append({"shard": len(specs), "first_index": index - count, "count": count,
                      "items": list(items)})
        items.clear()
    for kind, p in _sources(Path(path), skip_other):
        reader, n, cut, ident = _open_source(kind, p)
        identity.append([reader, str(p), ident])
        a = 0
        while a < n:
            b = min(n, a + per_shard - index % per_shard)
            items.append(cut(a, b))
            index, a = index + b - a, b
            if index % per_shard == 0:
                close(per_shard)
    if items:
        close(index % per_shard)
    return specs, identity


# ---------------------------------------------------------------- reading

def _parse(data: bytes, where: str):
    """The JSON value, or a Quarantine when it is not UTF-8 / not JSON at all (whether a
    valid value is a usable record is the adapters' question, with a better reason)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Quarantine("undecodable", f"{where}: {e}")
    try:
        return json.loads(text.lstrip("\ufeff"))  # a BOM some editors write first
    except json.JSONDecodeError as e:
        return Quarantine("bad_json", f"{where}: {e}")


def _read_item(item) -> Iterator[Tuple[str, object]]:
    kind, path = item[0], Path(item[1])
    if kind == "jsonl":
        start, end, lineno = item[2:]
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read(end - start)
        for k, line in enumerate(chunk.split(b"\n")):
            if line.strip():
                where = f"{path.name}:{lineno + k}"
                yield where, _parse(line, where)
    elif kind == "traj":
        # a copy: the cached document must not change if a caller edits a record
        for where, raw in _document(str(path), path.stat().st_size)[item[2]:item[3]]:
            yield where, copy.deepcopy(raw)
    elif kind == "parquet":
        yield from _read_parquet(path, *item[2:])
    elif kind == "other":
        yield path.name, Quarantine("not_a_trajectory_file",
                                    f"{path}: not .jsonl/.json/.traj(.json)/.parquet (data.skip_other_files=true skips such files)")
    else:
        a, b = item[2:]
        for r, row in enumerate(_hf_dataset(str(path)).select(range(a, b))):
            yield f"{path.name}#row{a + r}", row


def _read_parquet(path: Path, a: int, b: int):
    """Rows [a, b) reading only the row groups that hold them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pf, groups, first, start = pq.ParquetFile(path), [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if start < b and start + n > a:
            groups.append(g)
            first = start if first is None else first
        start += n
    table = pf.read_row_groups(groups) if groups else pa.table({})
    for r, row in enumerate(table.slice(a - (first or 0), b - a).to_pylist()):
        yield f"{path.name}#row{a + r}", row


def read_spec(spec: dict) -> Iterator[Tuple[int, str, object]]:
    """(global index, where, raw JSON value or Quarantine) for every record of a shard spec."""
    index = spec["first_index"]
    for item in spec["items"]:
        for where, raw in _read_item(item):
            yield index, where, raw
            index += 1
