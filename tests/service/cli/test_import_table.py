"""transformers' lazy-import table from the user's cache (:mod:`service.cli.import_table`): the same table
as transformers' own scan, read back in a later process without parsing the sources, and rebuilt whenever the
files it came from change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import import_table as cache

# A fresh interpreter: the watch installed before transformers is imported, then its models table as the package
# holds it, and what the wrapped scan did.
_PROBE = """
import json, sys
from service.cli import import_table as cache
installed = cache.install()
import transformers, transformers.models
from transformers.utils import import_utils
scan = import_utils.create_import_structure_from_path
from transformers.models.llama import LlamaConfig  # the lazy package still finds its objects
folder = transformers.models.__path__[0]
table = scan(folder)
print(json.dumps({
    "installed": installed,
    "wrapped": type(scan).__name__,
    "scanned": getattr(scan, "scanned", None),
    "read_back": getattr(scan, "read_back", None),
    "table": sorted(json.dumps(e, sort_keys=True) for e in cache._encode(table)),
    "llama": LlamaConfig.__name__,
}))
"""

# transformers' own table, in an interpreter that does not install the watch.
_REFERENCE = """
import json
import transformers.models
from transformers.utils import import_utils
from service.cli import import_table as cache
folder = transformers.models.__path__[0]
table = import_utils.create_import_structure_from_path.__wrapped__(folder)
print(json.dumps(sorted(json.dumps(e, sort_keys=True) for e in cache._encode(table))))
"""


def _run(code: str, tmp_path: Path, **env: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "LOADMASTER_IMPORT_CACHE_DIR": str(tmp_path / "cache"), **env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_later_process_reads_the_same_table_back_without_scanning(tmp_path: Path) -> None:
    reference = _run(_REFERENCE, tmp_path)
    first = _run(_PROBE, tmp_path)
    assert first["installed"] and first["wrapped"] == "CachedScan" and first["llama"] == "LlamaConfig"
    # one walk of the models folder for both of transformers' asks (not two: its own cache holds 128 folders)
    assert first["read_back"] == 0 and 500 < first["scanned"] < 2 * 500
    assert first["table"] == reference
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    second = _run(_PROBE, tmp_path)
    assert second["scanned"] == 0 and second["read_back"] == 1
    assert second["table"] == reference


def test_turned_off_transformers_scans_as_it_does(tmp_path: Path) -> None:
    off = _run(_PROBE, tmp_path, LOADMASTER_IMPORT_CACHE="0")
    assert not off["installed"] and off["wrapped"] != "CachedScan"
    assert not (tmp_path / "cache").exists()


def _package(root: Path) -> Path:
    """A small folder in transformers' layout: modules with ``__all__``, one with ``@requires``, a sub-folder."""
    (root / "alpha").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "alpha" / "__init__.py").write_text("")
    (root / "alpha" / "configuration_alpha.py").write_text('class AlphaConfig: ...\n\n__all__ = ["AlphaConfig"]\n')
    (root / "alpha" / "modeling_alpha.py").write_text(
        'class AlphaModel: ...\nclass AlphaForX: ...\n\n__all__ = [\n    "AlphaModel",\n    "AlphaForX",\n]\n'
    )
    (root / "beta.py").write_text(
        '@requires(backends=("tokenizers",))\nclass BetaTokenizer:\n    pass\n\n__all__ = ["BetaTokenizer"]\n'
    )
    return root


@pytest.fixture
def scan():
    """transformers' scan, its own per-folder cache emptied first (so a changed file is read again)."""
    from transformers.utils import import_utils

    own = import_utils.create_import_structure_from_path

    def fresh(path):
        own.cache_clear()
        return own.__wrapped__(path)

    return fresh


def test_the_table_round_trips_and_changes_with_the_files(tmp_path: Path, monkeypatch, scan) -> None:
    monkeypatch.setenv("LOADMASTER_IMPORT_CACHE_DIR", str(tmp_path / "cache"))
    folder = _package(tmp_path / "pkg")
    truth = scan(str(folder))
    assert frozenset({"tokenizers"}) in truth and "alpha" in truth  # both kinds of entry are exercised

    first = cache.CachedScan(scan, None)
    assert first(folder) == truth and first.scanned >= 1
    assert first(folder / "__init__.py") is first(str(folder))  # a file stands for its folder; kept in memory

    again = cache.CachedScan(scan, None)
    assert again(str(folder)) == truth and (again.scanned, again.read_back) == (0, 1)

    (folder / "alpha" / "modeling_alpha.py").write_text('class AlphaModel: ...\n\n__all__ = ["AlphaModel"]\n')
    changed = cache.CachedScan(scan, None)
    got = changed(str(folder))
    assert changed.read_back == 0 and got == scan(str(folder)) and got != truth

    (stored,) = (tmp_path / "cache").glob("*.json")
    stored.write_text("{broken")
    broken = cache.CachedScan(scan, None)
    assert broken(str(folder)) == got and broken.read_back == 0
    assert cache.CachedScan(scan, None)(str(folder)) == got  # written back whole


def test_a_table_of_unknown_shape_is_returned_but_not_cached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOADMASTER_IMPORT_CACHE_DIR", str(tmp_path / "cache"))
    folder = _package(tmp_path / "pkg")
    odd = {"alpha": {frozenset(): {"configuration_alpha": ["AlphaConfig"]}}}  # a list where a set belongs
    wrapped = cache.CachedScan(lambda _path: odd, None)
    assert wrapped(str(folder)) is odd
    assert not list((tmp_path / "cache").glob("*.json"))


def test_an_unwritable_cache_only_means_scanning(tmp_path: Path, monkeypatch, scan) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("LOADMASTER_IMPORT_CACHE_DIR", str(blocked / "cache"))
    folder = _package(tmp_path / "pkg")
    assert cache.CachedScan(scan, None)(str(folder)) == scan(str(folder))


def test_install_does_nothing_once_transformers_is_imported() -> None:
    import transformers  # noqa: F401  (this test process imports it anyway)

    assert not cache.install()
    assert not any(isinstance(f, cache._ScanWatcher) for f in sys.meta_path)
