"""The object-storage mirror of a run's checkpoints (--checkpoint_mirror), through fsspec.

The mirror holds the run directory's layout under its URL: `<url>/checkpoints/step-N/...`.
A checkpoint is uploaded file by file with `COMPLETE` last, so a copy cut short (a crash, a
lost connection) has no marker and is never resumed from, as in the run directory. Rank 0
uploads in a background thread (`BackgroundMirror`): training does not wait for a copy, the
end of training waits for the last one. A failed upload is a warning with its reason, and
is tried again after the next checkpoint: losing the mirror never stops training. A URL
that cannot be listed or written at startup is a ConfigError before anything trains.

s3:// needs s3fs and gs:// gcsfs (the `cloud` extra); file:// and memory:// need nothing.
"""

import json
import queue
import threading
import time
from pathlib import Path

from swiftlm.checkpoint import blocks
from swiftlm.checkpoint.folders import COMPLETE, list_checkpoints, step_of
from swiftlm.errors import ConfigError

CLOUD_EXTRA = "pip install 'swiftlm[cloud]' (s3fs, for s3://) or pip install gcsfs (gs://)"
MIRROR_FLAG = "--checkpoint_mirror"
CHECKPOINTS = "checkpoints"


def is_url(spec: str | None) -> bool:
    return bool(spec) and "://" in spec


def parse_options(options: str | None) -> dict:
    """--checkpoint_mirror_options: a JSON object of fsspec storage options."""
    if not options:
        return {}
    value = json.loads(options)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


class Mirror:
    """Checkpoints under an fsspec URL: list, upload, download, prune."""

    def __init__(self, url: str, options: dict | None = None):
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(options or {}))
        except ImportError as exc:  # fsspec names the missing package (s3fs, gcsfs)
            raise ConfigError(f"{MIRROR_FLAG} {url}: {exc}; install it with {CLOUD_EXTRA}") from exc
        except (ValueError, TypeError) as exc:  # an unknown protocol or option
            raise ConfigError(
                f"{MIRROR_FLAG} {url}: {exc}; pass an fsspec URL (s3://bucket/prefix, "
                "gs://bucket/prefix, file:///path) and options its filesystem takes"
            ) from exc
        self.root = root.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def remote(self, step: int) -> str:
        return f"{self.root}/{CHECKPOINTS}/step-{step}"

    def url_of(self, step: int) -> str:
        return f"{self.url}/{CHECKPOINTS}/step-{step}"

    def probe(self, rank: int) -> None:
        """Write, read back and delete a small file: the URL is reachable and writable."""
        probe = f"{self.root}/.swiftlm-probe-rank{rank}"
        try:
            if "file" in _protocols(self.fs):  # object stores have no folders to make
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"swiftlm")
            read = self.fs.cat_file(probe)
            self.fs.rm_file(probe)
            self.steps()
        except Exception as exc:  # any backend's error: the reason goes to the user
            raise ConfigError(
                f"{MIRROR_FLAG} {self.url} cannot be written ({type(exc).__name__}: {exc}); "
                "check the bucket exists, the credentials (AWS_ACCESS_KEY_ID/... or the "
                "store's own) and the endpoint (--checkpoint_mirror_options '{\"endpoint_url\": "
                '"http://host:port"}\' or AWS_ENDPOINT_URL)'
            ) from exc
        if read != b"swiftlm":
            raise ConfigError(f"{MIRROR_FLAG} {self.url}: a file written there read back wrong")

    def steps(self) -> tuple[list[int], list[int]]:
        """(complete, incomplete) checkpoint steps on the mirror, oldest first."""
        self.fs.invalidate_cache()  # another process may have written since the last listing
        try:
            entries = self.fs.ls(f"{self.root}/{CHECKPOINTS}", detail=False)
        except FileNotFoundError:
            return [], []
        steps = sorted(
            int(name[5:])
            for name in (entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)
            if name.startswith("step-") and name[5:].isdigit()
        )
        complete = [s for s in steps if self.fs.exists(f"{self.remote(s)}/{COMPLETE}")]
        return complete, [s for s in steps if s not in complete]

    def upload(self, folder: Path) -> None:
        """Copy a complete checkpoint folder; `COMPLETE` goes last. A copy left over from an
        earlier, interrupted upload of the same step is removed first. A block-format
        checkpoint (`blocks.py`) takes its blocks along; a block the mirror has already (same
        name, same bytes) is not copied again."""
        target = self.remote(step_of(folder))
        self.remove(step_of(folder))
        base = folder.parent  # paths relative to it keep the layout: step-N/..., blocks/...
        files = [p for p in blocks.checkpoint_files(folder) if p.name != COMPLETE]
        made = set()
        for file in files:
            relative = file.relative_to(base).as_posix()
            remote = f"{self.root}/{CHECKPOINTS}/{relative}"
            if relative.startswith(f"{blocks.STORE}/") and self.fs.exists(remote):
                continue
            parent = remote.rsplit("/", 1)[0]
            if parent not in made:
                self.fs.makedirs(parent, exist_ok=True)
                made.add(parent)
            self.fs.put_file(str(file), remote)
            pause_for_tests("SWIFTLM_TEST_MIRROR_PAUSE", step_of(folder))
        self.fs.pipe_file(f"{target}/{COMPLETE}", (folder / COMPLETE).read_bytes())

    def download(self, step: int, run_dir: Path) -> Path:
        """Copy a mirrored checkpoint into `run_dir/checkpoints/step-N` (and the blocks it
        needs into the run's block store) through a staging folder renamed at the end,
        `COMPLETE` written last."""
        folder = run_dir / CHECKPOINTS / f"step-{step}"
        staging = folder.with_name(folder.name + ".download")
        source = self.remote(step)
        for path in (staging, folder):
            _remove_local(path)
        for remote in sorted(self.fs.find(source)):
            relative = remote[len(source) :].lstrip("/")
            if relative != COMPLETE:
                self._get(remote, staging / relative)
        store = blocks.store_of(folder)
        for digest in sorted(blocks.referenced_blocks(staging)):
            local = blocks.block_path(store, digest)
            if not local.is_file():
                self._get(self._remote_block(local, store), local)
        staging.rename(folder)
        (folder / COMPLETE).write_bytes(self.fs.cat_file(f"{source}/{COMPLETE}"))
        return folder

    def _get(self, remote: str, local: Path) -> None:
        """Download one file atomically (a partial file is never left under its name)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(local.name + ".part")
        self.fs.get_file(remote, str(partial))
        partial.rename(local)

    def _remote_block(self, local: Path, store: Path) -> str:
        return f"{self.root}/{CHECKPOINTS}/{blocks.STORE}/{local.relative_to(store).as_posix()}"

    def remove(self, step: int) -> None:
        if self.fs.exists(self.remote(step)):
            self.fs.rm(self.remote(step), recursive=True)

    def prune(self, keep: int | None, protect: int | None = None) -> list[int]:
        """The mirror's own --save_total_limit, as `folders.prune_checkpoints`: the oldest
        complete checkpoints beyond `keep` (never the newest, nor `protect`, the best), and
        incomplete copies older than the newest complete one."""
        complete, incomplete = self.steps()
        removed = []
        if keep is not None and complete:
            rotating = [s for s in complete if s != protect]
            removed += rotating[: -max(keep, 1)]
        if complete:
            removed += [s for s in incomplete if s < complete[-1]]
        for step in removed:
            self.remove(step)
        if removed:
            self._collect_garbage()
        return removed

    def _collect_garbage(self) -> None:
        """Delete the mirror's blocks that no checkpoint there references any more."""
        store = f"{self.root}/{CHECKPOINTS}/{blocks.STORE}"
        if not self.fs.exists(store):
            return
        kept = set()
        for step in sum(self.steps(), []):
            manifest = f"{self.remote(step)}/{blocks.MANIFEST}"
            if self.fs.exists(manifest):
                kept |= _digests(json.loads(self.fs.cat_file(manifest)))
        for remote in self.fs.find(store):
            if remote.rsplit("/", 1)[-1].removesuffix(".bin") not in kept:
                self.fs.rm_file(remote)


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _digests(manifest: dict) -> set[str]:
    """The blocks a manifest references (as `blocks.referenced_blocks`, from its text)."""
    return {digest for layout in manifest["groups"].values() for digest, _ in layout["blocks"]}


def _remove_local(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)


def pause_for_tests(variable: str, step: int) -> None:
    """A test hook: `<variable>=STEP:SECONDS` sleeps while checkpoint STEP is half written,
    so that a test can kill the process there (tests/*/test_torn_checkpoint*.py)."""
    import os

    value = os.environ.get(variable, "")
    if value and value.split(":")[0] == str(step):
        time.sleep(float(value.split(":")[1]))


class BackgroundMirror:
    """Rank 0's uploader thread: after each checkpoint, every complete checkpoint of the
    run directory that the mirror lacks is copied, then the mirror is pruned."""

    def __init__(self, mirror: Mirror, run_dir: Path, keep: int | None, log):
        self.mirror, self.run_dir, self.keep, self.log = mirror, run_dir, keep, log
        self.requests: queue.Queue = queue.Queue()
        # A daemon: a crashed run exits without waiting; a copy cut short has no COMPLETE.
        self.thread = threading.Thread(target=self._serve, name="checkpoint-mirror", daemon=True)
        self.thread.start()

    def notify(self, protect: int | None = None) -> None:
        """A checkpoint was saved: copy what is complete (without waiting)."""
        self.requests.put(protect)

    def finish(self, newest: Path | None, wait_s: float = 600.0) -> None:
        """End of training: wait until `newest` (a background save may still be writing it)
        is complete, copy it, and stop the thread."""
        deadline = time.monotonic() + wait_s
        while newest is not None and newest.is_dir() and not (newest / COMPLETE).is_file():
            if time.monotonic() > deadline:
                self.log(f"warning: {newest} is still incomplete; the mirror does not get it")
                break
            time.sleep(0.05)
        self.requests.put("stop")
        self.thread.join()

    def _serve(self) -> None:
        protect = None
        while True:
            request = self.requests.get()
            if request != "stop":
                protect = request if request is not None else protect
            self._sync(protect)
            if request == "stop":
                return

    def _sync(self, protect: int | None) -> None:
        try:
            local, _ = list_checkpoints(self.run_dir)
            mirrored, _ = self.mirror.steps()
            for folder in local:
                if step_of(folder) not in mirrored:
                    started = time.perf_counter()
                    self.mirror.upload(folder)
                    seconds = time.perf_counter() - started
                    self.log(f"mirrored {folder.name} to {self.mirror.url} in {seconds:.1f}s")
            for step in self.mirror.prune(self.keep, protect):
                self.log(f"removed old checkpoint step-{step} from the mirror")
        except Exception as exc:  # a lost connection must not stop training
            self.log(
                f"warning: copying checkpoints to {self.mirror.url} failed "
                f"({type(exc).__name__}: {exc}); trying again after the next checkpoint"
            )
