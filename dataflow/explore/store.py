"""Durable store of exploration results: SQLite in WAL mode, one committed row per evaluated point.

Rows are keyed by (design point, workload, code version). Each result is
committed as soon as it arrives, so a sweep killed at any moment (kill -9
included) loses nothing that was reported as stored, and a rerun skips every
stored key. A store records the code version that wrote it; opening it with
another code version raises unless `allow_other_version` is given, in which
case it is read-only for that version's rows: results of two model versions are
never silently mixed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from codesign.specs import CodesignError

SCHEMA_VERSION = 1


def code_version() -> str:
    """codesign's version plus a hash of the model sources whose output the store caches.

    $CODESIGN_STORE_VERSION overrides it (to pin a version on purpose, e.g. in tests).
    """
    if os.environ.get("CODESIGN_STORE_VERSION"):
        return os.environ["CODESIGN_STORE_VERSION"]
    import codesign
    import codesign.accel_model as am
    import codesign.dataflow as df

    h = hashlib.sha1()
    for pkg in (am, df):
        root = Path(pkg.__file__).parent
        for f in sorted(root.glob("**/*.py")) + sorted(root.glob("**/*.yaml")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return f"{codesign.__version__}+{h.hexdigest()[:12]}"


class ResultStore:
    """Append-only results table. Safe for one writer process plus readers (WAL)."""

    def __init__(self, path: str | Path, version: str | None = None, allow_other_version: bool = False):
        self.path = Path(path)
        self.version = version or code_version()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, point_key TEXT, workload TEXT, "
                "version TEXT, point TEXT, metrics TEXT, created REAL DEFAULT (julianday('now')))"
            )
        except sqlite3.DatabaseError as e:
            raise CodesignError(f"store {self.path}: not a codesign result store ({e})") from None
        meta = dict(self.db.execute("SELECT k, v FROM meta").fetchall())
        if not meta:
            self.db.execute(
                "INSERT INTO meta VALUES ('schema', ?), ('version', ?)", (str(SCHEMA_VERSION), self.version)
            )
            meta = {"schema": str(SCHEMA_VERSION), "version": self.version}
        if meta.get("schema") != str(SCHEMA_VERSION):
            raise CodesignError(
                f"store {self.path}: schema {meta.get('schema')} unsupported (this build: {SCHEMA_VERSION})"
            )
        self.store_version = meta["version"]
        self.read_only = self.store_version != self.version
        if self.read_only and not allow_other_version:
            raise CodesignError(
                f"store {self.path} was written by code version {self.store_version}, this is {self.version}: "
                "results of different model versions are not mixed; use another --store path "
                "(or read it with --allow-other-version)"
            )

    @staticmethod
    def key(point_key: str, workload: str, version: str) -> str:
        return hashlib.sha1(f"{point_key}|{workload}|{version}".encode()).hexdigest()

    def has(self, point_key: str, workload: str) -> bool:
        k = self.key(point_key, workload, self.store_version)
        return self.db.execute("SELECT 1 FROM results WHERE key = ?", (k,)).fetchone() is not None

    def done_keys(self) -> set[tuple[str, str]]:
        rows = self.db.execute(
            "SELECT point_key, workload FROM results WHERE version = ?", (self.store_version,)
        )
        return set(rows.fetchall())

    def put(self, point_key: str, workload: str, point: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Commit one result now (its own transaction: durable before this returns)."""
        if self.read_only:
            raise CodesignError(f"store {self.path} is read-only for code version {self.version}")
        k = self.key(point_key, workload, self.version)
        self.db.execute(
            "INSERT OR IGNORE INTO results (key, point_key, workload, version, point, metrics) VALUES (?,?,?,?,?,?)",
            (k, point_key, workload, self.version, json.dumps(point, sort_keys=True), json.dumps(metrics)),
        )

    def rows(self) -> list[dict[str, Any]]:
        """All results of the store's version: point_key, workload, point, metrics."""
        cur = self.db.execute(
            "SELECT point_key, workload, point, metrics FROM results WHERE version = ? ORDER BY rowid",
            (self.store_version,),
        )
        return [
            {"point_key": pk, "workload": w, "point": json.loads(p), "metrics": json.loads(m)}
            for pk, w, p, m in cur.fetchall()
        ]

    def __len__(self) -> int:
        return self.db.execute(
            "SELECT COUNT(*) FROM results WHERE version = ?", (self.store_version,)
        ).fetchone()[0]

    def export_csv(self, path: str | Path) -> int:
        """Flatten every row (point params + metrics) into CSV; written to a temp file, then renamed."""
        rows = self.rows()
        cols_p = sorted({k for r in rows for k in r["point"]})
        cols_m = sorted({k for r in rows for k in r["metrics"]})
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["point_key", "workload", *cols_p, *cols_m])
            for r in rows:
                w.writerow(
                    [
                        r["point_key"],
                        r["workload"],
                        *(
                            json.dumps(r["point"].get(c))
                            if isinstance(r["point"].get(c), dict | list)
                            else r["point"].get(c)
                            for c in cols_p
                        ),
                        *(r["metrics"].get(c) for c in cols_m),
                    ]
                )
        tmp.replace(path)
        return len(rows)

    def close(self) -> None:
        self.db.close()


def iter_missing(store: ResultStore, items: Iterable[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """The (point_key, workload, payload) items not yet stored."""
    done = store.done_keys()
    return [it for it in items if (it[0], it[1]) not in done]
