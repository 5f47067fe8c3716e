"""Checkpoints: safetensors files plus JSON, written atomically, verified on load.

A checkpoint is a directory ``<root>/step_<8-digit step>/`` holding

* one ``<stem>.safetensors`` file per entry of ``tensors`` (e.g. ``model``, ``optim``),
* ``state.json``: the caller's JSON metadata (step, RNG seeds, loss scaler, data position, ...),
* ``manifest.json``: format version, step, and for every other file its size and SHA-256 -- and for a
  safetensors file the SHA-256 of each tensor entry (``entries``), so that a reader can verify exactly the
  tensors it reads (:mod:`shardwise.train.ckpt_digests`; checkpoints written before have none, and are
  verified file by file).

Nothing is ever unpickled: tensors are read with safetensors and everything else is JSON.

Atomicity follows the classic POSIX recipe (write to a temporary name, ``fsync`` the data,
``rename`` into place, ``fsync`` the directory; see rename(2) and the discussion of durable
renames in Pillai et al., "All File Systems Are Not Created Equal", OSDI 2014). The manifest is
written last, so a directory without a complete, matching manifest is never a valid checkpoint,
and ``verify_checkpoint`` detects truncated, missing or altered files by size and hash. What needs no read of
the tensors -- the manifest, every listed file present with its recorded size, ``state.json`` -- is checked
by :func:`verify_structure`: the launcher's check before a resume (:mod:`shardwise.run_dir`), where the ranks
then verify the bytes each reads (:mod:`shardwise.train.resume`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shardwise.train.ckpt_digests import file_sha256, safetensors_sha256

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "verify_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "latest_valid_checkpoint",
    "set_aside",
    "verify_structure",
    "manifest_digest",
]

FORMAT_NAME = "shardwise.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
TMP_PREFIX = ".tmp-"
CORRUPT_SUFFIX = ".corrupt"
"""A checkpoint that failed verification is renamed ``step_<N>.corrupt`` and kept: never resumed from,
overwritten by a later save of that step, or pruned (:func:`set_aside`)."""
# Temporary directories of dead processes are removed only once they are this old, so that a
# writer on another host sharing the file system (whose pid we cannot see) is left alone.
STALE_TMP_AGE_S = 3600.0

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_DIR = re.compile(r"^\.tmp-step_\d{8,}-(\d+)-[0-9a-f]+$")
_STEM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the checkpoint and file."""


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint for ``step`` (``step_00000100``)."""
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------- saving


def save_checkpoint(
    root: Path,
    step: int,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    meta: Mapping[str, Any],
    keep: int,
) -> Path:
    """Atomically write checkpoint ``step`` under ``root`` and prune to the newest ``keep``.

    ``tensors`` maps a file stem (``"model"``, ``"optim"``) to a flat ``{name: tensor}`` dict;
    tensors are detached, moved to CPU and made contiguous, and tensors that share storage
    (tied embeddings) are cloned so each is stored once per name. ``meta`` must be JSON
    serialisable. All inputs are validated before anything is written; a failure while writing
    removes the temporary directory and leaves existing checkpoints untouched.

    Re-saving an existing step replaces it: the old directory is renamed aside, the new one
    renamed into place, then the old one deleted. A crash between those two renames loses that
    one step (older checkpoints remain and ``latest_valid_checkpoint`` falls back to them).

    Returns the path of the new checkpoint directory.
    """
    root = Path(root)
    _check_save_args(step, tensors, keep)
    state_text = _meta_text(meta, step)
    tmp = begin_checkpoint(root, step)
    try:
        files: dict[str, dict[str, Any]] = {}
        for stem, flat in tensors.items():
            files.update(write_tensor_file(tmp, stem, flat))
        return finish_checkpoint(root, step, tmp, files, state_text, keep)
    except BaseException:
        abandon_checkpoint(tmp)
        raise


# Several writers (every rank writes its own shard file, see ``shardwise.train.sharded``) use the three
# steps directly: one process begins, every writer writes into the temporary directory, one finishes.


def begin_checkpoint(root: Path, step: int) -> Path:
    """Create and return the temporary directory a checkpoint of ``step`` is written into."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return _new_tmp_dir(root, step)


def write_tensor_file(directory: Path, stem: str, flat: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Write ``flat`` as ``<stem>.safetensors`` into ``directory`` (fsynced); returns its manifest entry."""
    _check_save_args(0, {stem: flat}, 1)
    name = f"{stem}.safetensors"
    path = Path(directory) / name
    try:
        save_file(_prepare_tensors(flat), str(path), metadata={"format": "pt"})
        return {name: _fsync_and_describe(path, entries=True)}
    except (OSError, SafetensorError) as e:  # a full disk: safetensors' message does not name the file
        raise CheckpointError(f"cannot write {path}: {_reason(e)}") from e


def _reason(e: BaseException) -> str:
    return (getattr(e, "strerror", None) or str(e)).strip().splitlines()[0]


def finish_checkpoint(root: Path, step: int, tmp: Path, files: Mapping[str, dict[str, Any]],
                      meta: Mapping[str, Any] | str, keep: int) -> Path:
    """Write ``state.json`` and the manifest (last), rename ``tmp`` into place, prune to ``keep``."""
    root = Path(root)
    state_text = meta if isinstance(meta, str) else _meta_text(meta, step)
    files = dict(files)
    _write_text(tmp / STATE, state_text)
    files[STATE] = _fsync_and_describe(tmp / STATE)
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step, "files": files}
    _write_text(tmp / MANIFEST, json.dumps(manifest, indent=2))
    _fsync_path(tmp / MANIFEST)
    _fsync_dir(tmp)
    final = root / step_dir_name(step)
    _move_into_place(tmp, final, root, step)
    _fsync_dir(root)
    _prune(root, keep, final)
    return final


def abandon_checkpoint(tmp: Path) -> None:
    """Remove a temporary checkpoint directory after a failed write (existing checkpoints are untouched)."""
    shutil.rmtree(tmp, ignore_errors=True)


def _meta_text(meta: Mapping[str, Any], step: int) -> str:
    try:
        return json.dumps(dict(meta), indent=2, sort_keys=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta for step {step} is not JSON-serialisable: {e}") from e


def _check_save_args(step: int, tensors: Mapping, keep: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"checkpoint keep must be an int >= 1, got {keep!r}")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"checkpoint tensors must be a dict of file stem -> {{name: tensor}}, got {type(tensors)}")
    for stem, flat in tensors.items():
        if not isinstance(stem, str) or not _STEM.match(stem):
            raise ValueError(
                f"checkpoint file stem {stem!r} is not a plain file name; use letters, digits, '_', '.', '-'"
            )
        if not isinstance(flat, Mapping):
            raise TypeError(f"checkpoint tensors[{stem!r}] must be a dict of name -> tensor, got {type(flat)}")
        for name, t in flat.items():
            if not isinstance(name, str):
                raise TypeError(f"checkpoint tensors[{stem!r}] has a non-string key {name!r}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"checkpoint tensors[{stem!r}][{name!r}] is a {type(t).__name__}, not a tensor")
            if t.is_sparse or t.layout != torch.strided:
                raise TypeError(f"checkpoint tensors[{stem!r}][{name!r}] has layout {t.layout}; only dense tensors")


def _prepare_tensors(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detach, move to CPU, make contiguous; clone any tensor whose storage was already seen."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in flat.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr != 0:  # empty tensors have no storage to share
            if ptr in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _new_tmp_dir(root: Path, step: int) -> Path:
    path = root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _move_into_place(tmp: Path, final: Path, root: Path, step: int) -> None:
    if not final.exists():
        os.rename(tmp, final)
        return
    old = root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int, just_written: Path) -> None:
    """Delete the oldest step directories beyond ``keep`` and stale temporary directories."""
    candidates = [p for p in list_checkpoints(root) if p.name != just_written.name]
    excess = len(candidates) + 1 - keep
    for victim in candidates[: max(0, excess)]:
        _remove_dir_atomically(root, victim)
    for entry in root.iterdir():
        if _is_stale_tmp(entry):
            shutil.rmtree(entry, ignore_errors=True)


def _remove_dir_atomically(root: Path, victim: Path) -> None:
    """Rename first so a crash mid-delete never leaves a half-deleted ``step_*`` directory."""
    m = _STEP_DIR.match(victim.name)
    grave = root / f"{TMP_PREFIX}step_{m.group(1) if m else '0' * 8}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(victim, grave)
    except FileNotFoundError:
        return  # another writer removed it already
    shutil.rmtree(grave, ignore_errors=True)


def _is_stale_tmp(entry: Path) -> bool:
    m = _TMP_DIR.match(entry.name)
    if m is None or not entry.is_dir():
        return False
    pid = int(m.group(1))
    if pid == os.getpid():
        return True  # saves are synchronous: any of ours left over is from a failed earlier save
    try:
        age = time.time() - entry.stat().st_mtime
    except FileNotFoundError:
        return False
    return age > STALE_TMP_AGE_S and not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _write_text(path: Path, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: the write's error names no file
        raise CheckpointError(f"cannot write {path}: {_reason(e)}") from e


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_path(path)
    except OSError:
        pass  # some platforms/file systems cannot fsync a directory


def _fsync_and_describe(path: Path, entries: bool = False) -> dict[str, Any]:
    """fsync ``path`` and return its manifest entry ``{"size": bytes, "sha256": hex}``, with ``entries`` (a
    safetensors file) also ``"entries": {tensor name: SHA-256 of its bytes}`` -- from the same one read."""
    _fsync_path(path)
    if entries:
        size, digest, per_entry = safetensors_sha256(path)
        return {"size": size, "sha256": digest, "entries": per_entry}
    size, digest = file_sha256(path)
    return {"size": size, "sha256": digest}


# ----------------------------------------------------------------------------- reading


def _manifest_bytes(path: Path) -> bytes:
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (incomplete write or not a checkpoint)")
    try:
        return mpath.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {e}") from e


def _read_manifest(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """The manifest of ``path`` (from ``data``, its bytes, when given), checked for form."""
    if data is None:
        data = _manifest_bytes(path)
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT_NAME} manifest")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} has format version {version!r}; this shardwise reads up to {FORMAT_VERSION}"
        )
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lacks an integer 'step' or a 'files' table")
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} says step {step}, directory name says {int(m.group(1))}")
    if STATE not in files:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {STATE}")
    for name, entry in files.items():
        if not isinstance(name, str) or not _STEM.match(name) or name == MANIFEST:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists an invalid file name {name!r}")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
            or not _SHA256.match(entry["sha256"])
        ):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} entry for {name} lacks a valid size and sha256")
        digests = entry.get("entries", {})
        if not isinstance(digests, dict) or not all(isinstance(k, str) and isinstance(v, str) and _SHA256.match(v)
                                                    for k, v in digests.items()):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} entry for {name} has invalid tensor digests")
    return manifest


def verify_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` unless every file in the manifest is present and intact.

    Checks, per file listed in ``manifest.json``: it exists, its size matches (catching
    truncation cheaply), and its SHA-256 matches (catching any altered byte).
    """
    path = Path(path)
    manifest = verify_structure(path)
    for name in manifest["files"]:
        if name != STATE:  # verified with the structure
            verify_file(path, name, manifest)


def verify_structure(path: Path) -> dict[str, Any]:
    """What a checkpoint is checked for without reading its tensor files: a valid manifest, every listed file
    present with its recorded size, and ``state.json`` intact (its SHA-256: it is small). Returns the manifest;
    raises :class:`CheckpointError` naming the checkpoint and file."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, entry in manifest["files"].items():
        fpath = path / name
        if not fpath.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        size = fpath.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than recorded"
            raise CheckpointError(f"checkpoint {path}: file {name} is {what} ({size} bytes, expected {entry['size']})")
    verify_file(path, STATE, manifest)
    return manifest


def verify_file(path: Path, name: str, manifest: dict[str, Any]) -> int:
    """Raise :class:`CheckpointError` unless the file ``name`` of checkpoint ``path`` has the SHA-256 its
    ``manifest`` records; returns the bytes read."""
    size, digest = file_sha256(Path(path) / name)
    expected = manifest["files"][name]["sha256"]
    if digest != expected:
        raise CheckpointError(
            f"checkpoint {path}: file {name} is corrupt (sha256 {digest[:12]}..., expected {expected[:12]}...)"
        )
    return size


def manifest_digest(path: Path) -> tuple[dict[str, Any], str, int]:
    """``(manifest, SHA-256 of manifest.json, its size)`` of a checkpoint whose manifest is valid, read once: two
    ranks that see the same digest see the same checkpoint (the manifest holds the digest of every file)."""
    path = Path(path)
    data = _manifest_bytes(path)
    return _read_manifest(path, data), hashlib.sha256(data).hexdigest(), len(data)


def verified_state(path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``(state.json as a dict, its size)``, read once and checked against the SHA-256 ``manifest`` records."""
    path = Path(path)
    try:
        data = (path / STATE).read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: file {STATE} is unreadable: {e}") from e
    digest, expected = hashlib.sha256(data).hexdigest(), manifest["files"][STATE]["sha256"]
    if digest != expected:
        raise CheckpointError(
            f"checkpoint {path}: file {STATE} is corrupt (sha256 {digest[:12]}..., expected {expected[:12]}...)")
    return read_state(path, data), len(data)


def read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's manifest, checked for form: ``files`` maps plain names inside the checkpoint directory to
    their size, SHA-256 and (safetensors files) tensor digests."""
    return _read_manifest(Path(path))


def read_state(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """``state.json`` of a checkpoint (already verified; from ``data``, its bytes, when given), as a dict."""
    path = Path(path)
    try:
        meta = json.loads((path / STATE).read_bytes() if data is None else data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: file {STATE} is unreadable: {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: file {STATE} does not hold a JSON object")
    return meta


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu"
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Verify, then load a checkpoint: returns ``({stem: {name: tensor}}, meta)``.

    Tensors are read with ``safetensors.torch.load_file`` onto ``map_location``; ``meta`` is
    ``state.json`` parsed as JSON. No pickle is involved.
    """
    path = Path(path)
    verify_checkpoint(path)
    manifest = _read_manifest(path)
    device = str(map_location) if isinstance(map_location, torch.device) else map_location
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(manifest["files"]):
        if name.endswith(".safetensors"):
            try:
                tensors[name[: -len(".safetensors")]] = load_file(str(path / name), device=device)
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"checkpoint {path}: file {name} cannot be read by safetensors: {e}") from e
    return tensors, read_state(path)


def list_checkpoints(root: Path) -> list[Path]:
    """Step directories under ``root``, oldest (lowest step) first; temporary dirs are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return [p for _, p in sorted(found)]


def latest_valid_checkpoint(root: Path, warn: Callable[[str], Any] = print, keep_aside: bool = False,
                            check: Callable[[Path], Any] = verify_checkpoint) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (``check``: every file's hash by default;
    :func:`verify_structure` reads no tensor file), or None.

    Each newer checkpoint that fails verification is reported through ``warn`` with one line
    naming the checkpoint, the file and what is wrong, and skipped; with ``keep_aside`` it is also
    renamed aside (:func:`set_aside`), so that a run going on from an older one cannot overwrite it.
    """
    for path in reversed(list_checkpoints(root)):
        try:
            check(path)
        except CheckpointError as e:
            why = str(e)
            if keep_aside:
                try:
                    why += f"; kept as {set_aside(path).name}"
                except OSError:
                    pass  # another process of the run set it aside first
            warn(f"skipping invalid checkpoint: {why}")
            continue
        return path
    return None


def set_aside(path: Path) -> Path:
    """Rename the checkpoint directory ``path`` to ``<name>.corrupt`` (``.corrupt-2``, ... if taken), out of
    the names :func:`list_checkpoints` and pruning see; returns the new path. The evidence of a corruption is
    kept, never overwritten by a later save of the same step or deleted."""
    path = Path(path)
    target, n = path.with_name(path.name + CORRUPT_SUFFIX), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{n}")
    os.rename(path, target)
    return target
