"""Read an offline W&B run back from its `run-<id>.wandb` file, for tests.

wandb 0.31 ships no Python reader of its transaction log, so this one follows the format: a
7-byte header (b":W&B", magic 0xBEE1 little-endian, version 0), then records split into
chunks within 32 KiB blocks, each chunk `<crc32 u32><length u16><type u8>` + data (type 1 a
whole record, 2/3/4 its first/middle/last part; the CRC is zlib's over type byte + data), and
each record a `wandb.proto.wandb_internal_pb2.Record`.

    run = read_offline_run(path_to_offline_run_dir)
    run["id"], run["name"], run["config"]["trainer"]["lr"], run["history"][0]["train/reward_mean"]
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
CHUNK = struct.Struct("<IHB")


def records(path: Path) -> list:
    """Every record of a .wandb file, in order; a bad header or checksum raises ValueError."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(path).read_bytes()
    if data[:len(HEADER)] != HEADER:
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, parts, out = len(HEADER), b"", []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, n, kind = CHUNK.unpack_from(data, pos)
        if crc == 0 and n == 0 and kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        body = data[pos + CHUNK.size:pos + CHUNK.size + n]
        if zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad checksum at byte {pos}")
        pos += CHUNK.size + n
        parts = body if kind in (1, 2) else parts + body
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_dir: Path) -> dict:
    """{'id', 'name', 'project', 'config': {...}, 'history': [row, ...], 'summary': {...}} of one
    offline-run-* folder."""
    (log,) = Path(run_dir).glob("run-*.wandb")
    out: dict = {"config": {}, "history": [], "summary": {}}
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(id=rec.run.run_id, name=rec.run.display_name, project=rec.run.project)
            for item in rec.run.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][_key(item)] = json.loads(item.value_json)
    return out
