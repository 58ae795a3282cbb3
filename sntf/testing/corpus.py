"""A corpus of real graphs as the pass received them, and their replay.

Each entry is one call of the graph pass captured inside TensorFlow: the
serialized GraphDef Grappler handed over, its fetch and preserve lists, the
static output properties the C API gave for every node, and what the pass
read from the process around it (the batch Keras fed, the device
allocator's bytes in use, the device's memory, the intra-op thread count,
whether oneDNN's rewrites run). Replaying an entry runs the pass again on
exactly those inputs, with no TensorFlow runtime, so the rewritten GraphDef
and the plan can be compared byte for byte with a recording.

The corpus guards refactorings: `tests/corpus/expected.json` holds, for
every entry and configuration, the SHA-256 of the rewritten graph and of the
plan. A change that means to alter plans re-records it
(`python benchmarks/corpus.py --expect`) and the diff shows which plans
moved.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import json
import os
from typing import Any, Iterator, Optional

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Entry:
    """One captured call of the pass.

    Attributes:
      name: unique within the corpus ("family-resnet", "fuzz-s1-17").
      graph: the serialized GraphDef.
      fetch, preserve: as Grappler handed them over.
      properties: node name -> serialized OpInfo.TensorProperties per output.
      runtime_batch: the batch Keras' fit() was feeding, or None.
      in_use_bytes: the device allocator's bytes in use, or None.
      device_memory_bytes: the device's memory (budget fractions resolve
        against it).
      threads: intra-op threads (the convolution scratch model reads it).
      onednn: whether oneDNN's graph rewrites were on.
      configs: the configurations the entry is replayed under (see Config).
    """

    name: str
    graph: bytes
    fetch: tuple
    preserve: tuple
    properties: dict
    runtime_batch: Optional[int]
    in_use_bytes: Optional[int]
    device_memory_bytes: int
    threads: int
    onednn: bool
    configs: tuple = ()


def config(policy: str, budget: Any = None, **options: Any) -> dict:
    """A replay configuration: what sntf.enable would be called with."""
    return {"policy": policy, "budget": budget, "options": dict(sorted(options.items()))}


def config_key(cfg: dict) -> str:
    """A stable text key of a configuration."""
    return json.dumps(cfg, sort_keys=True)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def save(entry: Entry, folder: str) -> str:
    """Writes an entry to `folder`/<name>.json.gz; returns the path."""
    doc = {
        "format": FORMAT, "name": entry.name, "graph": _b64(entry.graph),
        "fetch": list(entry.fetch), "preserve": list(entry.preserve),
        "properties": {k: [_b64(v) for v in outs]
                       for k, outs in sorted(entry.properties.items())},
        "runtime_batch": entry.runtime_batch, "in_use_bytes": entry.in_use_bytes,
        "device_memory_bytes": entry.device_memory_bytes, "threads": entry.threads,
        "onednn": entry.onednn, "configs": list(entry.configs),
    }
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, entry.name + ".json.gz")
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(doc, f, separators=(",", ":"))
    return path


def load(path: str) -> Entry:
    """Reads an entry written by save."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: corpus format {doc.get('format')!r}, expected {FORMAT}")
    return Entry(
        name=doc["name"], graph=base64.b64decode(doc["graph"]),
        fetch=tuple(doc["fetch"]), preserve=tuple(doc["preserve"]),
        properties={k: [base64.b64decode(v) for v in outs]
                    for k, outs in doc["properties"].items()},
        runtime_batch=doc["runtime_batch"], in_use_bytes=doc["in_use_bytes"],
        device_memory_bytes=doc["device_memory_bytes"], threads=doc["threads"],
        onednn=doc["onednn"], configs=tuple(doc["configs"]))


def entries(folder: str) -> Iterator[Entry]:
    """Every entry of a corpus folder, by name."""
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json.gz"):
            yield load(os.path.join(folder, name))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Report fields that vary from run to run (wall times, tracebacks' paths).
_VOLATILE = ("pass_seconds", "stage_seconds", "error")


def _plain(value):
    """A report value as JSON-able plain data."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def outcome(report: dict, graph_def) -> dict:
    """What a replay is compared by: digests of the rewritten graph, the
    plan (its KEEP decisions aside: they record why a tensor stays and
    change nothing) and the rest of the report, with a few fields in clear
    for a reader of a mismatch."""
    report = dict(report)
    plan = _plain(report.pop("plan", None))
    if plan is not None:
        plan["decisions"] = [d for d in plan["decisions"] if d["action"] != "keep"]
    for key in _VOLATILE:
        report.pop(key, None)
    graph = (None if graph_def is None
             else digest(graph_def.SerializeToString(deterministic=True)))
    return {
        "graph": graph,
        "plan": digest(json.dumps(plan, sort_keys=True).encode()),
        "report": digest(json.dumps(_plain(report), sort_keys=True).encode()),
        "action": report.get("action"),
        "predicted_peak_bytes": report.get("predicted_peak_bytes"),
        "planned_peak_bytes": report.get("planned_peak_bytes"),
        "swapped": len(report.get("swapped") or ()),
        "recomputed": len(report.get("recomputed") or ()),
        "reason": (report.get("reason") or "")[:300],
    }


def _budget(value):
    """A recorded budget as the pass received it: recorded budgets passed
    the validation of their day, which may since have tightened."""
    from sntf import config as sntf_config

    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return sntf_config.Budget(bytes=value)
    if isinstance(value, float):
        return sntf_config.Budget(fraction=value)
    return sntf_config.parse_budget(value)


def replay(entry: Entry, cfg: dict) -> dict:
    """Runs the pass on an entry under a configuration; returns its outcome."""
    result = run(entry, cfg)
    return outcome(result.report, result.graph_def)


def run(entry: Entry, cfg: dict) -> "passes.PassResult":
    """The pass's result on an entry under a configuration.

    The pass is given the entry's captured surroundings (batch, allocator
    bytes in use, device memory, threads, oneDNN) instead of this process's.

    Args:
      entry: a corpus entry (load).
      cfg: a configuration: policy, budget and options (see Config).

    Returns:
      The sntf.passes.PassResult, report and graph.
    """
    from sntf import config as sntf_config
    from sntf import passes

    state = sntf_config.State(
        enabled=True, policy=sntf_config.parse_policy(cfg["policy"]),
        budget=_budget(cfg["budget"]),
        options=sntf_config.parse_options(cfg["options"]))
    props = entry.properties

    def properties(node_names):
        return {n: props[n] for n in node_names if n in props}

    env = passes.Environment(
        threads=entry.threads, onednn=entry.onednn, runtime_batch=entry.runtime_batch,
        device_memory=lambda device: entry.device_memory_bytes,
        in_use=lambda device: entry.in_use_bytes)
    return passes.run_pass(entry.graph, entry.fetch, entry.preserve, state,
                           properties, env, defer=False)
